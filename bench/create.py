"""Create -> ready latency and creations/s through the platform, vs raw Podman.

    .venv/bin/python bench/create.py [--rounds 15] [--concurrency 1 8] [--burst 32]
                                     [--podman-n 30]

Measures the stack as it runs and prints its warm-pool configuration (the worker's
``DSEC_WARM_POOL``); run it once per configuration, restarting the stack between:

    source env; DSEC_WARM_POOL='{}' dsec down; DSEC_WARM_POOL='{}' dsec up
    .venv/bin/python bench/create.py
    DSEC_WARM_POOL='{"dsec/busybox:latest": 16}' dsec down; ... dsec up; ... again

- latency, per concurrency C: rounds of C creates sent at once through the SDK; each
  sandbox's time from its send to its SandboxReady reply. Between rounds the sandboxes
  are destroyed and the bench waits until the warm pool is full again, so each round
  starts alike; ``warm`` counts the sandboxes whose container was claimed from it;
- create to first command, one at a time: the SDK's ``create`` and then ``exec("true")``
  (the direct route), from a full pool each time, ``--rounds`` times;
- throughput: a burst of B creates sent at once; creations/s = B / time to the last
  reply (a pool serves the first ones, the rest start cold);
- raw podman: podman-py ``containers.create`` (the platform's secure defaults,
  ``sleep`` as PID 1) + ``start`` against the node's own rootless Podman service, one
  at a time and 8 at a time; removed afterwards, outside the timing. No cgroup move and
  no agent handshake: the platform pays for both.
Needs `dsec up`. The last line prints the headline figures.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import podman

from app.config import Settings, get_settings
from app.control import tenants
from app.domain.requests import CreateSandbox, DestroySandbox
from app.sdk import Client
from app.stats import percentile
from workers.containers.podman_api import container_args
from workers.containers.podman_driver import PodmanDriver
from workers.containers.spec import SandboxSpec
from workers.host.user import set_up_node_user

SHAPE: dict[str, Any] = {"cpus": 0.25, "memory_mb": 128, "ttl_s": 900}


def worker_pool_config(settings: Settings) -> dict[str, int]:
    """The running worker's warm pools: its environment, else the default."""
    pidfile = settings.state_dir / "run" / f"worker-{settings.node_id}.pid"
    try:
        environ = Path(f"/proc/{int(pidfile.read_text())}/environ").read_bytes()
    except (OSError, ValueError):
        return dict(settings.warm_pool)
    for entry in environ.split(b"\0"):
        if entry.startswith(b"DSEC_WARM_POOL="):
            return {str(k): int(v) for k, v in json.loads(entry.split(b"=", 1)[1]).items()}
    return dict(Settings.model_fields["warm_pool"].get_default(call_default_factory=True))


def warm_count(driver: PodmanDriver) -> int:
    return sum(1 for b in driver.list_sandboxes() if b.warm and b.running)


