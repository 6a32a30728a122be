"""The published JSON Schemas are the ones the models generate (no drift)."""

from __future__ import annotations

import json

from app.cli.schemas import SCHEMA_DIR, render
from app.domain.requests import CANONICAL_UUID, REQUEST_TYPES


def test_committed_schemas_match_the_models() -> None:
    for name, body in render().items():
        path = SCHEMA_DIR / name
        assert path.exists(), f"{path} missing: run `dsec schemas`"
        assert path.read_text() == body, f"{path} is stale: run `dsec schemas`"


def test_every_request_type_is_described() -> None:
    schema = render()["request.schema.json"]
    for kind in ("CreateSandbox", "Exec", "WriteFile", "ReadFile", "DestroySandbox"):
        assert kind in schema


def test_every_request_requires_its_own_id_and_zoned_time() -> None:
    schema = json.loads(render()["request.schema.json"])
    for kind in REQUEST_TYPES:
        body = schema["$defs"][kind]
        assert {"request_id", "sent_at"} <= set(body["required"]), kind
        assert body["properties"]["request_id"]["pattern"] == CANONICAL_UUID.pattern
