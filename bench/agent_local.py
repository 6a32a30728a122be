"""Micro-benchmark: round trips through dsec-agent run directly on the host.

    .venv/bin/python bench/agent_local.py [--n 500]

Compiles the agent into a temporary directory, starts it as a subprocess connected to
a temporary socket, and times PING (no fork) and EXEC of ``true`` (fork + exec) from
the host client. No container is involved: this is the agent's own cost, the floor
under what a sandbox adds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from workers.agent.build import ensure_agent_dir
from workers.agent.client import AgentListener


def _measure(n: int, call: Callable[[], object]) -> tuple[float, float]:
    for _ in range(min(50, n)):
        call()
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    samples.sort()
    return statistics.median(samples), samples[max(0, int(len(samples) * 0.99) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="round trips per measurement")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-"))
    try:
        agent = ensure_agent_dir(tmp / "bin") / "dsec-agent"
        listener = AgentListener(tmp)
        proc = subprocess.Popen(
            [str(agent), str(listener.path)], env={"PATH": "/usr/bin:/bin"}, cwd=tmp
        )
        try:
            conn = listener.accept(timeout_s=5)
            cases: dict[str, Callable[[], object]] = {
                "ping": conn.ping,
                "exec true": lambda: conn.exec(["true"], cwd=str(tmp)),
                "exec sh -c 'echo hi'": lambda: conn.exec(["sh", "-c", "echo hi"], cwd=str(tmp)),
            }
            for name, call in cases.items():
                p50, p99 = _measure(args.n, call)
                print(f"{name:24} n={args.n}  p50 {p50 * 1e3:6.3f} ms  p99 {p99 * 1e3:6.3f} ms")
            conn.close()
        finally:
            proc.terminate()
            proc.wait(timeout=5)
            listener.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
