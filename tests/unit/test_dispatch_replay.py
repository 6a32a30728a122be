"""The scheduler answers completed trajectory steps from the log."""

from __future__ import annotations

import json
import uuid

from app.config import Settings
from app.control.dispatch import Dispatcher
from app.control.outbox import Outbox
from app.domain.events import NodeHeartbeat, NodePayload
from app.domain.requests import CreateSandbox, Exec
from app.domain.trajectory import InMemoryTrajectoryLog, RecordedStep
from tests.unit.signing import KEYS, PARTITIONS, reply_to
from tests.unit.test_dispatch_groups import _record


def _dispatcher() -> tuple[Dispatcher, InMemoryTrajectoryLog]:
    log = InMemoryTrajectoryLog()
    dispatcher = Dispatcher(Settings(), KEYS, PARTITIONS, trajectory=log)
    beat = NodeHeartbeat(
        node_id="n0",
        payload=NodePayload(
            capacity_sandboxes=10, capacity_cpus=8, capacity_memory_mb=8192, queue="node.n0"
        ),
    )
    dispatcher.observe(Outbox(), _record(beat))
    dispatcher.handle(Outbox(), _record(CreateSandbox(sandbox_id="sb-a", tenant="t")))
    return dispatcher, log


def _exec(step: int) -> Exec:
    return Exec(
        sandbox_id="sb-a", tenant="t", command="mkdir x", trajectory_id="tr", step=step,
        reply_to=reply_to(),
    )  # fmt: skip


def test_completed_step_is_answered_without_a_node_task() -> None:
    dispatcher, log = _dispatcher()
    original = uuid.uuid4()
    log.recorded[("t", "tr", 0)] = RecordedStep(
        original, 0, "mkdir x", 0, "", "", 1.0, False, False
    )
    out = Outbox()
    dispatcher.handle(out, _record(_exec(0)))
    assert out.tasks == []
    reply = json.loads(out.replies[0][2])
    assert reply["replayed"] is True and reply["exit_code"] == 0
    event = json.loads(out.events[0][1])
    assert event["type"] == "CommandReplayed"
    assert event["payload"]["original_request_id"] == str(original)


def test_new_step_goes_to_the_node() -> None:
    dispatcher, _ = _dispatcher()
    out = Outbox()
    dispatcher.handle(out, _record(_exec(1)))
    assert len(out.inbox) == 1 and out.tasks == [] and out.replies == []


def test_restore_sends_the_trajectory_commands_with_the_create() -> None:
    dispatcher, log = _dispatcher()
    for i, cmd in enumerate(["mkdir x", "touch x/y"]):
        step = RecordedStep(uuid.uuid4(), i, cmd, 0, "", "", 1.0, False, False)
        log.recorded[("t", "tr", i)] = step
    out = Outbox()
    create = CreateSandbox(sandbox_id="sb-b", tenant="t", restore_trajectory="tr")
    dispatcher.handle(out, _record(create))
    _task, _queue, args = out.tasks[0]
    assert json.loads(args[0])["restore"] == ["mkdir x", "touch x/y"]
