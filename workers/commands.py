"""Commands in flight on a node, off the Celery pool.

A command may run for minutes (a test suite, a build); while it runs, the node only
waits on the agent's socket. Held in a Celery pool thread, sixteen of them filled the
node: a create or a destroy, or another tenant's command, queued behind them. So the
exec task only claims the command (on its pool thread, so a worker that dies before
the claim gets the task again, and one that dies after never runs it twice) and hands
the rest here: each command waits on a thread of its own, up to the node's limit
(`DSEC_NODE_MAX_COMMANDS`), and the pool thread is free for the next task at once.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from app import metrics
from workers.events_out import Outlet

log = logging.getLogger(__name__)


class Commands:
    """Runs claimed commands, each on its own thread, with their replies' keys."""

    def __init__(self, outlet: Outlet, limit: int) -> None:
        self._outlet = outlet
        self._pool = ThreadPoolExecutor(max_workers=limit, thread_name_prefix="dsec-command")
        self._lock = threading.Lock()
        self._in_flight = 0

    def submit(
        self, request_id: uuid.UUID, reply_key: bytes | None, job: Callable[[], None]
    ) -> None:
        """Run ``job`` (a claimed command) now, its replies proven with ``reply_key``."""
        self._moved(+1)
        try:
            self._pool.submit(self._run, request_id, reply_key, job)
        except BaseException:
            self._moved(-1)
            raise

    def in_flight(self) -> int:
        """Commands running (or about to) now."""
        with self._lock:
            return self._in_flight

    def _run(self, request_id: uuid.UUID, reply_key: bytes | None, job: Callable[[], None]) -> None:
        try:
            with self._outlet.answering(request_id, reply_key):
                job()
        except Exception:
            log.exception("command %s failed", request_id)
        finally:
            self._moved(-1)

    def _moved(self, by: int) -> None:
        with self._lock:
            self._in_flight += by
            metrics.COMMANDS_IN_FLIGHT.set(self._in_flight)

    def close(self) -> None:
        """Stop taking commands; those running finish."""
        self._pool.shutdown(wait=False, cancel_futures=False)
