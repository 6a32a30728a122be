"""CPU time of processes, read from /proc (shared by the benchmarks that print the
CPU each process spends per unit of work)."""

from __future__ import annotations

import os

#: Clock ticks per second (/proc/PID/stat counts in these).
HZ = os.sysconf("SC_CLK_TCK")


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
