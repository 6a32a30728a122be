"""Waiting out a backing service that is gone: retry with backoff, say so, never die.

A service whose Postgres (or broker, or Redis) restarts must come back by itself
where its stored position says; dying instead hands the wait to a supervisor, whose
restart limit turns a ten-minute outage into a service that stays down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from app import metrics
from app.db.errors import UNAVAILABLE
from app.errors import first_line

T = TypeVar("T")
log = logging.getLogger(__name__)

# What counts as "the service is not there" is UNAVAILABLE; anything else is a bug
# and propagates.


#: How often a long wait is said again in the log.
LOG_EVERY_S = 30.0


class Stopped(Exception):
    """The process was asked to stop while it waited."""


def until_available(
    attempt: Callable[[], T],
    who: str,
    service: str,
    stop: threading.Event | None = None,
    first_s: float = 0.5,
    most_s: float = 10.0,
) -> T:
    """``attempt()`` until it does not fail for want of ``service``; its result.

    Waits ``first_s``, doubling up to ``most_s``, between attempts; the wait is in the
    log (at once, then every :data:`LOG_EVERY_S`) and in ``dsec_waiting_for_service``.
    """
    delay, since, next_log = first_s, time.monotonic(), 0.0
    gauge = metrics.WAITING.labels(who, service)
    stop = stop or threading.Event()
    try:
        while True:
            try:
                return attempt()
            except UNAVAILABLE as exc:
                gauge.set(1)
                now = time.monotonic()
                if now >= next_log:
                    log.warning(
                        "%s: waiting for %s (%.0fs so far): %s",
                        who, service, now - since, first_line(exc),
                    )  # fmt: skip
                    next_log = now + LOG_EVERY_S
                if stop.wait(delay):
                    raise Stopped(f"{who}: stopped while waiting for {service}") from exc
                delay = min(delay * 2, most_s)
    finally:
        gauge.set(0)
