"""Tenants' own quotas (``tenant_quotas``): set by an operator (the owner role), read
by the scheduler (any service)."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from sqlalchemy import Connection, delete, select
from sqlalchemy.dialects.postgresql import insert

from app.db.tables import tenant_quotas
from app.domain.quotas import Limit, Resource

#: Each tenant's own limits, by resource (a resource it has none for takes the default).
Overrides = dict[str, dict[Resource, Limit]]


def load(conn: Connection, tenant: str | None = None) -> Overrides:
    """Every tenant's own limits (or ``tenant``'s)."""
    t = tenant_quotas
    query = select(t.c.tenant, t.c.resource, t.c.max_held)
    if tenant is not None:
        query = query.where(t.c.tenant == tenant)
    found: Overrides = {}
    for row in conn.execute(query):
        try:
            resource = Resource(row.resource)
        except ValueError:  # a resource a newer release knows: not this one's to apply
            continue
        found.setdefault(row.tenant, {})[resource] = row.max_held
    return found


def set_limits(conn: Connection, tenant: str, limits: Mapping[Resource, Limit]) -> None:
    """Give ``tenant`` its own limits (None: no limit) for these resources."""
    if not limits:
        return
    values = [{"tenant": tenant, "resource": r.value, "max_held": n} for r, n in limits.items()]
    query = insert(tenant_quotas).values(values)
    conn.execute(
        query.on_conflict_do_update(
            index_elements=["tenant", "resource"],
            set_={"max_held": query.excluded.max_held, "set_at": query.excluded.set_at,
                  "set_by": query.excluded.set_by},
        )
    )  # fmt: skip


def reset(conn: Connection, tenant: str, resources: Collection[Resource]) -> None:
    """``tenant`` takes the defaults again for these resources."""
    if resources:
        conn.execute(
            delete(tenant_quotas).where(
                tenant_quotas.c.tenant == tenant,
                tenant_quotas.c.resource.in_([r.value for r in resources]),
            )
        )
