"""Density: how many idle sandboxes one node holds, and the host memory each costs.

    .venv/bin/python bench/density.py [--steps 200 500 1000 2000] [--batch 50]
                                      [--min-available-mb 4096] [--cpu-window 0]

Creates idle sandboxes through the platform (SDK ``create_many`` in batches, the
smallest shape: 16 MiB, 0.005 CPU, so placement admits thousands), up to each step in
turn; after each step it lets the node settle and measures, per sandbox:
- host: the drop of MemAvailable since the start (everything: conmon, agent, the
  kernel's cgroups, namespaces and mounts, Podman's and the worker's bookkeeping), and
  of it the kernel's part (Slab + KernelStack + PageTables);
- PSS of the sandbox's own processes (its conmon and its agent, from
  ``/proc/<pid>/smaps_rollup``), and the growth of the node's Podman service and
  worker (PSS) since the start;
- how long listing the node's containers takes (the reconciler does it every 5 s, or
  ten times as long as it takes, whichever is longer);
- with ``--cpu-window S``, the CPU the node's Podman service and worker spend over S
  seconds with the sandboxes idle (percent of a core).
Other work on the machine moves MemAvailable too: the PSS figures are the precise ones.
It stops early when MemAvailable falls below ``--min-available-mb`` or a create fails,
then destroys everything it made. Needs `dsec up`. The last line prints the headline.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

from app.config import Settings, get_settings
from app.control import tenants
from app.domain.requests import DestroySandbox
from app.sdk import Client, Sandbox
from workers.containers.limits import CgroupLimiter
from workers.containers.podman_driver import PodmanDriver
from workers.host.user import set_up_node_user

SHAPE = {"memory_mb": 16, "cpus": 0.005, "ttl_s": 6 * 3600}
SETTLE_S = 10.0


def meminfo() -> dict[str, int]:
    """/proc/meminfo in KiB."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0])
    return out


def kernel_kb(info: dict[str, int]) -> int:
    return info["Slab"] + info["KernelStack"] + info["PageTables"]


