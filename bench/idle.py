"""What the embedded stack costs doing nothing: CPU per process, as a share of a core.

    .venv/bin/python bench/idle.py [--seconds 60]

Every service of `dsec up` (broker, Redis, Postgres, scheduler, projector, node
worker, its Podman service and conmon, Flower, the supervisor) with one node and no
sandbox of a trainer; the node's warm pool is idle, started once. The CPU each group
spends over the window (from /proc, the broker with its children) is printed as a
percentage of one core; the last line is the headline. Needs `dsec up`.
"""

from __future__ import annotations

import argparse
import time

from procstat import cpu_seconds, stack_processes
from rich.console import Console
from rich.table import Table

from app.config import get_settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    settings = get_settings()
    groups = stack_processes(settings.state_dir, settings.node_id)
    before, started = cpu_seconds(groups), time.monotonic()
    time.sleep(args.seconds)
    after, wall = cpu_seconds(groups), time.monotonic() - started
    share = {name: (after[name] - before[name]) / wall * 100 for name in groups}
    table = Table(title=f"idle stack, {wall:.0f} s: % of one core")
    table.add_column("process")
    table.add_column("% of a core", justify="right")
    for name, pct in sorted(share.items(), key=lambda kv: -kv[1]):
        table.add_row(name, f"{pct:.2f}")
    total = sum(share.values())
    table.add_row("all", f"{total:.2f}")
    Console().print(table)
    parts = " ".join(f"{name.replace(' ', '_')}={pct:.2f}" for name, pct in share.items())
    print(f"RESULT idle total_pct={total:.2f} {parts}")


if __name__ == "__main__":
    main()
