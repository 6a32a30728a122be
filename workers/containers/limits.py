"""Per-sandbox resource limits that hold on cgroup v1 and cgroup v2 hosts.

Rootless Podman cannot apply memory, pids or CPU limits on cgroup v1 hosts (our CI
machines), nor on cgroup v2 hosts with the ``cgroupfs`` manager our node users run
(podman#21575: the limits show in ``inspect`` and have no effect). So the node applies
them itself, the same way on both, as root:

1. Before the container is created, make one cgroup per sandbox and controller under
   a dsec hierarchy and write the limits into it::

       v1: /sys/fs/cgroup/<controller>/dsec/<node>/<sandbox>   memory, pids, cpu, cpuacct
       v2: /sys/fs/cgroup/dsec/<node>/<sandbox>                memory, pids, cpu

2. ``POST /containers/{name}/init`` (runc create): the sandbox's PID 1 exists, stopped
   before exec. Write that PID into each ``cgroup.procs``; all its threads move.
3. ``start``: PID 1 (the agent) execs inside the cgroups, and every command it forks
   inherits them. ``podman exec`` processes would not, which is one more reason exec
   goes through the agent.
4. On removal the cgroups are removed (after Podman has killed the sandbox); the
   reconciler removes leftovers (:meth:`CgroupLimiter.sandbox_ids`).

What is written (:meth:`CgroupLayout.writes`):

- memory: ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` (same value,
  so no swap either, when the kernel accounts swap) on v1; ``memory.max`` and
  ``memory.swap.max = 0`` on v2. tmpfs pages (/workspace, /tmp, /dev/shm) are charged
  to the writer's cgroup, so scratch space counts against the memory limit.
  ``memory.oom.group`` stays off: the OOM killer kills the hog, not the agent, so the
  trainer gets the command's exit (-9) before the node ends the sandbox (reason oom).
- pids: ``pids.max``. Without it a fork bomb in one sandbox reaches the node user's
  NPROC limit, which every sandbox of the node shares (and pid_max is 32768 here).
- cpu: CFS quota over a 100 ms period (``cpu.cfs_quota_us``/``cpu.max``) for the hard
  cap (a longer one, up to 1 s, for shares under 0.1 core: :data:`CPU_RUN_MIN_US`),
  and shares/weight proportional to the cores asked for, for fairness under
  contention. cpuacct (v1) only accounts.

OOM detection: the kernel counts kills per cgroup (``oom_kill`` in v1's
``memory.oom_control`` since Linux 4.13, in v2's ``memory.events``). The node reads it
after a command died of SIGKILL and in every reconciler round (:meth:`oom_kills`).

What the sandbox sees: Podman would bind the host's whole cgroup hierarchies into the
sandbox (read-only, but naming every other sandbox on the node). The driver instead
mounts :meth:`CgroupLayout.views`: an empty read-only tmpfs at /sys/fs/cgroup with the
sandbox's own cgroup directories bound read-only below it (v1), or the sandbox's own
cgroup directory at /sys/fs/cgroup (v2). Tools that size themselves from their cgroup
limits (JVMs, ``nproc``-like helpers) find them where they expect.

Pure path and value computation (:class:`Hierarchy`, :class:`CgroupLayout`,
:func:`parse_mountinfo`) is separated from the file writes (:class:`CgroupLimiter`),
so it is unit-tested without root. The v2 branch is written to the kernel's
documentation and unit-tested; the CI machines here are v1 hybrid, where the
integration tests run.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from workers.host.mounts import unescape

log = logging.getLogger(__name__)

#: cgroup v1 controllers a sandbox gets a cgroup in.
CONTROLLERS_V1 = ("memory", "pids", "cpu", "cpuacct")
#: cgroup v2 controllers enabled for sandboxes.
CONTROLLERS_V2 = ("memory", "pids", "cpu")
#: Name of the hierarchy every dsec cgroup lives under.
ROOT_NAME = "dsec"
#: CFS period of a sandbox whose share is not tiny: quota = cores x period.
CPU_PERIOD_US = 100_000
#: The longest period the kernel takes.
CPU_PERIOD_MAX_US = 1_000_000
#: Least CPU time per period a sandbox gets where the period can stretch to give it.
#: Starting one process costs ~2 ms of CPU in a sandbox here (fork, exec, exit;
#: measured in cpuacct): over a 100 ms period, a 0.005-core sandbox (its quota then at
#: the kernel's floor of 1 ms, twice its share) was held two periods for every command,
#: 200 ms for `true`. Over a longer period the same share comes in larger pieces.
CPU_RUN_MIN_US = 10_000
#: Where the sandbox sees its own cgroups.
CONTAINER_CGROUP_DIR = "/sys/fs/cgroup"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_name(name: str) -> str:
    """``name`` if it is safe as one path component (node and sandbox ids)."""
    if not _NAME.match(name):
        raise ValueError(f"{name!r} is not a safe cgroup name")
    return name


@dataclass(frozen=True)
class Limits:
    """What one sandbox may use."""

    #: Memory (and memory + swap) limit in bytes.
    memory_bytes: int
    #: Most tasks (processes and threads) at once.
    pids: int
    #: CPU cores (fractional): a hard cap per CFS period.
    cpus: float

    @classmethod
    def of(cls, memory_mb: int, pids: int, cpus: float) -> Limits:
        """Limits from the units a create request uses."""
        return cls(memory_bytes=memory_mb << 20, pids=pids, cpus=cpus)

    @property
    def cpu_period_us(self) -> int:
        """CFS period: :data:`CPU_PERIOD_US`, or longer (up to the kernel's 1 s) for a
        share so small that its quota would be under :data:`CPU_RUN_MIN_US`."""
        if self.cpus <= 0:
            return CPU_PERIOD_US
        stretched = round(CPU_RUN_MIN_US / self.cpus)
        return min(CPU_PERIOD_MAX_US, max(CPU_PERIOD_US, stretched))

    @property
    def cpu_quota_us(self) -> int:
        """CFS quota per :attr:`cpu_period_us` (at least 1 ms, the kernel's floor)."""
        return max(1000, int(self.cpus * self.cpu_period_us))

    @property
    def cpu_shares(self) -> int:
        """v1 ``cpu.shares``: 1024 per core."""
        return max(2, int(self.cpus * 1024))

    @property
    def cpu_weight(self) -> int:
        """v2 ``cpu.weight``: 100 per core, within the kernel's 1..10000."""
        return min(10_000, max(1, int(self.cpus * 100)))


@dataclass(frozen=True)
class Hierarchy:
    """The cgroup file system(s) of a host."""

    version: Literal[1, 2]
    #: v1: controller -> mount point of its hierarchy (co-mounted ones share one);
    #: v2: {"": the unified mount point}.
    mounts: dict[str, Path]


def parse_mountinfo(text: str) -> Hierarchy | None:
    """The host's cgroup layout from ``/proc/self/mountinfo``, or None if unusable.

    v1 (including hybrid hosts, whose cgroup2 mount has no controllers) when memory,
    pids and cpu each have a v1 hierarchy; v2 when a cgroup2 file system is mounted
    and no v1 hierarchy holds the memory controller.
    """
    v1: dict[str, Path] = {}
    unified: Path | None = None
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
            fstype, options = fields[sep + 1], fields[sep + 3]
        except (ValueError, IndexError):
            continue
        if fields[3] != "/":
            continue  # a bind of part of a hierarchy (a container's view), not the host's
        point = Path(unescape(fields[4]))
        if fstype == "cgroup":
            for opt in options.split(","):
                if opt in CONTROLLERS_V1:
                    v1.setdefault(opt, point)
        elif fstype == "cgroup2" and (unified is None or point == Path("/sys/fs/cgroup")):
            unified = point
    if "memory" in v1:
        if all(c in v1 for c in ("pids", "cpu")):
            return Hierarchy(1, v1)
        return None
    if unified is not None:
        return Hierarchy(2, {"": unified})
    return None


def parse_flat_keyed(text: str) -> dict[str, int]:
    """``key value`` lines (memory.oom_control, memory.events, cpu.stat) as a dict."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value)
    return out


#: A mount the sandbox gets: (host directory, or None for an empty read-only tmpfs;
#: path inside the sandbox).
View = tuple[Path | None, str]
#: A value to write: (file, value, required). Optional files are skipped where the
#: kernel does not have them (memsw without swap accounting, memory.swap.max).
Write = tuple[Path, str, bool]


@dataclass(frozen=True)
class CgroupLayout:
    """Where one node's sandbox cgroups live and what goes into them (no I/O)."""

    hierarchy: Hierarchy
    #: The node id: each node's sandboxes live under ``dsec/<node>``.
    scope: str
    root_name: str = ROOT_NAME

    def __post_init__(self) -> None:
        check_name(self.scope)
        check_name(self.root_name)

    @property
    def version(self) -> int:
        """1 or 2."""
        return self.hierarchy.version

    @property
    def renamable(self) -> bool:
        """A live sandbox's cgroups can take a new name (v1 only: cgroup2 has no rename)."""
        return self.version == 1

    def _controllers(self) -> tuple[str, ...]:
        if self.version == 2:
            return ("",)
        return tuple(c for c in CONTROLLERS_V1 if c in self.hierarchy.mounts)

    def node_dirs(self) -> dict[str, Path]:
        """Controller (v2: "") -> this node's directory holding its sandboxes."""
        m = self.hierarchy.mounts
        return {c: m[c] / self.root_name / self.scope for c in self._controllers()}

    def dirs(self, sandbox_id: str) -> dict[str, Path]:
        """Controller (v2: "") -> the sandbox's cgroup directory."""
        check_name(sandbox_id)
        return {c: d / sandbox_id for c, d in self.node_dirs().items()}

    def unique_dirs(self, sandbox_id: str) -> list[Path]:
        """The sandbox's directories, once each (co-mounted controllers share one)."""
        return list(dict.fromkeys(self.dirs(sandbox_id).values()))

    def enable_writes(self) -> list[Write]:
        """v2: enable the controllers from the root down to the node's directory."""
        if self.version == 1:
            return []
        root = self.hierarchy.mounts[""]
        value = " ".join(f"+{c}" for c in CONTROLLERS_V2)
        levels = [root, root / self.root_name, root / self.root_name / self.scope]
        return [(d / "cgroup.subtree_control", value, True) for d in levels]

    def writes(self, sandbox_id: str, limits: Limits) -> list[Write]:
        """The limit files to write, in order (memory before memory+swap)."""
        d = self.dirs(sandbox_id)
        if self.version == 2:
            u = d[""]
            return [
                (u / "memory.max", str(limits.memory_bytes), True),
                (u / "memory.swap.max", "0", False),
                (u / "pids.max", str(limits.pids), True),
                (u / "cpu.max", f"{limits.cpu_quota_us} {limits.cpu_period_us}", True),
                (u / "cpu.weight", str(limits.cpu_weight), False),
            ]
        out: list[Write] = [
            (d["memory"] / "memory.limit_in_bytes", str(limits.memory_bytes), True),
            (d["memory"] / "memory.memsw.limit_in_bytes", str(limits.memory_bytes), False),
            (d["pids"] / "pids.max", str(limits.pids), True),
            (d["cpu"] / "cpu.cfs_period_us", str(limits.cpu_period_us), True),
            (d["cpu"] / "cpu.cfs_quota_us", str(limits.cpu_quota_us), True),
            (d["cpu"] / "cpu.shares", str(limits.cpu_shares), False),
        ]
        return out

    def views(self, sandbox_id: str) -> list[View]:
        """What the sandbox mounts at /sys/fs/cgroup: its own cgroups only, read-only."""
        d = self.dirs(sandbox_id)
        if self.version == 2:
            return [(d[""], CONTAINER_CGROUP_DIR)]
        views: list[View] = [(None, CONTAINER_CGROUP_DIR)]
        views += [(path, f"{CONTAINER_CGROUP_DIR}/{c}") for c, path in d.items()]
        return views

    def oom_source(self, sandbox_id: str) -> tuple[Path, str]:
        """File and key counting the sandbox's OOM kills."""
        d = self.dirs(sandbox_id)
        if self.version == 2:
            return d[""] / "memory.events", "oom_kill"
        return d["memory"] / "memory.oom_control", "oom_kill"

    def cpu_source(self, sandbox_id: str) -> tuple[Path, str | None, float]:
        """File, key (None: the whole file is the number) and seconds per unit of CPU use."""
        d = self.dirs(sandbox_id)
        if self.version == 2:
            return d[""] / "cpu.stat", "usage_usec", 1e-6
        return d.get("cpuacct", d["cpu"]) / "cpuacct.usage", None, 1e-9

    def procs_file(self, sandbox_id: str) -> Path:
        """``cgroup.procs`` of the pids cgroup (every task of the sandbox is in it)."""
        d = self.dirs(sandbox_id)
        return (d[""] if self.version == 2 else d["pids"]) / "cgroup.procs"


class CgroupLimiter:
    """Applies a :class:`CgroupLayout` on this host. Needs root; raises OSError."""

    def __init__(self, layout: CgroupLayout) -> None:
        self.layout = layout

    @classmethod
    def detect(
        cls, scope: str, mountinfo: Path = Path("/proc/self/mountinfo")
    ) -> CgroupLimiter | None:
        """A limiter for node ``scope``, or None (logged) where cgroups are unusable."""
        hierarchy = parse_mountinfo(mountinfo.read_text())
        if hierarchy is None:
            log.warning("no usable cgroup hierarchy: sandboxes get Podman's limits only")
            return None
        limiter = cls(CgroupLayout(hierarchy, scope))
        try:
            limiter.prepare()
        except OSError as exc:
            log.warning("cannot manage cgroups (%s): sandboxes get Podman's limits only", exc)
            return None
        return limiter

    def prepare(self) -> None:
        """Make the node's directories (and on v2 enable the controllers). Idempotent."""
        enables = self.layout.enable_writes()
        if enables:
            root = self.layout.hierarchy.mounts[""]
            (root / self.layout.root_name / self.layout.scope).mkdir(parents=True, exist_ok=True)
            _write_all(enables)
        for d in self.layout.node_dirs().values():
            d.mkdir(parents=True, exist_ok=True)

    def create(self, sandbox_id: str, limits: Limits) -> None:
        """Make the sandbox's cgroups and write its limits. Idempotent."""
        self.prepare()
        for d in self.layout.unique_dirs(sandbox_id):
            d.mkdir(exist_ok=True)
        _write_all(self.layout.writes(sandbox_id, limits))

    def update(self, sandbox_id: str, limits: Limits) -> None:
        """Rewrite the limits of a live sandbox (a warm one being claimed).

        v1 refuses a memory limit above memory+swap, so when memory grows memsw is
        written first. Lowering it below what the sandbox holds makes the kernel reclaim
        and fail (EBUSY) if it cannot; a warm sandbox holds only its idle agent.
        """
        writes = self.layout.writes(sandbox_id, limits)
        if self.layout.version == 1:
            current = self.layout.dirs(sandbox_id)["memory"] / "memory.limit_in_bytes"
            if limits.memory_bytes > int(current.read_text()):
                writes[0], writes[1] = writes[1], writes[0]
        _write_all(writes)

    def rename(self, old: str, new: str) -> None:
        """Give a sandbox's cgroups a new name, processes and limits untouched.

        v1 only (:attr:`CgroupLayout.renamable`); the sandbox's read-only view of them
        follows, being bind mounts of the directories. Idempotent: a controller already
        renamed is skipped.
        """
        if not self.layout.renamable:
            raise OSError(errno.EOPNOTSUPP, "cgroup v2 cannot rename a cgroup")
        targets = self.layout.unique_dirs(new)
        for source, target in zip(self.layout.unique_dirs(old), targets, strict=True):
            if source.exists() or not target.exists():
                source.rename(target)

    def attach(self, sandbox_id: str, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the sandbox's cgroups."""
        if pid <= 0:
            raise OSError(errno.ESRCH, f"no process to attach to {sandbox_id}")
        for d in self.layout.unique_dirs(sandbox_id):
            (d / "cgroup.procs").write_text(str(pid))

    def remove(self, sandbox_id: str, wait_s: float = 1.0) -> bool:
        """Remove the sandbox's cgroups; False if one still has tasks after ``wait_s``.

        Only empty cgroups can go (rmdir fails with EBUSY otherwise), so removing the
        cgroups of a live sandbox is refused by the kernel, not by luck.
        """
        deadline = time.monotonic() + wait_s
        pending = self.layout.unique_dirs(sandbox_id)
        while True:
            left = []
            for d in pending:
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise
                    left.append(d)
            if not left:
                return True
            if time.monotonic() >= deadline:
                log.info("cgroups of %s still busy: %s", sandbox_id, left)
                return False
            pending = left
            time.sleep(0.02)

    def sandbox_ids(self) -> list[str]:
        """Sandboxes that have a cgroup on this node (for the reconciler's sweep)."""
        ids: set[str] = set()
        for d in self.layout.node_dirs().values():
            with contextlib.suppress(FileNotFoundError):
                ids.update(p.name for p in d.iterdir() if p.is_dir() and _NAME.match(p.name))
        return sorted(ids)

    def oom_kills(self, sandbox_id: str) -> int:
        """Processes of the sandbox the kernel's OOM killer has killed (0 if unknown)."""
        path, key = self.layout.oom_source(sandbox_id)
        return _read_key(path, key) or 0

    def cpu_usage_s(self, sandbox_id: str) -> float | None:
        """CPU time the sandbox has used, in seconds; None if it has no cgroup."""
        path, key, scale = self.layout.cpu_source(sandbox_id)
        if key is None:
            try:
                return int(path.read_text().strip()) * scale
            except (FileNotFoundError, ValueError):
                return None
        value = _read_key(path, key)
        return None if value is None else value * scale

    def memory_peak_mb(self, sandbox_id: str) -> float | None:
        """The sandbox's peak memory use in MiB; None where the kernel keeps none."""
        controller, name = (
            ("", "memory.peak")
            if self.layout.version == 2
            else ("memory", "memory.max_usage_in_bytes")
        )
        raw = self.read(sandbox_id, controller, name)
        try:
            return None if raw is None else int(raw.strip()) / (1 << 20)
        except ValueError:
            return None

    def pids(self, sandbox_id: str) -> list[int]:
        """Host pids of the sandbox's processes."""
        try:
            text = self.layout.procs_file(sandbox_id).read_text()
        except FileNotFoundError:
            return []
        return [int(p) for p in text.split()]

    def read(self, sandbox_id: str, controller: str, name: str) -> str | None:
        """One file of the sandbox's cgroup (v2: controller ""), or None."""
        d = self.layout.dirs(sandbox_id).get(controller)
        if d is None:
            return None
        try:
            return (d / name).read_text()
        except FileNotFoundError:
            return None


def _write_all(writes: list[Write]) -> None:
    for path, value, required in writes:
        if not required and not path.exists():
            continue
        path.write_text(value)


def _read_key(path: Path, key: str) -> int | None:
    try:
        return parse_flat_keyed(path.read_text()).get(key)
    except FileNotFoundError:
        return None
