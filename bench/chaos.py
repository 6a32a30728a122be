"""Chaos: a trainer-like workload while random parts of the stack are SIGKILLed and
brought back by the supervisor alone.

    .venv/bin/python bench/chaos.py --minutes 10 --every 30
    .venv/bin/python bench/chaos.py --minutes 3 --every 20 --targets projector,scheduler
    .venv/bin/python bench/chaos.py --cluster --minutes 5 --every 30

With ``--cluster`` the workload runs on three Apache Kafka brokers of the bench's own
(replication 3, min.insync.replicas 2: app/stack/local_cluster.py) and a scheduler,
projector and node worker on them (tests/side_platform.py); the targets are then the
brokers (``kafka-1`` ... ``kafka-3``), each killed one is started again ``--every / 2``
seconds later, as a supervisor would.

``--trainers`` threads each loop: create a sandbox, run ``--commands`` commands in it,
destroy it. Every ``--every`` seconds one of ``--targets`` (services of the embedded
stack, or ``podman-<node>``: the node's Podman service) is killed with SIGKILL, process
group and all; nobody types `dsec up`. Each command appends to a counter file in its
sandbox and prints the count, so a command that ran twice shows on the node's side (a
count that skips) as well as in the log.

At the end, after ``--settle`` seconds, the log is read back and it prints:
commands answered and failed (an error or a timeout: the trainer heard nothing or a
reason), lost (answered, but not in the log), doubled (ran twice: in the log twice or
a count that skipped), sandboxes leaked (created and not ended in the log), and the
p50/p99 latency of commands overall and in the 30 s after each kill. Then it runs
`dsec doctor` over the run (app/db/doctor.py: lives open past their deadlines, lives
ended twice, lost nodes with open lives, projections that differ from a rebuild) and
lists what it found. The last line is ``RESULT chaos ... lost=L doubled=D leaked=K
doctor=F``. Goal: all four 0 over 10 minutes with a kill every 30 s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from rich.console import Console
from rich.table import Table
from sqlalchemy import text

from app.config import Settings, get_settings
from app.control import tenants
from app.db import doctor
from app.db.engine import transaction
from app.errors import DsecError
from app.sdk import Client
from app.stack import local_cluster
from app.stack import services as stack_mod
from workers.host.mounts import remove_tree
from workers.host.podman_service import service_pids
from workers.host.user import find_node_user

# --cluster runs a platform of its own on three brokers with the test suite's helpers.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import declare_lost
from tests.side_platform import side_platform

console = Console()
TARGETS = ("projector", "scheduler", "worker-node0", "redis", "flower", "broker", "podman-node0")
#: A target named so is a node's Podman service (its worker starts another by itself).
PODMAN = "podman-"


@dataclass
class Tally:
    """What the trainers saw, shared by their threads."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    answered: dict[str, str] = field(default_factory=dict)  # token -> sandbox
    failed: Counter[str] = field(default_factory=Counter)
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (sent at, seconds)
    created: set[str] = field(default_factory=set)
    skipped_counts: int = 0


def trainer(client: Client, commands: int, stop: threading.Event, tally: Tally) -> None:
    """Create, run ``commands`` commands, destroy; until stopped."""
    while not stop.is_set():
        try:
            box = client.create(timeout_s=90, ttl_s=900)
        except DsecError as exc:
            with tally.lock:
                tally.failed[f"create: {type(exc).__name__}"] += 1
            continue
        with tally.lock:
            tally.created.add(box.id)
        # Commands sent to this sandbox so far: one that failed (a timeout) may still
        # have run, so only a count beyond every command sent is one run twice.
        sent_here = 0
        for _ in range(commands):
            sent_here += 1
            token = uuid.uuid4().hex
            sent = time.monotonic()
            try:
                result = box.exec(
                    f"echo {token} >/dev/null; echo x >> /tmp/ran; wc -l < /tmp/ran",
                    timeout_s=60,
                )
            except DsecError as exc:
                with tally.lock:
                    tally.failed[f"exec: {type(exc).__name__}"] += 1
                continue
            took = time.monotonic() - sent
            with tally.lock:
                tally.answered[token] = box.id
                tally.latencies.append((sent, took))
                if int(result.stdout.strip() or 0) > sent_here:
                    tally.skipped_counts += 1
        try:
            box.close()
        except DsecError as exc:
            with tally.lock:
                tally.failed[f"destroy: {type(exc).__name__}"] += 1


