"""Hosts as network namespaces on a bridge: a control host, two node hosts and a
trainer, each with its own address and state directory, joined only by the network.

The control namespace runs what an operator provides (an Apache Kafka broker with its
properties from `dsec kafka properties`, TLS and SASL on every listener; a Postgres; a
Redis; all on its bridge address) and `dsec control prepare` then `dsec control up`;
each node namespace runs `dsec node up` with its own credential file, which alone
tells it the broker, the protocol and the CA; the trainer's namespace runs the SDK
with nothing but its credential file. Loopback in each namespace holds nothing of
another's, so an address that falls back to 127.0.0.1 anywhere fails here. The test
itself reads the log over the bridge, as an operator's SQL client would.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from app import secret_files
from app.config import Settings
from app.images import store as image_store
from app.metrics import sample, scrape
from app.stack.process import port_open
from tests.conftest import flower_workers, wait_for
from tests.integration.test_images import _rootfs
from tests.pg_cluster import own_cluster
from workers.host.mounts import remove_tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SUBNET = "10.251.7"
BRIDGE = "dsecmh0"
CONTROL, NODE_A, NODE_B, TRAINER = "control", "mh1", "mh2", "trainer"
ADDRESS = {
    CONTROL: f"{SUBNET}.1",
    NODE_A: f"{SUBNET}.2",
    NODE_B: f"{SUBNET}.3",
    TRAINER: f"{SUBNET}.4",
}
#: The test's own place on the bridge.
HERE = f"{SUBNET}.254"
NODES = (NODE_A, NODE_B)
KAFKA = f"{ADDRESS[CONTROL]}:9092"
PG_PORT = 5432

#: What the trainer runs in its namespace: create sandboxes (MH_CREATE of them) or
#: run a command in those named (MH_IDS), and print what happened as JSON.
TRAINER_SCRIPT = """
import json, os
from app.config import get_settings
from app.sdk import Client
out = []
with Client(get_settings(), job_id="multi-host") as client:
    if os.environ.get("MH_ROOTFS"):
        # The tenant's own image, pushed from here to the hub; two sandboxes of it at once
        image = client.images.push("mhtools", os.environ["MH_ROOTFS"], tag="1")
        a = client.create(image=image, timeout_s=120)
        b = client.create(image=image, timeout_s=120)
        with a, b:
            for box in (a, b):
                out.append({"id": box.id, "node": box.node_id, "image": image,
                            "stdout": box.exec("cat /etc/marker").text})
        print(json.dumps(out))
        raise SystemExit(0)
    if os.environ.get("MH_CREATE"):
        boxes = [client.create(timeout_s=120) for _ in range(int(os.environ["MH_CREATE"]))]
    else:
        boxes = [client.sandbox(i) for i in os.environ["MH_IDS"].split(",")]
    for box in boxes:
        try:
            result = box.exec("cat /etc/hostname; echo $((6 * 7))", timeout_s=30)
            out.append({"id": box.id, "node": box.node_id, "stdout": result.text})
        except Exception as exc:
            out.append({"id": box.id, "node": box.node_id, "error": repr(exc)})
print(json.dumps(out))
"""


def _ns(host: str) -> str:
    return f"dsecmh-{host}"


def _in(host: str) -> list[str]:
    """The command prefix that runs something on ``host``: in its network namespace
    only (`ip netns exec` would also mount a new /sys, hiding the cgroup tree that
    the node's containers need)."""
    return ["nsenter", f"--net=/run/netns/{_ns(host)}", "--"]


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, timeout=30)


def _kill_host(host: str) -> None:
    """Every process of ``host`` dies at once, as when its machine loses power."""
    found = subprocess.run(
        ["ip", "netns", "pids", _ns(host)], capture_output=True, text=True, check=False
    )
    for pid in found.stdout.split():
        with suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _node_user_processes(node: str) -> None:
    """The node user's processes that live outside the host's network namespace (its
    sandboxes have namespaces of their own): a dead host takes them too."""
    subprocess.run(["pkill", "-KILL", "-u", f"dsec-{node}"], capture_output=True, check=False)


def _remove_network() -> None:
    for host in ADDRESS:
        _kill_host(host)
        _ip("netns", "del", _ns(host), check=False)
    _ip("link", "del", BRIDGE, check=False)


@contextmanager
def network() -> Iterator[None]:
    """The bridge and one namespace per host on it (leftovers of a killed run removed)."""
    _remove_network()
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{HERE}/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    try:
        for host, address in ADDRESS.items():
            ns, veth = _ns(host), f"mh-{host}"[:15]
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", BRIDGE, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for node in NODES:
            _node_user_processes(node)
        _remove_network()


