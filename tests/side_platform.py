"""A second platform beside the stack, for a test that must break something of its
own (a node's disk, a slow broker, a lost create): its own scheduler, node worker and,
if asked, projector, on topics of their own, a database of their own and, if asked,
another broker. Only Redis is the stack's (the side node's queue is its own).

Its database is made for it (the stack's credentials copied in, so the same keys
prove the same senders) and dropped after: whatever the side platform places, ends or
leaves open never reaches the stack's log or projections, so the suite leaves them as
it found them (`dsec doctor` clean).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app import kafka_admin
from app.config import Settings
from app.control import tenants
from app.domain.proof import Role
from tests.conftest import ensure_tenant, scratch_database, wait_for
from workers.agent.build import AGENT_BINARY, ensure_agent_dir
from workers.host.user import user_name

DSEC = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "dsec"


@contextmanager
def dsec_service(
    args: Sequence[str], env: Mapping[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """``dsec ARGS`` in the background with ``env``, its output in ``log``; stopped
    with SIGTERM at the end (SIGKILL if it has not stopped in 30 s)."""
    with open(log, "ab") as out:
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


class Service:
    """One service that a test starts, kills and starts again (stopped at the end)."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str], log: Path) -> None:
        self._args, self._env, self._log = list(args), dict(env), log
        self._running: AbstractContextManager[subprocess.Popen[bytes]] | None = None
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> subprocess.Popen[bytes]:
        """Start it (again)."""
        self.stop()
        self._running = dsec_service(self._args, self._env, self._log)
        self.process = self._running.__enter__()
        return self.process

    def kill(self) -> None:
        """SIGKILL it, process group and all, as a crash does."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self.stop()

    def stop(self) -> None:
        """Stop it (SIGTERM), if it runs."""
        running, self._running, self.process = self._running, None, None
        if running is not None:
            running.__exit__(None, None, None)

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


@dataclass
class Side:
    """A side platform's settings and how to start one of its services."""

    settings: Settings
    env: dict[str, str]
    state: Path
    node: str

    def service(self, *args: str) -> AbstractContextManager[subprocess.Popen[bytes]]:
        """``dsec ARGS`` as a service of this platform (``run scheduler``, ``run worker
        --node N``, ``run projector``), logged to ``<state>/<service>.log``."""
        return dsec_service(args, self.env, self.state / f"{args[1]}.log")

    def worker(self) -> AbstractContextManager[subprocess.Popen[bytes]]:
        """This platform's node worker."""
        return self.service("run", "worker", "--node", self.node)

    def restartable(self, *args: str) -> Service:
        """``dsec ARGS`` as a service the caller starts, kills and starts again."""
        return Service(args, self.env, self.state / f"{args[1]}.log")


@contextmanager
def side_setup(
    stack: Settings,
    node: str,
    state: Path,
    *,
    kafka: Settings | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[Side]:
    """Topics, a database and node ``node``'s credential for a side platform whose
    services the caller starts (:meth:`Side.service`); everything goes after, the node
    user's processes with it. ``kafka``: the settings of another broker's
    (app/stack/local_cluster.py)."""
    ensure_tenant(stack, "tests")
    tenants.ensure(stack, Role.NODE, node)
    with scratch_database(stack, credentials=True) as database:
        settings = (kafka or stack).model_copy(
            update={
                "state_dir": state,
                "topic_prefix": f"side{uuid.uuid4().hex[:6]}",
                "database_url": database.database_url,
                "admin_database_url": database.admin_database_url,
            }
        )
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
            "DSEC_DATABASE_URL": settings.database_url,
            "DSEC_ADMIN_DATABASE_URL": settings.admin_database_url,
            "DSEC_CELERY_BROKER_URL": stack.celery_broker_url,
            "DSEC_METRICS_PORT": "0",
            "DSEC_SCHEDULER_METRICS_PORT": "0",
            "DSEC_NODE_METRICS_PORT": "0",
            "DSEC_NODE_ID": node,
            **(env or {}),
        }
        try:
            yield Side(settings, full, state, node)
        finally:
            subprocess.run(["pkill", "-KILL", "-u", user_name(node)], capture_output=True)
            kafka_admin.drop_topics(settings)
            kafka_admin.ungrant(settings, tenants.grants_of(settings, keys))


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
    their state directory, topics and a database of their own; yields their settings,
    on which an SDK client reaches them. ``kafka``: the settings of another broker's
    (app/stack/local_cluster.py). ``env`` adds settings of the test's."""
    with side_setup(stack, node, state, kafka=kafka, env=env) as side, ExitStack() as running:
        running.enter_context(side.service("run", "scheduler"))
        running.enter_context(side.worker())
        if projector:
            running.enter_context(side.service("run", "projector"))
        yield side.settings
