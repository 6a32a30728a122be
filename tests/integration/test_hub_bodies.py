"""The hub's token service reads tenants' JSON bodies (``/share``, ``/secrets``) only
when their shape could be a call: one service serves every tenant's logins and every
node's pulls, and parsing a body of 1 MiB of empty arrays cost it ~0.5 s."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import pytest

from app.config import Settings
from app.domain.hub_access import hub_password
from tests.conftest import ensure_tenant
from tests.integration.test_hub import _tls

pytestmark = pytest.mark.integration


def _post(settings: Settings, path: str, method: str, body: bytes) -> tuple[int, str]:
    """(status, message) of a call signed by tenant "tests"."""
    cred = ensure_tenant(settings, "tests")
    url = f"https://{settings.hub.rpartition(':')[0]}:{settings.hub_auth_port}{path}"
    login = base64.b64encode(f"{cred.key_id}:{hub_password(cred.secret)}".encode()).decode()
    request = urllib.request.Request(url, data=body, method=method)
    request.add_header("Authorization", f"Basic {login}")
    try:
        with urllib.request.urlopen(request, context=_tls(settings), timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize(("path", "method"), [("/share", "POST"), ("/secrets", "PUT")])
def test_a_body_of_many_arrays_is_refused_before_it_is_read(
    stack: Settings, path: str, method: str
) -> None:
    # Given a tenant's body shaped like a call, its list made of 2,000 empty arrays
    body = json.dumps({"repository": "tenants/tests/x", "readers": [[]] * 2000}).encode()
    # Then the service refuses it for its shape, saying so
    status, message = _post(stack, path, method, body)
    assert status == 400 and "too_complex" in message, (status, message)
