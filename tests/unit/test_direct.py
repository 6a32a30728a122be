"""What a node takes on the direct route (app/domain/direct.py): only a fresh Exec proven
under the key of its own sandbox, recorded as the sandbox's owner's; and what the
scheduler hands a node for it (the sealed sandbox key, revocations)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import pytest

from app.domain.base import utcnow
from app.domain.codec import DeadLetterReason, encode
from app.domain.direct import DirectRefusal, DirectRules, SandboxKey, admit_direct
from app.domain.node_tasks import NodeTask, Opened, revocation, revoked_keys, unseal
from app.domain.proof import Purpose, headers, sandbox_key
from app.domain.requests import Exec, ReplyTo, WriteFile

CREATOR = b"c" * 32
KEY = SandboxKey("k-team-a-1", sandbox_key(CREATOR, "sb-1"), "team-a", "team-a/k-team-a-1")
RULES = DirectRules(
    max_age=timedelta(seconds=300),
    max_message_bytes=1 << 20,
    replies_topic=lambda tenant: f"dsec.replies.{tenant}",
    reply_partitions=lambda topic: 4 if topic == "dsec.replies.team-a" else None,
)


@dataclass(frozen=True)
class _Record:
    value: bytes
    headers: Sequence[tuple[str, bytes]]
    key: bytes | None = b"sb-1"
    topic: str = "dsec.node.n0"
    partition: int = 0
    offset: int = 0


def _exec(**fields: Any) -> Exec:
    base: dict[str, Any] = {
        "sandbox_id": "sb-1", "command": "true",
        "reply_to": ReplyTo(topic="dsec.replies.team-a", partition=1),
    }  # fmt: skip
    return Exec(**{**base, **fields})


def _record(request: Any, *, secret: bytes = KEY.secret, key_id: str = KEY.key_id) -> _Record:
    value = encode(request)
    return _Record(value, headers(Purpose.DIRECT, key_id, secret, value))


def _admit(record: _Record, revoked: frozenset[str] = frozenset()) -> Exec | DirectRefusal:
    return admit_direct(record, KEY, revoked, utcnow(), RULES)


def test_a_fresh_exec_proven_under_its_sandbox_key_is_the_owners() -> None:
    # A request that names no tenant or actor (the SDK leaves them to the platform)
    admitted = _admit(_record(_exec()))
    assert isinstance(admitted, Exec)
    assert (admitted.tenant, admitted.actor) == ("team-a", "team-a/k-team-a-1")


@pytest.mark.parametrize(
    ("make", "why"),
    [
        # another tenant's key derives another sandbox key
        (lambda: _record(_exec(), secret=sandbox_key(b"x" * 32, "sb-1")), "does not match"),
        # the sandbox key of another sandbox of the same creator
        (lambda: _record(_exec(), secret=sandbox_key(CREATOR, "sb-2")), "does not match"),
        # the right proof under another key id
        (lambda: _record(_exec(), key_id="k-team-a-2"), "does not match"),
        # a request sent longer ago than the window, or stamped as far ahead
        (lambda: _record(_exec(sent_at=utcnow() - timedelta(seconds=400))), "stale"),
        (lambda: _record(_exec(sent_at=utcnow() + timedelta(seconds=400))), "stale"),
        # replies to another tenant's topic, or to a partition that does not exist
        (lambda: _record(_exec(reply_to=ReplyTo(topic="dsec.replies.b", partition=0))), "replies"),
        (
            lambda: _record(_exec(reply_to=ReplyTo(topic="dsec.replies.team-a", partition=4))),
            "replies",
        ),
        # only commands come this way
        (lambda: _record(WriteFile(sandbox_id="sb-1", path="/x", data_b64="")), "only an Exec"),
    ],
)
def test_what_is_not_proven_fresh_and_well_addressed_is_dead_lettered(
    make: Callable[[], _Record], why: str
) -> None:
    # records are made when the test runs: made at collection, a long suite makes them stale
    refused = _admit(make())
    assert isinstance(refused, DirectRefusal) and why in refused.detail
    # never answered: it may be someone else's request, or a copy of one that ran
    assert refused.request is None and refused.dead_letter is not None


def test_a_record_keyed_by_another_sandbox_or_for_no_sandbox_here_is_refused() -> None:
    record = _record(_exec())
    moved = _Record(record.value, record.headers, key=b"sb-2")
    refused = _admit(moved)
    assert isinstance(refused, DirectRefusal) and refused.request is None
    nowhere = admit_direct(record, None, frozenset(), utcnow(), RULES)
    assert isinstance(nowhere, DirectRefusal)
    assert nowhere.dead_letter == DeadLetterReason.UNAUTHENTICATED


def test_a_revoked_creators_sandbox_key_proves_nothing() -> None:
    refused = _admit(_record(_exec()), frozenset({KEY.key_id}))
    assert isinstance(refused, DirectRefusal) and "revoked" in refused.detail
    assert refused.request is None


@pytest.mark.parametrize("fields", [{"trajectory_id": "traj-1", "step": 0}, {"tenant": "team-b"}])
def test_a_step_or_another_tenants_name_is_answered_with_a_refusal(fields: dict[str, Any]) -> None:
    refused = _admit(_record(_exec(**fields)))
    assert isinstance(refused, DirectRefusal) and refused.dead_letter is None
    # proven: answered under the sandbox's key, as its owner's
    assert refused.request is not None and refused.request.tenant == "team-a"


def test_a_revocation_is_sealed_for_its_node_alone() -> None:
    node, other = b"n" * 32, b"o" * 32
    record = revocation(["k-b", "k-a"], "k-node", node)
    import json

    args = json.loads(record)["args"]
    opened = unseal(NodeTask.REVOKE_KEYS, args, "k-node", node)
    assert isinstance(opened, Opened) and revoked_keys(opened) == ["k-a", "k-b"]
    assert isinstance(unseal(NodeTask.REVOKE_KEYS, args, "k-node", other), str)
    # nor does it pass for another task
    assert isinstance(unseal(NodeTask.EXEC, args, "k-node", node), str)


@dataclass(frozen=True)
class _Polled:
    """An inbox record as a poll returns it."""

    key: bytes
    headers: Sequence[tuple[str, bytes]] | None
    topic: str = "dsec.node.n1"
    partition: int = 0
    offset: int = 0
    value: bytes | None = b"sealed"


def test_a_polls_direct_commands_start_together_and_before_what_follows_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Direct commands of one poll are claimed in one call; a record of another kind
    (a scheduler's task: a kill, say) acts only after the commands read before it."""
    from workers import inbox, runtime, tasks

    done: list[Any] = []
    proven = [("dsec-key", b"k")]

    def direct_command(record: Any, rules: Any, name: str, starts: list[Any] | None = None) -> None:
        assert starts is not None
        starts.append((record.key.decode(), None))

    monkeypatch.setattr(runtime, "node", lambda: object())
    monkeypatch.setattr(inbox.direct, "carry_out", direct_command)
    monkeypatch.setattr(inbox, "header", lambda headers, name: dict(headers or []).get(name))
    monkeypatch.setattr(inbox, "HEADER_KEY", "dsec-key")
    monkeypatch.setattr(inbox, "read_inbox_record", lambda value: (NodeTask.KILL_COMMAND, []))
    monkeypatch.setattr(tasks, "perform", lambda task, args: done.append(task))
    monkeypatch.setattr(tasks, "start_commands", lambda starts: done.append([c for c, _ in starts]))
    records = [
        _Polled(b"a", proven), _Polled(b"b", proven), _Polled(b"x", None), _Polled(b"c", proven)
    ]  # fmt: skip
    inbox.carry_out_all(records, cast(DirectRules, None), "inbox n1")
    assert done == [["a", "b"], NodeTask.KILL_COMMAND, ["c"]]
