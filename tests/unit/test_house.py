"""The house's rules that import-linter cannot state alone: every flat module of app/
is held by the plumbing contract, and no module grows past what a newcomer reads in
one sitting (docs/architecture.md)."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The most lines a module of app/ or workers/ may hold.
MAX_LINES = 500
PLUMBING = "The plumbing of app (its flat modules) imports only itself and the domain"


def _contracts() -> list[dict[str, object]]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contracts: list[dict[str, object]] = config["tool"]["importlinter"]["contracts"]
    return contracts


def test_the_plumbing_contract_holds_every_flat_module_of_app() -> None:
    # Given the flat modules of app/ and the contract that keeps them below the rooms
    flat = {f"app.{p.stem}" for p in (REPO / "app").glob("*.py") if p.stem != "__init__"}
    [plumbing] = [c for c in _contracts() if c["name"] == PLUMBING]
    # Then each of them is a source of that contract: a new one cannot slip past it
    listed = plumbing["source_modules"]
    assert isinstance(listed, list)
    assert flat - set(listed) == set()
    assert set(listed) - flat == set()


def test_no_module_is_over_the_line_limit() -> None:
    modules = [*(REPO / "app").rglob("*.py"), *(REPO / "workers").rglob("*.py")]
    too_long = {
        str(path.relative_to(REPO)): lines
        for path in modules
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert too_long == {}
