"""How close to its deadline a sandbox's time to live ends it, and what it is billed.

    .venv/bin/python bench/ttl.py [--n 300] [--ttl 60]

Creates N sandboxes through the SDK, each running a background ``sleep`` (something
to kill), with the same time to live, so their deadlines fall within the few seconds
the creates took: the node's worst case, many deadlines at once. Nobody destroys
them. Then it reads, for each:

- from the node worker's log, how long after its deadline its processes were killed
  (the node measures it right after the kill);
- from ``sandbox_lives``, the seconds it is billed, against its TTL.

Before the deadlines thread the node reaped expired sandboxes in its reconciliation
round (every 5 s, longer with many sandboxes): 0-5 s late plus the round's length.
Needs `dsec up`.
"""

from __future__ import annotations

import argparse
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import text

from app.config import get_settings
from app.control import tenants
from app.db.engine import transaction
from app.sdk import Client
from app.stats import percentile

LINE = re.compile(r"(sb-[a-z0-9]+): time to live reached, \d+ processes killed ([\d.]+) ms after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--ttl", type=int, default=60, help="seconds; longer than the creates")
    args = parser.parse_args()
    settings = get_settings()
    log_path = settings.state_dir / "logs" / f"worker-{settings.node_id}.log"
    job = f"ttl-{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    with Client(settings, credential=tenants.local(settings, "bench"), job_id=job) as client:

        def one(_: int) -> str:
            box = client.create(cpus=0.05, memory_mb=32, ttl_s=args.ttl, timeout_s=300)
            box.exec("sleep 100000 > /dev/null 2>&1 &")
            return box.id

        with ThreadPoolExecutor(16) as pool:
            ids = set(pool.map(one, range(args.n)))
        created_s = time.monotonic() - started
        print(f"{len(ids)} sandboxes created in {created_s:.1f}s, ttl {args.ttl}s")
        time.sleep(args.ttl + 15)  # the last deadline, and the removals after it
    late = {
        m.group(1): float(m.group(2))
        for m in LINE.finditer(log_path.read_text(errors="replace"))
        if m.group(1) in ids
    }
    with transaction(settings.database_url) as conn:
        rows = conn.execute(
            text(
                "SELECT sandbox_id, end_reason, extract(epoch FROM ended_at - started_at) AS s"
                " FROM sandbox_lives WHERE job_id = :job"
            ),
            {"job": job},
        ).all()
    billed = [float(r.s) for r in rows if r.s is not None]
    reasons = {r.end_reason for r in rows}
    values = sorted(late.values())
    print(f"killed by the deadlines thread: {len(values)} of {len(ids)}; end reasons {reasons}")
    if values:
        print(
            f"kill after the deadline: p50 {percentile(values, 50):.1f} ms, "
            f"p99 {percentile(values, 99):.1f} ms, max {values[-1]:.1f} ms"
        )
    over = [b for b in billed if b > args.ttl]
    print(
        f"billed: {len(billed)} lives, max {max(billed, default=0):.3f}s of a {args.ttl}s ttl,"
        f" {len(over)} over it"
    )
    print(
        f"RESULT ttl n={len(ids)} late_p50_ms={percentile(values, 50) if values else -1:.1f}"
        f" late_p99_ms={percentile(values, 99) if values else -1:.1f}"
        f" late_max_ms={values[-1] if values else -1:.1f} billed_over_ttl={len(over)}"
    )


if __name__ == "__main__":
    main()
