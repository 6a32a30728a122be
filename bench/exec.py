"""Exec round trip on one node: the in-sandbox agent against `podman exec`, same run.

    .venv/bin/python bench/exec.py [--n 300] [--podman-n 30] [--platform-n 100]

One sandbox is created on the running node's rootless Podman service (the same
secure defaults the platform uses). Then, in this order:
- agent: the host client sends EXEC of ``true`` (a command that forks) and of ``echo``
  over the sandbox's socket; p50/p99 of the round trip;
- podman exec: ``exec_run(["true"])`` through the same REST service (what most
  sandbox tools do); fewer samples, each costs ~100 ms;
- one Kafka hop: a record handed to the platform's Publisher (acknowledged) until a
  consumer with the platform's settings has it; an exec waits on three of these
  (request, the node's inbox record, reply), the floor under the platform's figure;
- platform: the same command through the whole platform from the SDK, on a sandbox
  created through it: straight to the node's inbox (the direct route: Kafka, node,
  agent, Kafka back), and through the scheduler (one hop and the scheduler more), in
  turns of ten so that both meet the same machine;
- the platform from an SDK on librdkafka (``DSEC_SDK_KAFKA_CLIENT=librdkafka``; when
  confluent-kafka is installed, as `make` does), direct, in turns of ten with the
  kafka-python SDK, and the trainer process's CPU per command with each. The node's
  own clients are whatever its worker runs (``DSEC_NODE_KAFKA_CLIENT``, librdkafka by
  default): both ends on librdkafka is the ``librdkafka_end_to_end`` figure.
Needs `dsec up`. The last line prints the headline figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

from substrate import HOPS_PER_EXEC, kafka_hop, raw_sandbox

from app.config import Settings, get_settings
from app.control import tenants
from app.sdk import Client
from app.stats import durations, percentile


def line(name: str, samples: list[float]) -> str:
    p50, p99 = percentile(samples, 50) * 1000, percentile(samples, 99) * 1000
    return f"{name:<28} n={len(samples):<4} p50={p50:8.2f} ms  p99={p99:8.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--podman-n", type=int, default=30)
    parser.add_argument("--platform-n", type=int, default=100)
    args = parser.parse_args()
    settings = get_settings()
    results: dict[str, list[float]] = {}
    with raw_sandbox(settings) as (container, conn):
        results["agent: true"] = durations(args.n, lambda: conn.exec(["true"], timeout_s=10))
        results["agent: sh -c 'echo hi'"] = durations(
            args.n, lambda: conn.exec(["/bin/sh", "-c", "echo hi"], timeout_s=10)
        )
        results["podman exec: true"] = durations(
            args.podman_n, lambda: container.exec_run(["true"]), warmup=2
        )
    results["one Kafka hop"] = kafka_hop(settings, args.platform_n)
    with (
        Client(settings, credential=tenants.local(settings, "bench"), job_id="exec") as client,
        client.create() as box,
    ):
        durations(5, lambda: box.exec("true"))  # warm both routes
        box.direct = False
        durations(5, lambda: box.exec("true"))
        direct: list[float] = []
        routed: list[float] = []
        for _ in range(max(1, args.platform_n // 10)):
            box.direct = True
            direct += durations(10, lambda: box.exec("true"), warmup=0)
            box.direct = False
            routed += durations(10, lambda: box.exec("true"), warmup=0)
        box.direct = True
        results["platform (SDK): true"] = direct
        results["platform via the scheduler"] = routed
    trainer_cpu: dict[str, float] = {}
    if importlib.util.find_spec("confluent_kafka") is not None:
        trainer_cpu = _by_client(settings, args.platform_n, results)
    for name, samples in results.items():
        print(line(name, samples))
    for name, ms in trainer_cpu.items():
        print(f"trainer CPU per command, SDK on {name}: {ms:.2f} ms")
    agent = percentile(results["agent: true"], 50) * 1000
    podman = percentile(results["podman exec: true"], 50) * 1000
    platform = percentile(results["platform (SDK): true"], 50) * 1000
    platform_p99 = percentile(results["platform (SDK): true"], 99) * 1000
    routed = percentile(results["platform via the scheduler"], 50) * 1000
    hop = percentile(results["one Kafka hop"], 50) * 1000
    print(
        f"Kafka floor: an exec waits on {HOPS_PER_EXEC} hops of {hop:.1f} ms p50 ="
        f" {HOPS_PER_EXEC * hop:.1f} ms before the node or the agent does anything"
    )
    print(
        f"RESULT exec p50: agent={agent:.2f}ms podman_exec={podman:.1f}ms "
        f"speedup={podman / agent:.0f}x platform_end_to_end={platform:.1f}ms"
        f" platform_p99={platform_p99:.1f}ms via_scheduler={routed:.1f}ms kafka_hop={hop:.1f}ms"
        + (
            f" kafka_python_in_turns={percentile(kp, 50) * 1000:.1f}ms"
            f" librdkafka_end_to_end={percentile(rd, 50) * 1000:.1f}ms"
            f" librdkafka_p99={percentile(rd, 99) * 1000:.1f}ms"
            f" trainer_cpu_ms={trainer_cpu['kafka-python']:.2f}/{trainer_cpu['librdkafka']:.2f}"
            if (rd := results.get("platform (SDK on librdkafka)"))
            and (kp := results.get("platform (SDK on kafka-python)"))
            else ""
        )
    )


def _by_client(settings: Settings, n: int, results: dict[str, list[float]]) -> dict[str, float]:
    """Serial execs from an SDK on each Kafka client, in turns of ten; the trainer
    process's CPU per command with each (its every thread)."""
    clients = {
        name: Client(
            settings.model_copy(update={"sdk_kafka_client": name}),
            credential=tenants.local(settings, "bench"),
            job_id=f"exec-{name}",
        )
        for name in ("kafka-python", "librdkafka")
    }
    samples: dict[str, list[float]] = {name: [] for name in clients}
    cpu: dict[str, float] = {name: 0.0 for name in clients}
    try:
        boxes = {name: client.create() for name, client in clients.items()}
        for box in boxes.values():
            durations(5, lambda box=box: box.exec("true"))  # warm
        for _ in range(max(1, n // 10)):
            for name, box in boxes.items():
                started = time.process_time()
                samples[name] += durations(10, lambda box=box: box.exec("true"), warmup=0)
                cpu[name] += time.process_time() - started
        for box in boxes.values():
            box.close()
    finally:
        for client in clients.values():
            client.close()
    results["platform (SDK on kafka-python)"] = samples["kafka-python"]
    results["platform (SDK on librdkafka)"] = samples["librdkafka"]
    return {name: spent / len(samples[name]) * 1000 for name, spent in cpu.items()}


if __name__ == "__main__":
    main()
