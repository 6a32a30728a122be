"""JSON Schemas of every message on the bus, generated from the models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from app.domain.dead_letter import DeadLetter
from app.domain.events import EVENT_ADAPTER
from app.domain.replies import REPLY_ADAPTER
from app.domain.requests import REQUEST_ADAPTER

#: File name -> adapter of the message family it describes.
FAMILIES: dict[str, TypeAdapter[Any]] = {
    "request.schema.json": REQUEST_ADAPTER,
    "event.schema.json": EVENT_ADAPTER,
    "reply.schema.json": REPLY_ADAPTER,
    "dead-letter.schema.json": TypeAdapter(DeadLetter),
}

SCHEMA_DIR = Path(__file__).resolve().parents[2] / "docs" / "schemas"


def default_dir() -> Path:
    """The checkout's docs/schemas; ./schemas where dsec runs from an installed wheel."""
    return SCHEMA_DIR if SCHEMA_DIR.parent.is_dir() else Path("schemas")


def render() -> dict[str, str]:
    """Each family's JSON Schema, as the text written to docs/schemas."""
    return {
        name: json.dumps(adapter.json_schema(mode="serialization"), indent=2, sort_keys=True) + "\n"
        for name, adapter in FAMILIES.items()
    }


def write(directory: Path = SCHEMA_DIR) -> list[Path]:
    """Write the schemas; return the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for name, body in render().items():
        path = directory / name
        path.write_text(body)
        out.append(path)
    return out
