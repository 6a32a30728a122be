"""Every request the SDK sends carries its own request id, in canonical form, and a
sent_at with its time zone, signed with the rest: the gate decodes what it sends, and
a copy of the same bytes is a replay (no Kafka: the client's publisher is a fake)."""

from __future__ import annotations

import json
import threading
from typing import Any

from app.config import Settings
from app.credentials import Credential
from app.domain.codec import decode_request
from app.domain.proof import Purpose, Role, check_mac
from app.domain.requests import CANONICAL_UUID, DestroySandbox, KillCommand, ReadFile
from app.sdk.client import Client, exec_request
from tests.unit.signing import KEYS, reply_to

_KEY = KEYS.lookup("k-tenant-t")
assert _KEY is not None


class Captured:
    """A publisher that keeps what it was given."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, bytes, Any]] = []

    def publish(self, topic: str, key: str, value: bytes, **how: Any) -> None:
        self.sent.append((topic, key, value, how.get("headers")))


def _client() -> tuple[Client, Captured]:
    """A client as its constructor leaves it, without a broker behind it."""
    client = object.__new__(Client)
    client.settings = Settings()
    client.credential = Credential("k-tenant-t", _KEY.secret, Role.TENANT, "t")
    client.job_id = "job"
    client._reply_to = reply_to()
    client._transport = Captured()  # type: ignore[assignment]
    client.lease_id = "lease-1"
    client._storing, client._storing_lock = {}, threading.Lock()
    client._delivery_timeout_s = 45.0
    client._lease_ttl_s, client._lease_grace_s = 30.0, 300.0
    return client, client._transport  # type: ignore[return-value]


def test_every_request_the_sdk_makes_carries_its_own_id_and_zoned_time() -> None:
    client, publisher = _client()
    common = client.request_fields
    for request in (
        DestroySandbox(**common("sb-1")),
        exec_request(common("sb-1"), "true", timeout_s=5),
        KillCommand(command_id=exec_request(common("sb-1"), "x", timeout_s=1).request_id,
                    **common("sb-1")),
        ReadFile(path="/x", **common("sb-1")),
    ):  # fmt: skip
        client.publish(request)
    client._renew_lease()
    ids = set()
    for _topic, _key, value, headers in publisher.sent:
        raw = json.loads(value)
        assert CANONICAL_UUID.match(raw["request_id"])
        assert raw["sent_at"].endswith("Z") or raw["sent_at"][-6] in "+-"
        # what the gate decodes, under the proof the SDK gave it
        decoded = decode_request(value)
        assert check_mac(_KEY.secret, Purpose.REQUEST, value, dict(headers)["dsec-mac"].decode())
        ids.add(decoded.request_id)
    assert len(ids) == len(publisher.sent) == 5  # each request its own id
