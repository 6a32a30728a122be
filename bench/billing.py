"""Audit and billing at DSec scale: every query of docs/sql.md over a synthetic log.

    .venv/bin/python bench/billing.py --lives 1000000 --days 30
    .venv/bin/python bench/billing.py --lives 10000000 --days 30 --raw-timeout 120
    .venv/bin/python bench/billing.py --lives 10000000 --days 30 --reuse   # time again

Builds a database of its own (``<db>_billing``, migrated to head) holding ``--lives``
sandbox lives spread over the last ``--days`` UTC days: per life a SandboxRequested,
a SandboxStarted and (unless it still runs) a SandboxStopped, ``--commands`` commands
per life on average, and one refused sender per thousand lives; 50 tenants (``acme``
and ``team-a`` among them) with 20 jobs each (``rollout-0`` .. ``rollout-19``), 20
nodes; the sandbox ``sb-1234`` is one of acme's. Events are written in the order
they occurred, with positions, by COPY into ``events`` (the partitioned log, every
index in place) and, from the same lives, into the ``lives`` and ``sandboxes``
projections; ``usage_daily`` is then folded from ``lives`` and the log's commands by
one statement (``app.db.billing.ROLLUP_FROM_LIVES``), and ``usage`` from the lives.

Then every SQL block of docs/sql.md's "Queries an operator runs" is timed (median of
three, warm), and where it reads ``billing_daily`` or ``sandbox_lives`` the same
query over the raw log's views (``*_from_log``) is timed once, up to
``--raw-timeout``; then ``dsec bill`` and ``dsec audit`` as an operator types them
(wall time of the whole command, Python's start included: ``dsec --help`` is
timed first for that start-up alone). The last line is
``RESULT billing lives=N ... max_s=<slowest docs/sql.md query>``. Goal: under 1 s.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from rich.console import Console
from rich.table import Table

from app.config import Settings, get_settings
from app.db.billing import ROLLUP_FROM_LIVES, RUNNING_FROM_LIVES
from app.db.engine import libpq_url
from app.db.setup import drop_database, ensure_database, migrate

REPO = Path(__file__).resolve().parents[1]
TENANTS = ["acme", "team-a", *(f"tenant-{i:02d}" for i in range(2, 50))]
JOBS = [f"rollout-{j}" for j in range(20)]
NODES = [f"node-{n:02d}" for n in range(20)]
CPUS = ["0.5", "1.0", "2.0", "4.0"]
MEMORY = [512, 1024, 2048, 4096]
#: End reasons and their shares (the rest: destroyed).
ENDS = [("ttl", 0.06), ("oom", 0.02), ("failed", 0.01), ("node_lost", 0.005),
        ("lease_lapsed", 0.005)]  # fmt: skip
TOPIC_ID = "7f2c9a6e-0000-4000-8000-000000000000"

console = Console()


# --- the synthetic log ---------------------------------------------------------------


def _ts(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(sep=" ")


def _duration(rng: random.Random) -> float:
    """Seconds a sandbox lives: mostly minutes, some hours, a few a day."""
    x = rng.random()
    if x < 0.70:
        return rng.uniform(30, 600)
    if x < 0.95:
        return rng.uniform(600, 7200)
    return rng.uniform(7200, 86400)


def _sandbox_id(i: int) -> str:
    # A bijection of the counter over 48 bits: ids look random, never collide.
    return f"sb-{(i * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFF:012x}"


@dataclass
class Loaded:
    lives: int
    events: int
    seconds: float


class Writer:
    """Three COPY streams fed at once: the log, ``lives`` and ``sandboxes``."""

    def __init__(self, url: str) -> None:
        self.conns = [psycopg.connect(url) for _ in range(3)]
        self.copies = [
            c.cursor().copy(sql)
            for c, sql in zip(
                self.conns,
                (
                    "COPY events (position, event_id, type, version, sandbox_id, node_id,"
                    " tenant, job_id, occurred_at, recorded_at, payload, topic, topic_id,"
                    ' partition, "offset") FROM STDIN',
                    "COPY lives (sandbox_id, tenant, job_id, node_id, actor, image, cpus,"
                    " memory_mb, started_at, ended_at, end_reason, end_detail, last_position)"
                    " FROM STDIN",
                    "COPY sandboxes (sandbox_id, tenant, job_id, actor, image, node_id, state,"
                    " cpus, memory_mb, disk_mb, ttl_s, network, labels, requested_at,"
                    " started_at, ended_at, end_reason, detail, commands, last_position)"
                    " FROM STDIN",
                ),
                strict=True,
            )
        ]
        self.streams = [copy.__enter__() for copy in self.copies]
        self.buffers: list[list[str]] = [[], [], []]

    def add(self, which: int, line: str) -> None:
        buffer = self.buffers[which]
        buffer.append(line)
        if len(buffer) >= 20000:
            self.flush(which)

    def flush(self, which: int) -> None:
        self.streams[which].write("".join(self.buffers[which]))
        self.buffers[which].clear()

    def close(self) -> None:
        for which, copy in enumerate(self.copies):
            self.flush(which)
            copy.__exit__(None, None, None)
        for conn in self.conns:
            conn.commit()
            conn.close()


def load(url: str, lives: int, days: int, commands: float, seed: int) -> Loaded:
    """Write the synthetic log and its projections; return what was written."""
    rng = random.Random(seed)
    now = time.time()
    t0 = now - days * 86400
    writer = Writer(url)
    pending: list[tuple[float, int, str]] = []  # (occurred, tiebreak, event line sans pos)
    position = 0
    tiebreak = 0

    def emit_until(limit: float) -> None:
        nonlocal position
        while pending and pending[0][0] <= limit:
            _, _, rest = heapq.heappop(pending)
            position += 1
            writer.add(0, f"{position}\t{rest}")

    def event(
        at: float, kind: str, sid: str, node: str, tenant: str, job: str, payload: str
    ) -> None:
        nonlocal tiebreak
        tiebreak += 1
        rest = (
            f"{uuid.UUID(int=rng.getrandbits(128), version=4)}\t{kind}\t1\t{sid}\t{node}\t"
            f"{tenant}\t{job}\t{_ts(at)}\t{_ts(at + 0.004)}\t{payload}\tdsec.events\t"
            f"{TOPIC_ID}\t0\t{tiebreak}\n"
        )
        heapq.heappush(pending, (at, tiebreak, rest))

    starts = sorted(rng.uniform(t0, now) for _ in range(lives))
    acme_sample = lives // 2
    started = time.monotonic()
    for i, start in enumerate(starts):
        emit_until(start - 1)
        tenant, job = rng.choice(TENANTS), rng.choice(JOBS)
        sid = _sandbox_id(i)
        if i == acme_sample:
            tenant, sid = "acme", "sb-1234"
        node = rng.choice(NODES)
        actor = f"{tenant}/k{rng.randrange(3)}"
        cpus, memory = rng.choice(CPUS), rng.choice(MEMORY)
        request_id = uuid.UUID(int=rng.getrandbits(128), version=4)
        step, group = rng.randrange(200), rng.randrange(1000)
        labels = json.dumps({"step": str(step), "dsec.group": f"g-{group}"})
        requested = (
            f'{{"request_id":"{request_id}","actor":"{actor}","image":"dsec/python:3.12",'
            f'"cpus":{cpus},"memory_mb":{memory},"disk_mb":1024,"ttl_s":86400,'
            f'"network":false,"labels":{labels}}}'
        )
        event(start - 0.03, "SandboxRequested", sid, "\\N", tenant, job, requested)
        begun = f'{{"request_id":"{request_id}","container_id":"{sid[3:]:0>64}","warm":true}}'
        event(start, "SandboxStarted", sid, node, tenant, job, begun)
        end = start + _duration(rng)
        ran = int(commands) + (rng.random() < commands % 1)
        last = min(end, now)
        for _ in range(ran):
            at = rng.uniform(start, last)
            code = 1 if rng.random() < 0.05 else 0
            event(at, "CommandCompleted", sid, node, tenant, job,
                  f'{{"request_id":"{uuid.UUID(int=rng.getrandbits(128), version=4)}",'
                  f'"actor":"{actor}","command":["pytest","-q"],"exit_code":{code},'
                  f'"duration_ms":812.5,"stdout_bytes":120,"stderr_bytes":0,'
                  f'"stdout_head":"3 passed","stderr_head":"","timed_out":false,'
                  f'"truncated":false,"trajectory_id":null,"step":null,"stdout_b64":null,'
                  f'"stderr_b64":null}}')  # fmt: skip
        if rng.random() < 0.001:
            intruder = rng.choice(TENANTS)
            event(start + 1, "SandboxRejected", sid, "\\N", tenant, job,
                  f'{{"request_id":null,"request_type":"Exec","reason":"forbidden",'
                  f'"detail":"{sid} is not yours","actor":"{intruder}/k0"}}')  # fmt: skip
        running = end > now
        reason = "destroyed"
        x = rng.random()
        for name, share in ENDS:
            if x < share:
                reason = name
                break
            x -= share
        if not running:
            event(end, "SandboxStopped", sid, node, tenant, job,
                  f'{{"reason":"{reason}","detail":"","request_id":null,"actor":null,'
                  f'"last_state":null}}')  # fmt: skip
        ended = "\\N" if running else _ts(end)
        why = "\\N" if running else reason
        detail = why if running else ""
        writer.add(1, f"{sid}\t{tenant}\t{job}\t{node}\t{actor}\tdsec/python:3.12\t{cpus}\t"
                      f"{memory}\t{_ts(start)}\t{ended}\t{why}\t{detail}\t0\n")  # fmt: skip
        state = "running" if running else "stopped"
        writer.add(2, f"{sid}\t{tenant}\t{job}\t{actor}\tdsec/python:3.12\t{node}\t{state}\t"
                      f"{cpus}\t{memory}\t1024\t86400\tf\t{labels}\t{_ts(start - 0.03)}\t"
                      f"{_ts(start)}\t{ended}\t{why}\t\\N\t{ran}\t0\n")  # fmt: skip
        if i % 200000 == 0 and i:
            rate = i / (time.monotonic() - started)
            console.print(f"  {i:,} lives written ({rate:,.0f}/s)", highlight=False)
    emit_until(float("inf"))
    writer.close()
    return Loaded(lives, position, time.monotonic() - started)


def build_rollups(url: str) -> float:
    """usage_daily and running_usage from lives and the log's commands, usage from the
    lives; seconds."""
    started = time.monotonic()
    with psycopg.connect(url) as conn:
        conn.execute(
            "SELECT setval(pg_get_serial_sequence('events', 'position'),"
            " (SELECT max(position) FROM events))"
        )
        conn.execute(ROLLUP_FROM_LIVES)  # type: ignore[arg-type]
        conn.execute(RUNNING_FROM_LIVES)  # type: ignore[arg-type]
        conn.execute(
            """
            INSERT INTO usage (tenant, job_id, sandboxes_started, sandboxes_ended, commands,
                               ended_sandbox_seconds, ended_core_seconds, ended_gb_seconds,
                               last_position)
            SELECT l.tenant, l.job_id, count(*), count(l.ended_at), sum(s.commands),
                   coalesce(sum(extract(epoch FROM l.ended_at - l.started_at)), 0),
                   coalesce(sum(extract(epoch FROM l.ended_at - l.started_at) * l.cpus), 0),
                   coalesce(sum(extract(epoch FROM l.ended_at - l.started_at)
                                * l.memory_mb / 1024.0), 0), 0
              FROM lives l JOIN sandboxes s USING (sandbox_id)
             GROUP BY l.tenant, l.job_id
            """
        )
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE)")
    return time.monotonic() - started


# --- timing ----------------------------------------------------------------------


@dataclass
class Query:
    name: str
    sql: str


def doc_queries(path: Path) -> list[Query]:
    """The SQL blocks of docs/sql.md's "Queries an operator runs", named by the
    sentence before each."""
    text = path.read_text()
    section = text.split("## Queries an operator runs", 1)[1].split("\n## ", 1)[0]
    out = []
    for match in re.finditer(r"((?:[^\n]+\n)+)\n```sql\n(.*?)```", section, re.S):
        paragraph = " ".join(match[1].split())
        name = re.split(r"[:(]", paragraph, maxsplit=1)[0].strip()
        out.append(Query(name, match[2].strip()))
    return out


def _timed(run: Callable[[], int], repeat: int) -> tuple[float, int]:
    times, rows = [], 0
    for _ in range(repeat):
        begin = time.perf_counter()
        rows = run()
        times.append(time.perf_counter() - begin)
    return statistics.median(times), rows


def time_query(
    url: str, sql: str, repeat: int = 3, timeout_s: float | None = None
) -> tuple[float | None, int]:
    """Median seconds and rows of ``sql`` (after one warm-up run); None past the timeout."""
    with psycopg.connect(url, autocommit=True) as conn:
        if timeout_s is not None:
            conn.execute(f"SET statement_timeout = {int(timeout_s * 1000)}")  # type: ignore[arg-type]

        def run() -> int:
            return len(conn.execute(sql).fetchall())  # type: ignore[arg-type]

        try:
            run()
            return _timed(run, repeat)
        except psycopg.errors.QueryCanceled:
            return None, 0


def raw_version(sql: str) -> str | None:
    """The same query over the raw log's views, if it reads a rollup view."""
    raw = re.sub(r"\b(billing_daily|sandbox_lives)\b", r"\1_from_log", sql)
    return raw if raw != sql else None


