"""Keeps the embedded stack's services running.

`dsec up` starts a supervisor beside the services. Every second it looks at each
service the stack started: one whose pid file is still there (nobody ran `dsec down`
on it) but whose process is gone died, and is started again. A service that had run
for ``STABLE_S`` is started again at once: it is not crash-looping, and a node worker
kept down longer than the heartbeat timeout would lose its node's sandboxes. Deaths
that come soon after a start make a crash loop: each is followed by a longer pause
(1 s, 2 s, 4 s ... 60 s), and after ``LIMIT`` in a row the service is left down and
`dsec status` says it gave up. A broker
that comes back is empty (the embedded broker keeps topics in memory): the supervisor
makes the platform's and every tenant's topics again.

Each service's restarts are kept in ``<state_dir>/run/<name>.restarts`` (JSON), which
`dsec status` reads.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from app.config import Settings

log = logging.getLogger(__name__)

#: Deaths soon after a start, in a row, before the supervisor leaves a service down.
LIMIT = 10
#: A service that ran this long before dying was not crash-looping.
STABLE_S = 30.0
#: Restarts shown by `dsec status`: those within this window.
WINDOW_S = 600.0
#: Pause before the restart that follows the n-th quick death in a row.
BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 60.0)
#: How often the services are looked at.
TICK_S = 1.0


@dataclass
class Restarts:
    """One service's restarts by the supervisor (wall-clock times)."""

    times: list[float] = field(default_factory=list)
    #: Deaths in a row that each came within STABLE_S of the start before.
    quick: int = 0
    #: When the supervisor first saw the service dead (None while it runs).
    died_at: float | None = None
    gave_up: bool = False

    def recent(self, now: float) -> list[float]:
        """Restarts within the window."""
        return [t for t in self.times if now - t < WINDOW_S]

    def died(self, now: float) -> None:
        """Note a death seen at ``now`` (once per death): it extends the crash loop if
        it came soon after the supervisor's last start, and ends it otherwise."""
        if self.died_at is not None:
            return
        self.died_at = now
        soon = bool(self.times) and now - self.times[-1] < STABLE_S
        self.quick = self.quick + 1 if soon else 0

    def due(self, now: float) -> bool:
        """Whether a dead service may be started again now."""
        if self.quick >= LIMIT:
            return False
        pause = BACKOFF_S[min(self.quick, len(BACKOFF_S) - 1)]
        return self.died_at is None or now - self.died_at >= pause

    def started(self, now: float) -> None:
        """Note a restart at ``now``."""
        self.times = [*self.recent(now), now]
        self.died_at = None
        self.gave_up = False

    @classmethod
    def started_by_hand(cls, settings: Settings, name: str) -> None:
        """`dsec up` started the service: whatever loop it was in is over."""
        if cls.path(settings, name).exists():
            record = cls.load(settings, name)
            record.quick, record.died_at, record.gave_up = 0, None, False
            record.save(settings, name)

    @staticmethod
    def path(settings: Settings, name: str) -> Path:
        return settings.state_dir / "run" / f"{name}.restarts"

    @classmethod
    def load(cls, settings: Settings, name: str) -> Restarts:
        """The record of ``name`` (empty if none)."""
        try:
            raw = json.loads(cls.path(settings, name).read_text())
            died_at = raw.get("died_at")
            return cls(
                times=[float(t) for t in raw["times"]],
                quick=int(raw.get("quick", 0)),
                died_at=None if died_at is None else float(died_at),
                gave_up=bool(raw["gave_up"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return cls()

    def save(self, settings: Settings, name: str) -> None:
        self.path(settings, name).write_text(json.dumps(asdict(self)))


def _recreate_topics(settings: Settings) -> None:
    """The embedded broker came back empty: the platform's topics, and every tenant's."""
    from app import bus, tenants

    bus.ensure_topics(settings, tenants.reply_subjects(settings))


def tend(settings: Settings, now: float | None = None) -> list[str]:
    """One look at every service; returns the names started again."""
    from app import stack

    now = time.time() if now is None else now
    started = []
    for service in stack.services(settings, stack.known_node_ids(settings)):
        if service.name == stack.SUPERVISOR:
            continue
        if not service.pidfile(settings).exists() or service.pid(settings) is not None:
            continue  # stopped on purpose, or running
        record = Restarts.load(settings, service.name)
        if record.died_at is None:
            record.died(now)
            record.save(settings, service.name)
        if not record.due(now):
            if record.quick >= LIMIT and not record.gave_up:
                record.gave_up = True
                record.save(settings, service.name)
                log.error("%s keeps dying: left down (`dsec up` starts it again)", service.name)
            continue
        if service.restart_if_died(settings):
            log.warning("%s died: started it again", service.name)
            record.started(now)
            record.save(settings, service.name)
            started.append(service.name)
            if service.name == "broker":
                stack.wait_until(service.ready or (lambda: True), 20, "the broker")
                _recreate_topics(settings)
    return started


def run(settings: Settings) -> None:
    """Tend the services until SIGTERM."""
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    log.info("supervisor: watching the stack's services every %.0f s", TICK_S)
    while not stopping.wait(TICK_S):
        try:
            tend(settings)
        except Exception:  # one bad look must not end the supervision
            log.exception("supervisor: a round failed")
