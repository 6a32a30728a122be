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
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from app.stats import durations, percentile
from workers.agent.build import ensure_agent_dir
from workers.agent.listener import AgentListener


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
                samples = durations(args.n, call, warmup=min(50, args.n))
                p50, p99 = percentile(samples, 50), percentile(samples, 99)
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
