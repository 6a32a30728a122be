"""Refusals nobody answers for, folded into samples for the log (pure).

A record whose proof fails, or that may be a copy of someone's request (a replay, one
read where it does not belong, one older than the freshness window), costs its sender
nothing to send again and again: 5,000 made-up key ids made 5,000 rows of the
append-only log. Such refusals are counted (the scheduler's metrics, each one) and
kept whole in the dead letters where they were (Kafka, cheap, with a retention), but
the log gets at most two :class:`SandboxRejected` per kind and window: the refusal
that opens the window, at once (an operator sees an attack when it starts, not a
window later), and when the window closes, if more came, one sample for the rest.
Each carries ``folded``, how many refusals it stands for, so their sum counts every
one. A proven sender's own request (its first of that id) is always logged whole,
and so attributed.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.domain.base import MAX_DETAIL, new_id
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
        #: Samples of windows a later refusal found closed, not yet taken by :meth:`due`.
        self._closed: list[SandboxRejected] = []

    def add(self, kind: str, refused: SandboxRejected, now_s: float) -> SandboxRejected | None:
        """One more refusal of ``kind``; returns the sample to log now if it opens a
        window (the rest of the window are folded into one sample when it closes)."""
        window = self._open.get(kind)
        if window is None or now_s - window.opened_s >= self.window_s:
            if window is not None and window.count > 1:
                self._closed.append(self._rest(window))
            self._open[kind] = _Window(now_s, refused)
            return _folding(refused, 1, refused.payload.detail)
        window.count += 1
        return None

    def due(self, now_s: float) -> list[SandboxRejected]:
        """The samples of the refusals that followed a window's first, for the windows
        closed by ``now_s``, each under an id of its own (every scheduler logs its own)."""
        out, self._closed = self._closed, []
        for kind in [k for k, w in self._open.items() if now_s - w.opened_s >= self.window_s]:
            window = self._open.pop(kind)
            if window.count > 1:
                out.append(self._rest(window))
        return out

    def _rest(self, window: _Window) -> SandboxRejected:
        rest = window.count - 1
        more = f" (and {rest} more like it in the {self.window_s:g} s after it)"
        detail = window.first.payload.detail[: MAX_DETAIL - len(more)] + more
        return _folding(window.first, rest, detail)


def _folding(refused: SandboxRejected, count: int, detail: str) -> SandboxRejected:
    """``refused`` as a sample standing for ``count`` refusals, under an id of its own."""
    payload = refused.payload.model_copy(update={"folded": count, "detail": detail})
    return refused.model_copy(update={"event_id": new_id(), "payload": payload})
