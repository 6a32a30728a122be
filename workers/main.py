"""Start a node: set up its user and Podman service, then serve its Celery queue.

This is the node's composition root: the one place that builds its adapters (the
Podman driver, the agents' pool, its Kafka producer and inbox consumer, its Redis,
its metrics) and hands them to the node's logic, which builds none.
"""

from __future__ import annotations

import ipaddress
import logging
import resource
import threading
from typing import cast

from app import credentials, heap, metrics
from app.bus import KafkaLogin, Publisher
from app.config import Settings, get_settings
from app.consuming import PositionedConsumer
from app.domain.port_urls import url_key
from app.partition_cache import Metadata, PartitionCache
from app.ports import PositionedReader, Producer
from app.rdkafka_bus import RdkafkaPublisher, RdkafkaReader
from workers import direct, runtime, tasks
from workers.agent.connection import peer_is_sandbox_init
from workers.agent.pool import AgentPool
from workers.celery_app import celery, restore_unacked
from workers.containers.limits import CgroupLimiter
from workers.containers.podman_driver import PodmanDriver
from workers.courier import Courier
from workers.egress_dns import EgressResolver, host_lookup
from workers.egress_proxy import SecretProxy
from workers.handlers import Node
from workers.host.egress import EgressFence
from workers.host.hub_client import HubClient
from workers.host.layer_store import store_lock_path
from workers.host.podman_service import ensure_podman_service
from workers.host.podman_watch import PodmanWatch
from workers.host.setup import ensure_node_user, fence_egress
from workers.inbox import READY_WAIT_S, Inbox
from workers.ports import PortProxy
from workers.redis_state import Claims, Routes, StepGuard, claim_ttl_s, connect, connect_claims
from workers.upkeep import Upkeep
from workers.warm_pool import WarmPool

log = logging.getLogger(__name__)


def _raise_open_files() -> None:
    """Up to the hard limit: each sandbox holds two descriptors here (its agent's
    listener and connection), so a soft limit of 1024 caps a node near 500."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def run(node_id: str, concurrency: int = 16) -> None:
    """Serve ``node.<node_id>`` until the worker is stopped.

    A clean stop (SIGTERM: ``dsec down``) removes the warm pool's waiting containers;
    after a crash the next start does.
    """
    _raise_open_files()
    settings = get_settings()
    port = settings.node_metrics_port
    metrics.serve(
        settings.node_metrics_port_of(node_id) if port is None else port, settings.metrics_host
    )
    # The node's own credential, nothing more: a node host holds no master key.
    credential = credentials.load(
        settings.node_credential_file or credentials.node_file(settings, node_id)
    )
    user = ensure_node_user(node_id, allow_egress=settings.allow_egress)
    unfenced = fence_egress(user) if settings.allow_egress else None
    socket_url = ensure_podman_service(user)
    tally = metrics.NodeMetrics()
    watch = PodmanWatch(user, settings, tally)
    driver = PodmanDriver(
        socket_url,
        limiter=CgroupLimiter.detect(node_id),
        store_lock=store_lock_path(settings),
        revive=watch.revive,
    )
    agents = AgentPool(verify=peer_is_sandbox_init)
    store = connect(settings.celery_broker_url)
    courier = Courier(settings, credential, lambda: _producer(settings, credential.kafka))
    ttl_s = claim_ttl_s(settings.request_max_age_s)
    claims = Claims(connect_claims(settings.celery_broker_url), node_id, credential.secret, ttl_s)
    routes = Routes(store, node_id, credential.secret, ttl_s)
    node = Node(
        settings, node_id, driver, agents, credential, courier, claims, StepGuard(store), tally,
        routes,
    )  # fmt: skip
    node.egress_unfenced = unfenced
    if settings.allow_egress:
        node.egress, node.egress_unenforced = _egress(settings, node_id, credential.secret)
    node.ports = PortProxy(url_key(credential.secret), settings.ports_host, settings.ports_port)
    node.ports.start()
    runtime.install(node)
    # Images the node lacks come from the hub, logged in as this node (pull only).
    node.images = HubClient(settings, credential) if settings.hub else None
    if node.images is not None and settings.node_prefetch:
        threading.Thread(
            target=node.images.prefetch, args=(settings.node_prefetch,),
            name="dsec-prefetch", daemon=True,
        ).start()  # fmt: skip
    node.warm = WarmPool(node, settings.warm_pool)
    node.warm.start()
    node.deadlines.start()
    watch.start()
    stranded = node.answer_interrupted()
    if stranded:
        log.warning("node %s: answered %d commands a previous worker left", node_id, stranded)
    # Its topic before the first heartbeat (the scheduler sends commands once it hears
    # of the node); read once the first round listens again for the agents.
    upkeep = Upkeep(node)
    topic = settings.node_topic(node_id)
    inbox = Inbox(
        settings, node_id, courier, store,
        lambda: _reader(settings, topic, f"inbox {node_id}", credential.kafka),
        tally, direct.rules(settings, PartitionCache(lambda: cast(Metadata, courier.publisher))),
    )  # fmt: skip
    inbox.start(ready=upkeep.rounds)
    upkeep.start()
    threading.Thread(
        target=_redo, args=(node_id, upkeep.rounds), name="dsec-redo", daemon=True
    ).start()
    log.info(
        "node %s: podman at %s, queue %s, warm pools %s",
        node_id, socket_url, settings.node_queue(node_id), node.warm.sizes or "off",
    )  # fmt: skip
    restore_unacked(settings.node_queue(node_id))
    heap.settle()
    try:
        _serve(settings.node_queue(node_id), node_id, concurrency)
    finally:
        watch.stop()  # a service stopped with the node must not be started again
        inbox.stop()
        node.warm.close(drain=True)


def _producer(settings: Settings, login: KafkaLogin | None) -> Producer:
    """The node's one producer, on the Kafka client its settings name."""
    if settings.node_kafka_client == "librdkafka":
        return RdkafkaPublisher(settings, login=login)
    return Publisher(settings, login=login)


