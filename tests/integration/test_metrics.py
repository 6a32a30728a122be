"""Every service says what an operator watches on its Prometheus endpoint: the node
worker its sandboxes, warm pool, create and command times and its consumer's lag; the
scheduler its refusals by reason."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from app import metrics
from app.config import Settings
from app.errors import SandboxRejectedError
from app.metrics import Samples, sample
from app.sdk import Client
from tests.conftest import wait_for

pytestmark = pytest.mark.integration


def scrape(port: int) -> Samples:
    """Every sample of the local endpoint on ``port``, by name and labels."""
    return metrics.scrape(f"http://127.0.0.1:{port}/metrics")


def test_the_node_worker_serves_its_metrics(stack: Settings, client: Client) -> None:
    port = stack.node_metrics_port_of(stack.node_id)
    before = scrape(port)
    created = sample(before, "dsec_node_create_seconds_count", warm="true") or 0
    created += sample(before, "dsec_node_create_seconds_count", warm="false") or 0
    commands = sample(before, "dsec_node_exec_seconds_count") or 0
    with client.create(memory_mb=32) as box:
        box.exec("true")

        def after() -> Any:
            samples = scrape(port)
            made = (sample(samples, "dsec_node_create_seconds_count", warm="true") or 0) + (
                sample(samples, "dsec_node_create_seconds_count", warm="false") or 0
            )
            ran = sample(samples, "dsec_node_exec_seconds_count") or 0
            live = sample(samples, "dsec_node_sandboxes") or 0
            return samples if made > created and ran > commands and live >= 1 else None

        samples = wait_for(after, 30, "the create, the command and the sandbox counted")
    # The warm pool and the inbox's lag are there too
    assert sample(samples, "dsec_node_warm_ready", image=stack.default_image) is not None
    assert (
        sample(
            samples,
            "dsec_consumer_lag",
            consumer=f"inbox {stack.node_id}",
            topic=stack.node_topic(stack.node_id),
            partition="0",
        )
        is not None
    )


def test_the_scheduler_counts_refusals_by_reason(stack: Settings, client: Client) -> None:
    port = stack.metrics_port + 1  # the first scheduler's
    label = {"process": "scheduler", "reason": "unknown_sandbox"}
    before = sample(scrape(port), "dsec_refusals_total", **label) or 0
    with pytest.raises(SandboxRejectedError):
        client.sandbox(f"sb-{uuid.uuid4().hex[:20]}").exec("true")
    wait_for(
        lambda: (sample(scrape(port), "dsec_refusals_total", **label) or 0) > before,
        10,
        "the refusal counted",
    )
