"""What the log admits about a sandbox beyond its sender's proof (pure).

A proof says who states an event, and :mod:`app.domain.trust` which kinds of event
that sender may state. Two more rules need what the log already holds of the
sandbox, so the projector applies them as it appends (:func:`screen`):

- **A node speaks only for the sandboxes placed on it.** An event a node proved about
  a sandbox (started, failed, stopped, frozen, thawed, a command, a file) is refused
  ``forbidden`` unless the sandbox's ``SandboxScheduled`` names that node: a node's
  key cannot end another node's sandbox, start one nobody placed and bill it to a
  tenant of its choosing, or add commands to another's bill.
- **A life ends once.** A second end of the same life (a ``SandboxStopped``, or a
  ``SandboxFailed`` of its create) is not appended: the reconciler, a destroy, a
  lost node and a restart can race to end one sandbox, and every reader of the log
  (the raw billing views, the audit trail, a count of ends) must find one end. It
  is set aside as a dead letter, ``already_ended``, rather than recorded as a note:
  the log holds what its senders proved, in the words they proved it, and a note
  would be either the same event (an end for every reader that does not know the
  note) or words nobody signed. The dead letter keeps the bytes, the sender's
  position and the reason, ``dsec deadletters ls --reason already_ended`` lists these
  races, and a metric counts them. An end the log holds already under the same id
  (the same end, declared twice) is a duplicate, skipped as any other.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from app.domain.codec import DeadLetterReason, DecodeError
from app.domain.events import Event, SandboxFailed, SandboxScheduled, SandboxStarted, SandboxStopped


@dataclass(frozen=True)
class Known:
    """What the log holds of one sandbox, as far as these rules go."""

    #: The node its SandboxScheduled names; None: never placed.
    placed_on: str | None = None
    #: Its life has ended (stopped, or its create failed).
    ended: bool = False


def is_end(event: Event) -> bool:
    """Whether ``event`` ends a sandbox's life."""
    match event:
        case SandboxStopped():
            return True
        case SandboxFailed(payload=p):
            return p.request_type == "CreateSandbox"
    return False


def refusal(event: Event, node: str | None, known: Known | None) -> DecodeError | None:
    """Why the log refuses ``event`` about its sandbox, stated by ``node`` (None: by
    the scheduler), given what it holds of the sandbox; None if it admits it."""
    if event.sandbox_id is None:
        return None
    if node is not None and (known is None or known.placed_on != node):
        where = "was never placed" if known is None or known.placed_on is None else (
            f"was placed on {known.placed_on}"
        )  # fmt: skip
        return DecodeError(
            DeadLetterReason.FORBIDDEN,
            f"node {node} stated {event.type} about sandbox {event.sandbox_id}, which {where}",
        )
    if known is not None and known.ended and is_end(event):
        return DecodeError(
            DeadLetterReason.ALREADY_ENDED,
            f"{event.type} of sandbox {event.sandbox_id}: its life has ended already",
        )
    return None


def after(event: Event, known: Known | None) -> Known | None:
    """What the log holds of the sandbox once ``event`` is appended (as the
    ``sandboxes`` projection has it: its node is the one its placement or start names)."""
    base = known or Known()
    if is_end(event):
        return replace(base, ended=True)
    if base.ended:
        return known
    if isinstance(event, SandboxScheduled):
        return replace(base, placed_on=event.payload.node_id)
    if isinstance(event, SandboxStarted) and event.node_id is not None:
        return replace(base, placed_on=event.node_id)
    return known


def screen(
    items: Sequence[tuple[Event, str | None]],
    known: Mapping[str, Known],
    logged: set[uuid.UUID],
) -> list[DecodeError | None]:
    """For each (event, the node that stated it or None), in log order: why the log
    refuses it, or None. ``known``: what the log holds of the batch's sandboxes before
    it; ``logged``: the ids of the batch's ends the log holds already (duplicates are
    skipped by the append, not refused here). Later events see the earlier ones."""
    now = dict(known)
    seen = set(logged)
    verdicts: list[DecodeError | None] = []
    for event, node in items:
        sandbox = event.sandbox_id
        if sandbox is None or (event.event_id in seen and is_end(event)):
            verdicts.append(None)
            continue
        verdict = refusal(event, node, now.get(sandbox))
        verdicts.append(verdict)
        if verdict is None:
            seen.add(event.event_id)
            moved = after(event, now.get(sandbox))
            if moved is not None:
                now[sandbox] = moved
    return verdicts
