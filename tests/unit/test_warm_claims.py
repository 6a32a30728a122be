"""A warm create goes all the way round in one process (tests/unit/in_process.py): the
trainer is answered before the claimed container takes the sandbox's name, and a
rename Podman refuses ends the sandbox in the log instead of leaving it nameless."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.domain.base import StopReason
from app.domain.codec import decode_event
from app.domain.events import SandboxStarted, SandboxStopped
from tests.unit.in_process import IMAGE, PARTITIONS, Platform
from workers import runtime
from workers.errors import NodeError
from workers.warm_pool import WarmPool


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch) -> Iterator[Platform]:
    # Short: the agents' sockets live under it, and AF_UNIX takes 107 bytes at most.
    with tempfile.TemporaryDirectory(prefix="wc-") as state_dir:
        built = Platform(Path(state_dir))
        monkeypatch.setattr(runtime, "_node", built.node)
        pool = WarmPool(built.node, {IMAGE: 1}, idle_s=0)
        built.node.warm = pool
        pool.start()
        deadline = time.monotonic() + 5
        while pool.ready(IMAGE) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.ready(IMAGE) == 1
        pool.close(drain=False)  # no refill while the test looks
        built.beat()
        built.settle()
        yield built
        built.close()


def _events(platform: Platform) -> list[object]:
    topic = platform.settings.topic_events
    return [decode_event(r.value or b"") for r in platform.bus.read(topic, 0, 0, wait_s=0)]


def test_a_warm_create_is_answered_and_its_container_then_takes_its_name(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    renamed_after: list[bool] = []
    rename = platform.driver.rename

    def rename_seen(old: str, new: str) -> None:
        # Whether the trainer's answer had been sent when the rename began
        topic = platform.settings.replies_topic("t")
        replies = [
            r for p in range(PARTITIONS.replies_each)
            for r in platform.bus.read(topic, p, 0, wait_s=0)
        ]  # fmt: skip
        renamed_after.append(any(new.encode() in (r.value or b"") for r in replies))
        rename(old, new)

    monkeypatch.setattr(platform.driver, "rename", rename_seen)
    sandbox = platform.run(platform.client().create_many_steps(1))[0]
    platform.settle()
    started = [e for e in _events(platform) if isinstance(e, SandboxStarted)]
    assert started and started[-1].payload.warm
    box = platform.driver.get(sandbox.id)
    assert box is not None and box.claimed and renamed_after == [True]
    assert platform.run(sandbox.exec_steps("echo hi")).text == "hi\n"


def test_a_rename_refused_after_the_answer_ends_the_sandbox_failed(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(old: str, new: str) -> None:
        raise NodeError("rename refused")

    monkeypatch.setattr(platform.driver, "rename", refused)
    sandbox = platform.run(platform.client().create_many_steps(1))[0]
    platform.settle()
    stopped = [
        e for e in _events(platform) if isinstance(e, SandboxStopped) and e.sandbox_id == sandbox.id
    ]
    assert len(stopped) == 1 and stopped[0].payload.reason == StopReason.FAILED
    assert "could not be renamed" in stopped[0].payload.detail
    assert platform.driver.list_sandboxes() == []
