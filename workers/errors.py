"""The node's errors, a branch of the platform's tree (:class:`app.errors.DsecError`).

Drivers' errors are translated where the driver is called: podman-py's and requests'
in :mod:`workers.containers.podman_driver`, redis-py's in :mod:`workers.redis_state`. Callers
never see a driver's exception.
"""

from __future__ import annotations

from app.errors import DsecError, ServiceUnavailable


class NodeError(DsecError):
    """Something on the node (user, Podman service, image store, container) failed."""


class ImageNotFound(NodeError, LookupError):
    """The image is not in the node's stores (shared layer store or the node's own)."""


class PodmanUnavailable(NodeError, ConnectionError):
    """The node user's Podman service does not answer on its socket."""


class SandboxCreateFailed(NodeError):
    """Podman refused to create or start a sandbox container."""


class ImageRefused(SandboxCreateFailed, PermissionError):
    """A tenant's image holds what no sandbox may start from (device files); it was
    removed from the store again."""


class EgressDisabled(SandboxCreateFailed, PermissionError):
    """A sandbox asked for network on a node that gives none (``allow_egress`` off)."""


class NoSpace(SandboxCreateFailed, OSError):
    """The node's disk is too full to hold another sandbox."""


class StaleCreate(SandboxCreateFailed, TimeoutError):
    """A create reached the node after its trainer gave up on it (a task held by a worker
    that died, given back late): making the sandbox then would leave it to nobody."""


class StaleCommand(NodeError, TimeoutError):
    """A command reached the node after its trainer gave up on it (an inbox read again
    from further back than its position): its claim may have expired, so it must not run."""


class SandboxNotRunning(NodeError):
    """A direct command for a sandbox that ended or is frozen (app/domain/direct.py)."""


class DirectRefused(NodeError, PermissionError):
    """A direct command its sandbox's key proves, but that may not come that way."""


class CommandInterrupted(NodeError):
    """The node's worker stopped while the command ran (its agent killed it)."""


class RedisFailed(NodeError):
    """Redis refused a request of the node (its claims, step results, inbox position)."""


class RedisUnavailable(RedisFailed, ServiceUnavailable):
    """Redis cannot be reached, or did not answer in time."""
