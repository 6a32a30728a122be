"""A node's system user and the files it owns: who it is, its subordinate ids, its
home and runtime directory, and the Podman configuration written there.

Per node ``<id>`` (``state_dir`` = ``/var/lib/dsec`` by default)::

    user dsec-<id>                     system user, nologin, one 65536-id subuid/subgid range
    state_dir/nodes/<id>/              its home (0700)
        .config/containers/*.conf      containers.conf and storage.conf, rewritten here
        storage/                       the node's own store (container layers only)
        store/                         idmapped read-only view of the shared layer store
        run/                           XDG_RUNTIME_DIR: podman runroot, pause pid, socket
        run/podman/podman.sock         the REST socket the node agent talks to

Creating and changing anything here runs as root and is idempotent; looking a user up
(:func:`find_node_user`) changes nothing. Why containers.conf says what it says is
written next to :func:`containers_conf`.
"""

from __future__ import annotations

import logging
import os
import pwd
import resource
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from app.config import Settings, get_settings
from workers.errors import NodeError
from workers.host.file_lock import file_lock
from workers.host.ops import live_processes_of, mkdir, run

log = logging.getLogger(__name__)

#: Prefix of every node user's name: node ``node0`` runs as ``dsec-node0``.
USER_PREFIX = "dsec-"
#: Subordinate ids per node user: one full 16-bit range, what images expect.
SUBID_COUNT = 65536
#: Lowest subordinate id handed out (Debian's SUB_UID_MIN).
SUBID_MIN = 100_000
#: Podman's lock slots per node user; every container holds one for its lifetime, and
#: the default (2048) is below the sandboxes a node is meant to hold.
NUM_LOCKS = 16384


@dataclass(frozen=True)
class NodeUser:
    """The system user a node's rootless Podman runs as, and where its things live."""

    node_id: str
    name: str
    uid: int
    gid: int
    home: Path
    #: ``(start, count)`` ranges from /etc/subuid and /etc/subgid, in file order.
    subuids: tuple[tuple[int, int], ...]
    subgids: tuple[tuple[int, int], ...]

    @property
    def runtime_dir(self) -> Path:
        """XDG_RUNTIME_DIR of the node's Podman (runroot, pause process, socket)."""
        return self.home / "run"

    @property
    def socket_path(self) -> Path:
        """The REST socket of the node's ``podman system service``."""
        return self.runtime_dir / "podman" / "podman.sock"

    @property
    def socket_url(self) -> str:
        """``unix://`` URL of :attr:`socket_path`, what podman-py takes as ``base_url``."""
        return f"unix://{self.socket_path}"

    @property
    def config_dir(self) -> Path:
        """Where containers.conf and storage.conf are."""
        return self.home / ".config" / "containers"

    @property
    def graphroot(self) -> Path:
        """The node's own (writable) store: container layers, nothing shared."""
        return self.home / "storage"

    @property
    def store_view(self) -> Path:
        """Mount point of the idmapped, read-only view of the shared layer store."""
        return self.home / "store"


def user_name(node_id: str) -> str:
    """System user name of a node; refuses ids that make no good user name."""
    ok = node_id and len(node_id) <= 26 and node_id[0].isalnum()
    if not ok or not all(c.isalnum() or c in "-_" for c in node_id) or not node_id.isascii():
        raise NodeError(f"node id {node_id!r} must be 1-26 ASCII letters, digits, '-' or '_'")
    return f"{USER_PREFIX}{node_id.lower()}"


def set_up_node_user(node_id: str, settings: Settings | None = None) -> NodeUser:
    """The user of a node ``dsec up`` has set up; a clear error if there is none."""
    user = find_node_user(node_id, settings)
    if user is None:
        raise NodeError(f"node {node_id} is not set up: run `dsec up` first")
    return user


