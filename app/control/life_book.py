"""The scheduler's book of the lives whose end it waits for, without I/O.

Three kinds, each with the deadline the scheduler keeps (:mod:`app.domain.lives`):

- lives placed (or only requested) and not started: a node that never answers their
  create leaves them open, holding room; past their deadline they end
  ``create_lost``. The book knows when each was requested, whichever scheduler placed
  it, and a restarted scheduler learns it again from the projections;
- lives whose destroy was sent: their node is ending them, so a heartbeat that no
  longer lists them is no reason to call them vanished (the observed double end:
  ``failed: container vanished`` and then the destroy's own end) for a while;
- lives left on a node declared lost: the scheduler that declares a node lost ends
  its lives at once; every other scheduler ends those it still holds a little later
  (the declarer's ends come first, and carry the same ids), and a scheduler that
  recovers lives on a node already lost ends them at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from app.domain.lives import OpenLife, Terms, deadline_of

#: How often the lives not started are looked over for lost creates.
CHECK = timedelta(seconds=1)
#: How long a sandbox whose destroy was sent is not called vanished by the reconciler
#: (a destroy takes well under a second; a worker restarted in between does it again).
ENDING_S = 30.0
#: How long after another scheduler declared a node lost this one ends what is left
#: on it (the declarer's own ends normally follow its NodeLost at once).
LEFT_ON_LOST_S = 5.0


@dataclass(frozen=True)
class Unstarted:
    """A life placed (or only requested) whose start has not come back."""

    sandbox_id: str
    tenant: str
    job_id: str
    #: Where it was placed; None: only its request is in the log.
    node_id: str | None
    #: When it was requested (its SandboxRequested's time): what dates its deadline.
    requested_at: datetime | None

    def life(self) -> OpenLife:
        """As an open life (for its deadline and its end)."""
        return OpenLife(
            self.sandbox_id, self.tenant, self.job_id, self.node_id, self.requested_at,
            scheduled=self.node_id is not None,
        )  # fmt: skip


class LifeBook:
    """The scheduler's lives not started, being destroyed, or left on lost nodes."""

    def __init__(self, terms: Terms) -> None:
        self.terms = terms
        # Each life not started, with its deadline (None: nothing dates it).
        self._unstarted: dict[str, tuple[Unstarted, datetime | None]] = {}
        # Thousands of creates can wait in nodes' queues: they are looked over once a
        # second (:data:`CHECK_S`), not every round of the scheduler.
        self._checked: datetime | None = None
        # Sandbox -> when its destroy was sent (the scheduler's monotonic clock).
        self._ending: dict[str, float] = {}
        # Lost node -> when what is left on it is due to end (monotonic).
        self._lost: dict[str, float] = {}

    # --- lives not started --------------------------------------------------------

    def placed(self, entry: Unstarted) -> None:
        """A life was placed (or recovered unstarted)."""
        self._unstarted[entry.sandbox_id] = (entry, deadline_of(entry.life(), self.terms).at)

    def started(self, sandbox_id: str) -> None:
        """Its node started it: no create deadline any more."""
        self._unstarted.pop(sandbox_id, None)

    def __contains__(self, sandbox_id: object) -> bool:
        return sandbox_id in self._unstarted

    @property
    def unstarted(self) -> set[str]:
        """The lives placed and not started."""
        return set(self._unstarted)

    def lost_creates(self, now: datetime) -> list[Unstarted]:
        """The lives not started whose create can no longer start, oldest first (each
        is returned once: the caller ends it)."""
        if self._checked is not None and now - self._checked < CHECK:
            return []
        self._checked = now
        due = [(at, e) for e, at in self._unstarted.values() if at is not None and at < now]
        for _, entry in due:
            del self._unstarted[entry.sandbox_id]
        return [entry for _, entry in sorted(due, key=lambda d: (d[0], d[1].sandbox_id))]

    # --- lives being destroyed ----------------------------------------------------

    def ending(self, sandbox_id: str, now_s: float) -> None:
        """A destroy of the sandbox was sent to its node."""
        self._ending[sandbox_id] = now_s

    def quiet(self, placed: set[str], now_s: float) -> set[str]:
        """Those of ``placed`` a heartbeat may leave out without their being vanished:
        not started yet (a create can wait in a node's queue for many heartbeats), or
        being destroyed (for :data:`ENDING_S`)."""
        for sandbox_id, sent in list(self._ending.items()):
            if now_s - sent > ENDING_S:
                del self._ending[sandbox_id]
        return {s for s in placed if s in self._unstarted or s in self._ending}

    # --- lives left on lost nodes -------------------------------------------------

    def node_lost(self, node_id: str, now_s: float, *, at_once: bool = False) -> None:
        """A node was declared lost (by another scheduler, or before this one started:
        ``at_once``): what is left on it ends once due."""
        self._lost.setdefault(node_id, now_s if at_once else now_s + LEFT_ON_LOST_S)

    def node_back(self, node_id: str) -> None:
        """The node was heard from again."""
        self._lost.pop(node_id, None)

    def lost_nodes_due(self, now_s: float) -> list[str]:
        """The lost nodes whose leftover lives are due to end now (each once)."""
        due = sorted(n for n, at in self._lost.items() if at <= now_s)
        for node_id in due:
            del self._lost[node_id]
        return due

    # --- ended ----------------------------------------------------------------------

    def forget(self, sandbox_id: str) -> None:
        """The life ended."""
        self._unstarted.pop(sandbox_id, None)
        self._ending.pop(sandbox_id, None)