def broker_named(cluster: local_cluster.Cluster, name: str) -> local_cluster.Member:
    """The cluster's broker ``kafka-N``."""
    return cluster.members[int(name.removeprefix("kafka-")) - 1]


def kill_broker(cluster: local_cluster.Cluster, name: str) -> tuple[str, int] | None:
    """SIGKILL one of the cluster's brokers (``kafka-N``)."""
    member = broker_named(cluster, name)
    if not member.alive or member.process is None:
        return None
    pid = member.process.pid
    member.kill()
    return name, pid


def kill_one(settings: Settings, targets: list[str], rng: random.Random) -> tuple[str, int] | None:
    """SIGKILL one target's process group; (name, pid) or None if it was not running."""
    services = {s.name: s for s in stack_mod.services(settings, stack_mod.known_node_ids(settings))}
    name = rng.choice(targets)
    if name.startswith(PODMAN):
        user = find_node_user(name.removeprefix(PODMAN), settings)
        pids = service_pids(user) if user is not None else []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return (name, pids[0]) if pids else None
    pid = services[name].pid(settings) if name in services else None
    if pid is None:
        return None
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return name, pid


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--every", type=float, default=30.0, help="Seconds between kills.")
    parser.add_argument("--trainers", type=int, default=6)
    parser.add_argument("--commands", type=int, default=5, help="Per sandbox.")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--settle", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--cluster", action="store_true", help="Three brokers of its own.")
    args = parser.parse_args()

    settings = get_settings()
    tenants.local(settings, "chaos")
    with contextlib.ExitStack() as running:
        platform, cluster = settings, None
        if args.cluster:
            state = Path(tempfile.mkdtemp(prefix="dsec-chaos-"))
            os.chmod(state, 0o755)  # the node user walks through it to its home
            running.callback(remove_tree, state)
            running.callback(declare_lost, settings, [CLUSTER_NODE])
            cluster = running.enter_context(
                local_cluster.running(
                    settings, 3, state / "kafka", subjects=["tests", CLUSTER_NODE]
                )
            )
            platform = running.enter_context(
                side_platform(settings, CLUSTER_NODE, state, kafka=cluster.settings, projector=True)
            )
        run(args, settings, platform, cluster)


#: The node of the --cluster run's own platform.
CLUSTER_NODE = "node8"


