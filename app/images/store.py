"""Images in the shared, read-only image-layer store (``settings.layer_store``, kept by
:mod:`workers.host.layer_store`): importing, removing, and telling the running nodes.

Decision: root writes the store; each node user reads it through an idmapped view.

- Images are imported or built into the store by *root's* Podman
  (``podman --root <layer_store>``, own runroot and config, see :func:`store_podman`).
  Files keep the image's own ownership on disk (uid 0 is the image's root), the store
  belongs to real root, and no node user can change a layer another node runs.
- Each node user sees the store through a read-only, nodev, nosuid *idmapped* bind
  mount at ``~/store`` (made by :mod:`workers.host.store_view`), shifted by that user's
  rootless mapping (0 -> the user's uid, 1.. -> its subuids). On-disk uid 0 thus
  appears as the node user's uid, which is uid 0 inside its sandboxes. That node
  user's ``additionalimagestores`` points at its view. One copy on disk and in the
  page cache, however many node users (``dsec up --nodes 3``) share it, and files
  inside every sandbox are owned by the sandbox's root.

Rejected, measured on this host:

- Rootless Podman reading the root-owned store directly: files show as ``nobody``
  (host root is unmapped in the user namespace) and containers do not even start
  ("creating /etc/mtab symlink: permission denied": overlay cannot copy up a
  directory owned by an unmapped id).
- Importing as one node user: right for that node only (the others see ``nobody``
  and fail the same way), and that node user could tamper with everyone's images.
- One store per node user: N copies and N page caches, against the design.

Needs idmapped mounts (Linux >= 5.12; ext4/xfs/btrfs/tmpfs, not every network
filesystem). The view is a bind of the same directory, so new images are in it at
once. A running ``podman system service`` may cache the store's contents (reported on
these hosts; Podman 4.3 here re-read it when root's Podman changed it): after an
import or removal every running node service is asked about the image and the ones
that disagree are restarted (:func:`workers.host.podman_service.refresh_podman_services`).
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

from app.config import Settings, get_settings
from workers.containers.podman_driver import PodmanDriver
from workers.errors import ImageNotFound
from workers.host.layer_store import (
    find_image,
    image_exists,
    normalize_name,
    store_lock,
    store_podman,
)
from workers.host.podman_service import refresh_podman_services, service_answers
from workers.host.user import node_users

#: The busybox every sandbox image can rely on: Debian's busybox-static.
BUSYBOX = Path("/bin/busybox")
#: Default name of the busybox base image.
BUSYBOX_IMAGE = "dsec/busybox:latest"
#: Fixed mtime of the generated rootfs, so the layer digest is the same every time.
_EPOCH = 1_700_000_000
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def image_users(name: str, settings: Settings | None = None) -> list[str]:
    """Sandbox containers on this stack's nodes that run image ``name`` (``node/container``).

    Asks every running node service over its REST socket. Nodes of other stacks
    (another ``state_dir``) sharing the same store are not asked.
    """
    settings = settings or get_settings()
    image = find_image(name, settings)
    names = set(image.names) if image else {normalize_name(name)}
    users = []
    for user in node_users(settings):
        if not service_answers(user.socket_path):
            continue
        driver = PodmanDriver(user.socket_url)
        try:
            for box in driver.list_sandboxes():
                if normalize_name(box.image) in names:
                    users.append(f"{user.node_id}/{box.name}")
        finally:
            driver.close()
    return users


def remove_image(name: str, settings: Settings | None = None, *, refresh: bool = True) -> bool:
    """Remove ``name`` from the store; False if it was not there.

    Only remove images no sandbox uses: node stores do not tell root's Podman which
    layers their containers sit on.
    """
    settings = settings or get_settings()
    with store_lock(settings):
        if not image_exists(name, settings):
            return False
        store_podman(settings, "rmi", name)
    if refresh:
        refresh_nodes(settings, name, present=False)
    return True


def import_rootfs_tar(
    name: str,
    tar: bytes,
    settings: Settings | None = None,
    *,
    changes: tuple[str, ...] = (),
    refresh: bool = True,
) -> bool:
    """Import a root filesystem tarball as image ``name`` unless present; True if imported.

    ``changes`` are Containerfile instructions (``CMD ["/bin/sh"]``) for the config.
    """
    settings = settings or get_settings()
    with store_lock(settings):
        if image_exists(name, settings):
            return False
        args = ["import"]
        for change in changes:
            args += ["--change", change]
        store_podman(settings, *args, "-", name, stdin=tar)
    if refresh:
        refresh_nodes(settings, name, present=True)
    return True


def import_busybox_image(
    name: str = BUSYBOX_IMAGE, settings: Settings | None = None, *, refresh: bool = True
) -> bool:
    """Import the busybox base image into the store unless present; True if imported.

    A root filesystem of Debian's static busybox: every applet as a symlink at its
    usual path, /etc/passwd and /etc/group, /tmp, /workspace and the agent's mount
    points. With ``refresh`` the running node services are restarted to see it.
    """
    if not BUSYBOX.is_file():
        raise ImageNotFound(f"{BUSYBOX} is missing: apt-get install busybox-static")
    return import_rootfs_tar(
        name,
        busybox_rootfs_tar(),
        settings,
        changes=(
            'CMD ["/bin/sh"]',
            f"ENV PATH={_PATH}",
            "WORKDIR /workspace",
            "LABEL dsec.base=busybox-static",
        ),
        refresh=refresh,
    )


def busybox_rootfs_tar(busybox: Path = BUSYBOX) -> bytes:
    """A root filesystem tarball around a static busybox (ids 0, fixed mtimes)."""
    applets = subprocess.run(
        [str(busybox), "--list-full"], capture_output=True, text=True, check=True
    ).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = {
            "bin": 0o755,
            "sbin": 0o755,
            "usr": 0o755,
            "usr/bin": 0o755,
            "usr/sbin": 0o755,
            "etc": 0o755,
            "root": 0o700,
            "home": 0o755,
            "tmp": 0o1777,
            "var": 0o755,
            "var/tmp": 0o1777,
            "run": 0o755,
            "proc": 0o555,
            "sys": 0o555,
            "dev": 0o755,
            "workspace": 0o755,
            ".dsec": 0o755,
            ".dsec/bin": 0o755,
            ".dsec/run": 0o755,
        }
        for path, mode in dirs.items():
            tar.addfile(_entry(path, tarfile.DIRTYPE, mode))
        data = busybox.read_bytes()
        tar.addfile(_entry("bin/busybox", tarfile.REGTYPE, 0o755, size=len(data)), io.BytesIO(data))
        for applet in applets:
            if applet != "bin/busybox" and os.path.dirname(applet) in dirs:
                tar.addfile(_entry(applet, tarfile.SYMTYPE, 0o777, link="/bin/busybox"))
        files = {
            "etc/passwd": "root:x:0:0:root:/root:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
            "etc/group": "root:x:0:\nnogroup:x:65534:\n",
            "etc/hostname": "sandbox\n",
        }
        for path, text in files.items():
            raw = text.encode()
            tar.addfile(_entry(path, tarfile.REGTYPE, 0o644, size=len(raw)), io.BytesIO(raw))
        tar.addfile(_entry("etc/mtab", tarfile.SYMTYPE, 0o777, link="/proc/mounts"))
    return buf.getvalue()


def _entry(path: str, kind: bytes, mode: int, *, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(path)
    info.type, info.mode, info.size, info.linkname = kind, mode, size, link
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mtime = _EPOCH
    return info


def refresh_nodes(settings: Settings, image: str, present: bool) -> None:
    """Make this stack's running node services see ``image`` as (not) ``present``."""
    refresh_podman_services(settings, image=image, present=present)
