"""Sandboxes' deadlines, kept to the millisecond.

A sandbox's TTL is a promise to the trainer and to the bill: it ends at its deadline,
not at the next reconciliation round (every few seconds, longer with thousands of
sandboxes). One thread sleeps until the nearest deadline and hands each due sandbox
to the node, which kills its processes at once and removes it on another thread; the
Stopped event says the sandbox ended at its deadline.

The reconciler still reaps what this missed (a deadline that passed while the worker
was down), stamped with the same deadline.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from app.domain.base import utcnow

log = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class Due:
    """A sandbox and when its time is up."""

    at: datetime
    sandbox_id: str = field(compare=False)
    tenant: str = field(compare=False)
    job_id: str = field(compare=False)


class Deadlines(threading.Thread):
    """Calls ``expire(due)`` at each watched sandbox's deadline. ``expire`` returns
    False when the sandbox cannot be ended now (in another transition): it is asked
    again shortly."""

    RETRY_S = 0.05

    def __init__(self, expire: Callable[[Due], bool]) -> None:
        super().__init__(name="dsec-deadlines", daemon=True)
        self._expire = expire
        self._cond = threading.Condition()
        self._heap: list[Due] = []
        # The current deadline of each watched sandbox: heap entries that no longer
        # match it were cancelled or moved.
        self._current: dict[str, Due] = {}
        self._stopping = False

    def watch(self, due: Due) -> None:
        """End ``due.sandbox_id`` at ``due.at`` (replacing an earlier deadline)."""
        with self._cond:
            self._current[due.sandbox_id] = due
            heapq.heappush(self._heap, due)
            if self._heap[0] is due:
                self._cond.notify()

    def cancel(self, sandbox_id: str) -> None:
        """Forget a sandbox that ended otherwise (idempotent)."""
        with self._cond:
            self._current.pop(sandbox_id, None)

    def is_watched(self, sandbox_id: str) -> bool:
        """True if ``sandbox_id`` has a deadline here."""
        with self._cond:
            return sandbox_id in self._current

    def stop(self) -> None:
        """End the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def run(self) -> None:
        while True:
            due = self._next()
            if due is None:
                return
            try:
                done = self._expire(due)
            except Exception:
                log.exception("ending %s at its deadline failed", due.sandbox_id)
                done = True  # the reconciler's round reaps it
            if not done:
                later = Due(utcnow(), due.sandbox_id, due.tenant, due.job_id)
                with self._cond:
                    if self._current.get(due.sandbox_id) is None:
                        self._current[due.sandbox_id] = due
                    heapq.heappush(self._heap, later)
                self._pause()

    def _pause(self) -> None:
        with self._cond:
            self._cond.wait(self.RETRY_S)

    def _next(self) -> Due | None:
        """Wait for the nearest live deadline and take it; None once stopping."""
        with self._cond:
            while not self._stopping:
                while self._heap and self._heap[0].sandbox_id not in self._current:
                    heapq.heappop(self._heap)  # cancelled
                if not self._heap:
                    self._cond.wait()
                    continue
                head = self._heap[0]
                current = self._current[head.sandbox_id]
                if head is not current and head.at < current.at:
                    heapq.heappop(self._heap)  # an earlier deadline, since moved
                    continue
                wait_s = (head.at - utcnow()).total_seconds()
                if wait_s > 0:
                    self._cond.wait(wait_s)
                    continue
                heapq.heappop(self._heap)
                del self._current[head.sandbox_id]
                return current
            return None
