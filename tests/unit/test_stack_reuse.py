"""`dsec up` reuses a running process only when it runs this checkout's code (or, for a
foreign binary, the settings this checkout wrote)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from app.config import Settings
from app.stack.process import Service, code_fingerprint


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(state_dir=tmp_path)


def sleeper(name: str = "dsec-sleeper") -> Service:
    # "dsec" in the command line is how a pid file's process is recognised as ours.
    return Service(name, [sys.executable, "-c", "import time; time.sleep(60)", name])


def test_a_process_of_this_checkout_is_reused(settings: Settings) -> None:
    service = sleeper()
    try:
        assert service.start(settings)
        pid = service.pid(settings)
        assert not service.stale(settings)
        assert not service.start(settings)
        assert service.pid(settings) == pid
    finally:
        service.stop(settings, timeout_s=2)


@pytest.mark.parametrize("recorded", ["0123456789abcdef", None])
def test_a_process_running_other_code_is_replaced(settings: Settings, recorded: str | None) -> None:
    service = sleeper()
    try:
        assert service.start(settings)
        old = service.pid(settings)
        if recorded is None:  # started by a version that recorded no fingerprint
            service.codefile(settings).unlink()
        else:  # started from another clone or an older commit
            service.codefile(settings).write_text(recorded)
        assert service.stale(settings)
        assert service.start(settings)
        assert service.pid(settings) not in (None, old)
        assert service.codefile(settings).read_text() == code_fingerprint()
    finally:
        service.stop(settings, timeout_s=2)


def test_a_foreign_binary_is_never_stale(settings: Settings) -> None:
    service = sleeper()
    service.runs_our_code = False
    try:
        service.start(settings)
        assert not service.codefile(settings).exists()
        assert not service.stale(settings)
    finally:
        service.stop(settings, timeout_s=2)


def test_a_foreign_binary_whose_settings_changed_is_replaced(
    settings: Settings, tmp_path: Path
) -> None:
    # Given a broker-like process started with a settings file
    conf = tmp_path / "server.properties"
    conf.write_text("num.network.threads=2\n")
    service = sleeper()
    service.runs_our_code, service.config = False, conf
    try:
        assert service.start(settings)
        old = service.pid(settings)
        assert not service.stale(settings)
        assert not service.start(settings)  # the same settings: reused
        # When this checkout writes other settings
        conf.write_text("num.network.threads=1\n")
        # Then it is stale, and started again with them
        assert service.stale(settings)
        assert service.start(settings)
        assert service.pid(settings) not in (None, old)
        assert not service.stale(settings)
    finally:
        service.stop(settings, timeout_s=2)


def test_the_fingerprint_follows_the_sources() -> None:
    assert code_fingerprint() == code_fingerprint()
    assert len(code_fingerprint()) == 16


def test_down_leaves_the_services_it_is_told_to_keep(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.stack import services as stack

    broker, projector = sleeper("dsec-broker"), sleeper("dsec-projector")
    monkeypatch.setattr(stack, "services", lambda _s, _n: [broker, projector])
    monkeypatch.setattr(stack, "known_node_ids", lambda _s: [])
    try:
        broker.start(settings)
        projector.start(settings)
        stack.down(settings, log=lambda _m: None, keep=["dsec-broker", "podman"])
        assert broker.pid(settings) is not None
        assert projector.pid(settings) is None
    finally:
        broker.stop(settings, timeout_s=2)
        projector.stop(settings, timeout_s=2)
