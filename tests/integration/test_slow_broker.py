"""A broker that answers slowly: every command still gets its answer, runs once and is
in the log once, and the platform is as fast as before once the broker is.

The broker is an Apache Kafka of the test's own (app/stack/local_cluster.py), reached
only through a proxy that holds every chunk it forwards, each way, for as long as the
test says (its advertised client address is the proxy's, so no client goes around
it). A scheduler, a node worker and a projector of their own use it
(tests/side_platform.py), with a database of their own; Redis is the stack's.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import text

from app.config import Settings
from app.sdk import Client
from app.stack import local_cluster
from tests.conftest import free_port, wait_for
from tests.side_platform import first_sandbox, side_platform
from workers.host.mounts import remove_tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NODE = "node6"
#: How long the slow broker holds each chunk, each way.
SLOW_S = 0.25
COMMANDS = 24


class DelayProxy:
    """A TCP proxy to ``target`` that holds each chunk for ``delay_s`` before passing it
    on (a slow broker, or a slow network to it)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.delay_s = 0.0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if self.delay_s:
                    time.sleep(self.delay_s)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for end in (src, dst):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self.listener.close()


@pytest.fixture
def slow(stack: Settings) -> Iterator[tuple[Settings, DelayProxy]]:
    port = free_port()
    proxy = DelayProxy(("127.0.0.1", port))
    state = Path(tempfile.mkdtemp(prefix="dsec-slow-"))
    os.chmod(state, 0o755)  # the node user walks through it to its home
    address = f"127.0.0.1:{proxy.port}"
    try:
        with (
            local_cluster.running(
                stack, 1, state / "kafka", client_ports=[port], client_advertised=address,
                subjects=["tests", NODE],
            ) as cluster,
            side_platform(stack, NODE, state, kafka=cluster.settings, projector=True) as settings,
        ):  # fmt: skip
            yield settings, proxy
    finally:
        proxy.close()
        remove_tree(state)


def _logged(settings: Settings, job: str) -> list[str]:
    """The commands of ``job`` in the log, one per CommandCompleted event."""
    from app.db.engine import transaction

    with transaction(settings.database_url) as conn:
        return list(
            conn.execute(
                text(
                    "SELECT payload->>'command' FROM events"
                    " WHERE job_id = :j AND type = 'CommandCompleted'"
                ),
                {"j": job},
            ).scalars()
        )


def test_a_slow_broker_slows_commands_but_loses_and_doubles_none(
    slow: tuple[Settings, DelayProxy],
) -> None:
    settings, proxy = slow
    job = f"slow-{uuid.uuid4().hex[:6]}"
    with Client(settings, tenant="tests", job_id=job) as client:
        box = first_sandbox(client, NODE)
        assert box.exec("echo warm").text == "warm\n"

        # When every exchange with the broker takes SLOW_S more each way
        proxy.delay_s = SLOW_S
        with ThreadPoolExecutor(8) as pool:
            results = list(
                pool.map(lambda n: box.exec(f"echo slow-{n}", timeout_s=60), range(COMMANDS))
            )
        also = first_sandbox(client, NODE)  # made while the broker is slow

        # Then every command was answered, with its own output
        assert [r.text for r in results] == [f"slow-{n}\n" for n in range(COMMANDS)]
        assert also.exec("echo made").text == "made\n"

        # And once the broker is quick again, the platform serves as before
        proxy.delay_s = 0.0
        assert box.exec("echo quick").text == "quick\n"

    # And each command is in the log exactly once
    expected = sorted(["echo warm", "echo made", "echo quick"]
                      + [f"echo slow-{n}" for n in range(COMMANDS)])  # fmt: skip
    wait_for(lambda: len(_logged(settings, job)) >= len(expected), 60, "the commands logged")
    time.sleep(2)  # a command logged twice would come in the same batches
    assert sorted(_logged(settings, job)) == expected
