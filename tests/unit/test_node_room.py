"""A node refuses creates, with a reason of their own, when its disk is too full."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from app.domain.base import FailReason
from workers.creation import room_shortage
from workers.errors import NoSpace, SandboxCreateFailed, StaleCreate
from workers.failures import reason_for


def test_a_disk_with_room_is_no_shortage(tmp_path: Path) -> None:
    assert room_shortage(tmp_path, 0) is None


def test_a_disk_below_the_floor_says_how_full_it_is(tmp_path: Path) -> None:
    free_mb = shutil.disk_usage(tmp_path).free // 2**20
    # (the node's home may not exist yet: its nearest parent's disk is the one)
    found = room_shortage(tmp_path / "nodes" / "n0", free_mb + 1024)
    assert found is not None and str(tmp_path) in found and "MiB free" in found


def test_no_space_is_its_own_reason_whoever_says_it() -> None:
    assert reason_for(NoSpace("full")) == FailReason.NO_SPACE
    podman = SandboxCreateFailed("creating container storage: write ...: no space left on device")
    assert reason_for(podman) == FailReason.NO_SPACE
    assert reason_for(SandboxCreateFailed("some other trouble")) == FailReason.RUNTIME_ERROR


def test_a_create_nobody_waits_for_any_more_fails_timeout() -> None:
    assert reason_for(StaleCreate("sent 400s ago")) == FailReason.TIMEOUT


def test_a_host_without_iptables_says_its_fence_does_not_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from workers.host import setup
    from workers.host.user import NodeUser

    monkeypatch.setattr(setup.shutil, "which", lambda tool: None)
    user = NodeUser("n0", "dsec-n0", 12345, 12345, Path("/nonexistent"), (), ())
    assert setup.fence_egress(user) == "no iptables (apt-get install iptables)"
