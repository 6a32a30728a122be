"""A node user's view of the shared layer store: the store bind-mounted read-only at
``~/store``, idmapped through the user's own rootless id mapping.

Why a view and not the store itself: see :mod:`app.images.store`. In short, the
store on disk is owned by real root (uid 0 inside the images), and the view shows it
to each node user through that user's mapping, so files are owned by uid 0 *inside*
every sandbox, on every node, with one copy on disk.

The mount is made with the new mount API (``open_tree``, ``mount_setattr``,
``move_mount``), called as raw syscalls through ctypes.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import subprocess
import time
from pathlib import Path

from workers.errors import NodeError
from workers.host.mounts import mount_points
from workers.host.ops import run
from workers.host.user import NodeUser

log = logging.getLogger(__name__)

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


def ensure_store_view(user: NodeUser, store: Path) -> bool:
    """Mount the shared store at the user's view, idmapped; True if (re)mounted now."""
    view = user.store_view
    # Only a mount point: the idmapped view covers it (and is read-only once there).
    view.mkdir(mode=0o755, exist_ok=True)
    if _view_ok(view, store, user):
        return False
    while str(view) in mount_points():
        run(["umount", "--lazy", str(view)])
    _idmapped_bind(store, view, _id_map(user.uid, user.subuids), _id_map(user.gid, user.subgids))
    if not _view_ok(view, store, user):
        raise NodeError(f"idmapped view {view} of {store} is not right after mounting it")
    log.info("node %s: store %s viewed at %s", user.node_id, store, view)
    return True


def _view_ok(view: Path, store: Path, user: NodeUser) -> bool:
    if str(view) not in mount_points():
        return False
    try:
        v, s = view.stat(), store.stat()
    except OSError:
        return False
    # Same directory, and the store's root-owned root shows as the node user's ids.
    same = (v.st_dev, v.st_ino) == (s.st_dev, s.st_ino)
    return same and (v.st_uid, v.st_gid) == (user.uid, user.gid) and s.st_uid == 0


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