def wait_full(driver: PodmanDriver, size: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while size and warm_count(driver) < size and time.monotonic() < deadline:
        time.sleep(0.2)


def create_at_once(client: Client, n: int) -> tuple[list[str], list[float], float]:
    """Send ``n`` creates at once; sandbox ids, each one's latency, time to the last."""
    image = client.settings.default_image
    requests = [
        CreateSandbox(image=image, **client.request_fields(f"sb-{uuid.uuid4().hex[:20]}"), **SHAPE)
        for _ in range(n)
    ]
    done: dict[str, float] = {}
    lock = threading.Lock()
    sent: dict[str, float] = {}
    futures: list[Future[Any]] = []
    start = time.perf_counter()
    for request in requests:
        sent[request.sandbox_id] = time.perf_counter()
        future = client.send(request)

        def mark(_f: Future[Any], sid: str = request.sandbox_id) -> None:
            with lock:
                done[sid] = time.perf_counter()

        future.add_done_callback(mark)
        futures.append(future)
    for request, future in zip(requests, futures, strict=True):
        client.wait(request, future, 300)
    ids = [r.sandbox_id for r in requests]
    latencies = [done[s] - sent[s] for s in ids]
    return ids, latencies, max(done.values()) - start


def first_command(client: Client, driver: PodmanDriver, size: int, rounds: int) -> list[float]:
    """Create to the first command's answer, one at a time, as a trainer sees it: the
    SDK's ``create`` then ``exec("true")`` (which goes the direct route when the
    sandbox's ``ready`` says so), each from a full warm pool."""
    latencies = []
    for _ in range(rounds):
        wait_full(driver, size)
        began = time.perf_counter()
        box = client.create(**SHAPE)
        result = box.exec("true")
        latencies.append(time.perf_counter() - began)
        assert result.exit_code == 0, result
        box.close()
    return latencies


def destroy_all(client: Client, ids: list[str]) -> None:
    requests = [DestroySandbox(**client.request_fields(s)) for s in ids]
    futures = [client.send(r) for r in requests]
    for request, future in zip(requests, futures, strict=True):
        client.wait(request, future, 300)


def claimed(driver: PodmanDriver, ids: list[str]) -> int:
    wanted = set(ids)
    return sum(1 for b in driver.list_sandboxes() if b.sandbox_id in wanted and b.claimed)


def raw_podman(settings: Settings, n: int, concurrency: int) -> tuple[list[float], float]:
    """create+start latencies and creations/s straight against the node's service."""
    user = set_up_node_user(settings.node_id, settings)
    local = threading.local()

    def one(_: int) -> tuple[float, str]:
        if not hasattr(local, "client"):
            local.client = podman.PodmanClient(base_url=user.socket_url, timeout=60)
        sid = f"bench-raw-{uuid.uuid4().hex[:10]}"
        run_dir = settings.state_dir / "nodes" / settings.node_id / "bench" / sid
        run_dir.mkdir(parents=True, exist_ok=True)
        spec = SandboxSpec(
            sandbox_id=sid,
            image=settings.default_image,
            cpus=SHAPE["cpus"],
            memory_mb=SHAPE["memory_mb"],
            agent_bin_dir=settings.state_dir / "agent",
            run_dir=run_dir,
        )
        t = time.perf_counter()
        container = local.client.containers.create(
            spec.image, ["sleep", "3600"], **container_args(spec)
        )
        container.start()
        return time.perf_counter() - t, spec.container_name

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        results = list(ex.map(one, range(n)))
    wall = time.perf_counter() - start
    cleanup = podman.PodmanClient(base_url=user.socket_url, timeout=60)
    for _, name in results:
        cleanup.api.delete(f"/containers/{name}", params={"force": True, "timeout": 0})
    cleanup.close()
    return [r[0] for r in results], n / wall


def fmt(samples: list[float]) -> str:
    p50, p99 = percentile(samples, 50) * 1000, percentile(samples, 99) * 1000
    return f"p50={p50:7.1f} ms  p99={p99:7.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--burst", type=int, default=32)
    parser.add_argument("--podman-n", type=int, default=30)
    args = parser.parse_args()
    settings = get_settings()
    driver = PodmanDriver(set_up_node_user(settings.node_id, settings).socket_url)
    pools = worker_pool_config(settings)
    size = pools.get(settings.default_image, 0)
    print(f"stack: node {settings.node_id}, warm pool {pools or 'off'} ({size} of the image used)")
    headline: dict[str, str] = {}
    with Client(settings, credential=tenants.local(settings, "bench"), job_id="create") as client:
        destroy_all(client, create_at_once(client, 2)[0])  # warm up the paths
        for c in args.concurrency:
            latencies: list[float] = []
            warm = 0
            for _ in range(args.rounds):
                wait_full(driver, size)
                ids, lat, _ = create_at_once(client, c)
                latencies += lat
                warm += claimed(driver, ids)
                destroy_all(client, ids)
            print(f"platform c={c:<3} n={len(latencies):<4} {fmt(latencies)}  warm={warm}")
            headline[f"c{c}_p50"] = f"{percentile(latencies, 50) * 1000:.0f}ms"
        first = first_command(client, driver, size, args.rounds)
        print(f"platform create to first command c=1 n={len(first):<4} {fmt(first)}")
        headline["first_command_p50"] = f"{percentile(first, 50) * 1000:.0f}ms"
        headline["first_command_p99"] = f"{percentile(first, 99) * 1000:.0f}ms"
        wait_full(driver, size)
        ids, lat, wall = create_at_once(client, args.burst)
        warm = claimed(driver, ids)
        destroy_all(client, ids)
        rate = args.burst / wall
        print(f"platform burst of {args.burst}: {rate:.1f} creations/s ({warm} warm)  {fmt(lat)}")
        headline["burst"] = f"{rate:.1f}/s"
    for c in (1, 8):
        lat, rate = raw_podman(settings, args.podman_n, c)
        print(f"raw podman c={c:<3} n={len(lat):<4} {fmt(lat)}  {rate:.1f} creations/s")
        headline[f"podman_c{c}"] = f"p50={percentile(lat, 50) * 1000:.0f}ms,{rate:.1f}/s"
    print(f"RESULT create warm_pool={size}: " + " ".join(f"{k}={v}" for k, v in headline.items()))


if __name__ == "__main__":
    main()
