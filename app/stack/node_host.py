"""A node host, brought up and down from settings alone (`dsec node up`, `dsec node
down`): no embedded stack, no development extra, and with ``--agent`` no compiler.

A node finds the control plane only through Kafka and Redis: its events and replies go
to Kafka, its creation tasks come through Redis, its commands through its Kafka inbox.
What it needs on the host: its credential (made on a control host by `dsec node add`),
rootless Podman, Debian's busybox-static, and the agent binary (compiled here, or
the release's from `dsec node agent`). Its worker runs under the same supervisor as
the embedded stack's services (app/stack/supervisor.py), which restarts what dies.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from app import bus, credentials, taskqueue
from app.config import Settings
from app.errors import ConfigError


def check(settings: Settings, node_id: str) -> Path:
    """What the node needs before it starts: its credential, Kafka and Redis answering;
    returns the credential's file. Raises with what is missing."""
    path = settings.node_credential_file or credentials.node_file(settings, node_id)
    if not path.is_file():
        raise ConfigError(
            f"no credential for node {node_id} at {path}: make one on a control host with"
            f" `dsec node add {node_id} --out FILE` and set DSEC_NODE_CREDENTIAL_FILE"
        )
    credential = credentials.load(path)
    # Kafka answers the node's principal, and its inbox (made by `dsec node add`) exists.
    consumer = bus.make_consumer(settings, login=credential.kafka)
    try:
        bus.partitions(consumer, settings.node_topic(node_id))
    finally:
        consumer.close()
    taskqueue.check_broker(settings)
    return path


def up(
    settings: Settings,
    node_id: str,
    agent: Path | None,
    log: Callable[[str], None],
    *,
    foreground: bool = False,
) -> None:
    """Set the node host up and start its worker (and the supervisor); with
    ``foreground``, become the worker instead (a container's or a unit's process)."""
    from app.images.store import import_busybox_image
    from app.stack import services as stack
    from workers.agent.build import ensure_agent_dir

    path = check(settings, node_id)
    log(f"node {node_id}: credential {path}; Kafka at {settings.kafka_bootstrap} and Redis answer")
    agent = agent or settings.node_agent
    ensure_agent_dir(settings.state_dir / "agent", prebuilt=agent)
    log(f"agent: {'the release binary ' + str(agent) if agent else 'compiled here'}")
    import_busybox_image(settings=settings, refresh=False)
    log(f"layer store: {settings.layer_store} has {settings.default_image}")
    env_credential = {"DSEC_NODE_CREDENTIAL_FILE": str(path)}
    for service in stack.services(settings, [node_id]):
        if foreground and service.name == f"worker-{node_id}":
            log(f"{service.name}: running in the foreground")
            os.execve(
                service.argv[0], service.argv, {**os.environ, **service.env, **env_credential}
            )
        if service.name not in (f"worker-{node_id}", stack.SUPERVISOR):
            continue
        service.env = {**service.env, **env_credential}
        started = service.start(settings)
        log(f"{service.name}: {'started' if started else 'already running'}")


def down(settings: Settings, node_id: str, log: Callable[[str], None]) -> None:
    """Stop the node's worker; the supervisor too once no service of this host is left
    for it. The sandboxes stay with the node's Podman service: the next worker takes
    them back."""
    from app.stack import services as stack

    every = stack.services(settings, stack.known_node_ids(settings))
    worker = next((s for s in every if s.name == f"worker-{node_id}"), None)
    if worker is not None and worker.pid(settings) is not None:
        worker.stop(settings)
        log(f"worker-{node_id}: stopped")
    others = [
        s
        for s in every
        if s.name != stack.SUPERVISOR and s.pidfile(settings).exists() and s is not worker
    ]
    if not others:
        supervisor = next(s for s in every if s.name == stack.SUPERVISOR)
        supervisor.stop(settings)
        log("supervisor: stopped (nothing left on this host)")
