"""CPU time of processes, read from /proc (shared by the benchmarks that print the
CPU each process spends per unit of work)."""

from __future__ import annotations

import os
from pathlib import Path

from workers.containers.limits import CgroupLayout, parse_flat_keyed, parse_mountinfo

#: Clock ticks per second (/proc/PID/stat counts in these).
HZ = os.sysconf("SC_CLK_TCK")
#: The flag of a kernel thread (in /proc/PID/stat's flags).
PF_KTHREAD = 0x00200000
# Indexes into /proc/PID/stat's fields after the command name (man 5 proc's numbers
# less 3).
_PPID, _FLAGS, _UTIME, _STIME = 1, 6, 11, 12


def _pids() -> list[int]:
    """Every process's pid."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and
    parentheses); None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks (0 if it is gone)."""
    fields = _stat(pid)
    return 0 if fields is None else int(fields[_UTIME]) + int(fields[_STIME])


def named(prefix: str) -> list[int]:
    """Pids of the processes whose command name starts with ``prefix``."""
    pids = []
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().startswith(prefix):
                    pids.append(pid)
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
    for pid in _pids():
        fields = _stat(pid)
        if fields is not None:
            children.setdefault(int(fields[_PPID]), []).append(pid)
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


def kernel_threads() -> list[int]:
    """Pids of the kernel's own threads (workqueues, softirq threads, memory scanners):
    the kernel marks them PF_KTHREAD. (An empty command line is no sign: a process
    that exited and waits to be reaped has none either.)"""
    return [
        pid
        for pid in _pids()
        if (fields := _stat(pid)) is not None and int(fields[_FLAGS]) & PF_KTHREAD
    ]


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
