"""Who may do what on the bus: Kafka principals and the ACLs each one holds. Pure:
:mod:`app.kafka_admin` writes them to the broker, docs/security.md shows the table.

Every key the platform issues (a tenant's, an operator's, a node's) is a Kafka
principal of its own, named for its role, subject and key id, so that rotating a key
makes a new principal and revoking it removes exactly that one. The control plane's
processes are principals by kind (scheduler, projector); the stack's administrator
(topics, principals, ACLs) is a super user of the broker. Passwords are derived from
the master key (:func:`app.domain.proof.kafka_password`), never stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from app.domain.proof import Role

#: The control plane's own principals (passwords derived from the master key).
SCHEDULER = "dsec-scheduler"
PROJECTOR = "dsec-projector"


class Resource(StrEnum):
    """What an ACL is about."""

    TOPIC = "topic"
    GROUP = "group"


class Operation(StrEnum):
    """What an ACL allows (Write and Read imply Describe in Kafka)."""

    READ = "read"
    WRITE = "write"
    DESCRIBE = "describe"


@dataclass(frozen=True, order=True)
class Grant:
    """One ACL: ``principal`` may ``operation`` on ``resource`` ``name`` (every name
    starting with it when ``prefixed``)."""

    principal: str
    resource: Resource
    name: str
    prefixed: bool
    operation: Operation


def principal_name(role: Role, subject: str, key_id: str) -> str:
    """The Kafka principal of one issued key."""
    return f"{role.value}.{subject}.{key_id}"


def _topic(principal: str, name: str, op: Operation, *, prefixed: bool = False) -> Grant:
    return Grant(principal, Resource.TOPIC, name, prefixed, op)


def key_grants(prefix: str, role: Role, subject: str, principal: str) -> list[Grant]:
    """The ACLs of an issued key's principal.

    - a tenant writes requests and reads its own replies topic, nothing else (it may
      name consumer groups under its own name, for clients that must join one); it
      also writes the nodes' inboxes, where only a command proven under the key of a
      sandbox it created is taken (the direct route, app/domain/direct.py);
    - an operator also reads the events and the dead letters;
    - a node reads its own inbox and writes events, replies and dead letters (what it
      may *say* there is bounded by the proofs, docs/security.md).
    """
    requests, events = f"{prefix}.requests", f"{prefix}.events"
    dead, replies = f"{prefix}.deadletters", f"{prefix}.replies."
    if role in (Role.TENANT, Role.OPERATOR):
        grants = [
            _topic(principal, requests, Operation.WRITE),
            _topic(principal, f"{replies}{subject}", Operation.READ),
            Grant(principal, Resource.GROUP, f"{subject}.", True, Operation.READ),
        ]
        if role == Role.TENANT:  # an operator's commands go through the scheduler
            grants += [_topic(principal, f"{prefix}.node.", Operation.WRITE, prefixed=True)]
        if role == Role.OPERATOR:
            grants += [_topic(principal, events, Operation.READ)]
            grants += [_topic(principal, dead, Operation.READ)]
        return grants
    if role == Role.NODE:
        return [
            _topic(principal, f"{prefix}.node.{subject}", Operation.READ),
            _topic(principal, events, Operation.WRITE),
            _topic(principal, dead, Operation.WRITE),
            _topic(principal, replies, Operation.WRITE, prefixed=True),
        ]
    raise ValueError(f"no Kafka grants for role {role.value}")


def service_grants(prefix: str) -> list[Grant]:
    """The ACLs of the control plane's principals for the topics of ``prefix``."""
    requests, events = f"{prefix}.requests", f"{prefix}.events"
    dead, replies, inbox = f"{prefix}.deadletters", f"{prefix}.replies.", f"{prefix}.node."
    return [
        _topic(SCHEDULER, requests, Operation.READ),
        _topic(SCHEDULER, events, Operation.READ),
        _topic(SCHEDULER, events, Operation.WRITE),
        _topic(SCHEDULER, dead, Operation.WRITE),
        _topic(SCHEDULER, replies, Operation.WRITE, prefixed=True),
        _topic(SCHEDULER, inbox, Operation.WRITE, prefixed=True),
        # A lost node's inbox, where trainers' direct commands are answered for it.
        _topic(SCHEDULER, inbox, Operation.READ, prefixed=True),
        _topic(SCHEDULER, f"{prefix}.probe", Operation.WRITE),
        _topic(PROJECTOR, events, Operation.READ),
        # The ends of lives left open on lost nodes, which the projector states under
        # the scheduler's key when no scheduler knows them (app/control/lost_lives.py).
        _topic(PROJECTOR, events, Operation.WRITE),
        _topic(PROJECTOR, dead, Operation.WRITE),
    ]
