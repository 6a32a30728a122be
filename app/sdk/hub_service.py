"""The SDK's way to the hub and its token service: TLS trusted as the credential says,
the tenant's Basic login, and JSON calls to the token service's own paths (``/share``
for images, ``/secrets`` for egress secrets), found where the hub sends logins."""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import urllib.error
import urllib.request
from typing import Any

from app.config import Settings
from app.credentials import Credential
from app.domain.hub_access import hub_password


class PushError(Exception):
    """The hub or its token service refused a call, or could not be reached; says
    which and why."""


class HubService:
    """One tenant's calls to the hub's token service."""

    def __init__(self, settings: Settings, credential: Credential) -> None:
        self.settings = settings
        self.credential = credential

    def ca_pem(self) -> str | None:
        """The platform's CA (the credential's, else this host's), or None: the
        system's CAs."""
        kafka = self.credential.kafka
        if kafka is not None and kafka.ca_pem:
            return kafka.ca_pem
        local = self.settings.ca_dir / "ca.pem"
        return local.read_text() if os.access(local, os.R_OK) else None

    def context(self) -> ssl.SSLContext:
        """TLS trusting the platform's CA."""
        ca = self.ca_pem()
        return ssl.create_default_context(cadata=ca) if ca else ssl.create_default_context()

    def basic(self) -> str:
        """The tenant's login to the token service, as an Authorization header."""
        login = f"{self.credential.key_id}:{hub_password(self.credential.secret)}"
        return "Basic " + base64.b64encode(login.encode()).decode()

    def url(self, path: str) -> str:
        """A path on the hub's token service, found where the hub sends logins."""
        try:
            urllib.request.urlopen(
                f"https://{self.settings.hub}/v2/", context=self.context(), timeout=30
            ).close()
        except urllib.error.HTTPError as exc:
            realm = challenge(str(exc.headers.get("WWW-Authenticate", ""))).get("realm", "")
            if realm.startswith("https://") and realm.endswith("/token"):
                return realm[: -len("/token")] + path
        except OSError as exc:
            raise PushError(f"the hub at {self.settings.hub} did not answer: {exc}") from exc
        raise PushError("the hub names no token service")

    def call(self, method: str, path: str, body: dict[str, Any] | None, what: str) -> Any:
        """``method`` on the token service's ``path`` with a JSON ``body``; its JSON
        answer. :class:`PushError` says why ``what`` was refused."""
        request = urllib.request.Request(
            self.url(path),
            data=json.dumps(body).encode() if body is not None else None,
            method=method,
            headers={"Content-Type": "application/json", "Authorization": self.basic()},
        )
        try:
            with urllib.request.urlopen(request, context=self.context(), timeout=30) as answer:
                return json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as exc:
            said = exc.read().decode(errors="replace")[:500]
            raise PushError(f"{what} was refused ({exc.code}): {said}") from exc
        except OSError as exc:
            raise PushError(f"the hub's token service did not answer: {exc}") from exc


def challenge(header: str) -> dict[str, str]:
    """The fields of a ``WWW-Authenticate`` challenge (realm, service, ...)."""
    return dict(re.findall(r'(\w+)="([^"]*)"', header))
