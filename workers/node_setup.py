"""A node's rootless Podman: its system user, configuration, store view and REST service.

Everything here runs as root and is idempotent: run it on a clean machine, or again
on a configured one, and the end state is the same.

Per node ``<id>`` (``state_dir`` = ``/var/lib/dsec`` by default)::

    user dsec-<id>                     system user, nologin, one 65536-id subuid/subgid range
    state_dir/nodes/<id>/              its home (0700)
        .config/containers/*.conf      containers.conf and storage.conf, rewritten here
        storage/                       the node's own store (container layers only)
        store/                         idmapped read-only view of the shared layer store
        run/                           XDG_RUNTIME_DIR: podman runroot, pause pid, socket
        run/podman/podman.sock         the REST socket the node agent talks to
    state_dir/run/podman-<id>.pid      the service's pid (root-owned)
    state_dir/logs/podman-<id>.log     the service's log

Why an idmapped view of the layer store, and not the store itself: see
:mod:`workers.image_store`. In short, the store on disk is owned by real root (uid 0
inside the images), and the view shows it to each node user through that user's own
rootless id mapping, so files are owned by uid 0 *inside* every sandbox, on every node,
with one copy on disk.

Why containers.conf says what it says is written next to :func:`containers_conf`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import pwd
import resource
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from app.config import Settings, get_settings
from workers.errors import NodeError, PodmanUnavailable
from workers.file_lock import file_lock
from workers.layer_store import ensure_store, store_lock_path

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
#: Per-user kernel key quota we make sure of (Debian's default of 200 stops a node user
#: at ~200 containers when the keyring is on; ours is off, this is a second guard).
MIN_MAXKEYS = 20_000
MIN_MAXBYTES = 25 * MIN_MAXKEYS
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


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
        home=settings.state_dir / "nodes" / node_id,
        subuids=tuple(_subid_ranges(Path("/etc/subuid"), pw.pw_name)),
        subgids=tuple(_subid_ranges(Path("/etc/subgid"), pw.pw_name)),
    )


def ensure_node_user(
    node_id: str, settings: Settings | None = None, *, allow_egress: bool = False
) -> NodeUser:
    """Create or repair node ``node_id``'s user, configuration and store view.

    A running service whose configuration changed here is stopped, so that the next
    :func:`ensure_podman_service` starts one that reads the new files. With
    ``allow_egress`` /dev/net/tun is opened to all users (slirp4netns needs it for
    sandboxes with network; it is root-only on our hosts), and the node user's
    connections to the node's own addresses are refused (:func:`_fence_host`).
    """
    settings = settings or get_settings()
    _require_root()
    _mkdir(settings.state_dir, 0o755)
    for sub in ("nodes", "run", "logs"):
        _mkdir(settings.state_dir / sub, 0o755)
    with file_lock(settings.state_dir / "run" / "node-setup.lock"):
        name = user_name(node_id)
        home = settings.state_dir / "nodes" / node_id
        _ensure_system_user(name, home, node_id)
        _ensure_subids(name)
    user = find_node_user(node_id, settings)
    if user is None or not user.subuids or not user.subgids:
        raise NodeError(f"user {name} or its subordinate ids did not come into being")

    _mkdir(user.home, 0o700, user.uid, user.gid)
    _reset_stale_runtime_dir(user)
    for d in (user.runtime_dir, user.home / ".config", user.config_dir):
        _mkdir(d, 0o700, user.uid, user.gid)
    # Only a mount point: the idmapped view covers it (and is read-only once there).
    user.store_view.mkdir(mode=0o755, exist_ok=True)

    changed = _write_if_changed(user.config_dir / "containers.conf", containers_conf(), user)
    changed |= _write_if_changed(user.config_dir / "storage.conf", storage_conf(user), user)
    store = ensure_store(settings)
    _ensure_kernel_limits()
    _ensure_store_view(user, store)
    if allow_egress:
        _open_tun()
        _fence_host(user)
    if changed and service_pids(user):
        log.info("node %s: podman configuration changed, stopping its service", node_id)
        stop_podman_service(user, settings)
    return user


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
        "# Written by dsec node setup (workers/node_setup.py); rewritten on every setup.\n"
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
        "# Written by dsec node setup (workers/node_setup.py); rewritten on every setup.\n"
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


# --- the REST service --------------------------------------------------------------


def ensure_podman_service(
    user: NodeUser, settings: Settings | None = None, timeout_s: float = 20.0
) -> str:
    """Make ``podman system service`` answer on the node's socket; return its URL.

    A service already answering is reused. The service runs as the node user, detached
    (own session), logging to ``state_dir/logs/podman-<id>.log``.
    """
    settings = settings or get_settings()
    with file_lock(_run_file(settings, user, "lock")):
        return _ensure_service(user, settings, timeout_s)


def restart_podman_service(
    user: NodeUser, settings: Settings | None = None, timeout_s: float = 20.0
) -> str:
    """Stop the node's service and start a fresh one; return its URL.

    A long-running service does not see images added to the shared store after it
    started; a fresh one does. Sandboxes keep running meanwhile (conmon owns them).
    """
    settings = settings or get_settings()
    with file_lock(_run_file(settings, user, "lock")):
        _stop_service(user, settings)
        return _ensure_service(user, settings, timeout_s)


def stop_podman_service(user: NodeUser, settings: Settings | None = None) -> bool:
    """Stop the node's service (sandboxes keep running); False if none ran."""
    settings = settings or get_settings()
    with file_lock(_run_file(settings, user, "lock")):
        return _stop_service(user, settings)


