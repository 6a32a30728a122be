"""A restarted scheduler recovers its state from Postgres: sandboxes created before the
restart are still routed, groups still end as one, and a lease that lapsed and froze its
sandbox before the restart still thaws when its trainer comes back after it."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from app.config import Settings
from app.domain.requests import CreateSandbox
from app.errors import SandboxRejectedError
from app.sdk import Client
from app.stack import services as stack_mod
from tests.conftest import scalar, wait_for
from tests.integration.test_leases import event_count, process_states

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def stopped(db: Any, sandbox_id: str) -> bool:
    with db() as conn:
        return bool(
            scalar(
                conn, "SELECT state = 'stopped' FROM sandboxes WHERE sandbox_id = :s", s=sandbox_id
            )
        )


def restart_scheduler(settings: Settings) -> None:
    scheduler = next(s for s in stack_mod.services(settings) if s.name == "scheduler")
    assert scheduler.stop(settings), "the scheduler was not running"
    assert scheduler.start(settings)


def test_sandboxes_groups_and_leases_survive_a_scheduler_restart(
    stack: Settings, client: Any, db: Any
) -> None:
    # Given a sandbox, a rollout group, and a trainer whose lease lapsed (frozen sandbox)
    box = client.create()
    group = client.create_group(2)
    trainer = Client(
        stack, tenant="tests", job_id="restart", lease=True, lease_ttl_s=2, lease_grace_s=120
    )
    lease_id = trainer.lease_id
    assert lease_id is not None
    leased = trainer.create()
    leased.exec("sh -c 'while true; do :; done' >/dev/null 2>&1 &")
    trainer.close()
    wait_for(lambda: event_count(db, leased.id, "SandboxFrozen"), timeout_s=30, what="frozen")
    # and a sandbox that lived and ended, in the log
    ended = client.create()
    ended.close()
    wait_for(lambda: stopped(db, ended.id), timeout_s=30, what="ended")

    # When the scheduler restarts
    restart_scheduler(stack)

    # Then the id of the sandbox that ended is not given a second life (or a second bill
    # row under the same id): the new scheduler learns it from the log
    with pytest.raises(SandboxRejectedError) as refused:
        client.call(CreateSandbox(**client.request_fields(ended.id)), timeout_s=30)
    assert refused.value.reason == "id_in_use", refused.value

    # Then requests for what it placed before still reach the right node
    assert box.exec("echo still here", timeout_s=30).stdout == b"still here\n"
    # and the group is destroyed as one
    group.close(timeout_s=60)
    for member in group:
        wait_for(lambda m=member: stopped(db, m.id), timeout_s=30, what=f"{member.id} stopped")
    # and the trainer that comes back gets its frozen sandbox thawed
    again = Client(
        stack, tenant="tests", job_id="restart", lease=lease_id, lease_ttl_s=5, lease_grace_s=120
    )
    try:
        wait_for(lambda: event_count(db, leased.id, "SandboxThawed"), timeout_s=30, what="thawed")
        assert "T" not in process_states(leased.id)
        assert again.sandbox(leased.id).exec("echo back").stdout == b"back\n"
    finally:
        again.sandbox(leased.id).close()
        again.close()
        box.close()


def test_a_scheduler_starts_and_serves_with_a_tenants_replies_topic_gone(
    stack: Settings, client: Any
) -> None:
    from app import kafka_admin
    from tests.conftest import ensure_tenant, forget_tenant

    # Given a tenant whose replies topic was deleted behind the platform's back (the
    # scheduler's principal may not make it again)
    name = f"topicless-{uuid.uuid4().hex[:6]}"
    ensure_tenant(stack, name)
    try:
        kafka_admin.drop_topics(stack, [stack.replies_topic(name)])
        # When the scheduler starts again
        restart_scheduler(stack)
        # Then it serves everyone else
        with client.create(memory_mb=64, timeout_s=60) as box:
            assert box.exec("echo served").stdout == b"served\n"
    finally:
        forget_tenant(stack, name)
