"""The README's SDK examples, sync and async, run as a new user would run them:
authenticated, with no step beyond `make demo` (or `dsec up`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.config import Settings

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"


def examples() -> list[str]:
    """The README's Python examples, in order: the sync client's, then the async one's."""
    found = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(found) == 2, f"the README should have two Python examples, not {len(found)}"
    return found


def run_example(source: str, where: Path) -> str:
    """Run ``source`` as `example.py` beside a `my_project` tree; its stdout."""
    (where / "example.py").write_text(source)
    (where / "my_project").mkdir()
    (where / "my_project" / "a.txt").write_text("hi\n")
    run = subprocess.run(
        [sys.executable, "example.py"], cwd=where, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_the_readme_example_runs(stack: Settings, tmp_path: Path) -> None:
    out = run_example(examples()[0], tmp_path)
    assert "hello from" in out and "print(6 * 7)" in out
    assert (tmp_path / "out" / "my_project" / "a.txt").read_text() == "hi\n"


def test_the_readme_async_example_runs(stack: Settings, tmp_path: Path) -> None:
    out = run_example(examples()[1], tmp_path)
    assert "['42\\n', '42\\n', '42\\n']" in out
    assert (tmp_path / "out-async" / "my_project" / "a.txt").read_text() == "hi\n"