def node_users(settings: Settings | None = None) -> list[NodeUser]:
    """Node users that have a home under ``state_dir/nodes``."""
    settings = settings or get_settings()
    nodes = settings.state_dir / "nodes"
    found = (find_node_user(d.name, settings) for d in sorted(nodes.glob("*")) if d.is_dir())
    return [u for u in found if u is not None]


def stop_all_podman_services(settings: Settings | None = None) -> list[str]:
    """Stop every node's service; return the ids of the nodes whose service ran."""
    settings = settings or get_settings()
    return [u.node_id for u in node_users(settings) if stop_podman_service(u, settings)]


def refresh_podman_services(
    settings: Settings | None = None, *, image: str | None = None, present: bool = True
) -> list[str]:
    """Restart running node services so they see the shared store as it is now.

    With ``image``, a service that already agrees (sees it when ``present``, does not
    when not) is left alone: a restart drops its in-flight requests. Returns the ids of
    the nodes whose service was restarted.
    """
    settings = settings or get_settings()
    refreshed = []
    for user in node_users(settings):
        if not service_pids(user):
            continue
        if image is not None and service_sees_image(user.socket_path, image) is present:
            continue
        restart_podman_service(user, settings)
        refreshed.append(user.node_id)
    return refreshed


def service_answers(socket_path: Path, timeout_s: float = 2.0) -> bool:
    """The REST socket answers ``GET /_ping`` with 200."""
    return _http_status(socket_path, "/_ping", timeout_s) == 200


def service_sees_image(socket_path: Path, image: str, timeout_s: float = 5.0) -> bool | None:
    """Whether the service on ``socket_path`` knows ``image``; None if it does not answer."""
    status = _http_status(
        socket_path, f"/v4.0.0/libpod/images/{urllib.parse.quote(image, safe='')}/exists", timeout_s
    )
    return None if status is None else status == 204


def _service_reads_store(user: NodeUser, settings: Settings, timeout_s: float = 15.0) -> bool:
    """The service lists its images: ``/_ping`` answers even from a service stuck on a
    storage lock (a restart frees it; its sandboxes keep running). Asked with the
    store's lock held shared, so a root import in progress is waited for, not taken
    for a hang."""
    with file_lock(store_lock_path(settings), shared=True):
        return _http_status(user.socket_path, "/v4.0.0/libpod/images/json", timeout_s) == 200


