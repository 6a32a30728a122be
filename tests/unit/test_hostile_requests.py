"""Requests an attacker sends with its own valid credential, a plain Kafka client or a
victim's key id (issue 23). Each is refused, and every other tenant's request in the
same batch is answered as if it were not there."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from itertools import count
from typing import Any

import pytest
from pydantic import BaseModel

from app.config import Settings
from app.control.dispatch import Dispatcher
from app.control.outbox import Outbox
from app.domain.base import utcnow
from app.domain.codec import encode
from app.domain.events import NodeHeartbeat, NodePayload
from app.domain.gate import Handled, Refusal
from app.domain.partition_counts import FixedPartitions, PartitionCounts
from app.domain.partitioner import key_partition
from app.domain.proof import Purpose, headers
from app.domain.records import Inbound
from app.domain.requests import CreateSandbox, DestroySandbox, Exec, RenewLease
from tests.unit.signing import KEYS, PARTITIONS, record, reply_to
from tests.unit.test_gate import Counted

_offsets = count(1000)


def _signed(message: BaseModel, key_id: str | None = None) -> Inbound:
    """``message`` proven by ``key_id`` (tenant t's, or a node's for its events), at a
    fresh offset."""
    return record(message, next(_offsets), key_id=key_id)


def _forged(message: BaseModel, key_id: str | None) -> Inbound:
    """``message`` carrying ``key_id`` (or no key at all) and a proof that does not hold."""
    proof = [] if key_id is None else [("dsec-key", key_id.encode()), ("dsec-mac", b"0" * 64)]
    good = _signed(message)
    return Inbound(good.topic, good.partition, good.offset, good.key, good.value, proof)


def _payload() -> NodePayload:
    return NodePayload(
        capacity_sandboxes=1000, capacity_cpus=1000, capacity_memory_mb=1 << 20, queue="x"
    )


def _dispatcher(
    partitions: PartitionCounts = PARTITIONS, settings: Settings | None = None
) -> Dispatcher:
    dispatcher = Dispatcher(settings or Settings(), KEYS, partitions)
    dispatcher.observe(Outbox(), _signed(NodeHeartbeat(node_id="n0", payload=_payload())))
    return dispatcher


def _answered(out: Outbox) -> dict[str, dict[str, object]]:
    """The replies of a batch by request id."""
    return {json.loads(value)["request_id"]: json.loads(value) for _, _, value, _ in out.replies}


def _rejected(out: Outbox, dispatcher: Dispatcher | None = None) -> list[dict[str, object]]:
    """The SandboxRejected events of a batch (with ``dispatcher``: and the samples of
    its folded refusals, as if their windows had closed)."""
    if dispatcher is not None:
        for sample in dispatcher.send.samples.due(float("inf")):
            dispatcher.send.emit(out, sample)
    events = [json.loads(value) for _, value in out.events]
    return [e for e in events if e["type"] == "SandboxRejected"]


# --- 1. a reply partition the topic does not have ------------------------------------


def test_a_reply_partition_the_topic_lacks_is_never_written_to() -> None:
    # Given replies topics of 4 partitions (the platform asked for 16; the broker made 4)
    dispatcher = _dispatcher(FixedPartitions(requests_topic=8, replies_each=4))
    # When tenant t names partition 9 of its own topic, signed, unsigned and under u's
    # key id, between two renewals of tenant u
    out = Outbox()
    theirs = [RenewLease(sandbox_id=f"lease-u{i}", reply_to=reply_to("u", 2)) for i in range(2)]
    attack = RenewLease(sandbox_id="lease-t", reply_to=reply_to("t", 9))
    on_u = RenewLease(sandbox_id="lease-x", reply_to=reply_to("u", 9))
    batch = [
        _signed(theirs[0], "k-tenant-u"),
        _signed(attack),
        _forged(on_u, None),
        _forged(on_u, "k-tenant-u"),
        _signed(theirs[1], "k-tenant-u"),
    ]
    for one in batch:
        dispatcher.handle(out, one)
    # Then u's renewals are answered, and nothing goes to a partition that does not exist
    assert set(_answered(out)) == {str(r.request_id) for r in theirs}
    assert all(where.partition < 4 for where, *_ in out.replies)
    # and t's attempt is logged as invalid, naming the partitions there are
    [logged] = [e for e in _rejected(out) if e["tenant"] == "t"]
    assert logged["payload"]["reason"] == "invalid"  # type: ignore[index]
    assert "partitions 0-3" in logged["payload"]["detail"]  # type: ignore[index]


def test_a_replies_topic_the_broker_does_not_know_gets_no_answer() -> None:
    class NoReplies(FixedPartitions):
        def replies(self, topic: str) -> int | None:
            return None

    dispatcher = _dispatcher(NoReplies())
    out = Outbox()
    dispatcher.handle(out, _signed(RenewLease(sandbox_id="lease-t", reply_to=reply_to("t", 0))))
    assert out.replies == []
    assert [e["payload"]["reason"] for e in _rejected(out)] == ["invalid"]  # type: ignore[index]


# --- 7. a request copied elsewhere on the bus ------------------------------------------


def _moved(original: Inbound, *, partition: int | None = None, key: bytes | None = None) -> Inbound:
    """The same signed bytes, written again by someone else: on another partition, or
    under another record key."""
    return Inbound(
        original.topic,
        original.partition if partition is None else partition,
        next(_offsets),
        original.key if key is None else key,
        original.value,
        original.headers,
    )


def test_a_renewal_copied_onto_another_schedulers_partition_is_not_acted_on() -> None:
    # Given two schedulers: A reads the partition a lease's renewals go to, B another
    a, b = _dispatcher(), _dispatcher()
    renew = RenewLease(sandbox_id="lease-1", reply_to=reply_to("t", 0))
    original = _signed(renew)
    copy = _moved(original, partition=(original.partition + 1) % 8)
    # When B reads a copy of the signed renewal first, and A the original
    out_a, out_b = Outbox(), Outbox()
    b.handle(out_b, copy)
    a.handle(out_a, original)
    # Then only A renews and answers; B does neither, and says why in the log
    assert set(_answered(out_a)) == {str(renew.request_id)}
    assert out_b.replies == []
    with pytest.raises(KeyError):
        b.leases[("t", "lease-1")]
    assert [e["payload"]["reason"] for e in _rejected(out_b, b)] == ["invalid"]  # type: ignore[index]


def test_a_copy_read_first_on_the_wrong_partition_costs_the_original_nothing() -> None:
    dispatcher = _dispatcher()
    renew = RenewLease(sandbox_id="lease-1", reply_to=reply_to("t", 0))
    original = _signed(renew)
    out = Outbox()
    dispatcher.handle(out, _moved(original, partition=(original.partition + 3) % 8))
    dispatcher.handle(out, _moved(original, key=b"lease-2"))
    assert out.replies == []
    dispatcher.handle(out, original)
    assert set(_answered(out)) == {str(renew.request_id)}


# --- 2 and 3. what a request must carry itself ------------------------------------------


def _live(dispatcher: Dispatcher, sandbox_id: str = "sb-a", key_id: str = "k-tenant-t") -> None:
    """A sandbox of ``key_id``'s tenant, placed."""
    out = Outbox()
    dispatcher.handle(out, _signed(CreateSandbox(sandbox_id=sandbox_id), key_id))
    assert out.tasks, out


