"""A command cut short by its node's worker dying is answered, never left silent
and never run again."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
from sqlalchemy import text

from app.config import Settings
from app.errors import SandboxFailedError
from app.sdk import Client
from app.stack import services as stack_mod
from app.stack.process import Service
from tests.conftest import logged, wait_for

pytestmark = pytest.mark.integration


def _worker(stack: Settings) -> Service:
    """The stack's service of the configured node's worker."""
    every = stack_mod.services(stack, stack_mod.known_node_ids(stack))
    return next(s for s in every if s.name == f"worker-{stack.node_id}")


def test_a_command_cut_by_a_worker_crash_is_answered_interrupted(
    stack: Settings, client: Client, db: Any
) -> None:
    worker = _worker(stack)
    with client.create(memory_mb=64, ttl_s=600) as box:
        outcome: list[BaseException | object] = []

        def run() -> None:
            try:
                outcome.append(box.exec("sleep 120", timeout_s=150))
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        wait_for(lambda: b"sleep 120" in box.exec("ps -o args").stdout, what="the command")
        # When the node's worker dies, no word said, with the command running
        before = worker.pid(stack)
        assert before is not None
        os.killpg(before, signal.SIGKILL)
        # Then the trainer is told, long before the command's own timeout
        thread.join(timeout=90)
        assert not thread.is_alive(), "no answer: the trainer would wait out its timeout"
        [failed] = outcome
        assert isinstance(failed, SandboxFailedError) and failed.reason == "interrupted"
        # and the sandbox serves again once the supervisor restarted the worker
        wait_for(lambda: (pid := worker.pid(stack)) is not None and pid != before, 30)
        assert box.exec("echo back", timeout_s=30).stdout == b"back\n"
        assert b"sleep 120" not in box.exec("ps -o args").stdout  # killed, not re-run
        query = text(
            "SELECT type, payload->>'reason' AS reason FROM events WHERE sandbox_id = :s"
            " AND (type = 'SandboxFailed' OR payload->>'command' = 'sleep 120')"
        )

        def logged() -> list[tuple[str, str]]:
            with db() as conn:
                return [(r.type, r.reason) for r in conn.execute(query, {"s": box.id})]

        wait_for(logged, what="the failure in the log")
        assert logged() == [("SandboxFailed", "interrupted")]


def test_a_lifecycle_task_cut_by_a_worker_crash_is_done_again(
    stack: Settings, client: Client, db: Any
) -> None:
    import json
    import uuid

    import redis

    from app import credentials
    from app.domain.node_tasks import NodeTask, TaskEnvelope, seal, seal_secret
    from app.domain.proof import reply_key
    from app.domain.replies import Done
    from app.domain.requests import DestroySandbox

    worker = _worker(stack)
    box = client.create(memory_mb=64, ttl_s=600)
    # Given a destroy the node's worker had taken, sealed as the scheduler sends it,
    # and died doing (what a worker records while it does one)
    destroy = DestroySandbox(
        **client.request_fields(box.id), tenant=client.tenant, actor=f"{client.tenant}:test"
    )
    node_cred = credentials.load(credentials.node_file(stack, stack.node_id))
    envelope = TaskEnvelope(
        request=destroy.model_dump_json(),
        reply_key_sealed=seal_secret(
            node_cred.secret, reply_key(client.credential.secret, destroy.request_id)
        ),
    )
    args = seal(NodeTask.DESTROY, envelope, node_cred.key_id, node_cred.secret)
    answer = client.expect(destroy.request_id)
    redis.Redis.from_url(stack.celery_broker_url).hset(
        f"dsec:inflight-tasks:{stack.node_id}",
        str(destroy.request_id),
        json.dumps({"task": NodeTask.DESTROY.value, "args": args}),
    )
    before = worker.pid(stack)
    assert before is not None
    os.killpg(before, signal.SIGKILL)
    # Then the next worker does it again: the trainer gets its answer, the log its end
    reply = answer.result(timeout=90)
    assert isinstance(reply, Done) and reply.detail == "destroyed"

    def stopped() -> list[str]:
        return logged(db, box.id, "request_id", "SandboxStopped")

    assert wait_for(stopped, what="the sandbox's end") == [str(destroy.request_id)]
    assert uuid.UUID(stopped()[0]) == destroy.request_id


def test_a_create_given_back_after_its_trainer_gave_up_is_refused_not_made(
    stack: Settings, client: Client, db: Any
) -> None:
    import uuid
    from datetime import timedelta

    from app import credentials
    from app.domain.base import utcnow
    from app.domain.node_tasks import NodeTask, TaskEnvelope, seal, seal_secret
    from app.domain.proof import reply_key
    from app.domain.replies import ErrorReply
    from app.domain.requests import CreateSandbox
    from app.taskqueue import make_celery

    # Given a create the scheduler sealed for the node long ago, which a dead worker
    # held until its node's next worker gave it back (restore_unacked)
    sandbox_id = f"sb-stale-{uuid.uuid4().hex[:8]}"
    common = {
        **client.request_fields(sandbox_id),
        "sent_at": utcnow() - timedelta(seconds=stack.request_max_age_s + 60),
    }
    create = CreateSandbox(**common, tenant=client.tenant, actor=f"{client.tenant}:test")
    node_cred = credentials.load(credentials.node_file(stack, stack.node_id))
    envelope = TaskEnvelope(
        request=create.model_dump_json(),
        reply_key_sealed=seal_secret(
            node_cred.secret, reply_key(client.credential.secret, create.request_id)
        ),
    )
    answer = client.expect(create.request_id)
    celery = make_celery(stack)
    celery.send_task(
        NodeTask.CREATE.value,
        args=seal(NodeTask.CREATE, envelope, node_cred.key_id, node_cred.secret),
        queue=stack.node_queue(stack.node_id),
    )
    celery.close()
    # Then the node refuses it (reason timeout) instead of making a sandbox nobody uses
    reply = answer.result(timeout=60)
    assert isinstance(reply, ErrorReply) and reply.reason == "timeout", reply
    assert "DSEC_REQUEST_MAX_AGE_S" in reply.detail

    # and nothing started in the log (this create was sealed by hand, never placed: the
    # node's SandboxFailed about it is set aside as a node speaking for a sandbox not
    # its own, app/domain/admission.py)
    time.sleep(2)
    assert logged(db, sandbox_id, "reason", "SandboxStarted") == []
