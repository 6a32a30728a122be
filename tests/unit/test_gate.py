"""The request gate and the event rules: every way a sender can fail to be believed."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

from app.config import Settings
from app.control.dispatch import Dispatcher
from app.control.outbox import Outbox
from app.domain.base import RejectReason, utcnow
from app.domain.codec import encode
from app.domain.events import NodeHeartbeat, NodePayload, SandboxStopped, StoppedPayload
from app.domain.gate import Admitted, Gate, GateRules, Refusal
from app.domain.proof import Principal, Role
from app.domain.records import Inbound
from app.domain.requests import CreateSandbox, DestroySandbox, Exec, ReadFile, ReplyTo
from app.domain.trust import event_refusal
from tests.unit.signing import KEYS, PARTITIONS, inbox_tasks, record, reply_to, task_request

RULES = GateRules(timedelta(seconds=300), 1 << 20, "dsec")


def _gate() -> Gate:
    return Gate(RULES, KEYS, PARTITIONS)


def test_a_signed_request_is_admitted_as_its_sender() -> None:
    verdict = _gate().admit(record(Exec(sandbox_id="sb-a", command="true")), utcnow())
    assert isinstance(verdict, Admitted)
    assert verdict.request.tenant == "t" and verdict.request.actor == "t/k-tenant-t"


def test_an_unsigned_request_is_refused_and_nobody_is_answered() -> None:
    exec_ = Exec(sandbox_id="sb-a", command="true", reply_to=reply_to())
    plain = Inbound("r", 0, 0, b"sb-a", encode(exec_), [])
    verdict = _gate().admit(plain, utcnow())
    assert isinstance(verdict, Refusal) and verdict.reason == RejectReason.UNAUTHENTICATED
    assert verdict.reply_to is None and verdict.sender is None


def test_an_altered_request_is_refused_and_nobody_is_answered() -> None:
    exec_ = Exec(sandbox_id="sb-a", command="true", reply_to=reply_to())
    good = record(exec_)
    altered = Inbound(
        "r", 0, 0, b"sb-a", (good.value or b"").replace(b"true", b"rm -rf /"), good.headers
    )
    verdict = _gate().admit(altered, utcnow())
    assert isinstance(verdict, Refusal) and verdict.reason == RejectReason.UNAUTHENTICATED
    assert "bad_mac" in verdict.detail
    # An answer under the key it names would reach that key's holder, whose real
    # request of that id may be waiting: it would end it.
    assert verdict.sender is None and verdict.reply_to is None


def test_a_revoked_key_is_refused() -> None:
    keys = KEYS.__class__(KEYS.master)
    keys.keys = dict(KEYS.keys)
    keys.revoke("k-tenant-t")
    verdict = Gate(RULES, keys, PARTITIONS).admit(
        record(Exec(sandbox_id="sb-a", command="x")), utcnow()
    )
    assert isinstance(verdict, Refusal) and "revoked" in verdict.detail


def test_a_request_of_a_protocol_version_not_served_is_refused_with_its_reason() -> None:
    # Given an SDK that speaks a version this platform does not serve, signing as usual
    exec_ = Exec(sandbox_id="sb-a", command="true", reply_to=reply_to())
    body = json.loads(encode(exec_))
    body["version"] = 2
    verdict = _gate().admit(record(exec_, value=json.dumps(body).encode()), utcnow())
    # Then it is refused with a reason of its own, answered to its proven sender
    assert isinstance(verdict, Refusal) and verdict.reason == RejectReason.UNSUPPORTED_VERSION
    assert "version=2, supported 1" in verdict.detail
    assert verdict.sender is not None and verdict.reply_to is not None


def test_a_node_key_cannot_send_requests() -> None:
    signed = record(Exec(sandbox_id="sb-a", command="x"), key_id="k-node-n0")
    verdict = _gate().admit(signed, utcnow())
    assert isinstance(verdict, Refusal) and "wrong_role" in verdict.detail


def test_a_stale_request_is_refused_and_answered_only_from_the_future() -> None:
    for offset, answered in ((-301, False), (301, True)):
        sent_at = utcnow() + timedelta(seconds=offset)
        stale = Exec(sandbox_id="sb-a", command="x", reply_to=reply_to(), sent_at=sent_at)
        verdict = _gate().admit(record(stale), utcnow())
        assert isinstance(verdict, Refusal) and verdict.reason == RejectReason.UNAUTHENTICATED
        # From the past it may be a copy of a request admitted then and still running
        assert "stale" in verdict.detail and (verdict.reply_to is not None) is answered


def test_a_replay_elsewhere_is_refused_silently_but_a_reread_is_not() -> None:
    gate = _gate()
    exec_ = Exec(sandbox_id="sb-a", command="x", reply_to=reply_to())
    assert isinstance(gate.admit(record(exec_, offset=5), utcnow()), Admitted)
    # The same record read again (a restart before its offset was saved): admitted
    assert isinstance(gate.admit(record(exec_, offset=5), utcnow()), Admitted)
    # The same request at another place on the bus: a replay, no answer
    replay = gate.admit(record(exec_, offset=9), utcnow())
    assert isinstance(replay, Refusal) and replay.reason == RejectReason.DUPLICATE
    assert replay.reply_to is None


def test_a_request_naming_another_tenant_is_forbidden() -> None:
    verdict = _gate().admit(record(Exec(sandbox_id="sb-a", command="x", tenant="u")), utcnow())
    assert isinstance(verdict, Refusal) and verdict.reason == RejectReason.FORBIDDEN


def test_replies_stay_on_the_senders_topic_and_partitions() -> None:
    for where, reason in (
        (ReplyTo(topic="dsec.replies.u", partition=0), RejectReason.FORBIDDEN),
        (reply_to(partition=16), RejectReason.INVALID),
    ):
        exec_ = Exec(sandbox_id="sb-a", command="x", reply_to=where)
        verdict = _gate().admit(record(exec_), utcnow())
        assert isinstance(verdict, Refusal) and verdict.reason == reason
        assert verdict.reply_to is None


def test_the_record_key_must_be_the_sandbox() -> None:
    exec_ = Exec(sandbox_id="sb-a", command="x")
    good = record(exec_)
    moved = Inbound("r", 0, 0, b"sb-other", good.value, good.headers)
    verdict = _gate().admit(moved, utcnow())
    assert isinstance(verdict, Refusal) and verdict.reason == RejectReason.INVALID
    assert verdict.reply_to is None  # maybe a copy: the original's answer stands


def test_a_request_read_on_another_partition_than_its_keys_is_refused() -> None:
    good = record(Exec(sandbox_id="sb-a", command="x", reply_to=reply_to()))
    elsewhere = Inbound("r", (good.partition + 1) % 8, 0, good.key, good.value, good.headers)
    verdict = _gate().admit(elsewhere, utcnow())
    assert isinstance(verdict, Refusal) and verdict.reason == RejectReason.INVALID
    assert "murmur2" in verdict.detail and verdict.reply_to is None


# --- the dispatcher's rules on top ------------------------------------------------


def _payload(sandboxes: list[str] | None) -> NodePayload:
    return NodePayload(
        capacity_sandboxes=10, capacity_cpus=8, capacity_memory_mb=8192, queue="x",
        sandboxes=sandboxes,
    )  # fmt: skip


def _dispatcher() -> Dispatcher:
    dispatcher = Dispatcher(Settings(), KEYS, PARTITIONS)
    for node in ("n0", "n1"):
        beat = NodeHeartbeat(node_id=node, payload=_payload(None))
        dispatcher.observe(Outbox(), record(beat))
    dispatcher.handle(Outbox(), record(CreateSandbox(sandbox_id="sb-a"), offset=100))
    return dispatcher


def test_another_tenants_request_is_forbidden_and_sends_no_task() -> None:
    dispatcher = _dispatcher()
    out = Outbox()
    attack = DestroySandbox(sandbox_id="sb-a", reply_to=reply_to("u"))
    dispatcher.handle(out, record(attack, offset=101, key_id="k-tenant-u"))
    assert out.tasks == []
    # u is told what it would be told of a sandbox that does not exist; the log knows
    assert json.loads(out.replies[0][2])["reason"] == "unknown_sandbox"
    event = json.loads(out.events[0][1])
    assert event["tenant"] == "u" and event["payload"]["actor"] == "u/k-tenant-u"
    assert event["payload"]["reason"] == "forbidden"


def test_an_operator_acts_on_the_owners_bill() -> None:
    dispatcher = _dispatcher()
    out = Outbox()
    dispatcher.handle(out, record(Exec(sandbox_id="sb-a", command="x"), 102, key_id="k-operator"))
    sent = task_request(inbox_tasks(out)[0][2])
    assert sent["tenant"] == "t" and sent["actor"] == "operator:ops/k-operator"


def test_tasks_go_to_the_nodes_own_queue_sealed_for_it() -> None:
    dispatcher = _dispatcher()
    out = Outbox()
    dispatcher.handle(out, record(Exec(sandbox_id="sb-a", command="x"), offset=103))
    node = dispatcher.placement.node_of("sb-a")
    assert node is not None
    # A command goes straight to the node's inbox topic, sealed for that node
    [(topic, task, args)] = inbox_tasks(out)
    assert topic == f"dsec.node.{node.node_id}" and task == "dsec.node.exec"
    assert args[1] == f"k-node-{node.node_id}"
    # a file transfer through the node's own Celery queue
    dispatcher.handle(out, record(ReadFile(sandbox_id="sb-a", path="/x"), offset=104))
    _task, queue, args = out.tasks[0]
    assert queue == f"node.{node.node_id}"  # not the declared "x"
    assert args[1] == f"k-node-{node.node_id}"


def test_forged_and_foreign_node_events_are_ignored() -> None:
    dispatcher = _dispatcher()
    node = dispatcher.placement.node_of("sb-a")
    assert node is not None
    other = "n1" if node.node_id == "n0" else "n0"
    stop = SandboxStopped(sandbox_id="sb-a", node_id=node.node_id, tenant="t",
                          payload=StoppedPayload(reason="destroyed"))  # fmt: skip
    # unsigned; signed by the other node (about itself: it holds no such sandbox)
    dispatcher.observe(Outbox(), Inbound("e", 0, 1, b"sb-a", encode(stop), []))
    theirs = stop.model_copy(update={"node_id": other, "event_id": uuid.uuid4()})
    dispatcher.observe(Outbox(), record(theirs, key_id=f"k-node-{other}"))
    assert "sb-a" in dispatcher.placement.allocations
    # two empty heartbeats of the sandbox's node, unsigned: nothing vanishes
    for _ in range(2):
        empty = NodeHeartbeat(node_id=node.node_id, payload=_payload([]))
        out = Outbox()
        dispatcher.observe(out, Inbound("e", 0, 2, b"n", encode(empty), []))
        assert out.events == []
    assert "sb-a" in dispatcher.placement.allocations


def test_an_old_heartbeat_replayed_is_ignored() -> None:
    dispatcher = _dispatcher()
    node = dispatcher.placement.node_of("sb-a")
    assert node is not None
    five_minutes_ago = utcnow() - timedelta(minutes=5)
    old = NodeHeartbeat(node_id=node.node_id, occurred_at=five_minutes_ago, payload=_payload([]))
    for _ in range(2):
        out = Outbox()
        dispatcher.observe(out, record(old.model_copy(update={"event_id": uuid.uuid4()})))
        assert out.events == []
    assert "sb-a" in dispatcher.placement.allocations


def test_event_rules() -> None:
    node = Principal("k-node-n0", Role.NODE, "n0")
    scheduler = Principal("k-scheduler", Role.SCHEDULER, "scheduler")
    tenant = Principal("k-tenant-t", Role.TENANT, "t")
    beat = NodeHeartbeat(node_id="n1", payload=NodePayload(
        capacity_sandboxes=1, capacity_cpus=1, capacity_memory_mb=1, queue="x"))  # fmt: skip
    assert event_refusal(node, beat) is not None  # about another node
    assert event_refusal(node, beat.model_copy(update={"node_id": "n0"})) is None
    assert event_refusal(scheduler, beat) is not None  # only a node says it is alive
    assert event_refusal(tenant, beat) is not None


class Counted:
    """A Tally that remembers (the scheduler's is Prometheus's)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, ...]] = []

    def handled(self, request_type: str, outcome: str) -> None:
        self.seen.append(("handled", request_type, outcome))

    def refused(self, reason: str) -> None:
        self.seen.append(("refused", reason))

    def unproven(self, kind: str) -> None:
        self.seen.append(("unproven", kind))


def test_the_dispatcher_counts_what_it_did_through_its_tally_only() -> None:
    tally = Counted()
    dispatcher = Dispatcher(Settings(), KEYS, PARTITIONS, tally=tally)
    beat = NodeHeartbeat(node_id="n0", payload=_payload(None))
    dispatcher.observe(Outbox(), record(beat))
    dispatcher.handle(Outbox(), record(CreateSandbox(sandbox_id="sb-a"), offset=100))
    attack = DestroySandbox(sandbox_id="sb-a", reply_to=reply_to("u"))
    dispatcher.handle(Outbox(), record(attack, offset=101, key_id="k-tenant-u"))
    assert tally.seen == [
        ("handled", "CreateSandbox", "scheduled"),
        ("handled", "DestroySandbox", "rejected:forbidden"),
        ("refused", "forbidden"),
    ]
