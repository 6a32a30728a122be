"""One thread that waits on the agents' answers to every command in flight on a node.

A thread per command cost more than the command: 2,000 long commands meant 2,000
threads each woken once to write its request and once to read its answer, every
hand-off a trip through the interpreter's lock, and the last of a burst started seconds
after the first (docs/BENCHMARKS.md, sessions 27-31). Here the caller sends the request
itself (:meth:`Waiter.watch`, a few microseconds of a socket write) and this thread
reads every answer as it arrives (epoll, level-triggered), streamed output included,
ending each request at its deadline. What an answer sets off runs on this thread too,
so it must not block for long (the exec path hands anything slow to a thread); what it
would tell another service once per answer can wait for the end of the round of
answers and go in one round trip (:class:`RoundBatch`).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from workers.agent.connection import AgentConnection, Answer
from workers.agent.errors import AgentError, AgentProtocolError, AgentRefused, AgentTimeout
from workers.agent.messages import AgentErrorReply, Output, Request, Response

log = logging.getLogger(__name__)

#: Longest the thread sleeps while requests are watched: how late past its deadline
#: a request whose agent never answers is ended (the agent ends a command at its own
#: timeout; the host's deadline is the margin beyond it).
TICK_S = 1.0
_EVENTS = select.EPOLLIN | select.EPOLLRDHUP
#: Deadlines of answered requests the heap may hold beyond twice those watched.
COMPACT_AFTER = 1024

#: Called once per request, on the waiter's thread: its response, or why there is none.
Done = Callable[[Response | None, AgentError | None], None]

T = TypeVar("T")


@dataclass(eq=False)
class _Exchange:
    """One request in flight on one connection."""

    conn: AgentConnection
    deadline: float | None
    answer: Answer
    done: Done
    #: The connection's descriptor while watched (-1: never was).
    fd: int = -1

    def read(self) -> Response | None:
        """The final response, once it is complete; None until then. Output frames on
        the way go to the answer's ``on_output``."""
        frames = self.conn.read_frames(self.answer.limit)
        for i, payload in enumerate(frames):
            response = self.answer.take(payload)
            if response is None:
                continue
            if i + 1 < len(frames) or self.conn.unread:
                # Whatever follows would be read as the next request's answer.
                raise AgentProtocolError("agent sent more after its response")
            return response
        return None


