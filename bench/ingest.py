"""Ingest: events produced to Kafka -> in the Postgres log with projections updated.

The events are produced first (timed on their own), then the projector(s) are
started and timed until every event is in the log. In the same run the same rows are
loaded by raw COPY into a scratch table in batches of the projector's size: the
ceiling this machine's Postgres allows. The ratio is what counts here.

    .venv/bin/python bench/ingest.py --events 100000
    .venv/bin/python bench/ingest.py --events 100000 --processes 2   # partition-parallel
    .venv/bin/python bench/ingest.py --events 100000 --lanes 1       # one transaction at a time

Needs the embedded stack (`dsec up`) for Kafka and Postgres; it uses topics of its
own and a database of its own (``<db>_bench``, new for each run unless
``--keep-log``), so the stack's log stays small.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from datetime import timedelta

from procstat import broker_pids, named, ticks
from sqlalchemy import text

from app import bus, kafka_admin
from app.config import Settings, get_settings
from app.control.keyring import Keyring
from app.control.projector import BATCH_RECORDS
from app.db.engine import engine_for
from app.db.setup import drop_database, ensure_database, migrate
from app.domain.base import StopReason, utcnow
from app.domain.codec import encode
from app.domain.events import (
    CommandCompleted,
    CommandPayload,
    EventBase,
    RequestedPayload,
    SandboxRequested,
    SandboxStarted,
    SandboxStopped,
    StartedPayload,
    StoppedPayload,
)
from app.domain.proof import Purpose, headers


def events_for(tenant: str, n: int) -> list[EventBase]:
    """``n`` events shaped like real traffic: per sandbox 1 request, 1 start, commands, 1 stop."""
    out: list[EventBase] = []
    t0 = utcnow() - timedelta(minutes=5)
    i = 0
    while len(out) < n:
        sid = f"sb-ing-{tenant}-{i}"
        i += 1
        common = {"sandbox_id": sid, "tenant": tenant, "job_id": "ingest", "node_id": "n0"}
        rid = uuid.uuid4()
        out.append(SandboxRequested(occurred_at=t0, payload=RequestedPayload(
            request_id=rid, actor="bench", image="img", cpus=1, memory_mb=256, disk_mb=64,
            ttl_s=60, network=False), **common))  # fmt: skip
        out.append(SandboxStarted(occurred_at=t0 + timedelta(seconds=1),
                                  payload=StartedPayload(request_id=rid, container_id="c"),
                                  **common))  # fmt: skip
        for k in range(5):
            out.append(CommandCompleted(occurred_at=t0 + timedelta(seconds=2 + k),
                       payload=CommandPayload(request_id=uuid.uuid4(), actor="bench",
                       command="pytest -q", exit_code=0, duration_ms=3.2, stdout_bytes=12,
                       stderr_bytes=0, stdout_head="1 passed"), **common))  # fmt: skip
        out.append(SandboxStopped(occurred_at=t0 + timedelta(seconds=9),
                                  payload=StoppedPayload(reason=StopReason.DESTROYED),
                                  **common))  # fmt: skip
    return out[:n]


def cpu_seconds(projectors: list[int]) -> dict[str, float]:
    """CPU seconds used so far by the projectors, Postgres (all of it) and the broker."""
    hz = os.sysconf("SC_CLK_TCK")
    return {
        "projector": sum(map(ticks, projectors)) / hz,
        "postgres": sum(map(ticks, named("postgres"))) / hz,
        "broker": sum(map(ticks, broker_pids(get_settings().state_dir))) / hz,
    }


def copy_ceiling(url: str, events: list[EventBase], batch: int) -> float:
    """Seconds to COPY the same rows into a scratch table, one transaction per batch
    (as the database's owner: the services' role may create nothing)."""
    engine = engine_for(url)
    with engine.connect() as conn:
        conn.execute(text("DROP TABLE IF EXISTS bench_ingest_scratch"))
        conn.execute(
            text(
                # The same indexes as the log: the ceiling pays for what the log pays.
                "CREATE TABLE bench_ingest_scratch"
                " (LIKE events INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING INDEXES)"
            )
        )
        conn.commit()
    rows = [
        "\t".join(
            [str(e.event_id), e.type, "1", e.sandbox_id or "\\N", e.node_id or "\\N", e.tenant,
             e.job_id, e.occurred_at.isoformat(), "now", e.payload.model_dump_json()
             .replace("\\", "\\\\"), "bench", str(uuid.uuid4()), "0", str(i)]
        ) + "\n"
        for i, e in enumerate(events)
    ]  # fmt: skip
    raw = engine.raw_connection()
    started = time.perf_counter()
    try:
        cur = raw.cursor()
        for lo in range(0, len(rows), batch):
            with cur.copy(  # type: ignore[attr-defined]
                "COPY bench_ingest_scratch (event_id, type, version, sandbox_id, node_id, tenant,"
                ' job_id, occurred_at, recorded_at, payload, topic, topic_id, partition, "offset")'
                " FROM STDIN"
            ) as copy:
                copy.write("".join(rows[lo : lo + batch]))
            raw.commit()
        elapsed = time.perf_counter() - started
        cur.execute("DROP TABLE bench_ingest_scratch")
        raw.commit()
    finally:
        raw.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--processes", type=int, default=1, help="projectors, partition-parallel")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument(
        "--lanes", type=int, default=get_settings().projector_lanes,
        help="transactions in flight per projector process (DSEC_PROJECTOR_LANES)",
    )  # fmt: skip
    parser.add_argument(
        "--keep-log",
        action="store_true",
        help="append to the bench database left by earlier runs instead of a new one",
    )
    args = parser.parse_args()

    prefix = f"bench{uuid.uuid4().hex[:6]}"
    base = get_settings()
    settings = base.model_copy(
        update={
            "topic_prefix": prefix,
            "topic_partitions": args.partitions,
            "database_url": base.database_url + "_bench",
            "admin_database_url": base.admin_database_url + "_bench",
        }
    )
    if not args.keep_log:
        # Every run from an empty log: runs that appended to one database grew it by
        # 100,000 events each, and once its indexes outgrew the buffer cache a run's
        # Postgres cost rose with the number of runs before it.
        drop_database(settings)
    ensure_database(settings)
    migrate(settings)
    analyze(settings.admin_database_url)
    kafka_admin.ensure_topics(settings)
    try:
        measure(args, settings)
    finally:
        # The embedded broker keeps every message in memory: the run's topics go.
        kafka_admin.drop_topics(settings)


def analyze(admin_url: str) -> None:
    """Refresh the planner's statistics of the bench database.

    The machine's Postgres runs with autovacuum off (a CI setting), so tables grown
    by earlier runs were never analyzed, and the projections' lookups were planned
    for empty tables (7 ms more per batch after ~40 runs). Production keeps its
    statistics fresh; so does the bench, before it measures.
    """
    with engine_for(admin_url).connect() as conn:
        conn.execute(text("ANALYZE"))
        conn.commit()


def measure(args: argparse.Namespace, settings: Settings) -> None:
    """Produce, ingest with the projector(s), then the COPY ceiling; print RESULT."""
    tenant = f"ingest-{uuid.uuid4().hex[:6]}"
    events = events_for(tenant, args.events)

    # Proven as the platform proves them (the scheduler's key: no credentials table
    # is needed in the bench database), so the projector checks every proof.
    signer = Keyring.from_settings(settings).scheduler
    started = time.perf_counter()
    publisher = bus.Publisher(settings, linger_ms=5)
    for e in events:
        value = encode(e)
        proof = headers(Purpose.EVENT, signer.principal.key_id, signer.secret, value)
        publisher.publish(settings.topic_events, e.key, value, headers=proof)
    publisher.flush()
    publisher.close()
    produce_s = time.perf_counter() - started
    print(f"produced {len(events)} events in {produce_s:.2f}s ({len(events) / produce_s:,.0f}/s)")

    env = {
        **os.environ,
        "DSEC_TOPIC_PREFIX": settings.topic_prefix,
        "DSEC_METRICS_PORT": "0",
        "DSEC_DATABASE_URL": settings.database_url,
        "DSEC_PROJECTOR_LANES": str(args.lanes),
    }
    shares = [list(range(p, args.partitions, args.processes)) for p in range(args.processes)]
    engine = engine_for(settings.database_url)
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "app.cli", "run", "projector",
             "--partitions", ",".join(map(str, share))],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for share in shares
    ]  # fmt: skip
    # The clock starts at the first committed batch: process start-up (imports,
    # connections) is not ingest. Progress is read from the offsets the projectors
    # store with each batch (a few rows), not by counting the log: count(*) over
    # 100,000 fresh rows every 20 ms took ~40% of a core from the same two cores.
    progress = text(
        "SELECT coalesce(sum(next_offset), 0) FROM consumer_offsets"
        " WHERE consumer = 'projector' AND topic = :topic"
    )
    first: tuple[float, int, dict[str, float]] | None = None
    try:
        while True:
            with engine.connect() as conn:
                done = int(conn.execute(progress, {"topic": settings.topic_events}).scalar() or 0)
            now = time.perf_counter()
            if done and first is None:
                first = (now, done, cpu_seconds([p.pid for p in procs]))
            if done >= len(events):
                break
            time.sleep(0.02)
        cpu_end = cpu_seconds([p.pid for p in procs])
        assert first is not None
        startup_s = first[0] - started
        ingest_s = now - first[0]
        counted = len(events) - first[1]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    with engine.connect() as conn:
        logged = conn.execute(
            text("SELECT count(*) FROM events WHERE tenant = :t"), {"t": tenant}
        ).scalar()
        usage = conn.execute(
            text("SELECT commands, sandboxes_ended FROM usage WHERE tenant = :t"), {"t": tenant}
        ).one()
        projected = conn.execute(
            text("SELECT count(*) FROM commands WHERE tenant = :t"), {"t": tenant}
        ).scalar()
    assert logged == len(events), f"{logged} events in the log, {len(events)} produced"
    commands = sum(isinstance(e, CommandCompleted) for e in events)
    assert usage.commands == projected == commands, f"{projected} of {commands} commands projected"
    rate = counted / ingest_s
    print(
        f"projector x{args.processes} ({args.lanes} lanes each): start-up {startup_s:.2f}s, "
        f"then {counted} events in {ingest_s:.2f}s ({rate:,.0f} events/s); "
        f"usage projection: {usage.commands} commands, "
        f"{usage.sandboxes_ended} sandboxes ended"
    )
    # CPU time per event, by whom: on two shared cores this, not the wall clock,
    # says what one more process or one more core could buy.
    spent = {k: (cpu_end[k] - first[2][k]) / counted * 1e6 for k in cpu_end}
    print(
        "cpu per event: "
        + ", ".join(f"{k} {v:.1f} us" for k, v in spent.items())
        + f" (wall {ingest_s / counted * 1e6:.1f} us, {os.cpu_count()} cores)"
    )
    copy_s = copy_ceiling(settings.admin_database_url, events, BATCH_RECORDS)
    ceiling = len(events) / copy_s
    print(f"raw COPY, {BATCH_RECORDS}-row transactions: {copy_s:.2f}s ({ceiling:,.0f} rows/s)")
    print(
        f"RESULT ingest events={len(events)} processes={args.processes} lanes={args.lanes} "
        f"projector={rate:,.0f}/s copy={ceiling:,.0f}/s ratio={rate / ceiling:.2f}"
    )


if __name__ == "__main__":
    main()
