"""The scheduler ends the lives whose deadline it keeps (issue 28): a create whose task
was lost ends create_lost and gives its room back, lives left on a lost node end
node_lost whichever scheduler placed them, a restart recovers each open life with its
deadline, and a destroy in flight is not called vanished (a life ends once)."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta
from typing import Any

import pytest

from app.config import Settings
from app.control import life_book
from app.control.dispatch import Dispatcher, LiveSandbox
from app.control.outbox import Outbox
from app.domain.base import StopReason, utcnow
from app.domain.codec import decode_event
from app.domain.events import (
    NodeHeartbeat,
    NodeLost,
    NodeLostPayload,
    NodePayload,
    SandboxStarted,
    SandboxStopped,
    StartedPayload,
)
from app.domain.lease import LeaseAction
from app.domain.lives import end_id
from app.domain.proof import SCHEDULER_KEY_ID
from app.domain.requests import LEASE_LABEL, CreateSandbox, DestroySandbox
from tests.unit.signing import KEYS, PARTITIONS, reply_to
from tests.unit.test_dispatch_groups import _record
from tests.unit.test_dispatch_recover import Row

SETTINGS = Settings(request_max_age_s=300, create_grace_s=60, lease_grace_s=300)
#: When every create placed now has passed its deadline.
LATER = timedelta(seconds=361)


def _beat(node: str = "n0", sandboxes: list[str] | None = None) -> NodeHeartbeat:
    return NodeHeartbeat(
        node_id=node,
        payload=NodePayload(
            capacity_sandboxes=1, capacity_cpus=4, capacity_memory_mb=8192,
            queue=f"node.{node}", sandboxes=sandboxes,
        ),
    )  # fmt: skip


def _dispatcher() -> Dispatcher:
    dispatcher = Dispatcher(SETTINGS, KEYS, PARTITIONS)
    dispatcher.observe(Outbox(), _record(_beat()))
    return dispatcher


def _stops(out: Outbox) -> list[SandboxStopped]:
    found = [decode_event(value) for _, value in out.events]
    return [e for e in found if isinstance(e, SandboxStopped)]


def _at(monkeypatch: pytest.MonkeyPatch, when: datetime) -> None:
    """The dispatcher's wall clock reads ``when`` from now on (its rules on requests
    and the state it follows from the log)."""
    monkeypatch.setattr("app.control.dispatch.utcnow", lambda: when)
    monkeypatch.setattr("app.control.follower.utcnow", lambda: when)


def _place(dispatcher: Dispatcher, sandbox_id: str = "sb-1") -> Outbox:
    out = Outbox()
    create = CreateSandbox(sandbox_id=sandbox_id, tenant="t", reply_to=reply_to())
    dispatcher.handle(out, _record(create))
    assert len(out.tasks) == 1
    return out


def _start(dispatcher: Dispatcher, sandbox_id: str = "sb-1") -> None:
    """Its node says the sandbox started."""
    started = SandboxStarted(
        sandbox_id=sandbox_id, node_id="n0", tenant="t",
        payload=StartedPayload(request_id=dispatcher.created_by[sandbox_id], container_id="c"),
    )  # fmt: skip
    dispatcher.observe(Outbox(), _record(started))


def test_a_create_whose_task_was_lost_ends_create_lost_and_gives_its_room_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a sandbox placed on n0 (room for one) whose node never answers the create
    dispatcher = _dispatcher()
    _place(dispatcher)
    node = dispatcher.placement.nodes["n0"]
    assert node.used_sandboxes == 1
    out = Outbox()
    dispatcher.check_lives(out)
    assert out.events == []  # within its deadline: nothing yet
    # When its deadline passes (the request age limit and the create grace)
    _at(monkeypatch, utcnow() + LATER)
    out = Outbox()
    dispatcher.check_lives(out)
    # Then its life ends create_lost, once, and its trainer hears why
    [stop] = _stops(out)
    assert (stop.sandbox_id, stop.payload.reason) == ("sb-1", StopReason.CREATE_LOST)
    assert stop.event_id == end_id("sb-1", StopReason.CREATE_LOST)
    assert json.loads(out.replies[0][2])["reason"] == "create_lost"
    # And the node's room is free for the next create
    assert node.used_sandboxes == 0
    again = Outbox()
    dispatcher.check_lives(again)
    assert again.events == []
    monkeypatch.undo()  # a fresh create, sent now
    _place(dispatcher, "sb-2")


def test_a_started_sandbox_has_no_create_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    dispatcher = _dispatcher()
    _place(dispatcher)
    _start(dispatcher)
    _at(monkeypatch, utcnow() + LATER)
    out = Outbox()
    dispatcher.check_lives(out)
    assert out.events == []


def _recovered(*live: LiveSandbox, lost: bool = False, heard: datetime | None = None) -> Dispatcher:
    dispatcher = Dispatcher(SETTINGS, KEYS, PARTITIONS)
    if lost:
        dispatcher.recover([], live, [("n0", Row(), heard)])
    else:
        dispatcher.recover([("n0", Row())], live)
    return dispatcher


def _live(sandbox_id: str, **fields: Any) -> LiveSandbox:
    base: dict[str, Any] = {
        "node_id": "n0", "cpus": 1.0, "memory_mb": 256, "tenant": "t", "job_id": "j",
        "labels": {},
    }  # fmt: skip
    return LiveSandbox(sandbox_id=sandbox_id, **{**base, **fields})


def test_a_restarted_scheduler_recovers_each_unstarted_life_with_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given lives the log shows placed (or only requested) and never started, placed by
    # a scheduler that no longer runs
    requested = utcnow() - timedelta(seconds=100)
    dispatcher = _recovered(
        _live("sb-placed", started=False, requested_at=requested),
        _live("sb-asked", node_id=None, started=False, requested_at=requested),
        _live("sb-running", requested_at=requested),
    )
    # Then they are not called vanished while their create may still start
    assert dispatcher.book.unstarted == {"sb-placed", "sb-asked"}
    out = Outbox()
    dispatcher.check_lives(out)
    assert out.events == []
    # And once their create can no longer start, both end create_lost, the running one lives
    _at(monkeypatch, requested + LATER)
    out = Outbox()
    dispatcher.check_lives(out)
    stops = {s.sandbox_id: s for s in _stops(out)}
    assert set(stops) == {"sb-placed", "sb-asked"}
    assert {s.payload.reason for s in stops.values()} == {StopReason.CREATE_LOST}
    assert (stops["sb-placed"].node_id, stops["sb-asked"].node_id) == ("n0", None)
    assert dispatcher.placement.nodes["n0"].used_sandboxes == 1  # sb-running's
    assert "sb-asked" in dispatcher.ended and "sb-asked" not in dispatcher.created_by


def test_lives_recovered_on_a_node_already_lost_end_node_lost_at_its_last_heartbeat() -> None:
    # Given a node the log shows lost, with lives placed by a scheduler since stopped
    heard = utcnow() - timedelta(minutes=5)
    dispatcher = _recovered(_live("sb-a"), _live("sb-b", started=False), lost=True, heard=heard)
    # When the restarted scheduler checks its lives
    out = Outbox()
    dispatcher.check_lives(out)
    # Then every life on it ends node_lost, billed to the node's last word
    stops = _stops(out)
    assert sorted(s.sandbox_id for s in stops) == ["sb-a", "sb-b"]
    for stop in stops:
        assert stop.payload.reason == StopReason.NODE_LOST
        assert stop.occurred_at == heard
        assert stop.event_id == end_id(stop.sandbox_id or "", StopReason.NODE_LOST)
    assert dispatcher.placement.allocations == {}
    # And nothing is placed on it
    out = Outbox()
    dispatcher.handle(out, _record(CreateSandbox(sandbox_id="sb-new", tenant="t", queue_s=0)))
    assert out.tasks == []


def test_lives_another_scheduler_left_on_a_node_it_declared_lost_end_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a placement on n0, and another scheduler's NodeLost for n0 without its ends
    monkeypatch.setattr(life_book, "LEFT_ON_LOST_S", 0.0)
    dispatcher = _dispatcher()
    _place(dispatcher)
    lost = NodeLost(node_id="n0", payload=NodeLostPayload(detail="silent"))
    dispatcher.observe(Outbox(), _record(lost, key_id=SCHEDULER_KEY_ID))
    # When this scheduler checks its lives
    out = Outbox()
    dispatcher.check_lives(out)
    # Then the life left there ends node_lost (the declarer's id: the log keeps one)
    [stop] = _stops(out)
    assert (stop.sandbox_id, stop.payload.reason) == ("sb-1", StopReason.NODE_LOST)
    assert stop.event_id == end_id("sb-1", StopReason.NODE_LOST)


def test_a_sandbox_being_destroyed_is_not_called_vanished() -> None:
    # Given a running sandbox on n0 and its tenant's destroy on its way to the node
    dispatcher = _dispatcher()
    _place(dispatcher)
    _start(dispatcher)
    dispatcher.handle(Outbox(), _record(DestroySandbox(sandbox_id="sb-1", tenant="t")))
    # When the node's heartbeats no longer list it, twice (it is being removed)
    out = Outbox()
    for _ in range(3):
        dispatcher.observe(out, _record(_beat(sandboxes=[])))
    # Then the scheduler does not end it "vanished": the destroy's own end is its end
    assert _stops(out) == []


def test_a_frozen_lease_recovered_keeps_its_grace_from_the_freeze() -> None:
    # Given a leased sandbox the log shows frozen 400 s ago (the grace is 300 s)
    frozen_at = utcnow() - timedelta(seconds=400)
    dispatcher = _recovered(
        _live("sb-l", labels={LEASE_LABEL: "lease-1"}, frozen=True, frozen_at=frozen_at)
    )
    # When the restarted scheduler keeps its leases' clocks (even after a takeover)
    dispatcher.leases.restart_clocks(lambda _lease: True, 0.0)
    due = dispatcher.leases.due(time.monotonic())
    # Then its grace is over: destroyed now, not one more grace after the restart
    assert [(lease.lease_id, action) for lease, action in due] == [("lease-1", LeaseAction.DESTROY)]
