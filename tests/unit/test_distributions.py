"""The two distributions built from this repository: the trainer's SDK (``dsec-sdk``,
sdk/) carries what ``app.sdk`` needs and no more; the server (``dsec``, setup.py)
carries the rest; both take their one version from ``app.__version__``."""

from __future__ import annotations

import os
import runpy
import tomllib
from pathlib import Path
from typing import Any

import grimp

import app

REPO = Path(__file__).resolve().parents[2]


def _setup() -> dict[str, Any]:
    # Not as __main__: setup.py only builds then.
    return runpy.run_path(str(REPO / "setup.py"), run_name="dsec_setup")


def _linked(root: Path) -> set[str]:
    """The paths sdk/app holds, relative to sdk/ (a linked directory as one path)."""
    found: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for name in list(dirnames):
            if (here / name).is_symlink():
                found.add((here / name).relative_to(root.parent).as_posix())
                dirnames.remove(name)
        found.update((here / f).relative_to(root.parent).as_posix() for f in filenames)
    return found


def test_the_sdk_tree_links_exactly_what_the_server_leaves_out() -> None:
    owned = set(_setup()["SDK_OWNS"])
    assert _linked(REPO / "sdk" / "app") == owned
    for path in owned:
        link = REPO / "sdk" / path
        # Each link is the checkout's own file, at the same place under the repository
        assert link.is_symlink() and link.resolve() == (REPO / path).resolve(), path


def test_everything_the_sdk_imports_travels_with_it() -> None:
    graph = grimp.build_graph("app")
    todo = ["app.sdk", *(m for m in graph.modules if m.startswith("app.sdk."))]
    needed: set[str] = set()
    while todo:
        module = todo.pop()
        if module not in needed:
            needed.add(module)
            todo.extend(m for m in graph.find_modules_directly_imported_by(module))
    sdk_owned = _setup()["sdk_owned"]
    for module in needed:
        parts = module.split(".")
        path = "/".join(parts) + ".py"
        package = "/".join(parts) + "/__init__.py"
        assert sdk_owned(path) or sdk_owned(package), f"app.sdk needs {module}, not in the SDK"


def test_one_version_for_both_distributions() -> None:
    sdk = tomllib.loads((REPO / "sdk" / "pyproject.toml").read_text())
    server = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert sdk["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "app.__version__"}
    assert "version" in sdk["project"]["dynamic"] and "version" in server["project"]["dynamic"]
    assert _setup()["version"]() == app.__version__
    # The server depends on the SDK (pinned by setup.py to this very version)
    assert "dsec-sdk" in server["tool"]["dsec"]["dependencies"]
    # And the changelog says what this version changed; compose runs this version's images
    assert f"## {app.__version__} " in (REPO / "CHANGELOG.md").read_text()
    assert f"DSEC_VERSION:-{app.__version__}}}" in (REPO / "docker" / "compose.yaml").read_text()
