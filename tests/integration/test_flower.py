"""Flower, the workers' dashboard, sees the node worker."""

from __future__ import annotations

import json
import urllib.request
from base64 import b64encode

import pytest

from app import stack as stack_mod
from app.config import Settings
from tests.conftest import wait_for

pytestmark = pytest.mark.integration


def test_flower_lists_the_node_worker(stack: Settings) -> None:
    url = f"http://127.0.0.1:{stack.flower_port}/api/workers?refresh=1"
    token = b64encode(f"{stack_mod.FLOWER_USER}:{stack_mod.flower_password(stack)}".encode())
    request = urllib.request.Request(url, headers={"Authorization": f"Basic {token.decode()}"})

    def workers() -> dict[str, object] | None:
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                found: dict[str, object] = json.load(response)
        except OSError:
            return None
        return found if any(name.startswith(f"{stack.node_id}@") for name in found) else None

    found = wait_for(workers, timeout_s=60, what="the node worker in Flower")
    assert any(name.startswith(f"{stack.node_id}@") for name in found)
