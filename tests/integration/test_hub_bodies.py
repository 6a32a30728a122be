"""The hub's token service reads tenants' JSON bodies (``/share``, ``/secrets``) only
when their shape could be a call: one service serves every tenant's logins and every
node's pulls, and parsing a body of 1 MiB of empty arrays cost it ~0.5 s."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
import uuid

import pytest
from sqlalchemy import text

from app.config import Settings
from app.db.engine import transaction
from app.domain.hub_access import MAX_READERS, MAX_SHARED_READERS, hub_password
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


def test_a_repository_is_shared_with_a_bounded_number_of_tenants(stack: Settings) -> None:
    # Given a tenant's repository shared with the most tenants a repository may have,
    # a hundred at a time (the most one call names)
    repository = f"tenants/tests/many-{uuid.uuid4().hex[:8]}"
    names = [f"reader-{i:04d}" for i in range(MAX_SHARED_READERS + 1)]
    for start in range(0, MAX_SHARED_READERS, MAX_READERS):
        body = json.dumps({"repository": repository, "readers": names[start : start + 100]})
        assert _post(stack, "/share", "POST", body.encode())[0] == 200
    # When it names one more
    body = json.dumps({"repository": repository, "readers": names[-1:]})
    status, message = _post(stack, "/share", "POST", body.encode())
    # Then the service refuses, saying why, and stores none of it
    assert status == 403 and f"at most {MAX_SHARED_READERS}" in message, (status, message)
    with transaction(stack.database_url) as conn:
        held = conn.execute(
            text("SELECT count(*) FROM image_shares WHERE repository = :r"), {"r": repository}
        ).scalar_one()
        assert held == MAX_SHARED_READERS
        conn.execute(text("DELETE FROM image_shares WHERE repository = :r"), {"r": repository})
