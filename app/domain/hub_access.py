"""Who may do what in the image hub (the unit's OCI registry), free of I/O.

The registry (Distribution) trusts tokens the platform's token service signs
(app/stack/hub_auth.py). A client logs in with its platform credential: the key id as
the user name and :func:`hub_password` of the key's secret as the password, so the
hub needs no accounts of its own, a node on another host logs in with the
credential it already holds, and a revoked key stops getting tokens at once.

Decisions:

- Nodes pull, and only pull: a node that is taken over cannot change an image every
  other node runs.
- Operators (the platform's own CLI on a control host) pull, push and delete.
- Tenants get nothing directly yet: what a tenant brings must be checked (path
  escapes, device nodes, setuid files, size) before other tenants' nodes run it, so it
  will go through the platform, not straight into the hub.
- Only ``repository`` scopes are granted; the catalog and other registry-wide scopes
  are refused to everyone (a listing of every tenant's repositories is nobody's).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from app.domain.proof import Role


class HubAction(StrEnum):
    """What a token may allow on a repository."""

    PULL = "pull"
    PUSH = "push"
    DELETE = "delete"


#: Actions each role is granted on any repository.
GRANTS: dict[Role, frozenset[HubAction]] = {
    Role.OPERATOR: frozenset(HubAction),
    Role.NODE: frozenset({HubAction.PULL}),
}

#: A repository path as the OCI distribution spec allows it (lower case components).
REPOSITORY = re.compile(
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
)
#: A tag.
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
#: Longest repository name accepted (Distribution's limit is 255 with the host).
MAX_REPOSITORY = 200


@dataclass(frozen=True)
class Scope:
    """One ``type:name:actions`` item of a token request."""

    type: str
    name: str
    actions: tuple[str, ...]


def parse_scopes(values: Iterable[str]) -> list[Scope]:
    """The scopes of a token request (each ``scope`` parameter may hold several,
    separated by spaces); malformed items are dropped, never half-read."""
    out: list[Scope] = []
    for value in values:
        for item in value.split():
            kind, _, rest = item.partition(":")
            name, sep, actions = rest.rpartition(":")
            if kind and sep and name:
                out.append(Scope(kind, name, tuple(a for a in actions.split(",") if a)))
    return out


def grant(role: Role | None, scope: Scope) -> Scope:
    """What of ``scope`` a holder of ``role`` gets: possibly no action at all."""
    allowed = GRANTS.get(role, frozenset()) if role is not None else frozenset()
    if scope.type != "repository" or not valid_repository(scope.name):
        return Scope(scope.type, scope.name, ())
    return Scope(scope.type, scope.name, tuple(a for a in scope.actions if a in allowed))


def valid_repository(name: str) -> bool:
    """A repository path the hub serves (no host part, no upper case, no ``..``)."""
    return len(name) <= MAX_REPOSITORY and REPOSITORY.fullmatch(name) is not None


@dataclass(frozen=True)
class HubReference:
    """An image as the hub names it: ``repository:tag``."""

    repository: str
    tag: str

    def __str__(self) -> str:
        return f"{self.repository}:{self.tag}"


def hub_reference(image: str) -> HubReference | None:
    """The hub's name for a sandbox's ``image`` (``team/tools:1``, ``tools``), or None
    for a name the hub cannot hold: one naming another registry, a digest, or bad
    characters. ``localhost/`` (how the layer store names local images) is dropped."""
    name = image.removeprefix("localhost/")
    repository, sep, tag = name.rpartition(":")
    if not sep or "/" in tag:
        repository, tag = name, "latest"
    first = repository.split("/", 1)[0]
    if "." in first or ":" in first or "@" in name:
        return None  # another registry's host, or a digest
    if not valid_repository(repository) or TAG.fullmatch(tag) is None:
        return None
    return HubReference(repository, tag)


def hub_password(secret: bytes) -> str:
    """The hub password of a credential: derived from its secret, so that the token
    service (which derives every secret from the master key) checks it without a
    stored copy, and nothing else need be handed to its holder."""
    return hmac.new(secret, b"dsec hub login", hashlib.sha256).hexdigest()


def password_matches(secret: bytes, offered: str) -> bool:
    """``offered`` is the hub password of ``secret`` (compared in constant time)."""
    return hmac.compare_digest(hub_password(secret), offered)