def run(
    args: argparse.Namespace,
    settings: Settings,
    platform: Settings,
    cluster: local_cluster.Cluster | None,
) -> None:
    """The workload and the kills, then what the log says of it."""
    rng = random.Random(args.seed)
    targets = (
        [f"kafka-{i}" for i in (1, 2, 3)]
        if cluster is not None
        else [t for t in args.targets.split(",") if t]
    )
    job = f"chaos-{uuid.uuid4().hex[:6]}"
    began_at = datetime.now(UTC)
    tally = Tally()
    stop = threading.Event()
    kills: list[tuple[float, str]] = []
    restarts: list[tuple[float, str]] = []
    # The side platform knows the suite's own tenant (tests/side_platform.py).
    tenant = "tests" if cluster is not None else "chaos"
    with Client(platform, tenant=tenant, job_id=job, timeout_s=90) as client:
        threads = [
            threading.Thread(target=trainer, args=(client, args.commands, stop, tally))
            for _ in range(args.trainers)
        ]
        for thread in threads:
            thread.start()
        started = time.monotonic()
        end = started + args.minutes * 60
        next_kill = started + args.every
        while time.monotonic() < end:
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
            for due, name in [r for r in restarts if r[0] <= time.monotonic()]:
                assert cluster is not None
                broker_named(cluster, name).start()
                restarts.remove((due, name))
            if time.monotonic() >= next_kill:
                next_kill += args.every
                if cluster is not None:
                    killed = kill_broker(cluster, rng.choice(targets))
                    if killed is not None:
                        restarts.append((time.monotonic() + args.every / 2, killed[0]))
                else:
                    killed = kill_one(settings, targets, rng)
                if killed is not None:
                    kills.append((time.monotonic(), killed[0]))
                    console.print(
                        f"  {time.monotonic() - started:5.0f}s  killed {killed[0]} (pid"
                        f" {killed[1]}); {len(tally.answered)} commands answered so far"
                    )
        stop.set()
        for thread in threads:
            thread.join(timeout=300)
        for _due, name in restarts:
            assert cluster is not None
            broker_named(cluster, name).start()
    console.print(f"settling {args.settle:.0f}s ...")
    time.sleep(args.settle)

    with transaction(platform.database_url) as conn:
        logged = Counter(
            token
            for (command,) in conn.execute(
                text(
                    "SELECT payload->>'command' FROM events WHERE tenant = :t"
                    " AND job_id = :j AND type = 'CommandCompleted'"
                ),
                {"j": job, "t": tenant},
            )
            for token in [command.split()[1] if command and command.startswith("echo ") else ""]
            if token
        )
        ended = set(
            conn.execute(
                text(
                    "SELECT DISTINCT sandbox_id FROM events WHERE tenant = :t AND job_id = :j"
                    " AND type IN ('SandboxStopped', 'SandboxFailed')"
                ),
                {"j": job, "t": tenant},
            ).scalars()
        )
    # What breaks the invariants of lives, since the run began (every tenant's: the
    # platform's own ends count too).
    findings = doctor.examine(platform, began_at - timedelta(minutes=1), timedelta(seconds=60))
    lost = [t for t in tally.answered if logged[t] == 0]
    doubled = [t for t, n in logged.items() if n > 1]
    leaked = sorted(tally.created - ended)

    def in_recovery(sent: float) -> bool:
        return any(0 <= sent - at <= 30 for at, _ in kills)

    all_lat = [took for _, took in tally.latencies]
    rec_lat = [took for sent, took in tally.latencies if in_recovery(sent)]
    table = Table(title=f"chaos: {args.minutes:g} min, a kill every {args.every:g} s")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name, value in (
        ("kills", f"{len(kills)} ({', '.join(sorted(Counter(n for _, n in kills)))})"),
        ("sandboxes created", str(len(tally.created))),
        ("commands answered", str(len(tally.answered))),
        ("failed (reason or timeout)", str(sum(tally.failed.values()))),
        ("lost (answered, not in the log)", str(len(lost))),
        ("doubled (in the log twice)", str(len(doubled))),
        ("doubled (a count that skipped)", str(tally.skipped_counts)),
        ("sandboxes leaked (no end in the log)", str(len(leaked))),
        ("dsec doctor findings", str(len(findings))),
        ("p50 / p99 command latency, s",
         f"{percentile(all_lat, 0.5):.3f} / {percentile(all_lat, 0.99):.3f}"),
        ("p99 within 30 s of a kill, s", f"{percentile(rec_lat, 0.99):.3f}"),
    ):  # fmt: skip
        table.add_row(name, value)
    console.print(table)
    for kind, n in sorted(tally.failed.items()):
        console.print(f"  failed: {kind} x{n}")
    if leaked:
        console.print(f"  leaked: {', '.join(leaked[:10])}")
    for finding in findings[:20]:
        console.print(f"  doctor: {finding.check.value} {finding.subject}: {finding.detail}")
    print(
        f"RESULT chaos{' cluster' if cluster is not None else ''} minutes={args.minutes:g}"
        f" kills={len(kills)} answered={len(tally.answered)}"
        f" failed={sum(tally.failed.values())} lost={len(lost)}"
        f" doubled={len(doubled) + tally.skipped_counts} leaked={len(leaked)}"
        f" doctor={len(findings)}"
        f" p99_s={percentile(all_lat, 0.99):.3f} p99_recovery_s={percentile(rec_lat, 0.99):.3f}"
        f" median_s={statistics.median(all_lat) if all_lat else float('nan'):.3f}"
    )


if __name__ == "__main__":
    main()
