"""The node's Redis adapter: step results come back as they were kept, and redis-py's
errors leave it as the node's own."""

from __future__ import annotations

import socket
import uuid
from typing import Any

import pytest
import redis

from app.domain.events import CommandPayload
from app.domain.requests import Exec
from app.domain.trajectory import RecordedStep
from app.errors import ServiceUnavailable
from workers.errors import NodeError, RedisFailed, RedisUnavailable
from workers.redis_state import Claims, StepGuard


class _Strings:
    """The string calls a StepGuard makes, on a dict."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: Any, nx: bool = False, ex: int | None = None) -> bool:
        if nx and key in self.values:
            return False
        self.values[key] = value.encode() if isinstance(value, str) else value
        return True

    def get(self, key: str) -> bytes | None:
        return self.values.get(key)

    def delete(self, key: str) -> None:
        self.values.pop(key, None)


class _Refusing:
    """A Redis that answers every call with an error reply."""

    def __getattr__(self, name: str) -> Any:
        def refuse(*_args: Any, **_kwargs: Any) -> Any:
            raise redis.ResponseError("WRONGTYPE Operation against a key")

        return refuse


def _exec(step: int = 3) -> Exec:
    return Exec(
        sandbox_id="sb-1", tenant="t", job_id="j", actor="t", command=["echo", "hi"],
        trajectory_id="tr", step=step,
    )  # fmt: skip


def test_a_step_is_replayed_with_what_its_record_in_the_log_keeps() -> None:
    guard = StepGuard(_Strings())  # type: ignore[arg-type]
    first, second = _exec(), _exec()
    # Given a step one request claimed and ran, with its output cut for the log
    assert guard.claim("t", "tr", 3, str(first.request_id))
    completed = CommandPayload(
        request_id=first.request_id, actor="t", command=first.command, exit_code=0,
        duration_ms=1.5, stdout_bytes=3, stderr_bytes=0, truncated=True,
        trajectory_id="tr", step=3, stdout_b64="aGkK", stderr_b64="",
    )  # fmt: skip
    recorded = RecordedStep.of(completed)
    assert recorded is not None
    guard.record("t", "tr", recorded)
    # When a second request for the step finds it claimed and waits
    assert not guard.claim("t", "tr", 3, str(second.request_id))
    kept = guard.wait("t", "tr", 3, timeout_s=1.0)
    # Then it gets the step as recorded, and is answered as a replay of the first
    assert kept == recorded
    event, reply = kept.replay(second, node_id="n1")
    assert event.payload.original_request_id == first.request_id
    assert reply.replayed and reply.stdout_b64 == "aGkK"
    assert reply.stdout_truncated and reply.stderr_truncated


def test_a_command_that_is_no_step_keeps_nothing_for_replays() -> None:
    completed = CommandPayload(
        request_id=uuid.uuid4(), actor="t", command="true", exit_code=0, duration_ms=1.0,
        stdout_bytes=0, stderr_bytes=0,
    )  # fmt: skip
    assert RecordedStep.of(completed) is None


def test_an_unreadable_step_result_is_no_result() -> None:
    store = _Strings()
    store.values["dsec:step:t:tr:3:result"] = b'{"request_id": "not an id"}'
    assert StepGuard(store).wait("t", "tr", 3, timeout_s=1.0) is None  # type: ignore[arg-type]


def test_redis_out_of_reach_is_the_nodes_own_error() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    claims = Claims(redis.Redis(port=port, socket_connect_timeout=1), "n1", b"s" * 32, 660)
    with pytest.raises(RedisUnavailable) as raised:
        claims.claim(_exec(), None)
    # (a platform outage, a node error and a ConnectionError alike)
    assert all(
        isinstance(raised.value, t) for t in (ServiceUnavailable, NodeError, ConnectionError)
    )
    assert isinstance(raised.value.__cause__, redis.ConnectionError)


def test_an_error_reply_is_a_failure_not_an_outage() -> None:
    with pytest.raises(RedisFailed) as raised:
        StepGuard(_Refusing()).release("t", "tr", 3)  # type: ignore[arg-type]
    assert not isinstance(raised.value, RedisUnavailable)
