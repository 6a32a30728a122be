"""Commands in flight are bounded by the node, not by its Celery pool (16 threads):
long commands run side by side, and neither lifecycle requests nor another tenant's
commands queue behind them."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest

from app.config import Settings
from app.domain.requests import Exec
from tests.conftest import tenant_client

pytestmark = pytest.mark.integration

#: More sandboxes than the node's pool has threads.
N = 24


@pytest.fixture(scope="module")
def boxes(client: Any) -> Iterator[list[Any]]:
    made = client.create_many(N, memory_mb=32, cpus=0.05)
    yield made
    for box in made:
        box.close()


def _send(client: Any, box: Any, command: str) -> tuple[Exec, Any]:
    request = Exec(**client.request_fields(box.id), command=command, timeout_s=60)
    return request, client.send(request)


def test_more_commands_than_pool_threads_run_side_by_side(client: Any, boxes: list[Any]) -> None:
    # Given N long commands sent at once, each noting the host's uptime when it starts
    # and when it ends (/proc/uptime is the host's: one clock for all)
    sent = [
        _send(client, box, "cut -d' ' -f1 /proc/uptime; sleep 3; cut -d' ' -f1 /proc/uptime")
        for box in boxes
    ]
    spans = []
    for request, future in sent:
        reply = client.wait(request, future, 90)
        start, end = (float(x) for x in base64.b64decode(reply.stdout_b64).split())
        spans.append((start, end))
    # Then every one of them started before the first one ended: they all ran at once
    assert max(s for s, _ in spans) < min(e for _, e in spans), spans


def test_a_create_does_not_wait_behind_long_commands(client: Any, boxes: list[Any]) -> None:
    # Given every sandbox busy with a long command (more of them than pool threads)
    sent = [_send(client, box, "sleep 8") for box in boxes]
    try:
        # When a create and a command in the new sandbox are asked for
        with client.create(memory_mb=32) as fresh:
            assert fresh.exec("echo here").stdout == b"here\n"
            # Then they are answered while the long commands still run
            assert not any(future.done() for _, future in sent)
    finally:
        for request, future in sent:
            client.wait(request, future, 90)


def test_another_tenants_command_does_not_wait_behind_a_flood(
    stack: Settings, client: Any, boxes: list[Any]
) -> None:
    # Given one tenant flooding the node: four long commands in each of its sandboxes
    sent = [_send(client, box, "sleep 8") for box in boxes for _ in range(4)]
    try:
        with (
            tenant_client(stack, "frank", "fair-share") as frank,
            frank.create(memory_mb=32) as own,
        ):
            # When another tenant runs a short command
            reply = own.exec("echo mine")
            # Then it is answered while every one of the flood's still runs
            assert reply.stdout == b"mine\n"
            assert not any(future.done() for _, future in sent)
    finally:
        for request, future in sent:
            client.wait(request, future, 90)
