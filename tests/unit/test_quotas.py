"""Per-tenant quotas on everything a request can create or hold (issue 23, item 9):
each test is the flood a tenant tried, refused past its limit with the limit named,
while another tenant is not held to it; an operator is not held to quotas at all."""

from __future__ import annotations

import json
import logging
import time
from itertools import count

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from app.config import Settings
from app.control.dispatch import Dispatcher
from app.control.outbox import Outbox
from app.control.stored_quotas import Back, Held, StoredQuotas
from app.domain.events import CommandCompleted, CommandPayload, NodeHeartbeat, NodePayload
from app.domain.quotas import Quota, Resource
from app.domain.records import Inbound
from app.domain.requests import CreateGroup, CreateSandbox, DestroyGroup, Exec, RenewLease
from tests.unit.signing import KEYS, PARTITIONS, record, reply_to

_offsets = count(50_000)


def _signed(message: BaseModel, key_id: str | None = None) -> Inbound:
    return record(message, next(_offsets), key_id=key_id)


def _dispatcher(**settings: object) -> Dispatcher:
    dispatcher = Dispatcher(Settings(**settings), KEYS, PARTITIONS)  # type: ignore[arg-type]
    payload = NodePayload(
        capacity_sandboxes=100_000, capacity_cpus=100_000, capacity_memory_mb=1 << 30, queue="x"
    )
    dispatcher.observe(Outbox(), _signed(NodeHeartbeat(node_id="n0", payload=payload)))
    return dispatcher


def _replies(out: Outbox) -> list[dict[str, object]]:
    return [json.loads(value) for _, _, value, _ in out.replies]


def _reasons(out: Outbox) -> list[str]:
    return [str(r.get("reason", r["kind"])) for r in _replies(out)]


def test_twenty_thousand_leases_are_refused_past_the_lease_quota() -> None:
    # Given the default quota of leases (1,000)
    dispatcher = _dispatcher()
    out = Outbox()
    started = time.monotonic()
    # When tenant t renews 20,000 leases of its own making, and u one of its own
    for i in range(20_000):
        dispatcher.handle(out, _signed(RenewLease(sandbox_id=f"lease-{i}", reply_to=reply_to())))
    theirs = RenewLease(sandbox_id="lease-u", reply_to=reply_to("u"))
    dispatcher.handle(out, _signed(theirs, "k-tenant-u"))
    # Then t holds 1,000 leases, each further one refused quota, naming the limit
    replies = _replies(out)
    assert dispatcher.leases.count("t") == 1000
    assert [r["kind"] for r in replies[:1000]] == ["done"] * 1000
    refused = replies[1000:20_000]
    assert {r["reason"] for r in refused} == {"quota"}
    assert "its quota is 1000" in str(refused[0]["detail"])
    assert "dsec tenant quota t --leases" in str(refused[0]["detail"])
    # and u renews its own as ever; renewing one t already holds still works
    assert replies[-1]["kind"] == "done" and replies[-1]["request_id"] == str(theirs.request_id)
    out = Outbox()
    dispatcher.handle(out, _signed(RenewLease(sandbox_id="lease-7", reply_to=reply_to())))
    assert _reasons(out) == ["done"]
    assert time.monotonic() - started < 60


def test_a_create_making_a_new_lease_counts_too() -> None:
    dispatcher = _dispatcher(quota_leases=1)
    out = Outbox()
    dispatcher.handle(out, _signed(CreateSandbox(sandbox_id="sb-1", lease_id="l1")))
    dispatcher.handle(out, _signed(CreateSandbox(sandbox_id="sb-2", lease_id="l1")))
    dispatcher.handle(out, _signed(CreateSandbox(sandbox_id="sb-3", lease_id="l2",
                                                 reply_to=reply_to())))  # fmt: skip
    assert len(out.tasks) == 2 and _reasons(out) == ["quota"]


def test_groups_are_refused_past_the_group_quota_until_one_is_destroyed() -> None:
    dispatcher = _dispatcher(quota_groups=2)
    out = Outbox()
    for g in range(3):
        group = CreateGroup(sandbox_id=f"grp-{g}", members=[f"sb-{g}-a", f"sb-{g}-b"],
                            reply_to=reply_to())  # fmt: skip
        dispatcher.handle(out, _signed(group))
    assert len(out.tasks) == 4 and _reasons(out) == ["quota", "quota"]  # each member told
    dispatcher.handle(Outbox(), _signed(DestroyGroup(sandbox_id="grp-0")))
    out = Outbox()
    dispatcher.handle(out, _signed(CreateGroup(sandbox_id="grp-3", members=["sb-3-a"])))
    assert len(out.tasks) == 1


