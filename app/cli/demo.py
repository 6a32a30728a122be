"""A trainer-like workload: many sandboxes, a few commands each, all at once.

Each rollout creates a sandbox, writes a small program into it, runs commands
(one of them fails on purpose, as agents' commands do), reads a file back and
throws the sandbox away. The summary is what a trainer would want to know, and the
last table is a billing query over the event log, as an operator would run it.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from app.config import Settings
from app.control import tenants
from app.db import queries
from app.db.engine import transaction
from app.sdk.client import Client
from app.stats import summary_ms


@dataclass
class Tally:
    """What the workload measured."""

    create_s: list[float] = field(default_factory=list)
    exec_s: list[float] = field(default_factory=list)
    destroy_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    commands: int = 0


def rollout(client: Client, commands: int, tally: Tally) -> None:
    """One sandbox's life."""
    t0 = time.perf_counter()
    sandbox = client.create()
    tally.create_s.append(time.perf_counter() - t0)
    try:
        program = b"echo solving $1; test $1 -lt 99\n"
        sandbox.write_file("/workspace/task.sh", program)
        for i in range(commands):
            command = (
                "sh /workspace/task.sh 99" if i == commands - 1 else f"sh /workspace/task.sh {i}"
            )
            t0 = time.perf_counter()
            result = sandbox.exec(command, timeout_s=30)
            tally.exec_s.append(time.perf_counter() - t0)
            tally.commands += 1
            expected = 1 if i == commands - 1 else 0
            if result.exit_code != expected:
                tally.failures.append(f"{sandbox.id}: `{command}` exited {result.exit_code}")
        if sandbox.read_file("/workspace/task.sh") != program:
            tally.failures.append(f"{sandbox.id}: file read back differs from what was written")
    finally:
        t0 = time.perf_counter()
        sandbox.close()
        tally.destroy_s.append(time.perf_counter() - t0)


def run(
    settings: Settings, sandboxes: int, commands: int, concurrency: int, console: Console
) -> Tally:
    """Run the workload and print its summary; raise if any rollout failed."""
    job = f"demo-{uuid.uuid4().hex[:8]}"
    # The demo is a tenant like any other, with a credential of its own.
    demo = tenants.local(settings, "demo")
    tally = Tally()
    started = time.perf_counter()
    with (
        Client(settings, credential=demo, job_id=job) as client,
        Progress(
            TextColumn("[bold]rollouts"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress,
    ):
        bar = progress.add_task("rollouts", total=sandboxes)
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            futures = [pool.submit(rollout, client, commands, tally) for _ in range(sandboxes)]
            for future in as_completed(futures):
                error = future.exception()
                if error is not None:
                    tally.failures.append(f"{type(error).__name__}: {error}")
                progress.advance(bar)
    wall = time.perf_counter() - started

    table = Table(title=f"dsec demo — job {job}")
    for column in ("what", "count", "p50 ms", "p99 ms", "max ms"):
        table.add_column(column, justify="right" if column != "what" else "left")
    for name, values in (
        ("create", tally.create_s),
        ("exec", tally.exec_s),
        ("destroy", tally.destroy_s),
    ):
        s = summary_ms(values)
        table.add_row(
            name, str(len(values)), f"{s['p50']:.1f}", f"{s['p99']:.1f}", f"{s['max']:.1f}"
        )
    console.print(table)
    console.print(
        f"{len(tally.create_s)} sandboxes, {tally.commands} commands in {wall:.1f}s "
        f"({len(tally.create_s) / wall:.1f} sandboxes/s, {tally.commands / wall:.1f} commands/s), "
        f"{len(tally.failures)} failures"
    )

    # The log is written by the projector a few milliseconds behind: wait for the
    # last Stopped before billing.
    deadline = time.monotonic() + 30
    bill = None
    while time.monotonic() < deadline:
        with transaction(settings.database_url) as conn:
            bill = queries.job_bill(conn, "demo", job)
        if bill.stopped == len(tally.create_s):
            break
        time.sleep(0.5)
    billing = Table(title="billing from the event log (SQL)")
    for column in ("tenant", "job", "sandboxes", "sandbox-seconds", "commands"):
        billing.add_column(column)
    if bill is not None:
        billing.add_row(
            "demo", job, str(bill.sandboxes), str(bill.sandbox_seconds), str(bill.commands)
        )
    console.print(billing)
    for failure in tally.failures[:10]:
        console.print(f"[red]failure:[/] {failure}")
    if tally.failures:
        raise SystemExit(1)
    return tally