def _http_status(socket_path: Path, path: str, timeout_s: float) -> int | None:
    """Status code of a bare ``GET path`` on a unix socket (setup needs no HTTP client)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(socket_path))
            s.sendall(f"GET {path} HTTP/1.0\r\nHost: d\r\n\r\n".encode())
            head = s.recv(64)
    except OSError:
        return None
    if not head.startswith(b"HTTP/1.") or not head[9:12].isdigit():
        return None
    return int(head[9:12])


def _ensure_service(user: NodeUser, settings: Settings, timeout_s: float) -> str:
    if not _pause_sees_store_view(user):
        # The rootless pause process holds the mount namespace every podman of this
        # user joins; one that predates the store view never sees the view ("/" is
        # not a shared mount here), so it and the service go.
        log.warning("node %s: podman namespace predates the store view, resetting", user.node_id)
        _stop_service(user, settings)
        _kill_pause(user)
    if service_answers(user.socket_path):
        if _service_reads_store(user, settings):
            return user.socket_url
        log.warning("node %s: podman answers but cannot read its store: restart", user.node_id)
    _stop_service(user, settings)
    user.socket_path.parent.mkdir(mode=0o700, exist_ok=True)
    os.chown(user.socket_path.parent, user.uid, user.gid)
    logfile = settings.state_dir / "logs" / f"podman-{user.node_id}.log"
    podman = shutil.which("podman") or "/usr/bin/podman"
    cmd = [
        shutil.which("setpriv") or "/usr/bin/setpriv",
        f"--reuid={user.uid}",
        f"--regid={user.gid}",
        "--init-groups",
        "--",
        podman,
        "system",
        "service",
        "--time=0",
        user.socket_url,
    ]
    env = {
        "HOME": str(user.home),
        "USER": user.name,
        "LOGNAME": user.name,
        "PATH": _PATH,
        "LANG": "C.UTF-8",
        "XDG_RUNTIME_DIR": str(user.runtime_dir),
        "XDG_CONFIG_HOME": str(user.home / ".config"),
    }
    with open(logfile, "ab") as out:
        out.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(  # setpriv execs podman: proc.pid is the service's pid
            cmd,
            env=env,
            cwd=user.home,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    _run_file(settings, user, "pid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if service_answers(user.socket_path, 1.0):
            log.info("node %s: podman pid %d on %s", user.node_id, proc.pid, user.socket_url)
            return user.socket_url
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    _stop_service(user, settings)
    raise PodmanUnavailable(
        f"podman service of node {user.node_id} did not answer on {user.socket_path}; "
        f"last log lines:\n{_tail(logfile)}"
    )


def _stop_service(user: NodeUser, settings: Settings, grace_s: float = 5.0) -> bool:
    pids = service_pids(user)
    ran = bool(pids)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        time.sleep(0.05)
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    with contextlib.suppress(FileNotFoundError):
        user.socket_path.unlink()
    with contextlib.suppress(FileNotFoundError):
        _run_file(settings, user, "pid").unlink()
    return ran


def service_pids(user: NodeUser) -> list[int]:
    """Pids of this user's ``podman system service`` on its socket (found in /proc).

    Rootless podman may run as two processes (one outside, one inside the user
    namespace) with the same command line; both are found.
    """
    want = user.socket_url.encode()
    pids = []
    for pid in live_processes_of(user.uid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"podman" and want in argv and b"service" in argv:
            pids.append(pid)
    return pids


def _pause_pid(user: NodeUser) -> int | None:
    try:
        pid = int((user.runtime_dir / "libpod" / "tmp" / "pause.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        if Path(f"/proc/{pid}").stat().st_uid != user.uid:
            return None  # a recycled pid, not ours
    except OSError:
        return None
    return pid


def _pause_sees_store_view(user: NodeUser) -> bool:
    pid = _pause_pid(user)
    if pid is None:
        return True  # the next podman creates the namespace, with today's mounts
    try:
        return str(user.store_view) in _mount_points(Path(f"/proc/{pid}/mountinfo"))
    except OSError:
        return True


def _kill_pause(user: NodeUser) -> None:
    pid = _pause_pid(user)
    if pid is not None:
        _signal(pid, signal.SIGKILL)


# --- user, ids, files --------------------------------------------------------------


def _ensure_system_user(name: str, home: Path, node_id: str) -> None:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        _run(
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
        _run(["usermod", "--home", str(home), name])


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
    _run([*args, name])


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


def live_processes_of(uid: int) -> list[int]:
    """Pids of the live processes owned by ``uid`` (their /proc entry's owner; zombies,
    whose command line is empty anyway, excluded)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == uid and _alive(int(entry.name)):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


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


