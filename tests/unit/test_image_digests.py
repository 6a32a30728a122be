"""What a tenant's image name means to the schedulers: its first push, kept once
found, asked again a little later while unknown, never for the platform's images."""

from __future__ import annotations

from app.control.image_digests import StoredDigests

DIGEST = "sha256:" + "ab" * 32


def test_a_digest_found_is_kept_and_a_name_unknown_is_asked_again_later() -> None:
    asked: list[tuple[str, str]] = []
    known: dict[tuple[str, str], str] = {}

    def load(repository: str, tag: str) -> str | None:
        asked.append((repository, tag))
        return known.get((repository, tag))

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


def test_the_platforms_images_and_names_the_hub_cannot_hold_are_not_pinned() -> None:
    asked: list[str] = []
    digests = StoredDigests(lambda r, t: asked.append(r) or DIGEST)
    for image in ("dsec/busybox", "dsec/busybox:latest", "docker.io/x/y:1", "tenants/a@sha256:0"):
        assert digests.digest_of(image) is None
    assert asked == []


def test_postgres_away_leaves_the_name_unpinned_not_refused() -> None:
    def load(repository: str, tag: str) -> str | None:
        raise ConnectionError("no Postgres")

    assert StoredDigests(load).digest_of("tenants/acme/tools:1") is None
