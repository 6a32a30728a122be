"""What the log admits about a sandbox beyond a proof: a node speaks only for the
sandboxes placed on it (issue 23, item 6), and a life ends once (item 11)."""

from __future__ import annotations

import uuid

from app.domain.admission import Known, after, is_end, screen
from app.domain.base import FailReason, StopReason
from app.domain.codec import DeadLetterReason
from app.domain.events import (
    CommandCompleted,
    CommandPayload,
    Event,
    FailedPayload,
    RequestedPayload,
    SandboxFailed,
    SandboxRequested,
    SandboxScheduled,
    SandboxStarted,
    SandboxStopped,
    ScheduledPayload,
    StartedPayload,
    StoppedPayload,
)

RID = uuid.uuid4()


def _requested(sid: str = "sb-1") -> SandboxRequested:
    return SandboxRequested(
        sandbox_id=sid, tenant="t",
        payload=RequestedPayload(request_id=RID, actor="t/k", image="img", cpus=1,
                                 memory_mb=64, disk_mb=64, ttl_s=60, network=False),
    )  # fmt: skip


def _scheduled(node: str, sid: str = "sb-1") -> SandboxScheduled:
    return SandboxScheduled(
        sandbox_id=sid, node_id=node, tenant="t",
        payload=ScheduledPayload(request_id=RID, node_id=node),
    )  # fmt: skip


def _started(node: str, sid: str = "sb-1") -> SandboxStarted:
    return SandboxStarted(
        sandbox_id=sid, node_id=node, tenant="t",
        payload=StartedPayload(request_id=RID, container_id="c"),
    )  # fmt: skip


def _stopped(node: str | None, reason: StopReason = StopReason.DESTROYED) -> SandboxStopped:
    return SandboxStopped(
        sandbox_id="sb-1", node_id=node, tenant="t", payload=StoppedPayload(reason=reason)
    )


def _command(node: str) -> CommandCompleted:
    return CommandCompleted(
        sandbox_id="sb-1", node_id=node, tenant="t",
        payload=CommandPayload(request_id=uuid.uuid4(), actor="t/k", command="true",
                               exit_code=0, duration_ms=1, stdout_bytes=0, stderr_bytes=0),
    )  # fmt: skip


def _failed(node: str, request_type: str) -> SandboxFailed:
    return SandboxFailed(
        sandbox_id="sb-1", node_id=node, tenant="t",
        payload=FailedPayload(request_id=RID, request_type=request_type,
                              reason=FailReason.RUNTIME_ERROR, detail="x"),
    )  # fmt: skip


def _reasons(
    items: list[tuple[Event, str | None]],
    known: dict[str, Known] | None = None,
    logged: set[uuid.UUID] | None = None,
) -> list[str | None]:
    verdicts = screen(items, known or {}, logged or set())
    return [v.reason.value if v is not None else None for v in verdicts]


def test_a_node_cannot_end_a_sandbox_placed_on_another_node() -> None:
    # Given a sandbox placed on n0 (in the log before this batch)
    known = {"sb-1": Known(placed_on="n0")}
    # When n1, with its own valid key, says the sandbox stopped
    verdict = _reasons([(_stopped("n1"), "n1")], known)
    # Then the log refuses it: forbidden
    assert verdict == [DeadLetterReason.FORBIDDEN.value]
    assert _reasons([(_stopped("n0"), "n0")], known) == [None]


def test_a_node_cannot_start_or_bill_a_sandbox_nobody_placed() -> None:
    assert _reasons([(_started("n1", "sb-new"), "n1")]) == ["forbidden"]
    # Requested but not placed yet: still nobody's to start.
    assert _reasons([(_requested(), None), (_started("n1"), "n1")]) == [None, "forbidden"]
    # Commands, failures and files of another node's sandbox are refused too.
    known = {"sb-1": Known(placed_on="n0")}
    assert _reasons([(_command("n1"), "n1"), (_failed("n1", "Exec"), "n1")], known) == [
        "forbidden",
        "forbidden",
    ]


def test_a_placement_earlier_in_the_batch_counts() -> None:
    batch: list[tuple[Event, str | None]] = [
        (_requested(), None),
        (_scheduled("n0"), None),
        (_started("n0"), "n0"),
        (_command("n0"), "n0"),
        (_stopped("n0"), "n0"),
    ]
    assert _reasons(batch) == [None] * 5


def test_the_scheduler_speaks_for_every_sandbox() -> None:
    # The scheduler's key (node None here) ends lives on any node it declared lost.
    known = {"sb-1": Known(placed_on="n0")}
    assert _reasons([(_stopped("n0", StopReason.NODE_LOST), None)], known) == [None]


def test_a_life_ends_once_whoever_races_to_end_it() -> None:
    # Given a life the scheduler ended (its container vanished)
    vanished = _stopped(None, StopReason.FAILED)
    destroyed = _stopped("n0")
    known = {"sb-1": Known(placed_on="n0")}
    # When the node's destroy ends it again, in the same batch or a later one
    assert _reasons([(vanished, None), (destroyed, "n0")], known) == [None, "already_ended"]
    ended = {"sb-1": Known(placed_on="n0", ended=True)}
    assert _reasons([(destroyed, "n0")], ended) == ["already_ended"]
    # A failed create after the end is a second end too; a failed exec is no end
    assert _reasons([(_failed("n0", "CreateSandbox"), "n0")], ended) == ["already_ended"]
    assert _reasons([(_failed("n0", "Exec"), "n0"), (_command("n0"), "n0")], ended) == [None, None]


def test_the_same_end_declared_twice_is_a_duplicate_not_a_second_end() -> None:
    end = _stopped("n0", StopReason.NODE_LOST)
    ended = {"sb-1": Known(placed_on="n0", ended=True)}
    # Its id is in the log already: the append skips it as it skips any duplicate.
    assert _reasons([(end, None)], ended, logged={end.event_id}) == [None]
    # Twice in one batch: the first ends the life, the second is the same event.
    assert _reasons([(end, None), (end, None)], {"sb-1": Known(placed_on="n0")}) == [None, None]


def test_what_the_log_holds_follows_the_events() -> None:
    assert after(_scheduled("n0"), Known()) == Known(placed_on="n0")
    assert after(_stopped("n0"), Known(placed_on="n0")) == Known(placed_on="n0", ended=True)
    assert after(_started("n1"), Known(placed_on="n0", ended=True)) == Known("n0", True)
    assert is_end(_failed("n0", "CreateSandbox")) and not is_end(_failed("n0", "Exec"))
    assert not is_end(_command("n0"))