def _ensure_kernel_limits() -> None:
    for key, floor in (("maxkeys", MIN_MAXKEYS), ("maxbytes", MIN_MAXBYTES)):
        path = Path("/proc/sys/kernel/keys") / key
        try:
            if int(path.read_text()) < floor:
                path.write_text(f"{floor}\n")
        except OSError as exc:  # read-only /proc/sys inside a container: keyring is off
            log.warning("cannot raise kernel.keys.%s: %s", key, exc)


def _open_tun() -> None:
    tun = Path("/dev/net/tun")
    if tun.exists() and tun.stat().st_mode & 0o777 != 0o666:
        tun.chmod(0o666)


#: Destinations the node user (so a sandbox's slirp4netns) may never reach: the node's
#: own addresses, and link-local ones (cloud metadata services live there).
_FENCE_RULES = {
    "iptables": (["-m", "addrtype", "--dst-type", "LOCAL"], ["-d", "169.254.0.0/16"]),
    "ip6tables": (["-m", "addrtype", "--dst-type", "LOCAL"], ["-d", "fe80::/10"]),
}


def _fence_host(user: NodeUser) -> None:
    """Refuse the node user's connections to the node itself (idempotent).

    With egress a sandbox's traffic leaves through slirp4netns, a process of the node
    user in the host's network namespace: without this rule the sandbox reaches every
    service of the node listening on a non-loopback address (Podman's default
    ``allow_host_loopback=false`` only closes 10.0.2.2 -> 127.0.0.1). Nothing else of
    the node user speaks TCP/IP: its Podman service and the agents use unix sockets.
    Without iptables the node still gives egress, and says so in its log.
    """
    for tool, matches in _FENCE_RULES.items():
        exe = shutil.which(tool)
        if exe is None:
            log.warning("node %s: no %s, sandboxes with network reach the node", user.name, tool)
            continue
        for match in matches:
            rule = ["OUTPUT", "-m", "owner", "--uid-owner", str(user.uid), *match, "-j", "REJECT"]
            if subprocess.run([exe, "-C", *rule], capture_output=True, check=False).returncode:
                done = subprocess.run([exe, "-A", *rule], capture_output=True, text=True)
                if done.returncode != 0:
                    log.warning("node %s: %s -A failed: %s", user.name, tool, done.stderr.strip())


# --- the idmapped store view -------------------------------------------------------

# The new mount API's syscall numbers are the same on every architecture (>= 424).
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_MOUNT_SETATTR = 442
_OPEN_TREE_CLONE = 1
_OPEN_TREE_CLOEXEC = os.O_CLOEXEC
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_RDONLY = 0x1
_MOUNT_ATTR_NOSUID = 0x2
_MOUNT_ATTR_NODEV = 0x4
_MOUNT_ATTR_IDMAP = 0x100000


