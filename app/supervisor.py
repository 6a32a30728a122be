"""Keeps the embedded stack's services running.

`dsec up` starts a supervisor beside the services. Every second it looks at each
service the stack started: one whose pid file is still there (nobody ran `dsec down`
on it) but whose process is gone died, and is started again, with a growing pause
between restarts (1 s, 2 s, 4 s ... 60 s) and at most ``LIMIT`` restarts in
``WINDOW_S``, after which it is left down and `dsec status` says it gave up. A broker
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

#: Restarts allowed within WINDOW_S before the supervisor leaves a service down.
LIMIT = 10
WINDOW_S = 600.0
#: Pause before the n-th restart in the window (the last one repeats).
BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 60.0)
#: How often the services are looked at.
TICK_S = 1.0


@dataclass
class Restarts:
    """One service's restarts by the supervisor (wall-clock times)."""

    times: list[float] = field(default_factory=list)
    gave_up: bool = False

    def recent(self, now: float) -> list[float]:
        """Restarts within the window."""
        return [t for t in self.times if now - t < WINDOW_S]

    def due(self, now: float) -> bool:
        """Whether a dead service may be started again now."""
        recent = self.recent(now)
        if len(recent) >= LIMIT:
            return False
        pause = BACKOFF_S[min(len(recent), len(BACKOFF_S) - 1)]
        return not recent or now - recent[-1] >= pause

    @staticmethod
    def path(settings: Settings, name: str) -> Path:
        return settings.state_dir / "run" / f"{name}.restarts"

    @classmethod
    def load(cls, settings: Settings, name: str) -> Restarts:
        """The record of ``name`` (empty if none)."""
        try:
            raw = json.loads(cls.path(settings, name).read_text())
            return cls(times=[float(t) for t in raw["times"]], gave_up=bool(raw["gave_up"]))
        except (OSError, ValueError, KeyError, TypeError):
            return cls()

    def save(self, settings: Settings, name: str) -> None:
        self.path(settings, name).write_text(json.dumps(asdict(self)))


def _recreate_topics(settings: Settings) -> None:
    """The embedded broker came back empty: the platform's topics, and every tenant's."""
    from app import bus, tenants
    from app.domain.proof import Role

    subjects = {
        row.subject
        for row in tenants.listing(settings)
        if row.role in (Role.TENANT, Role.OPERATOR) and row.revoked_at is None
    }
    bus.ensure_topics(settings, sorted(subjects))


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
        if not record.due(now):
            if len(record.recent(now)) >= LIMIT and not record.gave_up:
                record.gave_up = True
                record.save(settings, service.name)
                log.error("%s keeps dying: left down (`dsec up` starts it again)", service.name)
            continue
        if service.restart_if_died(settings):
            log.warning("%s died: started it again", service.name)
            record.times = [*record.recent(now), now]
            record.gave_up = False
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