class Waiter:
    """Waits on requests sent on agent connections, all on one thread (started on first
    use), and hands each its answer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._watched: dict[int, _Exchange] = {}
        self._deadlines: list[tuple[float, int, _Exchange]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._batches: list[RoundBatch[Any]] = []

    def watch(
        self,
        conn: AgentConnection,
        request: Request,
        timeout_s: float | None,
        done: Done,
        on_output: Callable[[Output], None] | None = None,
    ) -> None:
        """Send ``request`` on ``conn`` (held by the caller until ``done``) and have
        ``done`` called with its response once it arrives: on this thread at once if it
        could not be sent, else on the waiter's. ``timeout_s`` bounds the round trip
        (None: without end); ``on_output`` gets a streaming command's output frames."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        exchange = _Exchange(conn, deadline, Answer(request, on_output), done)
        try:
            conn.send(request)
        except AgentError as exc:
            self._end(exchange, None, exc)
            return
        fd = exchange.fd = conn.fileno()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dsec-waiter", daemon=True)
                self._thread.start()
            idle = not self._watched
            self._watched[fd] = exchange
            if deadline is not None:
                heapq.heappush(self._deadlines, (deadline, next(self._order), exchange))
            self._epoll.register(fd, _EVENTS)
        if idle:  # asleep without a deadline: it must learn of this one's
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"x")

    def on_thread(self) -> bool:
        """True on the waiter's own thread (inside a round of answers)."""
        return threading.current_thread() is self._thread

    def batch(self, flush: Callable[[list[T]], None]) -> RoundBatch[T]:
        """A :class:`RoundBatch` this waiter flushes at the end of each round."""
        batch = RoundBatch(self, flush)
        self._batches.append(batch)
        return batch

    def watched(self) -> int:
        """Requests waiting for their answer now."""
        with self._lock:
            return len(self._watched)

    def _run(self) -> None:
        while True:
            try:
                self._step()
            except Exception:  # one bad answer must not stop every command's
                log.exception("agent waiter loop error")

    def _step(self) -> None:
        with self._lock:
            timeout = TICK_S if self._watched else -1.0
            if self._deadlines:
                timeout = min(timeout, max(0.0, self._deadlines[0][0] - time.monotonic()))
        for fd, _mask in self._epoll.poll(timeout):
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                continue
            with self._lock:
                exchange = self._watched.get(fd)
            if exchange is not None:
                self._read(exchange)
        self._expire(time.monotonic())
        for batch in self._batches:
            batch.flush()

    def _read(self, exchange: _Exchange) -> None:
        try:
            response = exchange.read()
        except AgentError as exc:
            self._end(exchange, None, exc)
            return
        except OSError as exc:  # not AgentError: what the socket itself raised
            self._end(exchange, None, AgentError(f"agent connection broke: {exc}"))
            return
        if response is not None:
            self._end(exchange, response, None)

    def _expire(self, now: float) -> None:
        while True:
            with self._lock:
                if not self._deadlines or self._deadlines[0][0] > now:
                    return
                _, _, exchange = heapq.heappop(self._deadlines)
                if self._watched.get(exchange.fd) is not exchange:
                    continue  # answered already
            # A late answer would be read as the next request's; closing also makes
            # the agent kill the command.
            self._end(exchange, None, AgentTimeout("agent did not answer in time"))

    def _end(
        self, exchange: _Exchange, response: Response | None, error: AgentError | None
    ) -> None:
        """Stop watching, close a connection that failed, and hand the answer over."""
        conn = exchange.conn
        if isinstance(response, AgentErrorReply):  # refused: the connection stays good
            error = AgentRefused(response.message, response.errno)
            response = None
        failed = error is not None and not isinstance(error, AgentRefused)
        with self._lock:
            if self._watched.get(exchange.fd) is exchange:
                del self._watched[exchange.fd]
                with contextlib.suppress(OSError):
                    self._epoll.unregister(exchange.fd)
            if len(self._deadlines) > 2 * len(self._watched) + COMPACT_AFTER:
                # An answered request's deadline stays in the heap until it passes (a
                # command's timeout and more): kept, thousands of answers a second would
                # hold every answered request for minutes.
                self._deadlines = [d for d in self._deadlines if self._watched.get(d[2].fd) is d[2]]
                heapq.heapify(self._deadlines)
        if failed:
            conn.close()
        conn.unwatch(failed=failed)
        try:
            exchange.done(response, error)
        except Exception:
            log.exception("handling an agent's answer failed")


class RoundBatch(Generic[T]):
    """Items gathered on a waiter's thread through one round of answers, handed to
    ``flush`` once at the round's end (made by :meth:`Waiter.batch`): one round trip to
    another service for a burst of answers where each would have made its own. An item
    added on any other thread is handed over at once, alone."""

    def __init__(self, waiter: Waiter, flush: Callable[[list[T]], None]) -> None:
        self._waiter = waiter
        self._flush = flush
        self._items: list[T] = []  # only the waiter's thread touches it

    def add(self, item: T) -> None:
        """Hand ``item`` over: at the end of the round on the waiter's thread, else now."""
        if self._waiter.on_thread():
            self._items.append(item)
        else:
            self._flush([item])

    def flush(self) -> None:
        """Hand over what the round gathered (called by the waiter)."""
        items, self._items = self._items, []
        if items:
            try:
                self._flush(items)
            except Exception:
                log.exception("handing over %d answers' work failed", len(items))