CLI = [
    ["bill", "--tenant", "acme", "--from", "7d", "--to", "yesterday"],
    ["bill", "--job", "rollout-7", "--tenant", "team-a", "--from", "30d", "--format", "csv"],
    ["bill", "--from", "yesterday", "--to", "yesterday", "--format", "csv"],
    ["audit", "--sandbox", "sb-1234"],
    ["audit", "--tenant", "acme", "--since", "2h"],
    ["audit", "--tenant", "team-a", "--job", "rollout-7", "--limit", "50"],
    ["audit", "--denied", "--since", "1d"],
]


def time_cli(settings: Settings, argv: list[str]) -> tuple[float, int]:
    env = {**os.environ, "DSEC_DATABASE_URL": settings.database_url,
           "DSEC_ADMIN_DATABASE_URL": settings.admin_database_url, "COLUMNS": "200"}  # fmt: skip
    dsec = str(Path(sys.executable).with_name("dsec"))
    times, lines = [], 0
    for _ in range(3):
        begin = time.perf_counter()
        done = subprocess.run([dsec, *argv], env=env, capture_output=True, text=True, check=True)
        times.append(time.perf_counter() - begin)
        lines = len(done.stdout.splitlines())
    return statistics.median(times), lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lives", type=int, default=1_000_000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--commands", type=float, default=0.5, help="Per life, on average.")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--raw-timeout", type=float, default=120.0)
    parser.add_argument("--reuse", action="store_true", help="Time the database already built.")
    parser.add_argument("--drop", action="store_true", help="Drop the database at the end.")
    args = parser.parse_args()

    base = get_settings()
    settings = base.model_copy(
        update={
            "database_url": base.database_url + "_billing",
            "admin_database_url": base.admin_database_url + "_billing",
        }
    )
    owner, app_url = libpq_url(settings.admin_database_url), libpq_url(settings.database_url)
    tag = f"lives={args.lives} days={args.days} commands={args.commands} seed={args.seed}"
    if args.reuse:
        with psycopg.connect(owner) as conn:
            row = conn.execute(
                "SELECT shobj_description(oid, 'pg_database') FROM pg_database"
                " WHERE datname = current_database()"
            ).fetchone()
            found = row[0] if row else None
        if found != tag:
            sys.exit(f"--reuse: the database holds {found!r}, not {tag!r}; run without --reuse")
    else:
        drop_database(settings)
        ensure_database(settings)
        migrate(settings)
        with psycopg.connect(owner, autocommit=True) as conn:
            conn.execute(
                "SELECT dsec_ensure_event_partition(d::date) FROM generate_series("
                f"(now() AT TIME ZONE 'UTC')::date - {args.days + 1},"  # type: ignore[arg-type]
                " (now() AT TIME ZONE 'UTC')::date, interval '1 day') AS d"
            )
        console.print(f"loading {tag} ...")
        loaded = load(owner, args.lives, args.days, args.commands, args.seed)
        console.print(
            f"log: {loaded.events:,} events of {loaded.lives:,} lives in {loaded.seconds:.0f} s"
            f" ({loaded.events / loaded.seconds:,.0f} events/s by COPY, indexes in place)"
        )
        rollup_s = build_rollups(owner)
        console.print(f"usage_daily and usage folded, VACUUM ANALYZE: {rollup_s:.0f} s")
        with psycopg.connect(owner, autocommit=True) as conn:
            conn.execute(f"COMMENT ON DATABASE {conn.info.dbname} IS '{tag}'")  # type: ignore[arg-type]
    with psycopg.connect(owner) as conn:
        events, lives_n, size, usage_rows = conn.execute(
            "SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM lives),"
            " pg_database_size(current_database()), (SELECT count(*) FROM usage_daily)"
        ).fetchone() or (0, 0, 0, 0)
    console.print(
        f"database: {events:,} events, {lives_n:,} lives, {usage_rows:,} usage_daily rows,"
        f" {size / 2**30:.1f} GiB"
    )

    table = Table(title=f"docs/sql.md at {lives_n:,} lives ({args.days} days)")
    for col in ("query", "rows", "rollups s", "raw log s", "raw / rollups"):
        table.add_column(col, justify="left" if col == "query" else "right")
    slowest = (0.0, "")
    for query in doc_queries(REPO / "docs" / "sql.md"):
        took, rows = time_query(app_url, query.sql)
        assert took is not None
        slowest = max(slowest, (took, query.name))
        raw = raw_version(query.sql)
        raw_cell, ratio = "", ""
        if raw is not None:
            raw_s, _ = time_query(app_url, raw, repeat=1, timeout_s=args.raw_timeout)
            raw_cell = f"> {args.raw_timeout:.0f}" if raw_s is None else f"{raw_s:.3f}"
            ratio = f"> {args.raw_timeout / took:,.0f}" if raw_s is None else f"{raw_s / took:,.0f}"
        table.add_row(query.name[:70], str(rows), f"{took:.4f}", raw_cell, ratio)
    console.print(table)

    cli = Table(title="dsec bill / dsec audit (whole command, median of 3)")
    for col in ("command", "lines", "s"):
        cli.add_column(col, justify="left" if col == "command" else "right")
    for argv in [["--help"], *CLI]:
        took, lines = time_cli(settings, argv)
        cli.add_row("dsec " + " ".join(argv), str(lines), f"{took:.3f}")
    console.print(cli)
    if args.drop:
        drop_database(settings)
    print(
        f"RESULT billing lives={lives_n} days={args.days} events={events} "
        f"max_s={slowest[0]:.4f} slowest={slowest[1]!r}"
    )


if __name__ == "__main__":
    main()
