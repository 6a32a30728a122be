"""A service's heap once it has started (app/heap.py): what is alive then is never
scanned again, and the collector's time is counted."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from app import heap
from app.metrics import GC_SECONDS


@pytest.fixture
def restored() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)
    if heap._timed in gc.callbacks:
        gc.callbacks.remove(heap._timed)


def _counted(generation: int) -> float:
    return GC_SECONDS.labels(str(generation))._value.get()


@pytest.mark.usefixtures("restored")
def test_what_is_alive_at_start_is_frozen_and_collections_are_timed() -> None:
    # Given a service that has started
    long_lived = [[i] for i in range(10_000)]
    heap.settle()
    # Then what was alive is in the permanent generation, out of every collection's way
    assert gc.get_freeze_count() >= len(long_lived)
    assert gc.get_threshold()[0] == heap.YOUNG_THRESHOLD
    # And a collection later is counted, by generation
    before = _counted(2)
    gc.collect()
    assert _counted(2) > before
    # And settling twice counts each collection once
    heap.settle()
    assert gc.callbacks.count(heap._timed) == 1