def _raw(value: dict[str, object], key_id: str = "k-tenant-t") -> Inbound:
    """Bytes as any Kafka client might send them, signed, keyed and placed correctly."""
    body = json.dumps(value).encode()
    info = KEYS.lookup(key_id)
    assert info is not None
    sandbox = str(value["sandbox_id"])
    return Inbound(
        "dsec.requests", key_partition(sandbox, 8), next(_offsets), sandbox.encode(), body,
        headers(Purpose.REQUEST, key_id, info.secret, body),
    )  # fmt: skip


def test_the_same_signed_bytes_without_id_and_time_never_run() -> None:
    # Given a live sandbox and an Exec signed without request_id and sent_at
    dispatcher = _dispatcher()
    _live(dispatcher)
    bare = {"type": "Exec", "sandbox_id": "sb-a", "command": "echo once", "reply_to": None}
    # When the same bytes arrive three times
    out = Outbox()
    for _ in range(3):
        dispatcher.handle(out, _raw(bare))
    # Then nothing runs (before, each copy got an id of its own and ran)
    assert out.inbox == [] and out.tasks == []
    refused = [e["payload"] for e in _rejected(out)]
    assert {p["reason"] for p in refused} == {"invalid"}  # type: ignore[index]
    assert all("request_id and sent_at missing" in p["detail"] for p in refused)  # type: ignore[index]
    assert len(out.dead) == 3


