"""CPU time of processes, read from /proc (shared by the benchmarks that print the
CPU each process spends per unit of work)."""

from __future__ import annotations

import os
from pathlib import Path

from workers.containers.limits import CgroupLayout, parse_flat_keyed, parse_mountinfo

#: Clock ticks per second (/proc/PID/stat counts in these).
HZ = os.sysconf("SC_CLK_TCK")
#: The flag (/proc/PID/stat's ninth field) of a kernel thread.
PF_KTHREAD = 0x00200000


def ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def named(prefix: str) -> list[int]:
    """Pids of the processes whose command name starts with ``prefix``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().startswith(prefix):
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def _pidfile(state_dir: Path, name: str) -> list[int]:
    try:
        return [int((state_dir / "run" / f"{name}.pid").read_text())]
    except (OSError, ValueError):
        return []


def descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process below them (a JVM's or a service's children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def broker_pids(state_dir: Path) -> list[int]:
    """The embedded broker's JVM and its children."""
    return descendants(_pidfile(state_dir, "broker"))


def stack_processes(state_dir: Path, node_id: str) -> dict[str, list[int]]:
    """The embedded stack's processes by role, found from its pid files (the broker
    with its children) and by name (Postgres, Podman, conmon)."""
    return {
        "scheduler": _pidfile(state_dir, "scheduler"),
        "projector": _pidfile(state_dir, "projector"),
        "node worker": _pidfile(state_dir, f"worker-{node_id}"),
        "flower": _pidfile(state_dir, "flower"),
        "supervisor": _pidfile(state_dir, "supervisor"),
        "hub": _pidfile(state_dir, "hub") + _pidfile(state_dir, "hub-auth"),
        "redis": named("redis-server"),
        "postgres": named("postgres"),
        "podman service": named("podman"),
        "conmon": named("conmon"),
        "broker": broker_pids(state_dir),
    }


def cpu_seconds(groups: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds spent so far by each group of processes."""
    return {name: sum(map(ticks, pids)) / HZ for name, pids in groups.items()}


def machine_seconds() -> dict[str, float]:
    """CPU seconds every core of the machine has spent since boot, by kind: ``user``
    (with nice), ``system``, ``interrupts`` (hard and soft, outside any process) and
    ``steal`` (wanted, but the hypervisor ran something else)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return {
        "user": (user + nice) / HZ,
        "system": system / HZ,
        "interrupts": (irq + softirq) / HZ,
        "steal": steal / HZ,
    }


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine has spent busy since boot: what no
    process list misses, the kernel's own work included."""
    return sum(machine_seconds().values())


def kernel_threads() -> list[int]:
    """Pids of the kernel's own threads (workqueues, softirq threads, memory scanners):
    the kernel marks them PF_KTHREAD. (An empty command line is no sign: a process
    that exited and waits to be reaped has none either.)"""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    flags = int(f.read().rsplit(")", 1)[1].split()[6])
            except (OSError, ValueError, IndexError):
                continue
            if flags & PF_KTHREAD:
                pids.append(int(entry))
    return pids


def sandboxes_cpu_seconds(node_id: str) -> float:
    """CPU seconds a node's sandboxes have spent (every process in them, the agents and
    their commands), from the cgroup above theirs: removed sandboxes' time stays
    counted there. 0 where the node has no such cgroup."""
    hierarchy = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    if hierarchy is None:
        return 0.0
    node_dirs = CgroupLayout(hierarchy, node_id).node_dirs()
    try:
        if hierarchy.version == 1:
            return int((node_dirs["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
        stat = parse_flat_keyed((node_dirs[""] / "cpu.stat").read_text())
        return stat["usage_usec"] / 1e6
    except (OSError, KeyError, ValueError):
        return 0.0
