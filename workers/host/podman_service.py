"""A node's ``podman system service``: started as the node user on its REST socket,
checked, restarted, stopped, and found again by its processes.

Per node ``<id>`` (``state_dir`` = ``/var/lib/dsec`` by default)::

    state_dir/nodes/<id>/run/podman/podman.sock   the REST socket the node talks to
    state_dir/run/podman-<id>.pid                 the service's pid (root-owned)
    state_dir/run/podman-<id>.lock                taken by whoever starts or stops it
    state_dir/logs/podman-<id>.log                the service's log

Everything here runs as root. Sandboxes keep running while the service is stopped or
restarted (conmon owns them).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
from pathlib import Path

from app.config import Settings, get_settings
from workers.errors import PodmanUnavailable
from workers.host.file_lock import file_lock
from workers.host.layer_store import store_lock_path
from workers.host.mounts import mount_points
from workers.host.ops import alive, live_processes_of, send_signal
from workers.host.user import NodeUser, node_users

log = logging.getLogger(__name__)

#: The service's PATH: its environment is built from nothing, and Podman looks its
#: helpers (newuidmap, slirp4netns) up there.
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


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


def container_images(socket_path: Path, timeout_s: float = 5.0) -> set[str] | None:
    """Ids of the images of every container (running or not) the service on
    ``socket_path`` holds; None if it does not answer."""
    answer = _http_get(socket_path, "/v4.0.0/libpod/containers/json?all=true", timeout_s)
    if answer is None or answer[0] != 200:
        return None
    try:
        return {str(c.get("ImageID", "")) for c in json.loads(answer[1])}
    except (ValueError, AttributeError):
        return None


def _http_status(socket_path: Path, path: str, timeout_s: float) -> int | None:
    """Status code of a bare ``GET path`` on a unix socket (setup needs no HTTP client)."""
    answer = _http_get(socket_path, path, timeout_s, whole=False)
    return None if answer is None else answer[0]


def _http_get(
    socket_path: Path, path: str, timeout_s: float, *, whole: bool = True
) -> tuple[int, bytes] | None:
    """Status and body of a bare ``GET path`` on a unix socket (only the status line's
    first bytes unless ``whole``); None if nothing answers HTTP."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(socket_path))
            s.sendall(f"GET {path} HTTP/1.0\r\nHost: d\r\n\r\n".encode())
            chunks = [s.recv(64 if not whole else 1 << 16)]
            while whole and chunks[-1]:
                chunks.append(s.recv(1 << 16))
    except OSError:
        return None
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.") or not head[9:12].isdigit():
        return None
    return int(head[9:12]), body


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
        send_signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if alive(p)]
        time.sleep(0.05)
    for pid in pids:
        send_signal(pid, signal.SIGKILL)
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
        return str(user.store_view) in mount_points(Path(f"/proc/{pid}/mountinfo"))
    except OSError:
        return True


def _kill_pause(user: NodeUser) -> None:
    pid = _pause_pid(user)
    if pid is not None:
        send_signal(pid, signal.SIGKILL)


def _run_file(settings: Settings, user: NodeUser, suffix: str) -> Path:
    return settings.state_dir / "run" / f"podman-{user.node_id}.{suffix}"


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