def test_a_signed_request_without_a_time_zone_is_refused_and_the_batch_goes_on() -> None:
    # Given a live sandbox of t, and one of u
    dispatcher = _dispatcher()
    _live(dispatcher)
    _live(dispatcher, "sb-u", "k-tenant-u")
    naive = json.loads(encode(Exec(sandbox_id="sb-a", command="true", reply_to=reply_to())))
    naive["sent_at"] = utcnow().replace(tzinfo=None).isoformat()
    theirs = [Exec(sandbox_id="sb-u", command="true", reply_to=reply_to("u", 1)) for _ in range(2)]
    # When t's Exec with a naive sent_at is read between two of u's
    out = Outbox()
    dispatcher.handle(out, _signed(theirs[0], "k-tenant-u"))
    dispatcher.handle(out, _raw(naive))  # raised TypeError here, failing the batch
    dispatcher.handle(out, _signed(theirs[1], "k-tenant-u"))
    # Then u's commands go to their node, and t is told why its request was refused
    assert len(out.inbox) == 2
    [answer] = _answered(out).values()
    assert answer["request_id"] == naive["request_id"] and answer["reason"] == "invalid"
    assert "timezone" in str(answer["detail"])


def test_a_request_id_spelt_otherwise_than_canonically_is_refused() -> None:
    dispatcher = _dispatcher()
    _live(dispatcher)
    exec_ = json.loads(encode(Exec(sandbox_id="sb-a", command="true")))
    for spelling in (str.upper, lambda text: "{" + text + "}", lambda text: text.replace("-", "")):
        odd = {**exec_, "request_id": spelling(exec_["request_id"])}
        out = Outbox()
        dispatcher.handle(out, _raw(odd))
        assert out.inbox == []
        [refused] = _rejected(out)
        assert "canonical form" in refused["payload"]["detail"]  # type: ignore[index]


def test_a_record_whose_handling_raises_is_dead_lettered_alone() -> None:
    # Given a dispatcher with a bug that only tenant t's lease "lease-bug" trips
    dispatcher = _dispatcher()
    renew = dispatcher.leases.renew

    def buggy(owner: str, lease_id: str, *args: float) -> Any:
        if lease_id == "lease-bug":
            raise RuntimeError("a bug")
        return renew(owner, lease_id, *args)

    dispatcher.leases.renew = buggy  # type: ignore[method-assign]
    theirs = [RenewLease(sandbox_id=f"lease-u{i}", reply_to=reply_to("u", 1)) for i in range(2)]
    bug = _signed(RenewLease(sandbox_id="lease-bug", reply_to=reply_to()))
    # When it is read between two of u's renewals
    out = Outbox()
    dispatcher.handle(out, _signed(theirs[0], "k-tenant-u"))
    dispatcher.handle(out, bug)  # raised out of the dispatcher, failing the batch
    dispatcher.handle(out, _signed(theirs[1], "k-tenant-u"))
    # Then u's renewals are answered, and the one that failed is a dead letter, alone
    assert set(_answered(out)) == {str(r.request_id) for r in theirs}
    assert [(r, e.reason.value) for r, e in out.dead] == [(bug, "internal")]
    assert "RuntimeError: a bug" in out.dead[0][1].detail


def test_an_event_whose_handling_raises_costs_the_others_nothing() -> None:
    dispatcher = _dispatcher()

    def buggy(*_: object) -> bool:
        raise RuntimeError("a bug")

    beat = NodeHeartbeat(node_id="n1", payload=_payload())
    heard = dispatcher.health.heard
    dispatcher.health.heard = buggy  # type: ignore[method-assign]
    out = Outbox()
    dispatcher.observe(out, _signed(beat))
    assert [e.reason.value for _, e in out.dead] == ["internal"]
    assert "n1" not in dispatcher.placement.nodes
    # the next event is followed as usual
    dispatcher.health.heard = heard  # type: ignore[method-assign]
    dispatcher.observe(out, _signed(beat.model_copy(update={"event_id": uuid.uuid4()})))
    assert "n1" in dispatcher.placement.nodes


# --- 4. nothing unproven settles a proven request -------------------------------------