def test_creates_waiting_for_room_are_refused_past_the_pending_quota() -> None:
    # Given no node with room (one node of 1 CPU, taken)
    dispatcher = Dispatcher(Settings(quota_pending_creates=3), KEYS, PARTITIONS)
    payload = NodePayload(capacity_sandboxes=1, capacity_cpus=1, capacity_memory_mb=4096,
                          queue="x")  # fmt: skip
    dispatcher.observe(Outbox(), _signed(NodeHeartbeat(node_id="n0", payload=payload)))
    dispatcher.handle(Outbox(), _signed(CreateSandbox(sandbox_id="sb-full", cpus=1)))
    # When t asks for 5 sandboxes that would wait
    out = Outbox()
    for i in range(5):
        create = CreateSandbox(sandbox_id=f"sb-w{i}", queue_s=600, reply_to=reply_to())
        dispatcher.handle(out, _signed(create))
    # Then 3 wait, 2 are refused at once; u may still wait
    assert len(dispatcher.pending) == 3 and _reasons(out) == ["quota", "quota"]
    dispatcher.handle(out, _signed(CreateSandbox(sandbox_id="sb-u", queue_s=600), "k-tenant-u"))
    assert len(dispatcher.pending) == 4


def _live_exec(dispatcher: Dispatcher, **exec_: object) -> tuple[Outbox, Exec]:
    request = Exec(sandbox_id="sb-a", command="sleep 60", reply_to=reply_to(), **exec_)  # type: ignore[arg-type]
    out = Outbox()
    dispatcher.handle(out, _signed(request))
    return out, request


def test_commands_in_flight_are_refused_past_the_quota_until_one_completes() -> None:
    dispatcher = _dispatcher(quota_commands=2)
    dispatcher.handle(Outbox(), _signed(CreateSandbox(sandbox_id="sb-a")))
    sent = [_live_exec(dispatcher) for _ in range(3)]
    assert [len(out.inbox) for out, _ in sent] == [1, 1, 0]
    assert _reasons(sent[2][0]) == ["quota"]
    # When the node says the first one completed, Then the next one may run
    first = sent[0][1]
    done = CommandCompleted(
        sandbox_id="sb-a", node_id="n0", tenant="t",
        payload=CommandPayload(request_id=first.request_id, actor="t/k", command="sleep 60",
                               exit_code=0, duration_ms=1, stdout_bytes=0, stderr_bytes=0,
                               stdout_head="", stderr_head=""),
    )  # fmt: skip
    dispatcher.observe(Outbox(), _signed(done))
    assert len(_live_exec(dispatcher)[0].inbox) == 1


def test_a_command_whose_end_is_never_heard_stops_counting_after_its_deadline() -> None:
    dispatcher = _dispatcher(quota_commands=1)
    dispatcher.handle(Outbox(), _signed(CreateSandbox(sandbox_id="sb-a")))
    out, _ = _live_exec(dispatcher, timeout_s=1)
    assert len(out.inbox) == 1
    assert _reasons(_live_exec(dispatcher)[0]) == ["quota"]
    dispatcher.quotas.holdings.expire("t", Resource.COMMANDS, time.monotonic() + 3600)
    assert len(_live_exec(dispatcher)[0].inbox) == 1


def test_trajectories_are_refused_past_the_quota_and_freed_with_their_sandboxes() -> None:
    dispatcher = _dispatcher(quota_trajectories=1)
    dispatcher.handle(Outbox(), _signed(CreateSandbox(sandbox_id="sb-a")))
    assert len(_live_exec(dispatcher, trajectory_id="tr-1", step=0)[0].inbox) == 1
    assert len(_live_exec(dispatcher, trajectory_id="tr-1", step=1)[0].inbox) == 1
    assert _reasons(_live_exec(dispatcher, trajectory_id="tr-2", step=0)[0]) == ["quota"]
    dispatcher._forget("sb-a", "destroyed")
    assert dispatcher.quotas.holdings.count("t", Resource.TRAJECTORIES) == 0


