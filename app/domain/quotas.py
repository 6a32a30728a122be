"""What one tenant may hold at once: a limit per resource a request can create or hold.

Defaults come from the settings (``DSEC_QUOTA_*``, ``DSEC_DEFAULT_TENANT_QUOTA`` for
sandboxes); an operator sets a tenant's own with ``dsec tenant quota`` (stored in
Postgres, read again by the scheduler every few seconds). A request that would take a
tenant past a limit is refused ``quota``, naming the limit; an operator's requests are
not held to quotas (the scheduler logs each time one goes past). ``capacity`` stays
the reason for nodes without room.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class Resource(StrEnum):
    """What a quota limits."""

    SANDBOXES = "sandboxes"
    LEASES = "leases"
    GROUPS = "groups"
    PENDING_CREATES = "pending_creates"
    COMMANDS = "commands"
    TRAJECTORIES = "trajectories"
    IMAGES = "images"
    IMAGE_MB = "image_mb"


#: A limit: the most of a resource (0: none at all), or None: no limit.
Limit = int | None


class Quota(BaseModel):
    """The most of each resource one tenant may hold at once; None: no limit."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sandboxes: Limit = Field(None, ge=0, description="Live sandboxes (placed, not ended).")
    leases: Limit = Field(
        None, ge=0, description="Trainer leases (renewed, or holding sandboxes) not yet lapsed."
    )
    groups: Limit = Field(
        None, ge=0, description="Rollout groups with a member alive, or waiting for room."
    )
    pending_creates: Limit = Field(
        None, ge=0, description="Sandboxes waiting for room (a group counts its members)."
    )
    commands: Limit = Field(
        None, ge=0, description="Commands routed to a node and not finished yet."
    )
    trajectories: Limit = Field(
        None, ge=0, description="Trajectories being written by its live sandboxes."
    )
    images: Limit = Field(
        None,
        ge=0,
        description="Image repositories in the hub (the token service enforces it).",
    )
    image_mb: Limit = Field(
        None,
        ge=0,
        description=(
            "Megabytes its images hold in the hub, each layer once (the token service"
            " gives no push once it holds this much)."
        ),
    )

    def limit(self, resource: Resource) -> Limit:
        """The limit on ``resource``."""
        found: Limit = getattr(self, resource.value)
        return found

    def overridden(self, overrides: Mapping[Resource, Limit]) -> Quota:
        """This quota with a tenant's own limits in place of the defaults."""
        return self.model_copy(update={r.value: limit for r, limit in overrides.items()})


def exceeds(limit: Limit, held: int, adding: int = 1) -> bool:
    """Whether holding ``adding`` more than ``held`` goes past ``limit``."""
    return limit is not None and held + adding > limit
