"""Which pulled images a node's disk budget removes (workers/host/image_budget.py)."""

from __future__ import annotations

from workers.host.image_budget import Held, evictions

MB = 1 << 20


def _held(name: str, size_mb: int, used_at: float | None) -> Held:
    return Held(f"localhost/{name}:1", f"id-{name}", size_mb * MB, used_at)


def test_least_recently_used_first_until_the_store_fits() -> None:
    held = [_held("a", 10, 1.0), _held("b", 10, 3.0), _held("c", 10, 2.0), _held("d", 10, 4.0)]
    assert [h.name for h in evictions(held, set(), 25 * MB)] == [
        "localhost/a:1",
        "localhost/c:1",
    ]
    assert evictions(held, set(), 40 * MB) == []


def test_images_in_use_and_images_not_from_the_hub_stay_even_over_budget() -> None:
    imported = _held("debian", 500, None)  # an operator's import: may exist nowhere else
    running = _held("a", 10, 1.0)
    idle = _held("b", 10, 2.0)
    gone = evictions([imported, running, idle], {"id-a"}, 0)
    assert gone == [idle]