class _MountAttr(ctypes.Structure):
    _fields_ = [  # ctypes wants a plain class-level list
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _id_map(own: int, ranges: tuple[tuple[int, int], ...]) -> str:
    """The id map rootless Podman gives the user: 0 -> own id, 1.. -> subordinate ids."""
    lines, inside = [f"0 {own} 1"], 1
    for start, count in ranges:
        lines.append(f"{inside} {start} {count}")
        inside += count
    return "\n".join(lines) + "\n"


def _ensure_store_view(user: NodeUser, store: Path) -> bool:
    """Mount the shared store at the user's view, idmapped; True if (re)mounted now."""
    view = user.store_view
    if _view_ok(view, store, user):
        return False
    while str(view) in _mount_points(Path("/proc/self/mountinfo")):
        _run(["umount", "--lazy", str(view)])
    _idmapped_bind(store, view, _id_map(user.uid, user.subuids), _id_map(user.gid, user.subgids))
    if not _view_ok(view, store, user):
        raise NodeError(f"idmapped view {view} of {store} is not right after mounting it")
    log.info("node %s: store %s viewed at %s", user.node_id, store, view)
    return True


def _view_ok(view: Path, store: Path, user: NodeUser) -> bool:
    if str(view) not in _mount_points(Path("/proc/self/mountinfo")):
        return False
    try:
        v, s = view.stat(), store.stat()
    except OSError:
        return False
    # Same directory, and the store's root-owned root shows as the node user's ids.
    same = (v.st_dev, v.st_ino) == (s.st_dev, s.st_ino)
    return same and (v.st_uid, v.st_gid) == (user.uid, user.gid) and s.st_uid == 0


def _mount_points(mountinfo: Path) -> set[str]:
    points = set()
    for line in mountinfo.read_text().splitlines():
        fields = line.split(" ")
        if len(fields) > 4:
            points.add(_unescape(fields[4]))
    return points


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _idmapped_bind(src: Path, dst: Path, uid_map: str, gid_map: str) -> None:
    """Bind ``src`` at ``dst`` read-only, nodev, nosuid, with ids shifted by the maps.

    The maps are written to a throwaway user namespace (a helper ``unshare --user``
    process) whose descriptor the kernel uses to shift ids on the new mount.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    helper = subprocess.Popen(
        ["unshare", "--user", "--", "sleep", "60"], stdin=subprocess.DEVNULL, close_fds=True
    )
    try:
        own_ns = os.readlink("/proc/self/ns/user")
        deadline = time.monotonic() + 5
        while os.readlink(f"/proc/{helper.pid}/ns/user") == own_ns:
            if time.monotonic() > deadline or helper.poll() is not None:
                raise NodeError("helper user namespace for the idmapped mount did not appear")
            time.sleep(0.002)
        Path(f"/proc/{helper.pid}/uid_map").write_text(uid_map)
        Path(f"/proc/{helper.pid}/gid_map").write_text(gid_map)
        ns_fd = os.open(f"/proc/{helper.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        try:
            tree = libc.syscall(
                _SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(src), _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC
            )
            if tree < 0:
                raise _oserror("open_tree", src)
            try:
                attr = _MountAttr(
                    _MOUNT_ATTR_IDMAP | _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NODEV | _MOUNT_ATTR_NOSUID,
                    0,
                    0,
                    ns_fd,
                )
                if (
                    libc.syscall(
                        _SYS_MOUNT_SETATTR,
                        tree,
                        b"",
                        _AT_EMPTY_PATH,
                        ctypes.byref(attr),
                        ctypes.sizeof(attr),
                    )
                    != 0
                ):
                    raise _oserror(
                        "mount_setattr (idmapped mounts need Linux >= 5.12 and a "
                        "filesystem that supports them)",
                        src,
                    )
                if (
                    libc.syscall(
                        _SYS_MOVE_MOUNT,
                        tree,
                        b"",
                        _AT_FDCWD,
                        os.fsencode(dst),
                        _MOVE_MOUNT_F_EMPTY_PATH,
                    )
                    != 0
                ):
                    raise _oserror("move_mount", dst)
            finally:
                os.close(tree)
        finally:
            os.close(ns_fd)
    finally:
        helper.kill()
        helper.wait()


def _oserror(what: str, path: Path) -> NodeError:
    err = ctypes.get_errno()
    return NodeError(f"{what} {path}: {os.strerror(err)} ({errno.errorcode.get(err, err)})")


# --- small helpers -----------------------------------------------------------------


def _require_root() -> None:
    if os.geteuid() != 0:
        raise NodeError("node setup must run as root (it creates users and mounts)")


def _mkdir(path: Path, mode: int, uid: int = 0, gid: int = 0) -> None:
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    st = path.stat()
    if (st.st_uid, st.st_gid) != (uid, gid):
        os.chown(path, uid, gid)
    if st.st_mode & 0o7777 != mode:
        path.chmod(mode)


def _run_file(settings: Settings, user: NodeUser, suffix: str) -> Path:
    return settings.state_dir / "run" / f"podman-{user.node_id}.{suffix}"


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NodeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _cap(limit: int, want: int) -> int:
    return want if limit == resource.RLIM_INFINITY else min(limit, want)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