def find_node_user(node_id: str, settings: Settings | None = None) -> NodeUser | None:
    """The node's user if it exists, without creating or changing anything."""
    settings = settings or get_settings()
    try:
        pw = pwd.getpwnam(user_name(node_id))
    except KeyError:
        return None
    return NodeUser(
        node_id=node_id,
        name=pw.pw_name,
        uid=pw.pw_uid,
        gid=pw.pw_gid,
        home=_home(settings, node_id),
        subuids=tuple(_subid_ranges(Path("/etc/subuid"), pw.pw_name)),
        subgids=tuple(_subid_ranges(Path("/etc/subgid"), pw.pw_name)),
    )


def create_node_user(node_id: str, settings: Settings) -> NodeUser:
    """Create or repair node ``node_id``'s user, its subordinate ids and the
    directories of its home (the state dir's own ones too)."""
    mkdir(settings.state_dir, 0o755)
    for sub in ("nodes", "run", "logs"):
        mkdir(settings.state_dir / sub, 0o755)
    # Two nodes set up at once would hand out the same next subordinate id range.
    with file_lock(settings.state_dir / "run" / "node-setup.lock"):
        name = user_name(node_id)
        _ensure_system_user(name, _home(settings, node_id), node_id)
        _ensure_subids(name)
    user = find_node_user(node_id, settings)
    if user is None or not user.subuids or not user.subgids:
        raise NodeError(f"user {name} or its subordinate ids did not come into being")
    mkdir(user.home, 0o700, user.uid, user.gid)
    _reset_stale_runtime_dir(user)
    for d in (user.runtime_dir, user.home / ".config", user.config_dir):
        mkdir(d, 0o700, user.uid, user.gid)
    return user


def write_config(user: NodeUser) -> bool:
    """Write the user's containers.conf and storage.conf; True if either changed (a
    service running meanwhile still reads the old ones)."""
    changed = _write_if_changed(user.config_dir / "containers.conf", containers_conf(), user)
    changed |= _write_if_changed(user.config_dir / "storage.conf", storage_conf(user), user)
    return changed


def node_users(settings: Settings | None = None) -> list[NodeUser]:
    """Node users that have a home under ``state_dir/nodes``."""
    settings = settings or get_settings()
    nodes = settings.state_dir / "nodes"
    found = (find_node_user(d.name, settings) for d in sorted(nodes.glob("*")) if d.is_dir())
    return [u for u in found if u is not None]


