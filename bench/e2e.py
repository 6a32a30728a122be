"""End to end: a trainer's sandboxes and commands through the platform, vs raw Podman.

    .venv/bin/python bench/e2e.py [--sandboxes 20] [--commands 10] [--concurrency 10]

Each of K rollouts, C at a time, creates a sandbox, runs M commands in it one after
the other (``echo hi``, checked) and destroys it. Two runs of the same work, in turn:
- platform: the SDK (Kafka, scheduler, Celery, node worker, rootless Podman, the
  in-sandbox agent, Kafka back), as a trainer uses it;
- podman: podman-py straight against the node's own rootless Podman service,
  ``containers.create`` with the platform's secure defaults (``container_args``) and
  ``sleep`` as PID 1, ``start``, ``exec_run`` M times, ``remove`` — what a trainer
  gets from the raw substrate. Podman's own limits only: the platform also creates the
  sandbox's cgroups and moves its PID 1 into them (rootless Podman ignores limits
  here), which the raw run does not pay for.
Reports sandboxes/s and commands/s (wall clock of the whole run), and p50/p99 of
create, exec and destroy; then the ratios. Needs `dsec up`. The last line prints the
headline figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import podman
from exec import line  # bench/exec.py, next to this file

from app.config import Settings, get_settings
from app.control import tenants
from app.sdk import Client
from app.stats import summary_ms
from workers.containers.podman_api import container_args
from workers.containers.spec import SandboxSpec
from workers.host.user import set_up_node_user

T = TypeVar("T")
COMMAND = ["echo", "hi"]
EXPECTED = b"hi\n"


@dataclass
class Run:
    """What one side measured."""

    name: str
    create_s: list[float] = field(default_factory=list)
    exec_s: list[float] = field(default_factory=list)
    destroy_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def timed(self, samples: list[float], call: Callable[[], T]) -> T:
        started = time.perf_counter()
        value = call()
        elapsed = time.perf_counter() - started
        with self._lock:
            samples.append(elapsed)
        return value

    def phases(self) -> list[tuple[str, list[float]]]:
        return [("create", self.create_s), ("exec", self.exec_s), ("destroy", self.destroy_s)]

    @property
    def sandboxes_per_s(self) -> float:
        return len(self.destroy_s) / self.wall_s

    @property
    def commands_per_s(self) -> float:
        return len(self.exec_s) / self.wall_s


def run_all(run: Run, rollouts: int, concurrency: int, rollout: Callable[[Run], None]) -> Run:
    """``rollouts`` rollouts, ``concurrency`` at a time; failures are counted, not raised."""

    def guarded(_: int) -> None:
        try:
            rollout(run)
        except Exception as exc:
            with run._lock:
                run.failures.append(f"{type(exc).__name__}: {exc}")

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(guarded, range(rollouts)))
    run.wall_s = time.perf_counter() - started
    return run


def warm_up(rollout: Callable[[Run], None]) -> None:
    """One unmeasured rollout (connections, caches); stop if even that fails."""
    run = run_all(Run("warm-up"), 1, 1, rollout)
    if run.failures:
        raise SystemExit(f"warm-up failed: {run.failures[0]}")


# --- the platform, through the SDK ---------------------------------------------------


def platform_rollout(client: Client, commands: int) -> Callable[[Run], None]:
    def rollout(run: Run) -> None:
        box = run.timed(run.create_s, client.create)
        try:
            for _ in range(commands):
                result = run.timed(run.exec_s, lambda: box.exec(COMMAND, timeout_s=30))
                if result.stdout != EXPECTED:
                    raise AssertionError(f"{box.id}: unexpected output {result!r}")
        finally:
            run.timed(run.destroy_s, box.close)

    return rollout


# --- the raw substrate: podman-py against the node's Podman service -----------------


class RawPodman:
    """Sandboxes as plain containers on the node's rootless Podman, one client per thread."""

    def __init__(self, settings: Settings, run_dir: Path) -> None:
        self.socket_url = set_up_node_user(settings.node_id, settings).socket_url
        self.settings = settings
        self.run_dir = run_dir
        self.tag = uuid.uuid4().hex[:8]
        self._local = threading.local()

    def client(self) -> podman.PodmanClient:
        client = getattr(self._local, "client", None)
        if client is None:
            client = podman.PodmanClient(base_url=self.socket_url, timeout=60)
            self._local.client = client
        return client

    def create(self) -> Any:
        spec = SandboxSpec(
            sandbox_id=f"e2e-raw-{self.tag}-{uuid.uuid4().hex[:8]}",
            image=self.settings.default_image,
            agent_bin_dir=self.settings.state_dir / "agent",
            run_dir=self.run_dir,
        )
        args = container_args(spec)
        # Not a sandbox of the node: no dsec label, so its reconciler leaves it alone.
        args.update(name=f"bench-{spec.sandbox_id}", labels={"dsec.bench": "e2e"})
        container = self.client().containers.create(spec.image, ["sleep", "3600"], **args)
        container.start()
        return container

    def rollout(self, commands: int) -> Callable[[Run], None]:
        def rollout(run: Run) -> None:
            container = run.timed(run.create_s, self.create)
            try:
                for _ in range(commands):
                    code, (out, _err) = run.timed(
                        run.exec_s, lambda: container.exec_run(COMMAND, demux=True)
                    )
                    if code != 0 or out != EXPECTED:
                        raise AssertionError(f"exec_run: exit {code}, output {out!r}")
            finally:
                remove = self.client().containers.remove
                run.timed(run.destroy_s, lambda: remove(container.id, force=True))

        return rollout

    def sweep(self) -> None:
        """Remove whatever this run left behind (after a failure)."""
        client = self.client()
        for container in client.containers.list(all=True, filters={"label": "dsec.bench=e2e"}):
            if self.tag in container.name:
                client.containers.remove(container.id, force=True)


