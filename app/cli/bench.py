"""``dsec bench``: find and run the benchmarks in ``bench/`` with this interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import app

#: The checkout's benchmark scripts (an installed wheel carries none).
BENCH_DIR = Path(app.__file__).resolve().parent.parent / "bench"


def available(directory: Path = BENCH_DIR) -> dict[str, str]:
    """Benchmark name -> the first line of its docstring."""
    found = {}
    for path in sorted(directory.glob("*.py")):
        if path.name.startswith("_"):
            continue
        try:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        except (OSError, SyntaxError):
            doc = ""
        found[path.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found


def run(name: str, args: Sequence[str], directory: Path = BENCH_DIR) -> int:
    """Run ``bench/NAME.py ARGS`` with the interpreter running dsec; its exit code."""
    script = directory / f"{name.removesuffix('.py')}.py"
    if not directory.is_dir():
        print(
            f"dsec: the benchmarks come with the source checkout ({directory} is not one)",
            file=sys.stderr,
        )
        return 2
    if not script.is_file():
        known = ", ".join(available(directory)) or "none"
        print(f"dsec: no benchmark {name!r} in {directory} (known: {known})", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *args])
