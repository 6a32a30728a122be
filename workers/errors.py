"""Errors the node's Podman side raises. Callers never see podman-py or requests errors."""

from __future__ import annotations


class NodeError(Exception):
    """Something on the node (user, Podman service, image store, container) failed."""


class ImageNotFound(NodeError, LookupError):
    """The image is not in the node's stores (shared layer store or the node's own)."""


class PodmanUnavailable(NodeError, ConnectionError):
    """The node user's Podman service does not answer on its socket."""


class SandboxCreateFailed(NodeError):
    """Podman refused to create or start a sandbox container."""


class NoSpace(SandboxCreateFailed, OSError):
    """The node's disk is too full to hold another sandbox."""


class StaleCreate(SandboxCreateFailed, TimeoutError):
    """A create reached the node after its trainer gave up on it (a task held by a worker
    that died, given back late): making the sandbox then would leave it to nobody."""
