"""The garbage collector in a long-running service: what it costs, and keeping it
off the hot path.

CPython's cyclic collector scans every tracked object of a generation when it runs.
A service's own code, its libraries' (pydantic, Celery, kombu, podman-py, Kafka's
clients) and its long-lived state are ~100,000 objects that never become garbage,
and a full collection walks them all: 46 ms on these machines right after the node
worker's imports, more once it holds thousands of sandboxes. A burst of commands
allocates fast enough to set off such collections again and again, each holding the
interpreter's lock while the node should be starting commands (a profile of 1,990
commands at once found a third of the node's busy time inside the frame that builds
a record from Kafka: allocation, where collections run).

:func:`settle` moves everything alive once a service has started into the permanent
generation (``gc.freeze``), which collections never scan, and raises the young
generation's threshold so that a burst's short-lived objects are collected in larger
and fewer rounds. Cycles made later are still collected; the time each generation's
collections take is counted (``dsec_gc_seconds_total``).
"""

from __future__ import annotations

import gc
import time
from typing import Any

from app.metrics import GC_SECONDS

#: Allocations (net of deallocations) between collections of the young generation
#: (CPython's default is 700): a burst's objects mostly die young, and at 700 each
#: command set off a collection or more.
YOUNG_THRESHOLD = 20_000

_started: dict[int, float] = {}


def settle() -> None:
    """Call once a service has imported its code and built its long-lived state:
    what is alive now is not scanned again, and collections run less often."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
    if _timed not in gc.callbacks:
        gc.callbacks.append(_timed)


def _timed(phase: str, info: dict[str, Any]) -> None:
    """Count each collection's time by generation (a callback CPython calls around
    every collection)."""
    generation = info.get("generation", 2)
    if phase == "start":
        _started[generation] = time.perf_counter()
    elif (began := _started.pop(generation, None)) is not None:
        GC_SECONDS.labels(str(generation)).inc(time.perf_counter() - began)
