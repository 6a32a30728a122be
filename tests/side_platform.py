"""A second platform beside the stack, for a test that must break something of its
own (a node's disk, a slow broker): its own scheduler, node worker and, if asked,
projector, on topics of their own and, if asked, another broker. Postgres and Redis
are the stack's; the log keeps each topic's events apart by their source."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from app import kafka_admin
from app.config import Settings
from app.control import tenants
from app.domain.proof import Role
from tests.conftest import ensure_tenant, wait_for
from workers.agent.build import AGENT_BINARY, ensure_agent_dir
from workers.host.user import user_name

DSEC = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "dsec"


@contextmanager
def dsec_service(
    args: Sequence[str], env: Mapping[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """``dsec ARGS`` in the background with ``env``, its output in ``log``; stopped
    with SIGTERM at the end (SIGKILL if it has not stopped in 30 s)."""
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [str(DSEC), *args], env=dict(env), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def first_sandbox(client: Any, node: str, timeout_s: float = 120) -> Any:
    """A sandbox, once the side platform's scheduler has heard from its node (creates
    before that are refused for want of nodes)."""
    from app.errors import SandboxError

    def created() -> Any:
        try:
            return client.create(timeout_s=60)
        except SandboxError:
            return None

    return wait_for(created, timeout_s, f"a sandbox on {node}")


@contextmanager
def side_platform(
    stack: Settings,
    node: str,
    state: Path,
    *,
    kafka: Settings | None = None,
    projector: bool = False,
    env: Mapping[str, str] | None = None,
) -> Iterator[Settings]:
    """Run a scheduler and node ``node``'s worker (and a projector) with ``state`` as
    their state directory and a topic prefix of their own; yields their settings, on
    which an SDK client reaches them. ``kafka``: the settings of another broker's
    (app/stack/local_cluster.py). ``env`` adds settings of the test's."""
    settings = (kafka or stack).model_copy(
        update={"state_dir": state, "topic_prefix": f"side{uuid.uuid4().hex[:6]}"}
    )
    ensure_tenant(stack, "tests")
    tenants.ensure(stack, Role.NODE, node)
    kafka_admin.ensure_topics(settings, ["tests"], [node])
    # The trainer's and the node's principals may use the topics of this prefix.
    keys = tenants.live_keys(stack, ["tests", node])
    tenants.enable(settings, keys)
    # The stack's agent binary, as a node host is given a release's.
    ensure_agent_dir(state / "agent", prebuilt=stack.state_dir / "agent" / AGENT_BINARY)
    full = {
        **os.environ,
        "DSEC_STATE_DIR": str(state),
        "DSEC_TOPIC_PREFIX": settings.topic_prefix,
        "DSEC_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "DSEC_KAFKA_SECURITY_PROTOCOL": settings.kafka_security_protocol,
        "DSEC_KAFKA_REPLICATION_FACTOR": str(settings.kafka_replication_factor),
        "DSEC_DATABASE_URL": stack.database_url,
        "DSEC_ADMIN_DATABASE_URL": stack.admin_database_url,
        "DSEC_CELERY_BROKER_URL": stack.celery_broker_url,
        "DSEC_METRICS_PORT": "0",
        "DSEC_SCHEDULER_METRICS_PORT": "0",
        "DSEC_NODE_METRICS_PORT": "0",
        "DSEC_NODE_ID": node,
        **(env or {}),
    }
    services: list[list[str]] = [["run", "scheduler"], ["run", "worker", "--node", node]]
    if projector:
        services.append(["run", "projector"])
    try:
        with ExitStack() as running:
            for args in services:
                running.enter_context(dsec_service(args, full, state / f"{args[1]}.log"))
            yield settings
    finally:
        subprocess.run(["pkill", "-KILL", "-u", user_name(node)], capture_output=True)
        kafka_admin.drop_topics(settings)
        kafka_admin.ungrant(settings, tenants.grants_of(settings, keys))
