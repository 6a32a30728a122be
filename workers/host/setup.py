"""Setting a node up: its user, configuration and store view, and what the host
must allow for them. Each step lives in its module; this one runs them in order.

Everything here runs as root and is idempotent: run it on a clean machine, or again
on a configured one, and the end state is the same.

- :mod:`workers.host.user`: the node's system user, subordinate ids, home and
  runtime dir, containers.conf and storage.conf (the layout of its home is there);
- :mod:`workers.host.store_view`: the idmapped read-only view of the shared layer store;
- :mod:`workers.host.podman_service`: the rootless ``podman system service`` of the node
  user, which the worker starts once the node is set up;
- here: the kernel's key quota, /dev/net/tun and the firewall rule of a node that
  gives sandboxes network.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

from app.config import Settings, get_settings
from workers.errors import NodeError
from workers.host.layer_store import ensure_store
from workers.host.podman_service import service_pids, stop_podman_service
from workers.host.store_view import ensure_store_view
from workers.host.user import NodeUser, create_node_user, write_config

log = logging.getLogger(__name__)

#: Per-user kernel key quota we make sure of (Debian's default of 200 stops a node user
#: at ~200 containers when the keyring is on; ours is off, this is a second guard).
MIN_MAXKEYS = 20_000
MIN_MAXBYTES = 25 * MIN_MAXKEYS


def ensure_node_user(
    node_id: str, settings: Settings | None = None, *, allow_egress: bool = False
) -> NodeUser:
    """Create or repair node ``node_id``'s user, configuration and store view.

    A running service whose configuration changed here is stopped, so that the next
    :func:`~workers.host.podman_service.ensure_podman_service` starts one that reads the
    new files. With ``allow_egress`` /dev/net/tun is opened to all users (slirp4netns
    needs it for sandboxes with network; it is root-only on our hosts), and the node
    user's connections to the node's own addresses are refused (:func:`fence_egress`).
    """
    settings = settings or get_settings()
    _require_root()
    user = create_node_user(node_id, settings)
    changed = write_config(user)
    store = ensure_store(settings)
    _ensure_kernel_limits()
    ensure_store_view(user, store)
    if allow_egress:
        _open_tun()
        unfenced = fence_egress(user)
        if unfenced is not None:
            log.error("node %s: sandbox egress cannot be fenced (%s)", node_id, unfenced)
    if changed and service_pids(user):
        log.info("node %s: podman configuration changed, stopping its service", node_id)
        stop_podman_service(user, settings)
    return user


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


def fence_egress(user: NodeUser) -> str | None:
    """Refuse the node user's connections to the node itself (idempotent); returns
    why the fence does not hold, or None when it does.

    With egress a sandbox's traffic leaves through slirp4netns, a process of the node
    user in the host's network namespace: without this rule the sandbox reaches every
    service of the node listening on a non-loopback address (Podman's default
    ``allow_host_loopback=false`` only closes 10.0.2.2 -> 127.0.0.1). Nothing else of
    the node user speaks TCP/IP: its Podman service and the agents use unix sockets.
    A node whose fence does not hold refuses creates that ask for network
    (:class:`workers.creation.Creation`): fail closed, never unfenced egress.
    """
    for tool, matches in _FENCE_RULES.items():
        exe = shutil.which(tool)
        if exe is None:
            return f"no {tool} (apt-get install iptables)"
        for match in matches:
            rule = ["OUTPUT", "-m", "owner", "--uid-owner", str(user.uid), *match, "-j", "REJECT"]
            if subprocess.run([exe, "-C", *rule], capture_output=True, check=False).returncode:
                done = subprocess.run([exe, "-A", *rule], capture_output=True, text=True)
                if done.returncode != 0:
                    return f"{tool} -A failed: {done.stderr.strip()[:200]}"
    return None


def _require_root() -> None:
    if os.geteuid() != 0:
        raise NodeError("node setup must run as root (it creates users and mounts)")
