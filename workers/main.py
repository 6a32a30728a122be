"""Start a node: set up its user and Podman service, then serve its Celery queue."""

from __future__ import annotations

import logging

from app.config import get_settings
from workers import runtime
from workers.agent.client import AgentPool
from workers.celery_app import celery
from workers.handlers import Node
from workers.limits import CgroupLimiter
from workers.node_setup import ensure_node_user, ensure_podman_service
from workers.podman_driver import PodmanDriver
from workers.upkeep import Upkeep

log = logging.getLogger(__name__)


def run(node_id: str, concurrency: int = 16) -> None:
    """Serve ``node.<node_id>`` until the worker is stopped."""
    settings = get_settings()
    user = ensure_node_user(node_id, allow_egress=settings.allow_egress)
    socket_url = ensure_podman_service(user)
    driver = PodmanDriver(socket_url, limiter=CgroupLimiter.detect(node_id))
    node = Node(settings, node_id, driver, AgentPool())
    runtime.install(node)
    Upkeep(node).start()
    log.info("node %s: podman at %s, queue %s", node_id, socket_url, settings.node_queue(node_id))
    celery.worker_main(
        [
            "worker",
            "--queues",
            settings.node_queue(node_id),
            "--pool",
            "threads",
            "--concurrency",
            str(concurrency),
            "--hostname",
            f"{node_id}@%h",
            "--loglevel",
            "INFO",
            "--task-events",
            "--without-mingle",
            "--without-gossip",
        ]
    )