def operator_services(root: Path, env: dict[str, str], password: str) -> ExitStack:
    """The broker and Redis on the control host's address, as docs/deploy.md has an
    operator run them (the broker's secrets and properties made by `dsec kafka`);
    closing stops them."""
    control = ADDRESS[CONTROL]
    logs = root / "logs"
    _dsec(CONTROL, env, "kafka", "secrets", "--hosts", control)
    props = _dsec(
        CONTROL, env, "kafka", "properties", "--node-id", "1", "--voters",
        f"1@{control}:9093", "--host", control, "--listen", control,
        "--data-dir", str(root / CONTROL / "kafka-data"),
        "--secrets", str(root / CONTROL / "secrets" / "kafka"),
        "--replication", "1", "--min-isr", "1",
    )  # fmt: skip
    properties = root / CONTROL / "server.properties"
    properties.write_text(props)
    dsec = str(REPO / ".venv" / "bin" / "dsec")
    commands = {
        "broker": [dsec, "kafka", "run", str(properties)],
        "redis": ["redis-server", "--bind", control, "--port", "6379", "--requirepass",
                  password, "--save", "", "--appendonly", "no"],
    }  # fmt: skip
    logs.mkdir(parents=True, exist_ok=True)
    running = ExitStack()
    for name, command in commands.items():
        out = running.enter_context(open(logs / f"{name}.log", "wb"))  # noqa: SIM115
        process = running.enter_context(
            subprocess.Popen(
                [*_in(CONTROL), *command], stdout=out, stderr=subprocess.STDOUT, env=env
            )
        )
        running.callback(process.kill)  # (runs before the Popen's own exit waits)
    return running


def _env(host: str, root: Path, redis_url: str, **more: str) -> dict[str, str]:
    """``host``'s settings: its own state and secrets, the control host's services."""
    own = root / host
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("DSEC_")},
        "DSEC_STATE_DIR": str(own),
        "DSEC_SECRETS_DIR": str(own / "secrets"),
        "DSEC_CELERY_BROKER_URL": redis_url,
        "DSEC_DATABASE_URL": f"postgresql+psycopg://dsec_app@{ADDRESS[CONTROL]}:{PG_PORT}/dsec",
        "DSEC_ADMIN_DATABASE_URL": (
            f"postgresql+psycopg://dsec_owner@{ADDRESS[CONTROL]}:{PG_PORT}/dsec"
        ),
        "DSEC_METRICS_HOST": ADDRESS[host],
        "DSEC_FLOWER_HOST": ADDRESS[host],
        # The unit's image hub, on the control host (`dsec control up` runs it).
        "DSEC_HUB": f"{ADDRESS[CONTROL]}:5443",
        **more,
    }


