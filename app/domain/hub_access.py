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
- A tenant's images live under ``tenants/<tenant>/``: it pulls, pushes and deletes
  there and nowhere else (what it deletes stops counting against its quota and its
  bill), and pulls the platform's images (every repository outside
  ``tenants/``), which its images may start FROM. Another tenant's are not readable:
  private by default. A create that names another tenant's image is refused by the
  scheduler (:func:`may_use`) before any node pulls it with its own, wider, login.
- Only ``repository`` scopes are granted; the catalog and other registry-wide scopes
  are refused to everyone (a listing of every tenant's repositories is nobody's).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from enum import StrEnum

from app.domain.proof import SUBJECT, Role


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
#: A reader of a tenant's image that means every tenant (public: an operator's decision).
PUBLIC = "*"
#: Where tenants' images live: ``tenants/<tenant>/<name>``.
TENANTS = "tenants"
#: What a tenant may do in its own namespace, and elsewhere.
OWN = frozenset(HubAction)
PLATFORM = frozenset({HubAction.PULL})

#: A repository path as the OCI distribution spec allows it (lower case components).
REPOSITORY = re.compile(
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
)
#: A tag.
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
#: A name Podman could take for an image id (or the start of one).
_HEX = re.compile(r"[0-9a-f]+")
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


def owner_of(repository: str) -> str | None:
    """The tenant a repository belongs to (None: the platform's)."""
    parts = repository.split("/")
    return parts[1] if len(parts) >= 3 and parts[0] == TENANTS else None


def tenant_repository(tenant: str, name: str) -> str | None:
    """Where ``tenant`` keeps its image ``name`` (None: not a name the hub can hold)."""
    repository = f"{TENANTS}/{tenant}/{name}"
    return repository if valid_repository(repository) else None


def grant(
    role: Role | None, scope: Scope, subject: str = "", readers: Collection[str] = ()
) -> Scope:
    """What of ``scope`` the holder of ``role`` (named ``subject``) gets, given who
    else may read that repository (``readers``): possibly no action at all."""
    if role == Role.TENANT:
        owner = owner_of(scope.name)
        if owner == subject:
            allowed = OWN
        elif owner is None or subject in readers or PUBLIC in readers:
            allowed = PLATFORM  # the platform's images, or one shared with it: pull
        else:
            allowed = frozenset()
    else:
        allowed = GRANTS.get(role, frozenset()) if role is not None else frozenset()
    if scope.type != "repository" or not valid_repository(scope.name):
        return Scope(scope.type, scope.name, ())
    return Scope(scope.type, scope.name, tuple(a for a in scope.actions if a in allowed))


def oversize(size: int, limit_mb: int) -> str | None:
    """Why an image of ``size`` bytes unpacked is too big under ``limit_mb`` (0: no
    limit), or None."""
    if limit_mb and size > limit_mb << 20:
        return f"is {size / (1 << 20):.0f} MB unpacked, over the limit of {limit_mb} MB"
    return None


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


def split_tag(name: str) -> tuple[str, str]:
    """``name`` as repository and tag (``latest`` where it names none; a ``:`` before
    the last ``/`` is a registry's port, not a tag)."""
    repository, sep, tag = name.rpartition(":")
    return (repository, tag) if sep and "/" not in tag else (name, "latest")


def hub_reference(image: str) -> HubReference | None:
    """The hub's name for a sandbox's ``image`` (``team/tools:1``, ``tools``), or None
    for a name the hub cannot hold: one naming another registry, a digest, or bad
    characters. ``localhost/`` (how the layer store names local images) is dropped."""
    name = image.removeprefix("localhost/")
    repository, tag = split_tag(name)
    first = repository.split("/", 1)[0]
    if "." in first or ":" in first or "@" in name:
        return None  # another registry's host, or a digest
    if not valid_repository(repository) or TAG.fullmatch(tag) is None:
        return None
    return HubReference(repository, tag)


def may_use(
    tenant: str, image: str, readers_of: Callable[[str], Collection[str]] = lambda _: ()
) -> bool:
    """Whether a sandbox of ``tenant`` may start from ``image``: the platform's images,
    the tenant's own and those shared with it (``readers_of(repository)``), by name.
    A name that is no plain ``repository:tag`` (a digest, another registry, or hex
    alone, which Podman may read as an image id) is refused: each could reach another
    tenant's image in a node's store by other means than its name."""
    ref = hub_reference(image)
    if ref is None or _HEX.fullmatch(ref.repository):
        return False
    owner = owner_of(ref.repository)
    if owner is None or owner == tenant:
        return True
    readers = readers_of(ref.repository)
    return tenant in readers or PUBLIC in readers