def test_an_altered_copy_of_a_victims_request_gets_no_answer_under_its_key() -> None:
    # Given tenant t's command in flight
    dispatcher = _dispatcher()
    _live(dispatcher)
    victim = Exec(sandbox_id="sb-a", command="sleep 600", reply_to=reply_to("t", 3))
    out = Outbox()
    dispatcher.handle(out, _signed(victim))
    assert len(out.inbox) == 1
    # When someone sends its bytes with the command changed under t's key id, and a
    # record carrying only t's key id and the request id
    original = _signed(victim)
    altered = (original.value or b"").replace(b"sleep 600", b"rm -rf /")
    bare = json.dumps(
        {"request_id": str(victim.request_id), "reply_to": reply_to("t", 3).model_dump()}
    ).encode()
    out = Outbox()
    for body in (altered, bare):
        copy = _moved(original)
        dispatcher.handle(out, Inbound(copy.topic, copy.partition, copy.offset, copy.key, body,
                                       original.headers))  # fmt: skip
    # Then nobody is answered (t's SDK would report its running command as refused),
    # and both are kept as dead letters
    assert out.replies == [] and out.inbox == []
    assert [e.reason.value for _, e in out.dead] == ["unauthenticated", "unauthenticated"]


def test_a_stale_copy_of_a_running_request_gets_no_answer() -> None:
    # Given t's hour-long command, admitted
    gate = _dispatcher().gate
    victim = Exec(sandbox_id="sb-a", command="sleep 3600", timeout_s=3600, reply_to=reply_to())
    assert not isinstance(gate.admit(_signed(victim), utcnow()), Refusal)
    # When its bytes are sent again after the freshness window
    later = utcnow() + timedelta(seconds=400)
    verdict = gate.admit(_moved(_signed(victim)), later)
    # Then it is refused as stale, and not answered: the command still runs
    assert isinstance(verdict, Refusal) and "stale" in verdict.detail
    assert verdict.reply_to is None


# --- 5. a proven attempt is its prover's ------------------------------------------------


def test_a_forbidden_attempt_is_logged_as_its_provers_whatever_came_first() -> None:
    # Given t's sandbox, and tenant u's attempt to destroy it under request id R
    dispatcher = _dispatcher()
    _live(dispatcher)
    attempt = DestroySandbox(sandbox_id="sb-a", reply_to=reply_to("u", 0))
    # When an unauthenticated record with R arrives first, then t's own request with R
    # (seen on the bus and copied), then u's attempt
    out = Outbox()
    dispatcher.handle(out, _forged(attempt, None))
    dispatcher.handle(out, _forged(attempt, "k-tenant-u"))
    own = {"sandbox_id": "sb-b", "reply_to": reply_to("t", 0)}
    dispatcher.handle(out, _signed(attempt.model_copy(update=own)))
    dispatcher.handle(out, _signed(attempt, "k-tenant-u"))
    # Then u's attempt is refused as u's, not as a replay, and logged under an id of its
    # own: the log keeps every event id once, so a shared one would lose it
    assert out.tasks == []
    logged = _rejected(out, dispatcher)
    assert len({e["event_id"] for e in logged}) == len(logged) == 4
    [theirs] = [e for e in logged if e["tenant"] == "u"]
    assert theirs["payload"]["actor"] == "u/k-tenant-u"  # type: ignore[index]
    assert theirs["payload"]["reason"] == "forbidden"  # type: ignore[index]


def test_request_ids_are_scoped_by_key_across_a_restart() -> None:
    # Given a scheduler that reloaded t's handled id R (partition 3, offset 9)
    gate = _dispatcher().gate
    exec_ = Exec(sandbox_id="sb-a", command="x")
    gate.remember(Handled("k-tenant-t", exec_.request_id, 3, 9, utcnow()))
    # Then t's request with R anywhere else is a replay, u's with R is not
    replay = gate.admit(_signed(exec_), utcnow())
    assert isinstance(replay, Refusal) and replay.reason.value == "duplicate"
    assert not isinstance(gate.admit(_signed(exec_, "k-tenant-u"), utcnow()), Refusal)


# --- 12. nothing about sandboxes that are not one's own ---------------------------------


def _told(dispatcher: Dispatcher, request: BaseModel, key_id: str) -> tuple[str, str]:
    """The reason and detail ``key_id``'s tenant is answered with, its sandbox id blanked."""
    out = Outbox()
    dispatcher.handle(out, _signed(request, key_id))
    [answer] = _answered(out).values()
    sandbox = str(answer["sandbox_id"])
    return str(answer["reason"]), str(answer["detail"]).replace(sandbox, "<id>")