def test_the_sandbox_quota_names_its_limit() -> None:
    dispatcher = _dispatcher(tenant_quotas={"t": 1})
    out = Outbox()
    dispatcher.handle(out, _signed(CreateSandbox(sandbox_id="sb-1")))
    dispatcher.handle(out, _signed(CreateSandbox(sandbox_id="sb-2", queue_s=0,
                                                 reply_to=reply_to())))  # fmt: skip
    [refused] = _replies(out)
    assert refused["reason"] == "quota" and "holds 1 sandboxes and its quota is 1" in str(
        refused["detail"]
    )


def test_an_operator_is_not_held_to_quotas_and_the_log_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dispatcher = _dispatcher(quota_leases=1)
    out = Outbox()
    with caplog.at_level(logging.INFO, logger="app.control.quotas"):
        for i in range(3):
            renew = RenewLease(sandbox_id=f"lease-{i}", reply_to=reply_to("ops"))
            dispatcher.handle(out, _signed(renew, "k-operator"))
    assert _reasons(out) == ["done"] * 3
    [said] = [r.getMessage() for r in caplog.records]
    assert "operator:ops/k-operator goes past ops's leases quota" in said


def test_a_lease_another_scheduler_keeps_stops_counting_with_its_last_sandbox() -> None:
    # Given a scheduler that keeps no lease's clock (another reads their renewals)
    dispatcher = _dispatcher(quota_leases=1)
    dispatcher.leases.keeps = lambda _lease_id: False
    dispatcher.handle(Outbox(), _signed(CreateSandbox(sandbox_id="sb-1", lease_id="l1")))
    assert dispatcher.leases.count("t") == 1
    # When its sandbox ends, Then the lease is its keeper's alone to count
    dispatcher._forget("sb-1", "destroyed")
    assert dispatcher.leases.count("t") == 0
    out = Outbox()
    dispatcher.handle(out, _signed(CreateSandbox(sandbox_id="sb-2", lease_id="l2")))
    assert len(out.tasks) == 1


# --- the stored limits ------------------------------------------------------------------


def test_stored_limits_override_the_defaults_and_outlive_a_failed_read() -> None:
    stored: dict[str, dict[Resource, int | None]] = {"t": {Resource.LEASES: 5}}
    reads = []

    def load() -> dict[str, dict[Resource, int | None]]:
        reads.append(1)
        if len(reads) > 1:
            raise ConnectionError("postgres is down")
        return stored

    quotas = StoredQuotas(Settings(quota_groups=7), load, refresh_s=0)
    assert quotas.of("t") == Quota(leases=5, groups=7, pending_creates=10_000,
                                   commands=100_000, trajectories=100_000)  # fmt: skip
    # Postgres gone: the limits read last hold
    assert quotas.of("t").leases == 5 and quotas.of("u").leases == 1000


def test_dsec_tenant_quota_sets_and_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    from app.cli.main import cli
    from app.control import stored_quotas

    asked: list[tuple[str, dict[Resource, object]]] = []

    def change(_settings: Settings, tenant: str, changes: dict[Resource, object]) -> list[Held]:
        asked.append((tenant, changes))
        return [Held(Resource.LEASES, 5, "tenant"), Held(Resource.COMMANDS, None, "default")]

    monkeypatch.setattr(stored_quotas, "change", change)
    monkeypatch.setattr(stored_quotas, "limits", lambda _s, _t: change(_s, _t, {}))
    runner = CliRunner()
    done = runner.invoke(
        cli, ["tenant", "quota", "team-a", "--leases", "5", "--commands", "none",
              "--pending-creates", "default", "--json"],
    )  # fmt: skip
    assert done.exit_code == 0, done.stdout
    assert asked == [("team-a", {Resource.LEASES: 5, Resource.COMMANDS: None,
                                 Resource.PENDING_CREATES: Back.DEFAULT})]  # fmt: skip
    assert json.loads(done.stdout) == [
        {"resource": "leases", "limit": 5, "from": "tenant"},
        {"resource": "commands", "limit": None, "from": "default"},
    ]
    shown = runner.invoke(cli, ["tenant", "quota", "team-a", "--show"])
    assert shown.exit_code == 0 and "none" in shown.stdout and asked[-1] == ("team-a", {})
    for wrong in (["--leases", "-3"], ["--leases", "many"], ["--show", "--leases", "1"]):
        assert runner.invoke(cli, ["tenant", "quota", "team-a", *wrong]).exit_code == 2
