"""A tenant's egress secrets (``client.secrets``): headers the platform adds to its
sandboxes' requests on the way out, so an API key never sits inside a sandbox.

    client.secrets.put("api.example.org", header="Authorization", value="Bearer sk-...")
    box = client.create(network=NetworkPolicy(allow=["api.example.org:443"]))
    box.exec(["wget", "-qO-", "http://api.example.org/v1/models"])

A sandbox whose allowlist reaches the destination on port 443 sends plain HTTP to
it; the node adds the header and carries the request over TLS, the destination's
certificate verified. Values are stored encrypted, never listed back, and only this
tenant's sandboxes created after a change carry it (docs/isolation.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pydantic import ValidationError

from app.config import Settings
from app.credentials import Credential
from app.domain.egress import EgressSecret
from app.errors import ConfigError
from app.sdk.hub_service import HubService


@dataclass(frozen=True)
class SecretInfo:
    """A secret as listed: where it goes and who set it, never its value."""

    destination: str
    header: str
    set_by: str
    set_at: datetime


class Secrets:
    """This tenant's egress secrets, kept by the platform."""

    def __init__(self, settings: Settings, credential: Credential) -> None:
        self._hub = HubService(settings, credential)

    def put(self, destination: str, *, header: str, value: str) -> None:
        """Add ``header: value`` to this tenant's sandboxes' requests to
        ``destination`` (a host name), replacing what that header was set to."""
        try:
            secret = EgressSecret(destination=destination, header=header, value=value)
        except ValidationError as exc:
            problems = "; ".join(f"{e['loc'][0]}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"egress secret refused: {problems}") from None
        self._hub.call("PUT", "/secrets", secret.plain(), f"the secret for {destination}")

    def list(self) -> list[SecretInfo]:
        """This tenant's secrets, without their values."""
        found = self._hub.call("GET", "/secrets", None, "listing secrets")
        return [
            SecretInfo(s["destination"], s["header"], s["set_by"],
                       datetime.fromisoformat(s["set_at"]))
            for s in found["secrets"]
        ]  # fmt: skip

    def delete(self, destination: str, header: str | None = None) -> int:
        """Remove the secret for ``destination``'s ``header`` (None: every header for
        it); returns how many went. Sandboxes created after no longer carry it."""
        body = {"destination": destination, "header": header}
        return int(self._hub.call("DELETE", "/secrets", body, "deleting secrets")["removed"])
