"""Prometheus metrics of the services (one registry per process)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

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
COMMANDS_IN_FLIGHT = Gauge(
    "dsec_node_commands_in_flight", "Commands claimed by the node and not yet answered"
)
COMMANDS_WAITING = Gauge(
    "dsec_node_commands_waiting",
    "Claimed commands waiting for their tenant's turn (node or tenant limit reached)",
)

WAITING = Gauge(
    "dsec_waiting_for_service",
    "1 while a process waits for a backing service to come back",
    ["process", "service"],
)


def serve(port: int) -> None:
    """Expose /metrics on ``port`` (0: do not serve)."""
    if port:
        start_http_server(port, addr="127.0.0.1")
