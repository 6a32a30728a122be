"""The node's half of the trajectory log: a step runs at most once.

The scheduler answers steps it finds in the log. A step that is not there yet (its
result still on the way to Postgres, or running right now) is guarded here: the
node claims ``(trajectory_id, step)`` in Redis before running it, and keeps the
result in Redis for an hour afterwards. A second request for a claimed step waits
for that result and is answered with it, marked replayed, instead of running the
command again.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import redis

CLAIM_TTL_S = 7 * 86_400
RESULT_TTL_S = 3600
POLL_S = 0.05


@dataclass(frozen=True)
class StepResult:
    """A step's result as kept in Redis."""

    request_id: str
    exit_code: int
    stdout_b64: str
    stderr_b64: str
    duration_ms: float
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool


class StepGuard:
    """Claims steps and shares their results through Redis."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    @staticmethod
    def _keys(tenant: str, trajectory_id: str, step: int) -> tuple[str, str]:
        # Trajectory ids are the tenant's own; a tenant name has no ':'.
        base = f"dsec:step:{tenant}:{trajectory_id}:{step}"
        return base, base + ":result"

    def claim(self, tenant: str, trajectory_id: str, step: int, request_id: str) -> bool:
        """True if this request may run the step (nobody claimed it before)."""
        claim, _ = self._keys(tenant, trajectory_id, step)
        return bool(self.redis.set(claim, request_id, nx=True, ex=CLAIM_TTL_S))

    def release(self, tenant: str, trajectory_id: str, step: int) -> None:
        """Give the step up (the command could not be started at all)."""
        claim, _ = self._keys(tenant, trajectory_id, step)
        self.redis.delete(claim)

    def record(self, tenant: str, trajectory_id: str, step: int, result: StepResult) -> None:
        """Keep the step's result for the requests that wait on it."""
        _, key = self._keys(tenant, trajectory_id, step)
        self.redis.set(key, json.dumps(asdict(result)), ex=RESULT_TTL_S)

    def wait(
        self, tenant: str, trajectory_id: str, step: int, timeout_s: float
    ) -> StepResult | None:
        """The result of a step someone else claimed, once it is recorded."""
        _, key = self._keys(tenant, trajectory_id, step)
        deadline = time.monotonic() + timeout_s
        while True:
            raw = self.redis.get(key)
            if raw is not None:
                return StepResult(**json.loads(raw))
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)
