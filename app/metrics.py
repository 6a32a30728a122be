"""Prometheus metrics of the services (one registry per process)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from urllib.request import urlopen
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from app.domain.placement import NodeView

EVENTS_APPENDED = Counter("dsec_events_appended_total", "Events newly appended to the log")
EVENTS_DUPLICATE = Counter("dsec_events_duplicate_total", "Redelivered events skipped")
DEAD_LETTERS = Counter(
    "dsec_dead_letters_total", "Messages sent to the dead-letter topic", ["consumer", "reason"]
)
BATCH_SECONDS = Histogram("dsec_projector_batch_seconds", "Projector transaction time")
REQUESTS = Counter("dsec_requests_total", "Requests handled by the scheduler", ["type", "outcome"])
FORGED = Counter(
    "dsec_unproven_messages_total",
    "Messages refused because their proof did not hold (forged, altered, not allowed)",
    ["consumer", "kind"],
)
TASKS = Counter("dsec_node_tasks_total", "Node tasks run", ["task", "outcome"])
GC_SECONDS = Counter(
    "dsec_gc_seconds_total",
    "Time this process spent in the garbage collector, by generation (app/heap.py)",
    ["generation"],
)
COMMANDS_IN_FLIGHT = Gauge(
    "dsec_node_commands_in_flight", "Commands claimed by the node and not yet answered"
)
COMMANDS_WAITING = Gauge(
    "dsec_node_commands_waiting",
    "Claimed commands waiting for their tenant's turn (node or tenant limit reached)",
)

SANDBOXES = Gauge("dsec_node_sandboxes", "Sandboxes the node runs or is creating")
WARM_READY = Gauge(
    "dsec_node_warm_ready", "Started sandboxes waiting in the node's warm pool", ["image"]
)
PULL_SECONDS = Histogram(
    "dsec_node_image_pull_seconds",
    "Time a node spent pulling an image it lacked from the hub for a create.",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
EGRESS_REFUSED = Counter(
    "dsec_node_egress_refused_total",
    "Connections and DNS names allowlists refused, counted as each allowlisted sandbox ends.",
)
CREATE_SECONDS = Histogram(
    "dsec_node_create_seconds",
    "A create on the node, from its task to the sandbox ready",
    ["warm"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
EXEC_SECONDS = Histogram(
    "dsec_node_exec_seconds",
    "A command on the node, from its claim to its answer (the command's own time included)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30, 120, 600),
)
REFUSALS = Counter(
    "dsec_refusals_total",
    "Requests refused or failed with a reason, by the process that said so",
    ["process", "reason"],
)
CONSUMER_LAG = Gauge(
    "dsec_consumer_lag",
    "Records a consumer has still to read in a partition (its end minus its position)",
    ["consumer", "topic", "partition"],
)

WAITING = Gauge(
    "dsec_waiting_for_service",
    "1 while a process waits for a backing service to come back",
    ["process", "service"],
)


#: How often the metrics server's thread looks whether it was asked to stop. Nothing
#: stops it (a daemon thread, gone with its process), and prometheus-client's own
#: server looks twice a second: a wakeup loop in every idle service for nothing.
_STOP_CHECK_S = 60.0


class _ServerV6(ThreadingWSGIServer):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are not worth a line each on stderr."""


def serve(port: int, host: str = "127.0.0.1") -> None:
    """Expose /metrics on ``host``:``port`` (port 0: do not serve)."""
    if not port:
        return
    kind = _ServerV6 if ":" in host else ThreadingWSGIServer
    server = make_server(host.strip("[]"), port, make_wsgi_app(), kind, handler_class=_Quiet)
    threading.Thread(
        target=server.serve_forever, args=(_STOP_CHECK_S,), name="metrics", daemon=True
    ).start()


#: Samples of a /metrics page by name and sorted labels.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout_s: float = 5.0) -> Samples:
    """Every sample a /metrics endpoint serves (raises OSError when it does not answer)."""
    with urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    """One sample's value, None when the page had none by that name and labels."""
    return samples.get((name, tuple(sorted(labels.items()))))


#: The gauge saying which nodes a scheduler places on (``dsec up`` waits for it).
NODE_PLACEABLE = "dsec_scheduler_node_placeable"


class PlacementCollector(Collector):
    """A scheduler's view of its nodes, read from its placement when scraped: whether
    it places on each (alive, and heard from since it started) and what it placed."""

    def __init__(self, nodes: Callable[[], Iterable[NodeView]]) -> None:
        self._nodes = nodes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        placeable = GaugeMetricFamily(
            NODE_PLACEABLE,
            "1 for a node this scheduler places sandboxes on (alive and heard from since"
            " it started), 0 for one it knows of but does not",
            labels=["node"],
        )
        placed = GaugeMetricFamily(
            "dsec_scheduler_node_sandboxes",
            "Sandboxes this scheduler counts against a node's room (its own and others')",
            labels=["node"],
        )
        for view in self._snapshot():
            placeable.add_metric([view.node_id], float(view.placeable))
            placed.add_metric([view.node_id], float(view.used_sandboxes))
        yield placeable
        yield placed

    def _snapshot(self) -> list[NodeView]:
        # The scheduler's thread may add a node while a scrape reads them.
        for _ in range(3):
            try:
                return list(self._nodes())
            except RuntimeError:
                continue
        return []


def watch_placement(nodes: Callable[[], Iterable[NodeView]]) -> None:
    """Serve a scheduler's view of its nodes with its other metrics."""
    REGISTRY.register(PlacementCollector(nodes))


class SchedulerTally:
    """The dispatcher's counts (:class:`app.control.outbox.Tally`) as the scheduler's metrics."""

    def handled(self, request_type: str, outcome: str) -> None:
        REQUESTS.labels(request_type, outcome).inc()

    def refused(self, reason: str) -> None:
        REFUSALS.labels("scheduler", reason).inc()

    def unproven(self, kind: str) -> None:
        FORGED.labels("scheduler", kind).inc()


class NodeMetrics:
    """The node's counts (:class:`workers.tally.NodeTally`) as its metrics."""

    def task(self, task: str, outcome: str) -> None:
        TASKS.labels(task, outcome).inc()

    def forged(self, consumer: str, kind: str) -> None:
        FORGED.labels(consumer, kind).inc()

    def dead_letter(self, consumer: str, reason: str) -> None:
        DEAD_LETTERS.labels(consumer, reason).inc()

    def waiting(self, process: str, service: str, waiting: bool) -> None:
        WAITING.labels(process, service).set(1 if waiting else 0)

    def commands(self, in_flight: int, waiting: int) -> None:
        COMMANDS_IN_FLIGHT.set(in_flight)
        COMMANDS_WAITING.set(waiting)

    def created(self, warm: bool, seconds: float) -> None:
        CREATE_SECONDS.labels(str(warm).lower()).observe(seconds)

    def executed(self, seconds: float) -> None:
        EXEC_SECONDS.observe(seconds)

    def pulled(self, seconds: float) -> None:
        if seconds > 0:
            PULL_SECONDS.observe(seconds)

    def refused(self, reason: str) -> None:
        REFUSALS.labels("node", reason).inc()

    def egress_refused(self, count: int) -> None:
        EGRESS_REFUSED.inc(count)

    def sandboxes(self, running: int) -> None:
        SANDBOXES.set(running)

    def warm_ready(self, image: str, ready: int) -> None:
        WARM_READY.labels(image).set(ready)
