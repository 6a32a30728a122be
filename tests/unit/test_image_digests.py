"""What a tenant's image name means to the schedulers: its first push, kept until the
hub reports a deletion, asked again a little later while unknown or deleted, never for
the platform's images."""

from __future__ import annotations

from datetime import UTC, datetime

from app.control.image_digests import StoredDigests
from app.db.hub_events import NamePin

DIGEST = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32


def test_a_digest_found_is_kept_and_a_name_unknown_is_asked_again_later() -> None:
    asked: list[tuple[str, str]] = []
    known: dict[tuple[str, str], str] = {}

    def load(repository: str, tag: str) -> NamePin:
        asked.append((repository, tag))
        return NamePin(known.get((repository, tag)))

    digests = StoredDigests(load, retry_s=60)
    assert digests.digest_of("tenants/acme/tools:1") is None
    known[("tenants/acme/tools", "1")] = DIGEST
    # Unknown a moment ago: not asked again before the retry
    assert digests.digest_of("tenants/acme/tools:1") is None
    assert len(asked) == 1
    digests = StoredDigests(load, retry_s=0)
    assert digests.digest_of("tenants/acme/tools:1") == DIGEST
    assert digests.digest_of("tenants/acme/tools:1") == DIGEST
    assert asked[1:] == [("tenants/acme/tools", "1")]  # found once, then kept


def test_a_deletion_reported_by_the_hub_ends_what_a_name_meant() -> None:
    pins = {("tenants/acme/tools", "1"): NamePin(DIGEST)}
    deleted_at: list[datetime | None] = [None]
    digests = StoredDigests(lambda r, t: pins[(r, t)], lambda: deleted_at[0], check_s=0)
    assert digests.digest_of("tenants/acme/tools:1") == DIGEST
    assert not digests.deleted("tenants/acme/tools:1")
    # When the owner deletes it, the next look at the hub's deletions drops the digest
    pins[("tenants/acme/tools", "1")] = NamePin(None, deleted=True)
    deleted_at[0] = datetime.now(UTC)
    assert digests.deleted("tenants/acme/tools:1")
    assert digests.digest_of("tenants/acme/tools:1") is None
    # and a push of the name again gives it its new meaning (after the retry)
    pins[("tenants/acme/tools", "1")] = NamePin(OTHER)
    digests = StoredDigests(lambda r, t: pins[(r, t)], lambda: deleted_at[0], retry_s=0)
    assert digests.digest_of("tenants/acme/tools:1") == OTHER


def test_the_platforms_images_and_names_the_hub_cannot_hold_are_not_pinned() -> None:
    asked: list[str] = []
    digests = StoredDigests(lambda r, t: asked.append(r) or NamePin(DIGEST))
    for image in ("dsec/busybox", "dsec/busybox:latest", "docker.io/x/y:1", "tenants/a@sha256:0"):
        assert digests.digest_of(image) is None
        assert not digests.deleted(image)
    assert asked == []


def test_postgres_away_leaves_the_name_unpinned_not_refused() -> None:
    def load(repository: str, tag: str) -> NamePin:
        raise ConnectionError("no Postgres")

    def deletions() -> datetime | None:
        raise ConnectionError("no Postgres")

    digests = StoredDigests(load, deletions)
    assert digests.digest_of("tenants/acme/tools:1") is None
    assert not digests.deleted("tenants/acme/tools:1")
