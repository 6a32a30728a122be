"""The embedded broker dies and comes back: nothing acknowledged is lost, and the
platform serves again by itself.

The stack's own broker (Apache Kafka, its log on disk) is SIGKILLed under a trainer's
feet; nobody types `dsec up`. The supervisor starts it again with every topic and
every acknowledged record; every service and the trainer's client reconnect: commands
sent while it was down are answered once it is back, by the sandbox made before, which
kept running with its files (the broker's silence is not its node's), and no command
runs twice.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from sqlalchemy import text

from app.config import Settings
from app.sdk import Client
from app.stack import services as stack_mod
from app.stack.process import Service
from tests.conftest import logged, wait_for

pytestmark = pytest.mark.integration


def _broker(settings: Settings) -> Service:
    every = stack_mod.services(settings, stack_mod.known_node_ids(settings))
    return next(s for s in every if s.name == "broker")


def test_a_broker_that_dies_and_comes_back_loses_nothing(
    stack: Settings, client: Client, db: Any
) -> None:
    broker = _broker(stack)
    with client.create(memory_mb=64, ttl_s=600) as box:
        box.exec("echo kept > /tmp/mark")
        before = broker.pid(stack)
        assert before is not None
        # When the broker dies
        os.killpg(before, signal.SIGKILL)
        # Then a command sent while it is down is answered once it is back (the
        # client's producer holds it meanwhile), by the same sandbox, still running
        assert box.exec("cat /tmp/mark", timeout_s=10).stdout == b"kept\n"
        assert (pid := broker.pid(stack)) is not None and pid != before
        # and the platform makes sandboxes again
        with client.create(memory_mb=64, timeout_s=120) as fresh:
            assert fresh.exec("echo new").stdout == b"new\n"

        # And the log has that command once, and the sandbox is not ended
        def completed() -> list[tuple[str, str]]:
            with db() as conn:
                query = text(
                    "SELECT type, payload->>'request_id' FROM events WHERE sandbox_id = :s"
                    " AND (type = 'SandboxStopped' OR payload->>'command' = 'cat /tmp/mark')"
                )
                return [(r[0], r[1]) for r in conn.execute(query, {"s": box.id})]

        logged = wait_for(completed, 30, "the command in the log")
        assert logged and {kind for kind, _ in logged} == {"CommandCompleted"}
        assert len(logged) == 1


def test_a_destroy_the_broker_lost_is_sent_again_and_the_sandbox_ends(
    stack: Settings, db: Any
) -> None:
    from tests.conftest import tenant_client

    with tenant_client(stack, "tests", "lost-destroy") as client:
        box = client.create(ttl_s=600)
        # Given a broker that loses the first destroy (what a memory-only broker that
        # dies does with the records it holds)
        sent = client.publish
        dropped: list[str] = []

        def lossy(request: Any, waiting: Any = None, **route: Any) -> None:
            if request.type == "DestroySandbox" and not dropped:
                dropped.append(str(request.request_id))
                return
            sent(request, waiting, **route)

        client.publish = lossy  # type: ignore[method-assign]
        # When the trainer destroys it, the destroy that got no answer is sent again
        client.destroy(box.id, timeout_s=5)
        assert len(dropped) == 1

        # Then the sandbox ends, once, and the trainer heard it done
        def ended() -> list[str]:
            return logged(db, box.id, "reason", "SandboxStopped")

        assert wait_for(ended, what="the sandbox's end") == ["destroyed"]