def _run(host: str, args: Sequence[str], env: dict[str, str], timeout_s: float = 300) -> str:
    """Run ``args`` on ``host``; its stdout (fails the test with its output if it fails)."""
    done = subprocess.run(
        [*_in(host), *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, f"{host}: {' '.join(args)}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _dsec(host: str, env: dict[str, str], *args: str) -> str:
    return _run(host, [str(REPO / ".venv" / "bin" / "dsec"), *args], env)


def _trainer(env: dict[str, str], **more: str) -> list[dict[str, Any]]:
    out = _run(TRAINER, [sys.executable, "-c", TRAINER_SCRIPT], {**env, **more})
    return list(json.loads(out.strip().splitlines()[-1]))


def _pulls(settings: Settings, node: str) -> float:
    """Images node ``node`` pulled from the hub (its metrics, over the bridge)."""
    url = f"http://{ADDRESS[node]}:{settings.node_metrics_port_of(node)}/metrics"
    return sample(scrape(url), "dsec_node_image_pull_seconds_count") or 0.0


def _query(engine: Engine, sql: str, **params: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text(sql), params).all())


@pytest.fixture
def root() -> Iterator[Path]:
    # Node users must reach their homes under it: not pytest's root-only directory.
    made = Path(tempfile.mkdtemp(prefix="dsec-multihost-"))
    os.chmod(made, 0o755)
    yield made
    # The nodes' read-only views of the shared store are mounted in it.
    remove_tree(made)


def test_nodes_on_other_hosts_serve_a_trainer_on_another_and_a_lost_host_ends_its_sandboxes(
    stack: Settings, root: Path
) -> None:
    control = ADDRESS[CONTROL]
    password = secrets.token_urlsafe(16)
    redis_url = f"redis://:{password}@{control}:6379/0"
    with (
        network(),
        own_cluster(host=control, port=PG_PORT, prefix=_in(CONTROL), trust=f"{SUBNET}.0/24") as pg,
    ):
        # Given what an operator runs on the control host: a broker, Postgres, Redis
        envs = {h: _env(h, root, redis_url) for h in ADDRESS}
        kafka = {
            "DSEC_KAFKA_BOOTSTRAP": KAFKA,
            "DSEC_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            # The jars the stack fetched: one machine, fetched once.
            "DSEC_KAFKA_DIST_DIR": str(stack.state_dir / "kafka"),
        }
        # The control host and the nodes are told the broker; the trainer is not.
        envs[CONTROL] |= {**kafka, "DSEC_KAFKA_CREDENTIAL_BOOTSTRAP": KAFKA}
        for node in NODES:
            envs[node] |= {k: v for k, v in kafka.items() if k != "DSEC_KAFKA_DIST_DIR"}
        services = operator_services(root, envs[CONTROL], password)
        admin = create_engine(pg.url("postgres", "postgres"), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text("CREATE ROLE dsec_owner LOGIN"))
            conn.execute(text("CREATE ROLE dsec_app LOGIN"))
            conn.execute(text("CREATE DATABASE dsec OWNER dsec_owner"))
        admin.dispose()
        log = create_engine(pg.url("dsec_app", "dsec"))
        try:
            wait_for(lambda: port_open(control, 9092) and port_open(control, 6379), 90, "broker")

            # And the control plane brought up from settings alone: the administrator
            # made on the broker's internal listener, then the services
            _dsec(CONTROL, envs[CONTROL], "control", "prepare", "--kafka-internal",
                  f"{control}:9094")  # fmt: skip
            said = _dsec(CONTROL, envs[CONTROL], "control", "up")
            assert "projector: started" in said and "scheduler: started" in said, said
            agent = root / "dsec-agent"
            _dsec(CONTROL, envs[CONTROL], "node", "agent", "--out", str(agent))
            for node in NODES:
                cred = root / node / "node.json"
                _dsec(CONTROL, envs[CONTROL], "node", "add", node, "--out", str(cred))
                envs[node] = {
                    **envs[node],
                    "DSEC_NODE_ID": node,
                    "DSEC_NODE_CREDENTIAL_FILE": str(cred),
                    # The image store shared by the nodes (read-only to them).
                    "DSEC_LAYER_STORE": str(stack.layer_store),
                }
            trainer_cred = root / TRAINER / "trainer.json"
            _dsec(
                CONTROL, envs[CONTROL], "tenant", "create", "mhtrainer", "--out", str(trainer_cred)
            )
            envs[TRAINER]["DSEC_CREDENTIALS"] = str(trainer_cred)

            # When two node hosts join over the bridge
            for node in NODES:
                said = _dsec(node, envs[node], "node", "up", "--agent", str(agent))
                assert f"worker-{node}: started" in said, said
            for node in NODES:
                wait_for(
                    lambda n=node: _query(
                        log, "SELECT 1 FROM nodes WHERE node_id = :n AND state = 'alive'", n=n
                    ),
                    120,
                    f"{node} alive in the log",
                )

            # And Flower on the control host shows both node workers
            flower = f"http://{control}:{stack.flower_port}"
            password = secret_files.read_text(root / CONTROL / "secrets" / "flower.password")

            def both_in_flower() -> bool:
                names = flower_workers(flower, password or "")
                return all(any(n.startswith(f"{node}@") for n in names) for node in NODES)

            wait_for(both_in_flower, 60, "both node workers in Flower")

            # And a trainer on a fourth host pushes its own image to the control host's hub
            rootfs = root / TRAINER / "rootfs.tar"
            rootfs.write_bytes(_rootfs("through the hub"))
            image = "tenants/mhtrainer/mhtools:1"
            try:
                pulled = _trainer(envs[TRAINER], MH_ROOTFS=str(rootfs))
                # Then both node hosts start sandboxes of it, fetched from the hub once
                assert {box["node"] for box in pulled} == {NODE_A, NODE_B}, pulled
                assert all(box["stdout"] == "through the hub" for box in pulled), pulled
                assert sum(_pulls(stack, node) for node in NODES) == 1
            finally:
                wait_for(lambda: not image_store.image_users(image, stack), 30, "sandboxes gone")
                image_store.remove_image(image, stack)

            # Then a trainer on a fourth host gets sandboxes on both, and they answer
            made = _trainer(envs[TRAINER], MH_CREATE="4")
            assert {box["node"] for box in made} == {NODE_A, NODE_B}, made
            assert all(box.get("stdout", "").endswith("42\n") for box in made), made

            # When one node host is torn down, its processes and sandboxes dying with it
            _kill_host(NODE_B)
            _node_user_processes(NODE_B)
            _ip("netns", "del", _ns(NODE_B))
            lost = {box["id"] for box in made if box["node"] == NODE_B}

            # Then its sandboxes end node_lost in the log, with no one typing a command
            def ended() -> list[Any]:
                rows = _query(
                    log,
                    "SELECT sandbox_id, end_reason FROM sandboxes WHERE sandbox_id = ANY(:ids)"
                    " AND state = 'stopped'",
                    ids=sorted(lost),
                )
                return rows if len(rows) == len(lost) else []

            assert {reason for _, reason in wait_for(ended, 90, "node_lost")} == {"node_lost"}
            # And the other node's sandboxes still answer the trainer
            kept = [box["id"] for box in made if box["node"] == NODE_A]
            again = _trainer(envs[TRAINER], MH_IDS=",".join(kept))
            assert all(box.get("stdout", "").endswith("42\n") for box in again), again
        finally:
            for node in NODES:
                subprocess.run(
                    [*_in(node), str(REPO / ".venv" / "bin" / "dsec"), "node", "down"],
                    env=envs[node], capture_output=True, timeout=60, check=False,
                )  # fmt: skip
            subprocess.run(
                [*_in(CONTROL), str(REPO / ".venv" / "bin" / "dsec"), "control", "down"],
                env=envs[CONTROL], capture_output=True, timeout=60, check=False,
            )  # fmt: skip
            services.close()
            log.dispose()