# --- report ---------------------------------------------------------------------


def report(run: Run, rollouts: int, commands: int, concurrency: int) -> None:
    print(
        f"{run.name}: {len(run.destroy_s)} sandboxes x {commands} commands, concurrency "
        f"{concurrency}, in {run.wall_s:.2f}s: {run.sandboxes_per_s:.1f} sandboxes/s, "
        f"{run.commands_per_s:.1f} commands/s, {len(run.failures)} failures"
    )
    for what, samples in run.phases():
        print("  " + line(what, samples))
    for failure in run.failures[:5]:
        print(f"  failure: {failure}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", "-k", type=int, default=20, help="Rollouts (K).")
    parser.add_argument("--commands", "-m", type=int, default=10, help="Commands each (M).")
    parser.add_argument("--concurrency", "-c", type=int, default=10, help="Rollouts at once (C).")
    parser.add_argument("--only", choices=("platform", "podman"), help="Run one side only.")
    args = parser.parse_args()
    k, m, c = args.sandboxes, args.commands, args.concurrency
    settings = get_settings()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average before: {load}, {os.cpu_count()} CPUs")
    runs: dict[str, Run] = {}

    if args.only in (None, "platform"):
        job = f"e2e-{uuid.uuid4().hex[:8]}"
        with Client(settings, credential=tenants.local(settings, "bench"), job_id=job) as client:
            warm_up(platform_rollout(client, 1))
            runs["platform"] = run_all(Run("platform (SDK)"), k, c, platform_rollout(client, m))
        report(runs["platform"], k, m, c)

    if args.only in (None, "podman"):
        run_dir = settings.state_dir / "nodes" / settings.node_id / "bench"
        run_dir = run_dir / f"e2e-{uuid.uuid4().hex[:8]}"
        run_dir.mkdir(parents=True, exist_ok=True)
        raw = RawPodman(settings, run_dir)
        try:
            warm_up(raw.rollout(1))
            runs["podman"] = run_all(Run("podman-py (raw)"), k, c, raw.rollout(m))
        finally:
            raw.sweep()
            shutil.rmtree(run_dir, ignore_errors=True)
        report(runs["podman"], k, m, c)

    figures = []
    for key, run in runs.items():
        s = {what: summary_ms(samples) for what, samples in run.phases()}
        figures.append(
            f"{key}: sandboxes/s={run.sandboxes_per_s:.1f} commands/s={run.commands_per_s:.1f} "
            f"create_p50={s['create']['p50']:.0f}ms exec_p50={s['exec']['p50']:.1f}ms "
            f"destroy_p50={s['destroy']['p50']:.0f}ms failures={len(run.failures)}"
        )
    if len(runs) == 2:
        p, r = runs["platform"], runs["podman"]
        exec_ratio = summary_ms(r.exec_s)["p50"] / summary_ms(p.exec_s)["p50"]
        print(
            f"platform / podman: sandboxes/s {p.sandboxes_per_s / r.sandboxes_per_s:.2f}x, "
            f"commands/s {p.commands_per_s / r.commands_per_s:.2f}x; "
            f"exec p50 podman / platform {exec_ratio:.1f}x"
        )
        figures.append(
            f"ratio: sandboxes/s={p.sandboxes_per_s / r.sandboxes_per_s:.2f}x "
            f"commands/s={p.commands_per_s / r.commands_per_s:.2f}x exec_p50={exec_ratio:.1f}x"
        )
    print(f"RESULT e2e K={k} M={m} C={c} " + " | ".join(figures))


if __name__ == "__main__":
    main()