def containers_conf() -> str:
    """The node user's containers.conf.

    - ``runtime = "runc"``: crun refuses cgroup v1 hybrid hosts.
    - ``default_ulimits``: Podman's defaults exceed the hard limits here and every
      CLI-made container would fail on setrlimit. Podman 4.3's REST API ignores this
      setting, so the driver sets NOFILE itself. NPROC is *not* per sandbox: the
      kernel counts it per user in the user namespace, and every sandbox of a node
      runs as the same mapped root, so it is a node-wide cap on sandbox processes
      (measured: two containers share it). It is therefore set high.
    - ``keyring = false``: each container would take a session key and hit the per-user
      key quota at ~200 containers.
    - ``netns = "none"``: no network unless a sandbox asks (the driver says so too).
    - ``log_driver``/``log_size_max``: sandboxes talk through the agent socket; what
      PID 1 prints stays in a small capped file, never journald or an unbounded one.
    - ``events_logger = "none"``: at thousands of creations a minute the events file
      would grow without bound, and nothing here reads it (the reconciler lists).
    - ``cgroup_manager = "cgroupfs"``: no systemd user session for a system user.
    - ``num_locks``: one lock per container, more than the default 2048.
    """
    nproc = _cap(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
    nofile = _cap(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1024)
    return (
        "# Written by dsec node setup (workers/host/user.py); rewritten on every setup.\n"
        "[containers]\n"
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
        "keyring = false\n"
        'netns = "none"\n'
        'log_driver = "k8s-file"\n'
        "log_size_max = 1048576\n"
        "init = false\n"
        "\n"
        "[engine]\n"
        'runtime = "runc"\n'
        'cgroup_manager = "cgroupfs"\n'
        'events_logger = "none"\n'
        f"num_locks = {NUM_LOCKS}\n"
    )


def storage_conf(user: NodeUser) -> str:
    """The node user's storage.conf: own overlay store, shared one read-only."""
    return (
        "# Written by dsec node setup (workers/host/user.py); rewritten on every setup.\n"
        "[storage]\n"
        'driver = "overlay"\n'
        f'graphroot = "{user.graphroot}"\n'
        f'runroot = "{user.runtime_dir / "containers"}"\n'
        "\n"
        "[storage.options]\n"
        f'additionalimagestores = ["{user.store_view}"]\n'
        "\n"
        "[storage.options.overlay]\n"
        'mountopt = "nodev"\n'
    )


def _ensure_system_user(name: str, home: Path, node_id: str) -> None:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        run(
            [
                "useradd",
                "--system",
                "--user-group",
                "--no-create-home",
                "--home-dir",
                str(home),
                "--shell",
                "/usr/sbin/nologin",
                "--comment",
                f"dsec node {node_id}",
                name,
            ]
        )
        return
    if Path(pw.pw_dir) != home:
        run(["usermod", "--home", str(home), name])


def _ensure_subids(name: str) -> None:
    """Give ``name`` one subuid and one subgid range of SUBID_COUNT, at the same start.

    Ranges come after every range already handed out in either file, so node users
    never share host ids (their sandboxes would then share files and signals).
    """
    files = (Path("/etc/subuid"), Path("/etc/subgid"))
    have = [bool(_subid_ranges(f, name)) for f in files]
    if all(have):
        return
    end = SUBID_MIN
    for f in files:
        for _, start, count in _subid_entries(f):
            end = max(end, start + count)
    start = -(-end // SUBID_COUNT) * SUBID_COUNT  # next multiple of the range size
    span = f"{start}-{start + SUBID_COUNT - 1}"
    args = ["usermod"]
    if not have[0]:
        args += ["--add-subuids", span]
    if not have[1]:
        args += ["--add-subgids", span]
    run([*args, name])


def _subid_entries(path: Path) -> Iterator[tuple[str, int, int]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return
    for line in lines:
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            yield parts[0], int(parts[1]), int(parts[2])


def _subid_ranges(path: Path, name: str) -> list[tuple[int, int]]:
    return [(start, count) for who, start, count in _subid_entries(path) if who == name]


def _reset_stale_runtime_dir(user: NodeUser) -> None:
    """Empty the runtime dir once nothing it describes can still be alive.

    A tmpfs XDG_RUNTIME_DIR would be emptied by a reboot; here it lives on disk, and
    the state dir may also be carried into a fresh process world on the same kernel
    (a restored machine image, a killed process tree). Podman then trusts a dead
    pause pid and containers it still calls running, joins none of them, and refuses
    to start ("invalid internal status ... podman system migrate"). Without its
    ``alive`` file it instead refreshes every container's state, as after a boot.
    """
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    marker = user.home / ".boot_id"
    try:
        seen = marker.read_text().strip()
    except FileNotFoundError:
        seen = ""
    if user.runtime_dir.exists():
        if seen and seen != boot_id:
            log.info("node %s: new boot, clearing %s", user.node_id, user.runtime_dir)
            shutil.rmtree(user.runtime_dir)
        elif not live_processes_of(user.uid):
            # Every pause process, service and conmon runs as the node user: with none
            # left, nothing in the runtime dir is true any more.
            log.info("node %s: no process left, clearing %s", user.node_id, user.runtime_dir)
            shutil.rmtree(user.runtime_dir)
    if seen != boot_id:
        marker.write_text(boot_id + "\n")


def _home(settings: Settings, node_id: str) -> Path:
    return settings.state_dir / "nodes" / node_id


def _write_if_changed(path: Path, text: str, user: NodeUser) -> bool:
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.chown(tmp, user.uid, user.gid)
    tmp.chmod(0o644)
    tmp.replace(path)
    return True


def _cap(limit: int, want: int) -> int:
    return want if limit == resource.RLIM_INFINITY else min(limit, want)
