"""What importing a room loads: the layering `make lint` checks statically, seen at
run time in a fresh interpreter (a lazy import inside a function escapes the former)."""

from __future__ import annotations

import subprocess
import sys

import pytest

DRIVERS = ("kafka", "celery", "prometheus_client", "sqlalchemy", "psycopg", "redis", "podman")


def _loaded_drivers(module: str) -> set[str]:
    probe = (
        f"import sys, {module}\n"
        f"print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({DRIVERS!r}))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    return set(out.split())


@pytest.mark.parametrize(
    ("module", "allowed"),
    [
        ("app.control.dispatch", set()),
        ("app.domain.events", set()),
        ("app.sdk", {"kafka"}),
    ],
)
def test_a_room_loads_only_the_drivers_it_may(module: str, allowed: set[str]) -> None:
    assert _loaded_drivers(module) <= allowed
