"""Flower, the workers' dashboard, sees the node worker."""

from __future__ import annotations

import pytest

from app.config import Settings
from app.stack import services as stack_mod
from tests.conftest import flower_workers, wait_for

pytestmark = pytest.mark.integration


def test_flower_lists_the_node_worker(stack: Settings) -> None:
    base = f"http://{stack.flower_host}:{stack.flower_port}"
    password = stack_mod.flower_password(stack)

    def workers() -> list[str]:
        found = flower_workers(base, password)
        return [name for name in found if name.startswith(f"{stack.node_id}@")]

    assert wait_for(workers, timeout_s=60, what="the node worker in Flower")
