"""Where the node counts what it does: a hook its logic calls, so that nothing here
imports a metrics library. The worker's main hands in the Prometheus one
(:class:`app.metrics.NodeMetrics`); tests and tools take :class:`NoNodeTally`."""

from __future__ import annotations

from typing import Protocol


class NodeTally(Protocol):
    """What a node counts; counting is all it may do."""

    def task(self, task: str, outcome: str) -> None:
        """A node task ended (``ok``, ``error``, ``invalid`` or ``unproven``)."""

    def forged(self, consumer: str, kind: str) -> None:
        """A message whose proof did not hold was refused."""

    def dead_letter(self, consumer: str, reason: str) -> None:
        """A message went to the dead-letter topic."""

    def waiting(self, process: str, service: str, waiting: bool) -> None:
        """A process waits for a backing service (or no longer does)."""

    def commands(self, in_flight: int, waiting: int) -> None:
        """Commands claimed and not answered, and those among them waiting their turn."""

    def created(self, warm: bool, seconds: float) -> None:
        """A create took ``seconds`` from its task to a ready sandbox."""

    def executed(self, seconds: float) -> None:
        """A command took ``seconds`` from its claim to its answer."""

    def pulled(self, seconds: float) -> None:
        """A create pulled its image from the hub in ``seconds`` (0: another had)."""

    def refused(self, reason: str) -> None:
        """A request failed or was refused with ``reason``."""

    def egress_refused(self, count: int) -> None:
        """An allowlisted sandbox ended, its allowlist having refused ``count``
        connections and names."""

    def sandboxes(self, running: int) -> None:
        """Sandboxes the node runs or is creating now."""

    def warm_ready(self, image: str, ready: int) -> None:
        """Started sandboxes of ``image`` waiting in the warm pool now."""


class NoNodeTally:
    """Counts nothing."""

    def task(self, task: str, outcome: str) -> None:
        pass

    def forged(self, consumer: str, kind: str) -> None:
        pass

    def dead_letter(self, consumer: str, reason: str) -> None:
        pass

    def waiting(self, process: str, service: str, waiting: bool) -> None:
        pass

    def commands(self, in_flight: int, waiting: int) -> None:
        pass

    def created(self, warm: bool, seconds: float) -> None:
        pass

    def executed(self, seconds: float) -> None:
        pass

    def pulled(self, seconds: float) -> None:
        pass

    def refused(self, reason: str) -> None:
        pass

    def egress_refused(self, count: int) -> None:
        pass

    def sandboxes(self, running: int) -> None:
        pass

    def warm_ready(self, image: str, ready: int) -> None:
        pass
