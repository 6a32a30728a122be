"""A command that reaches its node after its trainer gave up never runs: its claim,
kept only twice the freshness window, may be gone, and running it could run it twice."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any, cast

from app.config import Settings
from app.domain.base import utcnow
from app.domain.requests import Exec
from workers.errors import StaleCommand
from workers.exec_path import Ender, ExecHost, ExecPath
from workers.failures import reason_for
from workers.redis_state import CLAIM_SKEW_S, claim_ttl_s


class _Claims:
    def __init__(self) -> None:
        self.claimed: list[Exec] = []

    def claim(self, request: Exec, reply_key: bytes | None) -> bool:
        self.claimed.append(request)
        return True


class _Failures:
    def __init__(self) -> None:
        self.failed: list[tuple[Exec, Exception]] = []

    def fail(self, request: Exec, exc: Exception) -> None:
        self.failed.append((request, exc))


def _exec(sent_ago_s: float) -> Exec:
    return Exec(
        sandbox_id="sb-1", tenant="t", actor="t:test", command=["true"],
        sent_at=utcnow() - timedelta(seconds=sent_ago_s),
    )  # fmt: skip


def _path() -> tuple[ExecPath, Any]:
    node = SimpleNamespace(
        settings=Settings(request_max_age_s=300), claims=_Claims(), failures=_Failures()
    )
    return ExecPath(cast(ExecHost, node), cast(Ender, None)), node


def test_a_command_sent_longer_ago_than_the_freshness_window_is_refused_unclaimed() -> None:
    path, node = _path()
    assert path.admit_exec(_exec(sent_ago_s=301)) is None
    assert node.claims.claimed == []
    [(_request, exc)] = node.failures.failed
    assert isinstance(exc, StaleCommand)
    assert reason_for(exc).value == "timeout"


def test_a_fresh_command_is_claimed_and_its_claim_outlives_every_fresh_delivery() -> None:
    path, node = _path()
    assert path.admit_exec(_exec(sent_ago_s=10)) is not None
    assert len(node.claims.claimed) == 1 and node.failures.failed == []
    # Stamped up to the window ahead and delivered up to the window late: twice it.
    assert claim_ttl_s(300) == 600 + CLAIM_SKEW_S
