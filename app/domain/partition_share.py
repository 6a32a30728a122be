"""Sharing one topic's partitions among several schedulers (pure arithmetic).

Every live scheduler is a member; each aims at its fair share, ``ceil(partitions /
members)``. One that holds more gives the extra back (its highest partitions: the
choice is arbitrary but stable, so two rounds never swap partitions back and forth);
one that holds fewer claims free partitions (its lowest free ones) up to its share.
Shares always add up to at least the partition count, so no partition stays free
for longer than a round once every member has looked.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass


def fair_share(partitions: int, members: int) -> int:
    """Partitions one of ``members`` schedulers should hold (a lone or unknown
    membership counts as one member: it takes everything)."""
    if partitions <= 0:
        return 0
    return math.ceil(partitions / max(members, 1))


@dataclass(frozen=True)
class Rebalance:
    """What one scheduler does in one round: partitions to try to claim (another may
    win the race for them) and partitions to give back."""

    claim: tuple[int, ...] = ()
    release: tuple[int, ...] = ()


def rebalance(
    owned: Collection[int], free: Collection[int], partitions: int, members: int
) -> Rebalance:
    """One round for a scheduler that holds ``owned``, seeing ``free`` unheld and
    ``members`` live schedulers (itself included)."""
    share = fair_share(partitions, members)
    mine = sorted(p for p in owned if 0 <= p < partitions)
    if len(mine) > share:
        return Rebalance(release=tuple(mine[share:]))
    candidates = sorted(p for p in free if 0 <= p < partitions and p not in owned)
    return Rebalance(claim=tuple(candidates[: share - len(mine)]))
