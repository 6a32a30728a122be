"""The README's SDK example runs as a new user would run it: authenticated, with no
step beyond `make demo` (or `dsec up`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.config import Settings

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_example_runs(stack: Settings, tmp_path: Path) -> None:
    found = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert found, "the README has no Python example"
    (tmp_path / "example.py").write_text(found.group(1))
    (tmp_path / "my_project").mkdir()
    (tmp_path / "my_project" / "a.txt").write_text("hi\n")
    run = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "hello from" in run.stdout and "print(6 * 7)" in run.stdout
    assert (tmp_path / "out" / "my_project" / "a.txt").read_text() == "hi\n"
