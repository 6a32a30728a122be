"""The Containerfile a tenant builds from: every FROM is an image of the hub."""

from __future__ import annotations

import pytest

from app.errors import ConfigError
from app.sdk.image_build import hub_froms


def test_each_from_names_its_image_in_the_hub_and_stages_stay_stages() -> None:
    text, needed = hub_froms(
        "FROM --platform=linux/amd64 dsec/busybox AS base\n"
        "RUN echo FROM nowhere\n"
        "from tenants/acme/tools:2 as tools\n"
        "FROM base\n"
        "COPY --from=tools /x /x\n"
        "FROM scratch\n",
        "hub.internal:5443",
    )
    assert [str(r) for r in needed] == ["dsec/busybox:latest", "tenants/acme/tools:2"]
    assert text.splitlines() == [
        "FROM --platform=linux/amd64 hub.internal:5443/dsec/busybox:latest AS base",
        "RUN echo FROM nowhere",
        "from hub.internal:5443/tenants/acme/tools:2 as tools",
        "FROM base",
        "COPY --from=tools /x /x",
        "FROM scratch",
    ]


@pytest.mark.parametrize(
    "image", ["docker.io/library/alpine", "quay.io/x/y:1", "dsec/busybox@sha256:" + "a" * 64]
)
def test_a_from_the_hub_cannot_hold_is_refused_naming_it(image: str) -> None:
    with pytest.raises(ConfigError, match=f"FROM {image}"):
        hub_froms(f"FROM {image}\nRUN true\n", "hub:5443")