#: How a snapshot's login to the hub starts (the rest names the node, the repository
#: and when it lapses).
TICKET = "ticket."
#: How long a snapshot's login lets its node push.
TICKET_TTL_S = 600


def ticket_user(node: str, repository: str, expires: int, job: str = "") -> str:
    """The user name of a one-repository hub login the scheduler hands a node for a
    snapshot: the node may push there, and only there, until ``expires``; ``job`` is
    the snapshot's job, which its storage is billed to."""
    raw = json.dumps([node, repository, expires, job], separators=(",", ":")).encode()
    return TICKET + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def ticket_password(key: bytes, user: str) -> str:
    """Its password: a MAC of the user name under the platform's ticket key (derived
    from the master key by the scheduler and the token service alike)."""
    return hmac.new(key, user.encode(), hashlib.sha256).hexdigest()


def read_ticket(key: bytes, user: str, password: str, now: float) -> tuple[str, str, str] | None:
    """The node, repository and job of a valid, unexpired ticket login; else None."""
    if not user.startswith(TICKET) or not hmac.compare_digest(ticket_password(key, user), password):
        return None
    body = user[len(TICKET) :]
    try:
        node, repository, expires, job = json.loads(
            base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        )
    except (ValueError, TypeError):
        return None
    if not all(isinstance(v, str) for v in (node, repository, job)):
        return None
    return (node, repository, job) if isinstance(expires, int) and expires > now else None


def ticket_actor(node: str, job: str) -> str:
    """How the hub's audit trail names a snapshot's push: by its node and job."""
    return f"ticket:{node}:{job}"


def job_of(actor: str) -> str | None:
    """The job a push's actor names (a snapshot's ticket), or None."""
    kind, _, rest = actor.partition(":")
    return (rest.partition(":")[2] or None) if kind == "ticket" else None


def share_refusal(role: Role, subject: str, repository: str, readers: list[str]) -> str | None:
    """Why ``subject`` (of ``role``) may not share ``repository`` with ``readers``
    (or take them back); None if it may. An owner shares its own images with named
    tenants; making one public (``*``) is an operator's decision."""
    owner = owner_of(repository) if valid_repository(repository) else None
    if owner is None:
        return f"{repository!r} is not a tenant's image repository"
    if not readers or len(readers) > MAX_READERS:
        return f"name 1 to {MAX_READERS} readers"
    for reader in readers:
        if reader == PUBLIC:
            if role != Role.OPERATOR:
                return "only an operator makes an image public"
        elif SUBJECT.match(reader) is None:
            return f"{reader!r} is not a tenant name"
    if role == Role.OPERATOR or (role == Role.TENANT and owner == subject):
        return None
    return f"{repository} is not {subject}'s"


#: Most readers one share names.
MAX_READERS = 100
#: Most tenants one repository is shared with, all shares together: every token the
#: service issues for the repository reads them, and each is a row a tenant adds.
MAX_SHARED_READERS = 1_000


def readers_refusal(repository: str, readers_after: int) -> str | None:
    """Why a share that leaves ``repository`` with ``readers_after`` readers is
    refused; None if it is not."""
    if readers_after > MAX_SHARED_READERS:
        return f"{repository} may be shared with at most {MAX_SHARED_READERS} tenants"
    return None


def hub_password(secret: bytes) -> str:
    """The hub password of a credential: derived from its secret, so that the token
    service (which derives every secret from the master key) checks it without a
    stored copy, and nothing else need be handed to its holder."""
    return hmac.new(secret, b"dsec hub login", hashlib.sha256).hexdigest()


def password_matches(secret: bytes, offered: str) -> bool:
    """``offered`` is the hub password of ``secret`` (compared in constant time)."""
    return hmac.compare_digest(hub_password(secret), offered)


#: The digest a tenant's image name was first pushed with (None: unknown, or not a
#: tenant's image): what a node runs under that name.
DigestLookup = Callable[[str], str | None]


def no_digests(image: str) -> str | None:
    """No image is pinned (tests, tools without the hub's trail)."""
    return None
