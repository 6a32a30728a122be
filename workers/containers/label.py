"""The labels a sandbox's container carries, in one place: who it is for, until when,
on which node, and whether it waits in a warm pool. Podman keeps them with the
container, so a worker that restarts reads back what it needs from them."""

from __future__ import annotations

from datetime import datetime

#: The sandbox id the container was created for (for a warm one, its slot id: labels
#: cannot change when it is claimed). Every sandbox container carries it.
SANDBOX_ID = "dsec.sandbox_id"
TENANT = "dsec.tenant"
JOB = "dsec.job_id"
#: The TTL's deadline, ISO 8601 with its zone.
EXPIRES = "dsec.expires_at"
NODE = "dsec.node_id"
#: A warm-pool container; the value is the pool's image (workers/warm_pool.py).
WARM = "dsec.warm"


def expires_at(labels: dict[str, str]) -> datetime | None:
    """The sandbox's TTL deadline, from its labels (None if absent or unreadable)."""
    raw = labels.get(EXPIRES)
    if not raw:
        return None
    try:
        return datetime.fromisoformat(raw)
    except ValueError:
        return None