def pss_kb(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    found = re.search(r"^Pss:\s+(\d+) kB", text, re.M)
    return int(found.group(1)) if found else 0


def conmons(container_ids: set[str]) -> list[int]:
    """Pids of the conmon processes of these containers (by id: a claimed warm
    container's conmon still carries the name it was created with)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if Path(f"/proc/{entry.name}/comm").read_text().strip() != "conmon":
                continue
            argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-c" in argv and argv[argv.index(b"-c") + 1].decode() in container_ids:
            pids.append(int(entry.name))
    return pids


def service_pids(settings: Settings) -> dict[str, int]:
    """The node's Podman service and worker."""
    run = settings.state_dir / "run"
    return {
        "podman": int((run / f"podman-{settings.node_id}.pid").read_text()),
        "worker": int((run / f"worker-{settings.node_id}.pid").read_text()),
    }


def children(pid: int) -> list[int]:
    """A process's children but its conmons, whichever of its threads made them (a Go
    program such as the Podman service forks from any thread)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for child in kids:
            try:
                if Path(f"/proc/{child}/comm").read_text().strip() != "conmon":
                    found.append(int(child))
            except OSError:
                continue
    return found


def tree_pss(pid: int) -> int:
    """PSS of a process and its children (the worker runs under a wrapper; the Podman
    service does its work in a child re-executed in its user namespace)."""
    return pss_kb(pid) + sum(tree_pss(child) for child in children(pid))


def tree_ticks(pid: int) -> int:
    """CPU ticks (user + system) of a process and its children, conmons left out."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        own = int(fields[11]) + int(fields[12])
        return own + sum(tree_ticks(child) for child in children(pid))
    except OSError:
        return 0


def idle_cpu(settings: Settings, seconds: float) -> dict[str, float]:
    """Percent of a core each of the node's services spends over ``seconds``."""
    pids = service_pids(settings)
    before = {name: tree_ticks(pid) for name, pid in pids.items()}
    started = time.perf_counter()
    time.sleep(seconds)
    took = time.perf_counter() - started
    hz = os.sysconf("SC_CLK_TCK")
    return {
        f"{name}_cpu_pct": (tree_ticks(pid) - before[name]) / hz / took * 100
        for name, pid in pids.items()
    }


def measure(
    settings: Settings, driver: PodmanDriver, limiter: CgroupLimiter, ids: list[str]
) -> dict[str, float]:
    started = time.perf_counter()
    listed = driver.list_sandboxes()
    list_s = time.perf_counter() - started
    live = {b.sandbox_id: b.container_id for b in listed if b.running}
    assert set(ids) <= set(live), f"{len(set(ids) - set(live))} sandboxes are not running"
    agents = [pid for sid in ids for pid in limiter.pids(sid)]
    mons = conmons({live[sid] for sid in ids})
    services = {name: tree_pss(pid) for name, pid in service_pids(settings).items()}
    info = meminfo()
    return {
        "available_kb": info["MemAvailable"],
        "kernel_kb": kernel_kb(info),
        "conmon_kb": sum(map(pss_kb, mons)),
        "agent_kb": sum(map(pss_kb, agents)),
        "conmons": len(mons),
        "agents": len(agents),
        "list_s": list_s,
        **{f"{name}_kb": kb for name, kb in services.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[200, 500])
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--min-available-mb", type=int, default=4096)
    parser.add_argument(
        "--cpu-window", type=float, default=0.0, help="seconds of idle CPU measured per step"
    )
    args = parser.parse_args()
    settings = get_settings()
    driver = PodmanDriver(set_up_node_user(settings.node_id, settings).socket_url)
    limiter = CgroupLimiter.detect(settings.node_id)
    if limiter is None:
        raise SystemExit(f"node {settings.node_id} has no usable cgroups")
    boxes: list[Sandbox] = []
    rows: list[tuple[int, dict[str, float]]] = []
    bench = tenants.local(settings, "bench")
    with Client(settings, credential=bench, job_id="density", timeout_s=600) as c:
        time.sleep(SETTLE_S)
        base = measure(settings, driver, limiter, [])
        print(
            f"baseline: MemAvailable {base['available_kb'] / 1024:.0f} MiB,"
            f" podman {base['podman_kb'] / 1024:.1f} MiB, worker {base['worker_kb'] / 1024:.1f} MiB"
        )
        try:
            for step in args.steps:
                started = time.perf_counter()
                while len(boxes) < step:
                    n = min(args.batch, step - len(boxes))
                    boxes += c.create_many(n, **SHAPE)
                    if meminfo()["MemAvailable"] < args.min_available_mb * 1024:
                        break
                created_s = time.perf_counter() - started
                time.sleep(SETTLE_S)
                now = measure(settings, driver, limiter, [b.id for b in boxes])
                if args.cpu_window:
                    now.update(idle_cpu(settings, args.cpu_window))
                rows.append((len(boxes), now))
                report(len(boxes), base, now, created_s)
                if now["available_kb"] < args.min_available_mb * 1024:
                    print(f"stopping: MemAvailable below {args.min_available_mb} MiB")
                    break
        except Exception as exc:
            print(f"stopping at {len(boxes)} sandboxes: {type(exc).__name__}: {exc}")
        finally:
            cleanup(c, boxes)
    n, last = rows[-1] if rows else (0, base)
    host = (base["available_kb"] - last["available_kb"]) / max(n, 1) / 1024
    own = (last["conmon_kb"] + last["agent_kb"]) / max(n, 1)
    print(
        f"RESULT density: {n} idle sandboxes on one node; host memory {host:.2f} MiB each"
        f" (MemAvailable); conmon+agent PSS {own:.0f} KiB each"
    )


def report(n: int, base: dict[str, float], now: dict[str, float], created_s: float) -> None:
    per = 1 / n / 1024  # KiB in total -> MiB per sandbox

    def d(key: str) -> float:
        return now[key] - base[key]

    print(
        f"{n:>5} sandboxes (made at {n / created_s if created_s else 0:.1f}/s over this step):"
        f" host {-d('available_kb') * per:.2f} MiB each (kernel {d('kernel_kb') * per:.2f}),"
        f" PSS conmon {now['conmon_kb'] / n:.0f} KiB + agent {now['agent_kb'] / n:.0f} KiB,"
        f" podman +{d('podman_kb') / n:.0f} KiB, worker +{d('worker_kb') / n:.0f} KiB each;"
        f" {int(now['conmons'])} conmons, {int(now['agents'])} agents;"
        f" listing took {now['list_s']:.2f} s"
    )
    if "podman_cpu_pct" in now:
        print(
            f"       idle CPU: Podman service {now['podman_cpu_pct']:.1f} %,"
            f" worker {now['worker_cpu_pct']:.1f} % of a core"
        )


def cleanup(client: Client, boxes: list[Sandbox]) -> None:
    started = time.perf_counter()
    requests = [DestroySandbox(**client.request_fields(b.id)) for b in boxes]
    futures = [client.send(r) for r in requests]
    failed = 0
    for request, future in zip(requests, futures, strict=True):
        try:
            client.wait(request, future, 900)
        except Exception:
            failed += 1
    took = time.perf_counter() - started
    print(f"destroyed {len(boxes) - failed} sandboxes in {took:.0f} s ({failed} failed)")


if __name__ == "__main__":
    main()
