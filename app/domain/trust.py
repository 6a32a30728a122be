"""Who may say what: the rules a proven sender must also satisfy.

A proof says who sent a message (app/domain/proof.py); these rules say whether that
sender may send it. Tenants and operators send requests; nodes and the scheduler
state facts, and a node only about itself.
"""

from __future__ import annotations

from app.domain.events import Event
from app.domain.proof import Principal, Role

#: Who may send requests.
REQUEST_SENDERS = frozenset({Role.TENANT, Role.OPERATOR})
#: Who may state facts on the events topic.
EVENT_SENDERS = frozenset({Role.NODE, Role.SCHEDULER})

#: What a node may state (about its own sandboxes and itself).
NODE_EVENTS = frozenset(
    {
        "SandboxStarted", "SandboxFailed", "SandboxStopped", "SandboxFrozen",
        "SandboxThawed", "CommandCompleted", "CommandReplayed", "FileWritten", "FileRead",
        "PortExposed",
        "NodeRegistered", "NodeHeartbeat",
    }
)  # fmt: skip
#: What only a node may state: that it is alive and what it runs.
NODE_ONLY_EVENTS = frozenset({"NodeRegistered", "NodeHeartbeat"})


def event_refusal(sender: Principal, event: Event) -> str | None:
    """Why ``sender`` may not state ``event``; None if it may."""
    if sender.role == Role.SCHEDULER:
        if event.type in NODE_ONLY_EVENTS:
            return f"only a node may send {event.type}"
        return None
    if sender.role != Role.NODE:
        return f"a {sender.role.value} credential cannot state facts"
    if event.type not in NODE_EVENTS:
        return f"a node may not send {event.type}"
    if event.node_id != sender.subject:
        return f"node {sender.subject} sent an event about node {event.node_id}"
    return None


def may_act_on(sender: Principal, owner: str) -> bool:
    """Whether ``sender`` may act on something ``owner`` owns (its own, or an operator)."""
    return sender.is_operator or sender.subject == owner
