"""The settings of images and the hub (``DSEC_*``, part of :class:`app.config.Settings`)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings


class ImageSettings(BaseSettings):
    """Where images come from, and what a node keeps of them (docs/images.md)."""

    hub: str = Field(
        "127.0.0.1:5443",
        description="host:port of the image hub, the unit's registry (docs/images.md); '': none.",
    )
    hub_auth_port: int = Field(
        5444, description="Port of the hub's token service, on the hub's host (`dsec up`)."
    )
    node_image_budget_mb: int = Field(
        0, ge=0, description="Store size above which pulled images go, LRU first (0: none)."
    )
    node_prefetch: list[str] = Field(
        [],
        description=(
            "Images every node pulls from the hub as it starts (retrying until it has"
            " them) and keeps whatever its budget says: a unit's popular images, on a"
            " host that joins with no step per image. JSON list."
        ),
    )
    image_max_mb: int = Field(
        20_480, ge=0, description="Largest tenant image a node keeps, unpacked (0: no limit)."
    )