def test_not_there_and_not_yours_are_one_answer() -> None:
    # Given t's live sandbox sb-a and t's ended sandbox sb-e
    dispatcher = _dispatcher()
    _live(dispatcher)
    dispatcher.note_ended("sb-e", "destroyed", "t")
    # When u execs in each, and in a sandbox that never was
    answers = {
        _told(dispatcher, Exec(sandbox_id=box, command="id", reply_to=reply_to("u")), "k-tenant-u")
        for box in ("sb-a", "sb-e", "sb-never")
    }
    # Then u hears one thing, whoever holds the id
    assert answers == {("unknown_sandbox", "u has no live sandbox <id>")}


def test_a_create_with_a_taken_id_says_nothing_of_whose_or_how_it_ended() -> None:
    dispatcher = _dispatcher()
    _live(dispatcher)
    dispatcher.note_ended("sb-e", "oom", "t")
    answers = {
        _told(dispatcher, CreateSandbox(sandbox_id=box, reply_to=reply_to("u")), "k-tenant-u")
        for box in ("sb-a", "sb-e")
    }
    assert answers == {
        ("id_in_use", "sandbox id <id> is taken: ids are never reused, choose another")
    }
    # and a replay is another reason (not answered: its first answer stands)
    create = CreateSandbox(sandbox_id="sb-new", reply_to=reply_to("u"))
    first = _signed(create, "k-tenant-u")
    out = Outbox()
    dispatcher.handle(out, first)
    dispatcher.handle(out, _moved(first))
    assert [e["payload"]["reason"] for e in _rejected(out, dispatcher)] == ["duplicate"]  # type: ignore[index]


# --- 10. junk is counted and sampled, not logged row by row ---------------------------


def test_made_up_keys_are_counted_and_sampled_not_logged_row_by_row() -> None:
    # Given a scheduler counting what it refuses
    tally = Counted()
    dispatcher = Dispatcher(Settings(), KEYS, PARTITIONS, tally=tally)
    dispatcher.observe(Outbox(), _signed(NodeHeartbeat(node_id="n0", payload=_payload())))
    # When 5,000 records with made-up key ids arrive (with made-up types), and tenant
    # u's renewal among them
    out = Outbox()
    junk = [_forged(RenewLease(sandbox_id=f"lease-{i}"), f"k-madeup-{i}") for i in range(5000)]
    theirs = RenewLease(sandbox_id="lease-u", reply_to=reply_to("u", 1))
    for i, one in enumerate(junk):
        if i == 2500:
            dispatcher.handle(out, _signed(theirs, "k-tenant-u"))
        body = (one.value or b"").replace(b"RenewLease", f"Type{i}".encode())
        dispatcher.handle(out, Inbound(one.topic, one.partition, one.offset, one.key, body,
                                       one.headers))  # fmt: skip
    # and the window closes
    dispatcher.send.samples.window_s = 0
    dispatcher.log_samples(out)
    # Then u is answered, each junk record is a dead letter and counted, under no
    # made-up label
    assert set(_answered(out)) == {str(theirs.request_id)}
    assert len(out.dead) == 5000
    assert tally.seen.count(("unproven", "request")) == 5000
    assert tally.seen.count(("handled", "unknown", "rejected:unauthenticated")) == 5000
    # and the log gets two rows for them all: the first at once, then one for the
    # rest of its window, each saying how many it stands for
    first, rest = _rejected(out)
    assert {first["tenant"], rest["tenant"]} == {"unauthenticated"}
    assert first["payload"]["folded"] == 1  # type: ignore[index]
    assert rest["payload"]["folded"] == 4999  # type: ignore[index]
    assert "4999 more like it" in rest["payload"]["detail"]  # type: ignore[index]


def test_replays_of_a_captured_request_are_sampled_not_logged_one_by_one() -> None:
    dispatcher = _dispatcher()
    captured = _signed(RenewLease(sandbox_id="lease-t", reply_to=reply_to()))
    out = Outbox()
    dispatcher.handle(out, captured)
    for _ in range(1000):
        dispatcher.handle(out, _moved(captured))
    assert len(_answered(out)) == 1  # the original's answer only
    first, rest = _rejected(out, dispatcher)
    for sample in (first, rest):
        assert sample["payload"]["reason"] == "duplicate"  # type: ignore[index]
        assert sample["tenant"] == "t"  # the key's, whoever sent the copies
    assert (first["payload"]["folded"], rest["payload"]["folded"]) == (1, 999)  # type: ignore[index]
