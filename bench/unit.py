"""A DSec unit, simulated: the real schedulers, projector, Postgres, Redis and broker
against simulated nodes filled to a unit's live sandboxes, creates and commands at
rising rates, and the cores a unit's control plane needs.

    .venv/bin/python bench/unit.py [--nodes 160] [--per-node 2400] [--schedulers 1]
        [--create-rates 10,20,40,80,160,320] [--command-rates 25,50,100,200,400,800,1600]
        [--step-s 20] [--baseline-s 30] [--max-p99-s 5] [--scale-to 2]
        [--route direct|scheduler]

A platform of its own beside the stack (topics under a fresh prefix, a database of
its own dropped at the end; the stack's broker, Postgres and Redis): one projector
and ``--schedulers`` scheduler processes, started as the stack starts them, and
``--nodes`` simulated nodes in one process (bench/simnodes.py) that answer over the
broker and Redis as node workers do. The nodes are filled to ``--per-node``
sandboxes each through the log (the schedulers start after it and recover them from
the projections, as after a restart), then heartbeat every 5 s listing them all.

Measured, in order:

1. baseline: nothing asked, the nodes heartbeating with their lists: the CPU of each
   component per heartbeat (all of the baseline counted as the heartbeats');
2. a warm-up, not counted: a command to every node, creates for 10 s;
3. lives: creates at each rate of ``--create-rates``, each with a destroy of the
   oldest live sandbox (the live count stays put), until a rate is not sustained
   (fewer than 97 % answered within the step and 5 s after, or p99 above
   ``--max-p99-s``);
4. commands: ``true`` in random live sandboxes at each of ``--command-rates``, the
   same way, each straight to its sandbox's node as the SDK sends it (the direct
   route; ``--route scheduler``: through the scheduler);
5. with ``--scale-to K``: a step of each kind at half its highest sustained rate,
   then K-1 more schedulers and the same step again: how a scheduler's CPU splits
   between what every process pays (each follows the whole log) and what only the
   owner of a request pays.

The CPU of every component per create (a life: its create and its destroy), per
command and per heartbeat is read from /proc, the baseline's share taken out. From
these the cores a unit needs (5,000 creates/s, 20,000 commands/s, 160 nodes of 2,400
sandboxes heartbeating) are extrapolated: measured per-operation costs times a
unit's rates, with as many schedulers as keep each under one core. Every table says
whether it was measured or extrapolated. An empty rate list skips its ramp (a
baseline alone: ``--create-rates '' --command-rates ''``). Needs `dsec up`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from kafka import TopicPartition
from procstat import broker_pids, cpu_seconds, named
from rich.console import Console
from rich.table import Table
from simnodes import fill_id, fill_tenant, node_ids, tenant_names
from sqlalchemy import text

from app import bus, kafka_admin
from app.config import Settings, get_settings
from app.control.keyring import Keyring, credential_for
from app.credentials import Credential
from app.db import credentials as stored
from app.db.engine import engine_for, transaction
from app.db.setup import drop_database, ensure_database, migrate
from app.domain.codec import decode_event, encode
from app.domain.proof import Purpose, Role, headers, sandbox_key, verify
from app.domain.requests import CreateSandbox, DestroySandbox, Exec, ReplyTo, RequestBase
from app.domain.trust import EVENT_SENDERS
from app.stack import services as stack
from app.stats import percentile
from workers.redis_state import claim_ttl_s

HERE = Path(__file__).resolve().parent
#: A DSec unit (docs/BENCHMARKS.md, "A DSec unit, simulated").
UNIT_NODES = 160
UNIT_PER_NODE = 2400
UNIT_CREATES_S = 5000
UNIT_COMMANDS_S = 20_000
UNIT_CORES_GOAL = 16
#: A node's heartbeat period (workers/upkeep.py).
HEARTBEAT_S = 5.0
#: A step is sustained when this share of its requests is answered...
ANSWERED_SHARE = 0.97
#: ...and its stragglers are waited for this long after it.
DRAIN_S = 5.0
#: The control plane the goal counts; the broker is reported beside it.
CONTROL_PLANE = ("scheduler", "projector", "postgres", "redis")


# --- the platform of the run ----------------------------------------------------------


@dataclass
class Run:
    """The run's settings, its nodes and tenants, and the processes it started."""

    settings: Settings
    tag: str
    nodes: list[str]
    tenants: dict[str, Credential]
    logs: Path
    env: dict[str, str]
    schedulers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    projectors: list[subprocess.Popen[bytes]] = field(default_factory=list)
    sim: subprocess.Popen[str] | None = None
    #: A core's share one scheduler spends with nothing asked (following heartbeats).
    scheduler_idle: float = 0.0

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        """``dsec run ...`` of this platform, logged in the run's directory."""
        name = f"{args[1]}-{len(self.schedulers) + len(self.projectors)}.log"
        log = open(self.logs / name, "ab")  # noqa: SIM115 (the child holds it)
        return subprocess.Popen(
            [sys.executable, "-m", "app.cli", *args], env=self.env, stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip

    def add_scheduler(self) -> None:
        self.schedulers.append(self.start("run", "scheduler"))

    def groups(self) -> dict[str, list[int]]:
        """The processes whose CPU is counted, by component."""
        return {
            "scheduler": [p.pid for p in self.schedulers],
            "projector": [p.pid for p in self.projectors],
            "postgres": named("postgres"),
            "redis": named("redis-server"),
            "broker": broker_pids(self.settings.state_dir),
            "nodes (simulated)": [self.sim.pid] if self.sim else [],
            "trainers (this process)": [os.getpid()],
        }


def private_settings(tag: str) -> Settings:
    """The stack's settings on topics and a database of the run's own."""
    base = get_settings()
    return base.model_copy(
        update={
            "topic_prefix": f"unit{tag}",
            "database_url": base.database_url + "_unit",
            "admin_database_url": base.admin_database_url + "_unit",
        }
    )


def set_up(settings: Settings, tag: str, nodes: int, tenants: int) -> tuple[list[str], list[str]]:
    """A fresh database with the run's node and tenant keys enrolled (as `dsec node
    add` and `dsec tenant create` record them), and the run's topics."""
    drop_database(settings)
    ensure_database(settings)
    migrate(settings)
    ids, names = node_ids(tag, nodes), tenant_names(tag, tenants)
    with transaction(settings.admin_database_url) as conn:
        for node in ids:
            stored.issue(conn, Role.NODE, node, "bench/unit.py")
        for name in names:
            stored.issue(conn, Role.TENANT, name, "bench/unit.py")
    kafka_admin.ensure_topics(settings, names, ids)
    analyze(settings)
    return ids, names


def analyze(settings: Settings) -> None:
    """Fresh planner statistics: this machine's Postgres runs with autovacuum off, and
    the fill grows the projections by hundreds of thousands of rows."""
    with engine_for(settings.admin_database_url).connect() as conn:
        conn.execute(text("ANALYZE"))
        conn.commit()


def tenant_credentials(settings: Settings, names: list[str]) -> dict[str, Credential]:
    with transaction(settings.database_url) as conn:
        rows = [r for r in stored.load(conn, Role.TENANT) if r.subject in names]
    return {row.subject: credential_for(settings, row) for row in rows}


def projected(settings: Settings) -> int:
    """Records of the events topic the projector has committed."""
    with transaction(settings.database_url) as conn:
        done = conn.execute(
            text(
                "SELECT coalesce(sum(next_offset), 0) FROM consumer_offsets"
                " WHERE consumer = 'projector' AND topic = :topic"
            ),
            {"topic": settings.topic_events},
        ).scalar()
    return int(done or 0)


def log_bytes(settings: Settings) -> int:
    """Bytes of the log (every partition of ``events``, indexes and TOAST included)."""
    with transaction(settings.database_url) as conn:
        size = conn.execute(
            text(
                "SELECT coalesce(sum(pg_total_relation_size(i.inhrelid)), 0)"
                " FROM pg_inherits i WHERE i.inhparent = 'events'::regclass"
            )
        ).scalar()
    return int(size or 0)


def events_end(settings: Settings) -> int:
    """Records written to the events topic so far."""
    probe = bus.make_consumer(settings)
    try:
        parts = bus.partitions(probe, settings.topic_events)
        return sum(bus.end_offsets(probe, parts).values())
    finally:
        probe.close()


def wait_until(
    check: Callable[[], bool], what: str, timeout_s: float, every_s: float = 1.0
) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout_s:
            raise SystemExit(f"unit: timed out waiting for {what}")
        time.sleep(every_s)
    return time.monotonic() - started


def settled(run: Run, window_s: float = 3.0) -> Callable[[], bool]:
    """A check that each scheduler used little more than its idle share of a core
    over the last window (it has followed the log to its end)."""
    groups = {str(p.pid): [p.pid] for p in run.schedulers}
    below = run.scheduler_idle + 0.2

    def check() -> bool:
        before = cpu_seconds(groups)
        time.sleep(window_s)
        after = cpu_seconds(groups)
        return all((after[k] - before[k]) / window_s < below for k in groups)

    return check


# --- the trainers ---------------------------------------------------------------------


class Live:
    """Live sandboxes (and their owners): random picks, and the oldest first to go."""

    def __init__(self) -> None:
        self._ids: list[str] = []
        self._at: dict[str, int] = {}
        self.owner: dict[str, str] = {}
        self._order: list[str] = []
        self._next_out = 0
        self.lock = threading.Lock()

    def add(self, sandbox_id: str, tenant: str) -> None:
        with self.lock:
            self._at[sandbox_id] = len(self._ids)
            self._ids.append(sandbox_id)
            self.owner[sandbox_id] = tenant
            self._order.append(sandbox_id)

    def pick(self) -> str:
        with self.lock:
            return random.choice(self._ids)

    def take_oldest(self) -> str | None:
        """The oldest live sandbox, no longer live (its destroy is on its way)."""
        with self.lock:
            while self._next_out < len(self._order):
                sandbox_id = self._order[self._next_out]
                self._next_out += 1
                at = self._at.pop(sandbox_id, None)
                if at is None:
                    continue
                last = self._ids.pop()
                if last != sandbox_id:
                    self._ids[at] = last
                    self._at[last] = at
                return sandbox_id
        return None

    def __len__(self) -> int:
        return len(self._ids)


@dataclass
class Sent:
    kind: str
    at: float
    sandbox_id: str
    tenant: str


@dataclass
class StepResult:
    kind: str
    rate: float
    seconds: float
    sent: int
    answered: int
    failed: int
    achieved: float
    p50_ms: float
    p99_ms: float
    cpu: dict[str, float]
    events: int
    reasons: Counter[str]
    schedulers: int
    max_p99_ms: float

    @property
    def sustained(self) -> bool:
        return self.answered >= ANSWERED_SHARE * self.sent and self.p99_ms <= self.max_p99_ms


class Trainers:
    """Trainers of the run's tenants: requests signed with their keys, replies read
    from their replies topics (every partition, one consumer)."""

    def __init__(
        self, settings: Settings, tenants: dict[str, Credential], route: str = "direct"
    ) -> None:
        """``route``: ``direct`` sends a command straight to its sandbox's node, proven
        under the sandbox's key, as the SDK does for a sandbox whose ``ready`` said so;
        ``scheduler`` sends every command through the scheduler."""
        self.settings = settings
        self.tenants = tenants
        self.route = route
        #: The node of each sandbox that takes direct commands.
        self.node_of: dict[str, str] = {}
        self.names = sorted(tenants)
        self.publisher = bus.Publisher(settings)
        self.live = Live()
        self._sent: dict[str, Sent] = {}
        self._lock = threading.Lock()
        self._answers: list[tuple[str, float, bool, str]] = []
        self._stopping = threading.Event()
        self._consumer = bus.make_consumer(settings)
        # One partition of each tenant's replies, as each SDK client reads one.
        parts = [TopicPartition(settings.replies_topic(name), 0) for name in self.names]
        self._consumer.assign(parts)
        self._consumer.seek_to_end(*parts)
        for tp in parts:
            self._consumer.position(tp)
        self._reader = threading.Thread(target=self._read, name="replies", daemon=True)
        self._reader.start()
        self._created = 0

    def _read(self) -> None:
        while not self._stopping.is_set():
            for records in self._consumer.poll(timeout_ms=500, max_records=2000).values():
                now = time.monotonic()
                for record in records:
                    self._answer(record.value or b"", now)

    def _answer(self, value: bytes, now: float) -> None:
        doc = json.loads(value)
        with self._lock:
            sent = self._sent.pop(str(doc.get("request_id")), None)
            if sent is None:
                return
            ok = doc.get("kind") != "error"
            self._answers.append(
                (sent.kind, now - sent.at, ok, "" if ok else str(doc.get("reason")))
            )
        if ok and sent.kind == "create":
            if doc.get("direct") and doc.get("node_id"):
                self.node_of[sent.sandbox_id] = str(doc["node_id"])
            self.live.add(sent.sandbox_id, sent.tenant)

    def send(self, request: RequestBase, tenant: str, kind: str) -> None:
        cred = self.tenants[tenant]
        value = encode(request)
        with self._lock:
            self._sent[str(request.request_id)] = Sent(
                kind, time.monotonic(), request.sandbox_id, tenant
            )
        node = self.node_of.get(request.sandbox_id) if isinstance(request, Exec) else None
        if node is None or self.route != "direct":
            proof = headers(Purpose.REQUEST, cred.key_id, cred.secret, value)
            self.publisher.publish(
                self.settings.topic_requests, request.sandbox_id, value, headers=proof
            )
            return
        key = sandbox_key(cred.secret, request.sandbox_id)
        proof = headers(Purpose.DIRECT, cred.key_id, key, value)
        self.publisher.publish(
            self.settings.node_topic(node), request.sandbox_id, value, headers=proof, partition=0
        )

    def reply_to(self, tenant: str) -> ReplyTo:
        return ReplyTo(topic=self.settings.replies_topic(tenant), partition=0)

    def one(self, kind: str, tag: str) -> None:
        """One operation of ``kind``: a life's create and a destroy of the oldest
        sandbox, or a command in a random live one."""
        if kind == "create":
            tenant = self.names[self._created % len(self.names)]
            sandbox_id = f"sb-{tag}c{self._created:015d}"
            self._created += 1
            self.send(
                CreateSandbox(
                    sandbox_id=sandbox_id, job_id="unit", cpus=0.5, memory_mb=256,
                    reply_to=self.reply_to(tenant),
                ),
                tenant, "create",
            )  # fmt: skip
            old = self.live.take_oldest()
            if old is not None:
                owner = self.live.owner.pop(old)
                self.node_of.pop(old, None)
                self.send(
                    DestroySandbox(sandbox_id=old, job_id="unit", reply_to=self.reply_to(owner)),
                    owner, "destroy",
                )  # fmt: skip
        else:
            sandbox_id = self.live.pick()
            owner = self.live.owner[sandbox_id]
            self.send(
                Exec(sandbox_id=sandbox_id, job_id="unit", command="true",
                     reply_to=self.reply_to(owner)),
                owner, "command",
            )  # fmt: skip

    def outstanding(self) -> int:
        with self._lock:
            return len(self._sent)

    def answers(self) -> list[tuple[str, float, bool, str]]:
        """The answers since the last call."""
        with self._lock:
            found, self._answers = self._answers, []
        return found

    def forget_outstanding(self) -> int:
        with self._lock:
            n = len(self._sent)
            self._sent.clear()
        return n

    def close(self) -> None:
        self._stopping.set()
        self._reader.join(timeout=5)
        self._consumer.close()
        self.publisher.close()


# --- steps ----------------------------------------------------------------------------


@contextmanager
def cpu_window(run: Run) -> Iterator[dict[str, float]]:
    """CPU seconds of each component over the block (filled in when it ends), with
    the projector's committed records counted under ``events``."""
    groups = run.groups()
    before, events = cpu_seconds(groups), projected(run.settings)
    started = time.monotonic()
    spent: dict[str, float] = {}
    yield spent
    after = cpu_seconds(groups)
    spent.update({k: after[k] - before[k] for k in before})
    spent["seconds"] = time.monotonic() - started
    spent["events"] = projected(run.settings) - events


def step(run: Run, trainers: Trainers, kind: str, rate: float, seconds: float, max_p99_s: float,
         baseline: dict[str, float]) -> StepResult:  # fmt: skip
    """``rate`` operations of ``kind`` a second for ``seconds``, then their stragglers."""
    trainers.answers()
    with cpu_window(run) as spent:
        started = time.monotonic()
        done = 0
        while (now := time.monotonic()) - started < seconds:
            due = int(rate * (now - started)) - done
            for _ in range(due):
                trainers.one(kind, run.tag)
            done += due
            time.sleep(0.002)
        drain_end = time.monotonic() + max_p99_s + DRAIN_S
        while trainers.outstanding() and time.monotonic() < drain_end:
            time.sleep(0.1)
        # The projector's share of the last answers.
        time.sleep(1.0)
    lost = trainers.forget_outstanding()
    answers = [a for a in trainers.answers() if a[0] in (kind, "destroy")]
    mine = [a for a in answers if a[0] == kind]
    latencies = [a[1] for a in mine]
    reasons = Counter(a[3] for a in answers if not a[2])
    ok = sum(1 for a in mine if a[2])
    failed = len(mine) - ok + lost
    elapsed = spent["seconds"]
    cpu = {
        k: (spent[k] - baseline.get(k, 0.0) * elapsed) / max(done, 1) * 1000 for k in run.groups()
    }
    # The heartbeats' events are the baseline's, not the operations'.
    events = round(spent["events"] - baseline.get("events", 0.0) * elapsed)
    return StepResult(
        kind=kind, rate=rate, seconds=seconds, sent=done, answered=ok, failed=failed,
        achieved=ok / seconds,
        p50_ms=percentile(latencies, 50) * 1000 if latencies else math.inf,
        p99_ms=percentile(latencies, 99) * 1000 if latencies else math.inf,
        cpu=cpu, events=events, reasons=reasons, schedulers=len(run.schedulers),
        max_p99_ms=max_p99_s * 1000,
    )  # fmt: skip


def ramp(run: Run, trainers: Trainers, kind: str, rates: list[float], args: argparse.Namespace,
         baseline: dict[str, float], console: Console) -> list[StepResult]:  # fmt: skip
    """Steps at rising rates until one is not sustained."""
    results: list[StepResult] = []
    for rate in rates:
        result = step(run, trainers, kind, rate, args.step_s, args.max_p99_s, baseline)
        results.append(result)
        console.print(describe(result))
        if not result.sustained:
            # Let the backlog drain before the next phase measures anything.
            time.sleep(DRAIN_S)
            wait_until(settled(run), "the schedulers to settle", 300, 0)
            trainers.answers()
            trainers.forget_outstanding()
            break
    return results


def describe(r: StepResult) -> str:
    cp = sum(r.cpu[k] for k in CONTROL_PLANE)
    return (
        f"  {r.kind:7} {r.rate:7.0f}/s x{r.schedulers} sched: answered {r.answered}/{r.sent}"
        f" ({r.achieved:.0f}/s) p50 {r.p50_ms:.0f} ms p99 {r.p99_ms:.0f} ms,"
        f" control plane {cp:.2f} ms CPU per op, {r.events / max(r.sent, 1):.1f} events per op"
        f" -> {'sustained' if r.sustained else 'NOT sustained'}"
        + (f" (refusals: {dict(r.reasons.most_common(3))})" if r.reasons else "")
    )


# --- the extrapolation ------------------------------------------------------------------


@dataclass
class Unit:
    """The cores a unit's control plane needs, from measured costs: per create and
    per command at the highest rate measured (ms of CPU), per heartbeat (ms), per
    event of the log at full batches (us), and what following one event costs each
    scheduler (us)."""

    per_create: dict[str, float]
    per_command: dict[str, float]
    per_heartbeat: dict[str, float]
    events_per_create: float
    events_per_command: float
    ingest_us: dict[str, float]
    follow_us: float
    heartbeats_s: float = UNIT_NODES / HEARTBEAT_S

    @property
    def events_s(self) -> float:
        """Events a second of a unit's creates and commands (heartbeats apart)."""
        return UNIT_CREATES_S * self.events_per_create + UNIT_COMMANDS_S * self.events_per_command

    def linear(self, component: str) -> float:
        """Cores of ``component`` at a unit's rates, were each operation to cost what it
        cost at the rates measured here (an upper bound: a process's cost per round
        weighs less the more each round carries)."""
        return (
            UNIT_CREATES_S * self.per_create[component]
            + UNIT_COMMANDS_S * self.per_command[component]
            + self.heartbeats_s * self.per_heartbeat[component]
        ) / 1000

    def log_writer(self, component: str) -> float:
        """Cores of the projector or Postgres: a unit's events at what one cost them
        at full batches (the fill), its heartbeats at what one cost them."""
        hb = self.heartbeats_s * self.per_heartbeat[component] / 1000
        return self.events_s * self.ingest_us[component] / 1e6 + hb

    def scheduler_follow(self) -> float:
        """Cores each scheduler process spends following the log at a unit's rates:
        every event and every heartbeat, whoever owns the request."""
        hb = self.heartbeats_s * self.per_heartbeat["scheduler"] / 1000
        return self.events_s * self.follow_us / 1e6 + hb

    def schedulers(self) -> tuple[int | None, float]:
        """Scheduler processes so that each stays under one core, and their cores
        (None: no number does: following the log alone takes a core). What only the
        owner of a request pays is the measured cost less the following."""
        follow = self.scheduler_follow()
        handle = max(0.0, self.linear("scheduler") - follow)
        if follow >= 1.0:
            return None, math.inf
        k = max(1, math.ceil(handle / (1.0 - follow)))
        return k, handle + k * follow

    def cores(self) -> dict[str, float]:
        _k, sched = self.schedulers()
        return {
            "scheduler": sched,
            "projector": self.log_writer("projector"),
            "postgres": self.log_writer("postgres"),
            "redis": self.linear("redis"),
            "broker": self.linear("broker"),
        }


def best(results: list[StepResult]) -> StepResult | None:
    sustained = [r for r in results if r.sustained]
    return max(sustained, key=lambda r: r.rate) if sustained else None


def chosen(results: list[StepResult]) -> StepResult | None:
    """The step whose costs count: the highest rate whose requests were all but
    answered by its end, slow or not (the largest count, the least noise, and the
    batching nearest a unit's: a process's fixed cost per round weighs less the more
    each round carries)."""
    complete = [r for r in results if r.answered >= ANSWERED_SHARE * r.sent]
    return max(complete, key=lambda r: r.rate) if complete else None


def per_op(results: list[StepResult]) -> dict[str, float]:
    """CPU per operation of each component (nothing if the kind was not measured)."""
    step = chosen(results)
    return step.cpu if step is not None else defaultdict(float)


def events_per_op(results: list[StepResult]) -> float:
    step = chosen(results)
    return step.events / max(step.sent, 1) if step is not None else 0.0


# --- the run ----------------------------------------------------------------------------


def follow_cost(settings: Settings, n: int = 20_000) -> float:
    """Microseconds of CPU to follow one event of the log as every scheduler does with
    every event (app/control/follower.py): fetched and parsed by the Kafka client, its
    proof checked, decoded. Measured in this process on the run's last ``n`` events,
    heartbeats apart (their cost is the baseline's); the scheduler's bookkeeping per
    event (a few dictionary operations) is not in it."""
    keys = Keyring.from_settings(settings)
    consumer = bus.make_consumer(settings)
    try:
        parts = bus.partitions(consumer, settings.topic_events)
        ends = bus.end_offsets(consumer, parts)
        consumer.assign(parts)
        for tp in parts:
            consumer.seek(tp, max(0, ends[tp] - n // len(parts)))
        records = []
        started = time.process_time()
        while any(consumer.position(tp) < end for tp, end in ends.items()):
            for batch in consumer.poll(timeout_ms=1000, max_records=5000).values():
                records.extend(batch)
        fetched = time.process_time() - started
    finally:
        consumer.close()
    plain = [r for r in records if b'"type":"NodeHeartbeat"' not in (r.value or b"")]
    started = time.process_time()
    for record in plain:
        verify(Purpose.EVENT, record.value, record.headers, keys, EVENT_SENDERS)
        decode_event(record.value, settings.max_message_bytes)
    decoded = time.process_time() - started
    # The fetch's share of the plain events: heartbeats are most of the bytes.
    share = sum(len(r.value or b"") for r in plain) / max(
        1, sum(len(r.value or b"") for r in records)
    )
    return (fetched * share + decoded) / max(1, len(plain)) * 1e6


def start_schedulers(run: Run, k: int, console: Console) -> None:
    """Schedulers up to ``k``, started as the stack starts them: each recovers the live
    sandboxes from the projections, reads the log after them, then takes its share of
    the requests' partitions."""
    started = time.monotonic()
    while len(run.schedulers) < k:
        run.add_scheduler()
    wait_until(
        lambda: len(stack.scheduler_partitions(run.settings) or {}) == k,
        "the schedulers' partitions", 1800,
    )  # fmt: skip
    wait_until(settled(run), "the schedulers to settle", 1800, 0)
    console.print(
        f"{k} scheduler(s) recovered, own their partitions and are quiet after"
        f" {time.monotonic() - started:.0f} s"
    )


def fill(run: Run, args: argparse.Namespace, console: Console) -> dict[str, float]:
    """Start the nodes, let them register and fill, and wait for the log to hold it;
    the CPU of each component per event of the fill (us) and its events/s.
    The schedulers start after (a scheduler recovers live sandboxes from the
    projections, as after any restart; one that follows a fill of a million events
    with no request coming takes 2,000 of them a round, one round a second)."""
    sim = subprocess.Popen(
        [sys.executable, str(HERE / "simnodes.py"), "--tag", run.tag, "--nodes", str(args.nodes),
         "--fill", str(args.per_node)],
        env=run.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        stderr=open(run.logs / "simnodes.log", "ab"),  # noqa: SIM115
    )  # fmt: skip
    run.sim = sim
    expect(sim, "REGISTERED")
    started = time.monotonic()
    # The projector at full batches: the events/s it and Postgres sustain, and what
    # each event costs them there (a unit's rates batch at least as much).
    with cpu_window(run) as spent:
        line = expect(sim, "FILLED")
        console.print(
            f"fill: {line.split()[1]} sandboxes written to the log in {line.split()[2]} s"
        )
        end = events_end(run.settings)
        wait_until(lambda: projected(run.settings) >= end, "the projector", 3600, 0.5)
    events = max(1.0, spent["events"])
    ingest = {k: spent[k] / events * 1e6 for k in ("projector", "postgres", "broker")}
    ingest["events/s"] = events / spent["seconds"]
    console.print(
        f"fill: the projector had the {end:,} events"
        f" {time.monotonic() - started:.0f} s after the fill began"
        f" ({ingest['events/s']:,.0f} events/s while the nodes wrote them on the same cores;"
        f" CPU per event: projector {ingest['projector']:.1f} us,"
        f" Postgres {ingest['postgres']:.1f} us, broker {ingest['broker']:.1f} us)"
    )
    analyze(run.settings)
    return ingest


def list_sandboxes(run: Run) -> None:
    """From now on the nodes' heartbeats list their sandboxes (two of each node's
    before anything is measured)."""
    assert run.sim is not None
    tell(run.sim, "LIST")
    expect(run.sim, "LISTING")
    time.sleep(2 * HEARTBEAT_S + 1)


def expect(sim: subprocess.Popen[str], word: str) -> str:
    assert sim.stdout is not None
    for line in sim.stdout:
        if line.startswith(word):
            return line.strip()
    raise SystemExit(f"unit: the simulated nodes ended before {word} (see simnodes.log)")


def tell(sim: subprocess.Popen[str], line: str) -> None:
    stdin: IO[str] | None = sim.stdin
    assert stdin is not None
    stdin.write(line + "\n")
    stdin.flush()


def measure_baseline(run: Run, seconds: float) -> tuple[dict[str, float], dict[str, float], int]:
    """CPU seconds per second of each component with only heartbeats flowing, the CPU
    per heartbeat (ms), and the log's growth per heartbeat (bytes)."""
    size = log_bytes(run.settings)
    with cpu_window(run) as spent:
        time.sleep(seconds)
    heartbeats = max(1, int(spent["events"]))
    per_s = {k: spent[k] / spent["seconds"] for k in [*run.groups(), "events"]}
    run.scheduler_idle = per_s["scheduler"] / len(run.schedulers)
    per_hb = {k: spent[k] / heartbeats * 1000 for k in run.groups()}
    return per_s, per_hb, (log_bytes(run.settings) - size) // heartbeats


def scale_check(run: Run, trainers: Trainers, results: dict[str, list[StepResult]], k: int,
                args: argparse.Namespace, baseline: dict[str, float],
                console: Console) -> dict[str, StepResult]:  # fmt: skip
    """A step of each kind at half the best rate with the run's schedulers, then the
    same with ``k`` of them: the same rate, so that batching weighs the same."""
    rates = {kind: top.rate / 2 for kind, steps in results.items() if (top := best(steps))}
    again = {}
    for kind, rate in rates.items():
        again[f"{kind}@1"] = step(run, trainers, kind, rate, args.step_s, args.max_p99_s, baseline)
        console.print(describe(again[f"{kind}@1"]))
    before = len(run.schedulers)
    start_schedulers(run, k, console)
    # Each new scheduler follows the heartbeats too: its idle share is baseline.
    more = {**baseline, "scheduler": baseline["scheduler"] * k / before}
    for kind, rate in rates.items():
        again[kind] = step(run, trainers, kind, rate, args.step_s, args.max_p99_s, more)
        console.print(describe(again[kind]))
    return again


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=UNIT_NODES)
    parser.add_argument("--per-node", type=int, default=UNIT_PER_NODE)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--schedulers", type=int, default=1)
    parser.add_argument("--create-rates", default="10,20,40,80,160,320")
    parser.add_argument("--command-rates", default="25,50,100,200,400,800,1600")
    parser.add_argument("--step-s", type=float, default=20.0)
    parser.add_argument("--baseline-s", type=float, default=30.0)
    parser.add_argument("--max-p99-s", type=float, default=5.0)
    parser.add_argument(
        "--scale-to", type=int, default=2, help="schedulers of the scale check (0: none)"
    )
    parser.add_argument(
        "--route", choices=["direct", "scheduler"], default="direct",
        help="how commands go: straight to the node (as the SDK sends them) or through"
        " the scheduler",
    )  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep the run's database")
    args = parser.parse_args()
    console = Console()
    tag = uuid.uuid4().hex[:4]
    settings = private_settings(tag)
    logs = Path(f"/tmp/dsec-unit-{tag}")
    logs.mkdir(parents=True, exist_ok=True)
    console.print(f"unit run {tag}: topics {settings.topic_prefix}.*, logs in {logs}")
    nodes, names = set_up(settings, tag, args.nodes, args.tenants)
    env = {
        **os.environ,
        "DSEC_TOPIC_PREFIX": settings.topic_prefix,
        "DSEC_DATABASE_URL": settings.database_url,
        "DSEC_ADMIN_DATABASE_URL": settings.admin_database_url,
        "DSEC_METRICS_PORT": "0",
        "DSEC_SCHEDULER_METRICS_PORT": "0",
    }
    run = Run(settings, tag, nodes, tenant_credentials(settings, names), logs, env)
    trainers: Trainers | None = None
    stats: dict[str, int] = {}
    try:
        run.projectors.append(run.start("run", "projector"))
        ingest = fill(run, args, console)
        start_schedulers(run, args.schedulers, console)
        list_sandboxes(run)
        trainers = Trainers(settings, run.tenants, args.route)
        # Oldest first across the nodes, so the destroys of the create steps spread.
        for j in range(args.per_node):
            for i, node in enumerate(nodes):
                sandbox_id = fill_id(tag, i, j)
                trainers.live.add(sandbox_id, names[fill_tenant(j, len(names))])
                trainers.node_of[sandbox_id] = node
        measured = measure(run, trainers, args, console, ingest)
    finally:
        if trainers is not None:
            trainers.close()
        stats = stop(run, args.keep)
    report(args, measured, stats, console)


def warm_up(run: Run, trainers: Trainers, args: argparse.Namespace, baseline: dict[str, float],
            console: Console) -> None:  # fmt: skip
    """Every path once, unmeasured: a command to each node (the scheduler makes sure of
    each node's inbox topic, and its producer learns it, on the first one) and creates
    for a while (each tenant's replies topic, nodes' Celery queues)."""
    for i in range(args.nodes):
        sandbox_id = fill_id(run.tag, i, 0)
        owner = trainers.live.owner[sandbox_id]
        trainers.send(
            Exec(sandbox_id=sandbox_id, job_id="unit", command="true",
                 reply_to=trainers.reply_to(owner)),
            owner, "command",
        )  # fmt: skip
        time.sleep(0.02)
    wait_until(lambda: trainers.outstanding() == 0, "the warm-up's commands", 300, 0.5)
    warm = step(run, trainers, "create", 10.0, 10.0, args.max_p99_s, baseline)
    console.print("warm-up:" + describe(warm).removeprefix(" "))


def measure(run: Run, trainers: Trainers, args: argparse.Namespace, console: Console,
            ingest: dict[str, float]) -> Measured:  # fmt: skip
    """The baseline, the two ramps, what following an event costs, the scale check."""
    baseline, per_hb, hb_bytes = measure_baseline(run, args.baseline_s)
    console.print(
        f"baseline: {describe_cpu(per_hb)} ms CPU per heartbeat; log +{hb_bytes:,} B each"
    )
    warm_up(run, trainers, args, baseline, console)
    results = {}
    for kind, rates in (("create", args.create_rates), ("command", args.command_rates)):
        console.print(f"{kind}s at rising rates:")
        rising = [float(r) for r in rates.split(",") if r.strip()]
        results[kind] = ramp(run, trainers, kind, rising, args, baseline, console)
    follow = follow_cost(run.settings)
    console.print(f"following the log: {follow:.1f} us of CPU per event (measured in this process)")
    again = {}
    if args.scale_to > args.schedulers:
        again = scale_check(run, trainers, results, args.scale_to, args, baseline, console)
    return Measured(results, again, per_hb, hb_bytes, ingest, follow)


@dataclass
class Measured:
    """What a run measured."""

    results: dict[str, list[StepResult]]
    again: dict[str, StepResult]
    per_heartbeat: dict[str, float]
    heartbeat_log_bytes: int
    #: CPU per event of the fill (us), and its events/s.
    ingest: dict[str, float]
    #: CPU to follow one event as a scheduler does (us).
    follow_us: float


def stop(run: Run, keep: bool) -> dict[str, int]:
    """Stop what the run started and drop its topics (and database unless ``keep``);
    the simulated nodes' counts."""
    stats: dict[str, int] = {}
    if run.sim is not None:
        # SystemExit too: expect() raises it when the simulated nodes died, and the
        # run's services, topics and database must go all the same.
        with suppress(Exception, SystemExit):
            tell(run.sim, "STOP")
            stats = json.loads(expect(run.sim, "STATS").removeprefix("STATS "))
        try:
            run.sim.wait(timeout=60)
        except subprocess.TimeoutExpired:
            run.sim.kill()
    for proc in run.schedulers + run.projectors:
        proc.send_signal(signal.SIGTERM)
    for proc in run.schedulers + run.projectors:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    kafka_admin.drop_topics(run.settings)
    engine_for(run.settings.database_url).dispose()
    engine_for(run.settings.admin_database_url).dispose()
    if not keep:
        drop(run.settings)
    return stats


def drop(settings: Settings) -> None:
    """Drop the run's database (tried again while a stopped service's session lingers)."""
    drop_database(settings)


def describe_cpu(cpu: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())


def report(args: argparse.Namespace, m: Measured, stats: dict[str, int], console: Console) -> None:
    """The tables, the unit's cores and the RESULT line."""
    results, again, per_hb = m.results, m.again, m.per_heartbeat
    hb_bytes = m.heartbeat_log_bytes
    # What each command leaves in Redis: its claim's dedupe key, kept claim_ttl_s.
    redis_per_op = stats.get("done_key_bytes", 0)
    components = [*CONTROL_PLANE, "broker", "nodes (simulated)", "trainers (this process)"]
    steps = Table(title="Steps (measured)")
    for col in ("kind", "schedulers", "offered/s", "answered/s", "p50 ms", "p99 ms", "events/op",
                "control plane ms/op", "sustained"):  # fmt: skip
        steps.add_column(col, justify="right")
    for r in [*results["create"], *results["command"], *again.values()]:
        steps.add_row(
            r.kind, str(r.schedulers), f"{r.rate:.0f}", f"{r.achieved:.0f}", f"{r.p50_ms:.0f}",
            f"{r.p99_ms:.0f}", f"{r.events / max(r.sent, 1):.2f}",
            f"{sum(r.cpu[k] for k in CONTROL_PLANE):.2f}", "yes" if r.sustained else "no",
        )  # fmt: skip
    console.print(steps)

    per_create, per_command = per_op(results["create"]), per_op(results["command"])
    cpu = Table(title="CPU per operation, ms (measured; a create is a life: create + destroy)")
    for col in ("component", "per create", "per command", "per heartbeat"):
        cpu.add_column(col, justify="right")
    for name in components:
        cpu.add_row(
            name, f"{per_create[name]:.3f}", f"{per_command[name]:.3f}", f"{per_hb[name]:.3f}"
        )
    console.print(cpu)

    ceilings(per_create, per_command, per_hb, results, console)
    top_c, top_x = best(results["create"]), best(results["command"])
    ev_c, ev_x = events_per_op(results["create"]), events_per_op(results["command"])
    unit = Unit(per_create, per_command, per_hb, ev_c, ev_x, m.ingest, m.follow_us)
    k, _ = unit.schedulers()
    cores = unit.cores()
    total = sum(cores[c] for c in CONTROL_PLANE)
    ext = Table(
        title=f"A unit: {UNIT_CREATES_S:,} creates/s, {UNIT_COMMANDS_S:,} commands/s, "
        f"{UNIT_NODES} nodes x {UNIT_PER_NODE:,} heartbeating (extrapolated)"
    )
    for col in ("component", "cores", "upper bound", "how"):
        ext.add_column(col, justify="left" if col == "how" else "right")
    ext.add_row(
        "scheduler", f"{cores['scheduler']:.1f}", f"{unit.linear('scheduler'):.1f}",
        f"{k or 'no number of'} processes; each follows the log for"
        f" {unit.scheduler_follow():.2f} core ({unit.events_s:,.0f} events/s at"
        f" {m.follow_us:.1f} us, {unit.heartbeats_s:.0f} heartbeats/s at"
        f" {per_hb['scheduler']:.1f} ms)",
    )  # fmt: skip
    for c in ("projector", "postgres"):
        ext.add_row(
            c, f"{cores[c]:.1f}", f"{unit.linear(c):.1f}",
            f"{unit.events_s:,.0f} events/s at {m.ingest[c]:.1f} us (the fill's batches),"
            f" heartbeats at {per_hb[c]:.1f} ms",
        )  # fmt: skip
    ext.add_row("redis", f"{cores['redis']:.1f}", "", "one thread: more than 1.0 is a cap")
    ext.add_row("control plane", f"{total:.1f}", "", f"goal <= {UNIT_CORES_GOAL}")
    ext.add_row("broker (beside)", f"{cores['broker']:.1f}", "", "not in the goal's count")
    console.print(ext)
    for kind in ("create", "command"):
        one, more = again.get(f"{kind}@1"), again.get(kind)
        if one is not None and more is not None:
            console.print(
                f"scale check ({kind}s at {one.rate:.0f}/s, measured): scheduler CPU per op"
                f" {one.cpu['scheduler']:.2f} ms with {one.schedulers},"
                f" {more.cpu['scheduler']:.2f} ms with {more.schedulers} (all of them)"
            )

    hb_day = hb_bytes * unit.heartbeats_s * 86_400
    kept_s = claim_ttl_s(get_settings().request_max_age_s)
    redis_held = redis_per_op * UNIT_COMMANDS_S * kept_s
    live = args.nodes * args.per_node
    console.print(
        f"heartbeats listing {args.per_node:,} sandboxes:"
        f" {stats.get('heartbeat_bytes_mean', 0):,} B"
        f" each on the bus, +{hb_bytes:,} B of log each: {hb_day / 1e9:,.0f} GB of log a day"
        f" for a unit (extrapolated)\n"
        f"Redis: {redis_per_op:.0f} B per command's dedupe key (measured; kept {kept_s} s):"
        f" {redis_held / 1e9:,.1f} GB at {UNIT_COMMANDS_S:,} commands/s (extrapolated)\n"
        f"simulated nodes: {stats}"
    )
    unit_note = f"{total:.1f}" if k is not None else "inf"
    print(
        f"RESULT unit nodes={args.nodes} live={live} schedulers={args.schedulers}"
        f" route={args.route}"
        f" creates/s={top_c.achieved if top_c else 0:.0f}"
        f" commands/s={top_x.achieved if top_x else 0:.0f}"
        f" cpu_ms/create={{{fmt(per_create)}}} cpu_ms/command={{{fmt(per_command)}}}"
        f" heartbeat_ms={{{fmt(per_hb)}}}"
        f" heartbeat_ms/node={sum(per_hb[c] for c in CONTROL_PLANE):.2f}"
        f" unit_schedulers={k} unit_cores={unit_note}"
    )


def ceilings(per_create: dict[str, float], per_command: dict[str, float],
             per_hb: dict[str, float], results: dict[str, list[StepResult]],
             console: Console) -> None:  # fmt: skip
    """What one core of each component would sustain of each kind alone, a unit's
    heartbeats counted first (extrapolated from the measured CPU per operation)."""
    table = Table(title="One core of each, at a unit's heartbeats (extrapolated)")
    for col in ("component", "heartbeats' share", "creates/s", "commands/s", "events/s"):
        table.add_column(col, justify="right")
    ev_x = events_per_op(results["command"])
    for c in CONTROL_PLANE:
        left = 1000.0 - UNIT_NODES / HEARTBEAT_S * per_hb[c]
        events = f"{left / (per_command[c] / ev_x):,.0f}" if ev_x and per_command[c] > 0 else "-"
        table.add_row(
            c, f"{(1000.0 - left) / 10:.0f} %", per_core(left, per_create[c]),
            per_core(left, per_command[c]), events,
        )  # fmt: skip
    console.print(table)
    top = chosen(results["command"])
    if top is not None:
        console.print(
            f"events into the log at {top.rate:.0f} commands/s (measured):"
            f" {top.events / top.seconds:,.0f}/s, the heartbeats' apart"
        )


def per_core(left_ms: float, per_op_ms: float) -> str:
    return f"{left_ms / per_op_ms:,.0f}" if per_op_ms > 0 and left_ms > 0 else "-"


def fmt(cpu: dict[str, float]) -> str:
    return ",".join(f"{k}:{cpu[k]:.3f}" for k in (*CONTROL_PLANE, "broker"))


if __name__ == "__main__":
    main()
