"""A claimed warm sandbox's claim record: what its container's labels cannot say
(workers/warm_pool.py), kept as ``sandbox.json`` in its run directory. The run
directory is the node's own and mounted read-only into the sandbox, so the record
cannot be forged from inside."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

#: The claim record in a claimed sandbox's run directory.
RECORD_NAME = "sandbox.json"
#: Largest claim record read back (it holds a create request's env and labels).
MAX_RECORD_BYTES = 1 << 20


@dataclass(frozen=True)
class ClaimRecord:
    """What a claimed sandbox's container labels cannot say."""

    sandbox_id: str
    #: The warm slot the container was created as (its ``dsec.sandbox_id`` label).
    slot_id: str
    image: str
    #: The labels a cold create would have given it (tenant, job, expiry, node).
    labels: dict[str, str] = field(default_factory=dict)
    #: The create request's environment.
    env: dict[str, str] = field(default_factory=dict)


def write_record(run_dir: Path, record: ClaimRecord) -> None:
    """Write the claim record atomically (the run dir is the node's own)."""
    tmp = run_dir / f".{RECORD_NAME}.tmp"
    tmp.write_text(json.dumps(asdict(record)))
    tmp.chmod(0o644)
    tmp.replace(run_dir / RECORD_NAME)


def read_record(run_dir: Path) -> ClaimRecord | None:
    """The claim record in ``run_dir``, or None if it is missing or unreadable."""
    try:
        fd = os.open(run_dir / RECORD_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            data = json.loads(f.read(MAX_RECORD_BYTES))
        return ClaimRecord(
            sandbox_id=str(data["sandbox_id"]),
            slot_id=str(data["slot_id"]),
            image=str(data["image"]),
            labels={str(k): str(v) for k, v in dict(data["labels"]).items()},
            env={str(k): str(v) for k, v in dict(data["env"]).items()},
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("claim record in %s unreadable: %s", run_dir, exc)
        return None
