"""A service's restarts by the supervisor, as kept on disk and read by `dsec status`
and `dsec up`: the crash-loop rule in one place (see :mod:`app.stack.supervisor`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from app.config import Settings

#: Deaths soon after a start, in a row, before the supervisor leaves a service down.
LIMIT = 10
#: A service that ran this long before dying was not crash-looping.
STABLE_S = 30.0
#: Restarts shown by `dsec status`: those within this window.
WINDOW_S = 600.0
#: Pause before the restart that follows the n-th quick death in a row.
BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 60.0)


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
