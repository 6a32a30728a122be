"""Placements and routed commands per second from one scheduler over 160 simulated
nodes.

    .venv/bin/python bench/schedule.py [--requests 20000] [--nodes 160] [--execs 50000]

Measures the scheduler's own work per CreateSandbox, as it runs in the scheduler
process: check the request's proof, its freshness and that its id is new, decode and
validate the request bytes, place it (capacity, image locality),
build and serialise its Requested and Scheduled events and its node task. The I/O
around it (Kafka, Celery) is the same per request whatever the placement costs and is
measured end to end by bench/e2e.py. For scale: DSec's peak is 5,000 creations/s per
unit (160 nodes).

The exec case then routes ``--execs`` Exec requests to the sandboxes placed: the same
proof, freshness, replay and decoding checks, the owner's check, and the sealed node
task. Goal: 10,000 commands/s in one process.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

from app.config import get_settings
from app.control.dispatch import Dispatcher
from app.control.outbox import Outbox
from app.domain.codec import encode
from app.domain.events import NodeHeartbeat, NodePayload
from app.domain.partition_counts import FixedPartitions
from app.domain.proof import InMemoryKeys, KeyInfo, Purpose, Role, headers
from app.domain.records import Inbound
from app.domain.requests import CreateSandbox, Exec, ReplyTo


def record(value: bytes, offset: int, key: bytes, signer: KeyInfo, purpose: Purpose) -> Inbound:
    """A record proven by ``signer``, as the SDK or a node would prove it."""
    proof = headers(purpose, signer.principal.key_id, signer.secret, value)
    return Inbound("dsec.requests", offset % 8, offset, key, value, proof)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--nodes", type=int, default=160)
    parser.add_argument("--execs", type=int, default=50_000)
    args = parser.parse_args()
    keys = InMemoryKeys(os.urandom(32))
    tenants = [keys.add(f"k-tenant-{i}", Role.TENANT, f"t{i}") for i in range(50)]
    settings = get_settings()
    partitions = FixedPartitions(settings.topic_partitions, settings.reply_partitions)
    dispatcher = Dispatcher(settings, keys, partitions)
    out = Outbox()
    # 160 nodes of DSec's shape: 188 cores, 1.5 TB, ~3,200 sandboxes each.
    for i in range(args.nodes):
        beat = NodeHeartbeat(
            node_id=f"node{i}",
            payload=NodePayload(
                capacity_sandboxes=3200, capacity_cpus=188 * 8, capacity_memory_mb=1_500_000,
                images=["dsec/busybox:latest"] if i % 2 else [], queue=f"node.node{i}",
            ),
        )  # fmt: skip
        node = keys.add(f"k-node-{i}", Role.NODE, f"node{i}")
        dispatcher.observe(out, record(encode(beat), i, b"n", node, Purpose.EVENT))
    requests = []
    for i in range(args.requests):
        tenant = tenants[i % 50]
        create = CreateSandbox(
            sandbox_id=f"sb-{uuid.uuid4().hex[:20]}", job_id="bench", cpus=1, memory_mb=512,
            reply_to=ReplyTo(topic=f"dsec.replies.t{i % 50}", partition=i % 16),
        )  # fmt: skip
        requests.append(
            record(encode(create), i, create.sandbox_id.encode(), tenant, Purpose.REQUEST)
        )
    started = time.perf_counter()
    for request in requests:
        out = Outbox()
        dispatcher.handle(out, request)
    elapsed = time.perf_counter() - started
    placed = len(dispatcher.placement.allocations)
    used = sorted(n.used_sandboxes for n in dispatcher.placement.nodes.values())
    print(f"{placed} of {args.requests} placed on {args.nodes} nodes in {elapsed:.2f}s")
    print(f"sandboxes per node: min {used[0]}, max {used[-1]}")
    execs = []
    owned = list(dispatcher.placement.allocations.values())
    for i in range(args.execs):
        allocation = owned[i % len(owned)]
        tenant = tenants[int(allocation.tenant[1:])]
        command = Exec(
            sandbox_id=allocation.sandbox_id, job_id="bench", command="python -m pytest -x",
            reply_to=ReplyTo(topic=f"dsec.replies.{allocation.tenant}", partition=i % 16),
        )  # fmt: skip
        execs.append(
            record(encode(command), args.requests + i, command.sandbox_id.encode(), tenant,
                   Purpose.REQUEST)
        )  # fmt: skip
    started = time.perf_counter()
    routed = 0
    for request in execs:
        out = Outbox()
        dispatcher.handle(out, request)
        routed += len(out.inbox)  # commands go to the nodes' inbox topics
    exec_s = time.perf_counter() - started
    print(f"{routed} of {args.execs} commands routed to their nodes in {exec_s:.2f}s")
    print(
        f"RESULT schedule placements/s={placed / elapsed:,.0f} commands/s={routed / exec_s:,.0f}"
        f" nodes={args.nodes} goal=5,000/10,000"
    )


if __name__ == "__main__":
    main()
