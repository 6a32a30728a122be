"""Who may do what in the image hub (app/domain/hub_access.py)."""

from __future__ import annotations

import pytest

from app.domain.hub_access import (
    MAX_SHARED_READERS,
    HubReference,
    Scope,
    grant,
    hub_password,
    hub_reference,
    may_use,
    owner_of,
    parse_scopes,
    password_matches,
    readers_refusal,
    share_refusal,
)
from app.domain.proof import Role


def test_scopes_are_read_one_or_several_per_parameter() -> None:
    scopes = parse_scopes(["repository:a/b:pull,push repository:c:pull", "registry:catalog:*"])
    assert scopes == [
        Scope("repository", "a/b", ("pull", "push")),
        Scope("repository", "c", ("pull",)),
        Scope("registry", "catalog", ("*",)),
    ]
    # Malformed items are dropped whole
    assert parse_scopes(["repository", "repository:", ":x:pull", ""]) == []


@pytest.mark.parametrize(
    ("role", "asked", "granted"),
    [
        (Role.NODE, ("pull", "push", "delete"), ("pull",)),
        (Role.OPERATOR, ("pull", "push", "delete"), ("pull", "push", "delete")),
        (Role.TENANT, ("pull", "push"), ("pull",)),  # the platform's image
        (Role.SCHEDULER, ("pull",), ()),
        (None, ("pull",), ()),
        (Role.OPERATOR, ("*",), ()),  # a wildcard is not an action anyone is given
    ],
)
def test_each_role_gets_only_its_actions(
    role: Role | None, asked: tuple[str, ...], granted: tuple[str, ...]
) -> None:
    assert grant(role, Scope("repository", "team/tools", asked)).actions == granted


@pytest.mark.parametrize(
    "scope",
    [
        Scope("registry", "catalog", ("*",)),  # listing every tenant's repositories
        Scope("repository", "../etc", ("pull",)),
        Scope("repository", "Team/Tools", ("pull",)),
        Scope("repository", "a//b", ("pull",)),
        Scope("repository", "x" * 201, ("pull",)),
    ],
)
def test_nothing_outside_a_well_formed_repository_is_granted(scope: Scope) -> None:
    assert grant(Role.OPERATOR, scope).actions == ()


@pytest.mark.parametrize(
    ("image", "ref"),
    [
        ("dsec/busybox:latest", HubReference("dsec/busybox", "latest")),
        ("localhost/dsec/busybox:latest", HubReference("dsec/busybox", "latest")),
        ("tools", HubReference("tools", "latest")),
        ("team/tools:1.2-rc_3", HubReference("team/tools", "1.2-rc_3")),
        ("docker.io/library/alpine:3", None),  # another registry
        ("127.0.0.1:5000/x:1", None),
        ("team/tools@sha256:" + "0" * 64, None),
        ("Team/Tools:1", None),
        ("team/tools:-bad", None),
        ("--authfile=/etc/shadow", None),  # never an option to Podman
    ],
)
def test_sandbox_image_names_map_to_hub_references(image: str, ref: HubReference | None) -> None:
    assert hub_reference(image) == ref


def test_the_hub_password_is_derived_from_the_secret_and_checked_in_constant_time() -> None:
    secret, other = b"k" * 32, b"j" * 32
    password = hub_password(secret)
    assert password_matches(secret, password)
    assert not password_matches(other, password)
    assert not password_matches(secret, "")
    assert password != hub_password(other)


@pytest.mark.parametrize(
    ("repository", "asked", "granted"),
    [
        ("tenants/acme/tools", ("pull", "push", "delete"), ("pull", "push", "delete")),
        ("tenants/acme/deep/tools", ("pull", "push"), ("pull", "push")),
        ("tenants/other/tools", ("pull", "push", "delete"), ()),  # private by default
        ("tenants/acmex/tools", ("pull",), ()),  # a prefix of a name is not the name
        ("dsec/busybox", ("pull", "push", "delete"), ("pull",)),  # FROM the platform's
        ("tenants/acme", ("pull", "push"), ("pull",)),  # no name under it: the platform's
    ],
)
def test_a_tenant_writes_only_under_its_own_name_and_reads_no_other_tenants(
    repository: str, asked: tuple[str, ...], granted: tuple[str, ...]
) -> None:
    assert grant(Role.TENANT, Scope("repository", repository, asked), "acme").actions == granted


def test_a_sandbox_starts_only_from_the_platforms_images_and_its_tenants_own() -> None:
    assert owner_of("tenants/acme/tools") == "acme"
    assert owner_of("dsec/busybox") is None
    assert may_use("acme", "tenants/acme/tools:1")
    assert may_use("acme", "localhost/tenants/acme/tools:1")
    assert may_use("acme", "dsec/busybox:latest")
    assert not may_use("acme", "tenants/other/tools:1")
    assert not may_use("acme", "localhost/tenants/other/tools")


@pytest.mark.parametrize(
    "image",
    [
        "tenants/other/tools@sha256:" + "a" * 64,  # a digest of another tenant's
        "ab04c56d280",  # an image id's start: Podman may resolve it by id
        "ab04c56d280:latest",
        "docker.io/tenants/other/tools:1",  # another registry
        "Tenants/Other/tools:1",
    ],
)
def test_names_that_could_reach_an_image_by_other_means_are_refused(image: str) -> None:
    assert not may_use("acme", image)


def test_a_shared_repository_is_readable_by_its_readers_only() -> None:
    scope = Scope("repository", "tenants/acme/tools", ("pull", "push", "delete"))
    assert grant(Role.TENANT, scope, "bob", readers={"bob"}).actions == ("pull",)
    assert grant(Role.TENANT, scope, "eve", readers={"bob"}).actions == ()
    assert grant(Role.TENANT, scope, "eve", readers={"*"}).actions == ("pull",)
    assert may_use("bob", "tenants/acme/tools:1", lambda repo: {"bob"})
    assert not may_use("eve", "tenants/acme/tools:1", lambda repo: {"bob"})
    assert may_use("eve", "tenants/acme/tools:1", lambda repo: {"*"})


@pytest.mark.parametrize(
    ("role", "subject", "repository", "readers", "refused"),
    [
        (Role.TENANT, "acme", "tenants/acme/tools", ["bob"], None),
        (Role.TENANT, "bob", "tenants/acme/tools", ["eve"], "not bob's"),
        (Role.TENANT, "acme", "tenants/acme/tools", ["*"], "only an operator"),
        (Role.OPERATOR, "ops", "tenants/acme/tools", ["*"], None),
        (Role.OPERATOR, "ops", "dsec/busybox", ["bob"], "not a tenant's"),
        (Role.TENANT, "acme", "tenants/acme/tools", [], "readers"),
        (Role.TENANT, "acme", "tenants/acme/tools", ["Bad Name"], "not a tenant name"),
        (Role.NODE, "node0", "tenants/acme/tools", ["bob"], "not node0's"),
    ],
)
def test_who_may_share_what(
    role: Role, subject: str, repository: str, readers: list[str], refused: str | None
) -> None:
    said = share_refusal(role, subject, repository, readers)
    assert said is None if refused is None else said is not None and refused in said


def test_a_repository_has_a_bounded_number_of_readers() -> None:
    assert readers_refusal("tenants/a/x", MAX_SHARED_READERS) is None
    said = readers_refusal("tenants/a/x", MAX_SHARED_READERS + 1)
    assert said is not None and f"at most {MAX_SHARED_READERS}" in said
