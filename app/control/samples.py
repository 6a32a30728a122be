"""Refusals nobody answers for, folded into samples for the log (pure).

A record whose proof fails, or that may be a copy of someone's request (a replay, one
read where it does not belong, one older than the freshness window), costs its sender
nothing to send again and again: 5,000 made-up key ids made 5,000 rows of the
append-only log. Such refusals are counted (the scheduler's metrics, each one) and
kept whole in the dead letters where they were (Kafka, cheap, with a retention), but
the log gets one :class:`SandboxRejected` per kind and window: the first refusal of
the window, carrying ``folded``, how many it stands for. A proven sender's own
request (its first of that id) is always logged whole, and so attributed.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.domain.base import new_id
from app.domain.events import SandboxRejected

#: How long one sample's window is: at most one row per kind in this time.
SAMPLE_WINDOW_S = 10.0


@dataclass
class _Window:
    opened_s: float
    first: SandboxRejected
    count: int = 1


class RefusalSamples:
    """Open windows, by kind (a reason with the proof's failure or the key id)."""

    def __init__(self, window_s: float = SAMPLE_WINDOW_S) -> None:
        self.window_s = window_s
        self._open: dict[str, _Window] = {}

    def add(self, kind: str, refused: SandboxRejected, now_s: float) -> None:
        """One more refusal of ``kind`` (the first of a window is the one logged)."""
        window = self._open.get(kind)
        if window is None:
            self._open[kind] = _Window(now_s, refused)
        else:
            window.count += 1

    def due(self, now_s: float) -> list[SandboxRejected]:
        """The samples of windows that closed by ``now_s``, each under an id of its own
        (every scheduler logs its own samples)."""
        closed = [k for k, w in self._open.items() if now_s - w.opened_s >= self.window_s]
        return [self._sample(self._open.pop(kind)) for kind in closed]

    def _sample(self, window: _Window) -> SandboxRejected:
        payload = window.first.payload
        detail = payload.detail
        if window.count > 1:
            more = f" (and {window.count - 1} more like it in {self.window_s:g} s)"
            detail = detail[: 2000 - len(more)] + more
        folded = payload.model_copy(update={"folded": window.count, "detail": detail})
        return window.first.model_copy(update={"event_id": new_id(), "payload": folded})
