"""Podman's REST API and the sandbox, both ways, without I/O: what a
:class:`~workers.containers.spec.SandboxSpec` becomes in a ``containers.create`` call
(:func:`container_args`: secure by default, see :mod:`workers.containers.podman_driver`)
and what Podman's list and inspect answers become (:func:`from_list`,
:func:`from_inspect`).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Any

from workers.containers import label
from workers.containers.limits import Limits, View
from workers.containers.port import SandboxContainer, sandbox_id_of
from workers.containers.spec import (
    AGENT_BIN_MOUNT,
    AGENT_RUN_MOUNT,
    RESOLV_CONF,
    WORKDIR,
    SandboxSpec,
)

#: Open files per sandbox process. Set here because Podman 4.3's REST API ignores
#: containers.conf ``default_ulimits`` (only its CLI applies them); without it a
#: sandbox inherits the service's limit. NPROC is left to the service: the kernel
#: counts it per user across all of a node's sandboxes, so it is no per-sandbox cap.
NOFILE = 1024


def container_args(spec: SandboxSpec, cgroup_views: Sequence[View] = ()) -> dict[str, Any]:
    """podman-py ``containers.create`` keyword arguments for ``spec`` (no I/O).

    ``cgroup_views`` replace Podman's view of the host's cgroup hierarchies with the
    sandbox's own cgroups (:meth:`workers.containers.limits.CgroupLayout.views`).
    """
    limits = Limits.of(spec.memory_mb, spec.pids_limit, spec.cpus)
    return {
        "name": spec.container_name,
        "labels": {**spec.labels, label.SANDBOX_ID: spec.sandbox_id},
        "environment": dict(spec.env),
        "working_dir": WORKDIR,
        "network_mode": "slirp4netns" if spec.network else "none",
        "cap_drop": ["ALL"],
        "no_new_privileges": True,
        "read_only": True,
        # No automatic tmpfs on /run, /tmp, /var/tmp: only the ones below are writable.
        "read_write_tmpfs": False,
        "mounts": [
            _tmpfs("/tmp", spec.tmp_mb, "1777"),
            _tmpfs(WORKDIR, spec.disk_mb, "755"),
            _bind(spec.agent_bin_dir, AGENT_BIN_MOUNT),
            _bind(spec.run_dir, AGENT_RUN_MOUNT),
            # Every sandbox, so that a warm one can become an allowlisted one.
            _bind(spec.agent_bin_dir / RESOLV_CONF, "/etc/resolv.conf"),
            *(
                _bind(src, target) if src is not None else _empty_ro_tmpfs(target)
                for src, target in cgroup_views
            ),
        ],
        "pids_limit": spec.pids_limit,
        "mem_limit": f"{spec.memory_mb}m",
        "memswap_limit": f"{spec.memory_mb}m",
        "cpu_period": limits.cpu_period_us,
        "cpu_quota": limits.cpu_quota_us,
        "ulimits": [{"Name": "nofile", "Soft": NOFILE, "Hard": NOFILE}],
        "tty": False,
        "stdin_open": False,
        # A PID 1 that ignores SIGTERM would make every stop wait: kill at once.
        "stop_signal": int(signal.SIGKILL),
        "stop_timeout": 0,
    }


def _tmpfs(target: str, size_mb: int, mode: str) -> dict[str, Any]:
    return {
        "type": "tmpfs",
        "source": "tmpfs",
        "target": target,
        "size": f"{size_mb}m",
        "mode": mode,
    }


def _empty_ro_tmpfs(target: str) -> dict[str, Any]:
    return {**_tmpfs(target, 1, "755"), "size": "4k", "read_only": True}


def _bind(source: Any, target: str) -> dict[str, Any]:
    return {"type": "bind", "source": str(source), "target": target, "read_only": True}


def from_list(attrs: dict[str, Any], oom_killed: bool) -> SandboxContainer:
    """A sandbox container from one entry of Podman's container list."""
    labels = dict(attrs.get("Labels") or {})
    names = attrs.get("Names") or [""]
    state = str(attrs.get("State", ""))
    return SandboxContainer(
        sandbox_id=sandbox_id_of(str(names[0]), labels),
        container_id=str(attrs.get("Id", "")),
        name=str(names[0]),
        image=str(attrs.get("Image", "")),
        state=state,
        exit_code=None if state in ("running", "created") else int(attrs.get("ExitCode") or 0),
        oom_killed=oom_killed,
        labels=labels,
        pid=int(attrs.get("Pid") or 0) or None,
    )


def from_inspect(data: dict[str, Any]) -> SandboxContainer:
    """A sandbox container from Podman's inspect of it."""
    st = data.get("State") or {}
    labels = dict((data.get("Config") or {}).get("Labels") or {})
    state = str(st.get("Status", ""))
    return SandboxContainer(
        sandbox_id=sandbox_id_of(str(data.get("Name", "")), labels),
        container_id=str(data.get("Id", "")),
        name=str(data.get("Name", "")),
        image=str(data.get("ImageName") or data.get("Image", "")),
        state=state,
        exit_code=None if state in ("running", "created") else int(st.get("ExitCode") or 0),
        oom_killed=bool(st.get("OOMKilled")),
        labels=labels,
        pid=int(st.get("Pid") or 0) or None,
    )