def _reader(
    settings: Settings, topic: str, name: str, login: KafkaLogin | None
) -> PositionedReader:
    """A reader of the node's inbox, on the Kafka client its settings name."""
    if settings.node_kafka_client == "librdkafka":
        return RdkafkaReader(settings, topic, name, login=login)
    return PositionedConsumer(settings, topic, name, login=login)


def _egress(settings: Settings, node_id: str, key: bytes) -> tuple[EgressFence | None, str | None]:
    """The node's allowlist enforcement, its resolver and its secrets proxy; (None,
    why) where the host cannot enforce allowlists (creates asking for one are then
    refused)."""
    pool = ipaddress.IPv4Network(settings.egress_pool)
    fence = EgressFence(
        node_id, pool, 0, settings.egress_max_connections, settings.egress_mbit, key
    )
    hosts = settings.egress_hosts or settings.state_dir / "egress-hosts"
    resolver = EgressResolver(fence, host_lookup(hosts), (pool,))
    proxy = SecretProxy(fence, settings.egress_ca_file or settings.state_dir / "egress-ca.pem")
    fence.dns_port = resolver.port  # before ensure: recovered sandboxes' DNS comes here
    fence.proxy_port = proxy.port
    why = fence.ensure()
    if why is not None:
        log.warning("node %s: no egress allowlists: %s", node_id, why)
        resolver.sock.close()
        proxy.server.close()
        return None, why
    resolver.start()
    proxy.start()
    return fence, None


def _redo(node_id: str, ready: threading.Event) -> None:
    """Once the node listens again for its sandboxes' agents, do again the lifecycle
    tasks a previous worker left half done."""
    ready.wait(READY_WAIT_S)
    redone = tasks.redo_interrupted()
    if redone:
        log.warning("node %s: did again %d tasks a previous worker left", node_id, redone)


def _serve(queue: str, node_id: str, concurrency: int) -> None:
    celery.worker_main(
        [
            "worker",
            "--queues",
            queue,
            "--pool",
            "threads",
            "--concurrency",
            str(concurrency),
            "--hostname",
            f"{node_id}@%h",
            "--loglevel",
            "INFO",
            "--task-events",
            # Flower's sign of life; Celery's 2 s woke an idle worker for nothing.
            "--heartbeat-interval",
            "10",
            "--without-mingle",
            "--without-gossip",
        ]
    )
