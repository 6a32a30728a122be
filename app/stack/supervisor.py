"""Keeps the embedded stack's services running.

`dsec up` starts a supervisor beside the services. It waits on their processes (a
pidfd each), so a death wakes it at once, and looks at each service the stack started
then, and every few seconds besides: one whose pid file is still there (nobody ran
`dsec down` on it) but whose process is gone died, and is started again. A service that had run
for ``STABLE_S`` is started again at once: it is not crash-looping, and a node worker
kept down longer than the heartbeat timeout would lose its node's sandboxes. Deaths
that come soon after a start make a crash loop: each is followed by a longer pause
(1 s, 2 s, 4 s ... 60 s), and after ``LIMIT`` in a row the service is left down and
`dsec status` says it gave up. The broker keeps its log on disk: one started again
has every topic and every acknowledged record it had.

Each service's restarts are kept in ``<state_dir>/run/<name>.restarts`` (JSON, see
:mod:`app.stack.restarts`), which `dsec status` reads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time

from app.config import Settings
from app.stack.restarts import LIMIT, Restarts

log = logging.getLogger(__name__)

#: How often the services are looked at while one is down (waiting out its pause).
TICK_S = 1.0
#: How often they are looked at while all run: only to notice processes that someone
#: else started or replaced (a death wakes the supervisor by itself). Looking every
#: second cost the idle stack ~0.25 % of a core.
RESCAN_S = 5.0


def tend(settings: Settings, now: float | None = None) -> list[str]:
    """One look at every service; returns the names started again."""
    from app.stack import services as stack

    now = time.time() if now is None else now
    started = []
    for service in stack.services(settings, stack.known_node_ids(settings)):
        if service.name == stack.SUPERVISOR:
            continue
        if not service.pidfile(settings).exists() or service.pid(settings) is not None:
            continue  # stopped on purpose, or running
        record = Restarts.load(settings, service.name)
        if record.died_at is None:
            record.died(now)
            record.save(settings, service.name)
        if not record.due(now):
            if record.quick >= LIMIT and not record.gave_up:
                record.gave_up = True
                record.save(settings, service.name)
                log.error("%s keeps dying: left down (`dsec up` starts it again)", service.name)
            continue
        if service.restart_if_died(settings):
            log.warning("%s died: started it again", service.name)
            record.started(now)
            record.save(settings, service.name)
            started.append(service.name)
            if service.name == "broker":
                threading.Thread(
                    target=resync_principals, args=(settings,), name="dsec-resync", daemon=True
                ).start()
    return started


#: How long a restarted broker has to answer before its principals are put back.
BROKER_READY_S = 90.0


def resync_principals(settings: Settings) -> None:
    """Put the principals and ACLs back on a broker the supervisor started again, as
    `dsec up` does: the credentials in Postgres are what holds. Apache Kafka 4.1 here
    came back from a SIGKILL, on a metadata log of ~10,000 records, with its topics and
    without a single SCRAM credential (docs/BENCHMARKS.md, session 22): every service
    was then refused at its next connection, for good."""
    from app.control import tenants
    from app.stack import broker
    from app.stack.process import port_open

    host, _port, _tls, internal, _controller = broker.ports(settings)
    deadline = time.monotonic() + BROKER_READY_S
    while not port_open(host, internal) and time.monotonic() < deadline:
        time.sleep(0.5)
    for attempt in range(5):
        try:
            broker.ensure_principals(settings, host, internal)
            tenants.sync_kafka(settings)
            log.info("supervisor: the broker's principals and ACLs are in place again")
            return
        except Exception as exc:  # the broker may still be starting: try again
            log.warning("supervisor: principals not put back yet (%s)", exc)
            time.sleep(2.0 * (attempt + 1))
    log.error("supervisor: the broker's principals could not be put back: run `dsec up`")


def _pidfds(settings: Settings) -> tuple[list[int], bool]:
    """A pidfd per running service (readable once it exits), and whether any service
    that should run does not."""
    from app.stack import services as stack

    fds, down = [], False
    for service in stack.services(settings, stack.known_node_ids(settings)):
        if service.name == stack.SUPERVISOR or not service.pidfile(settings).exists():
            continue
        pid = service.pid(settings)
        if pid is None:
            down = True
            continue
        try:
            fds.append(os.pidfd_open(pid))
        except OSError:  # gone meanwhile: the next look sees it
            down = True
    return fds, down


def run(settings: Settings) -> None:
    """Tend the services until SIGTERM."""
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    # A signal also ends the wait on the services' processes.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    log.info("supervisor: watching the stack's services (a look every %.0f s)", RESCAN_S)
    while not stopping.is_set():
        fds: list[int] = []
        try:
            tend(settings)
            fds, down = _pidfds(settings)
            select.select([wake_r, *fds], [], [], TICK_S if down else RESCAN_S)
        except Exception:  # one bad look must not end the supervision
            log.exception("supervisor: a round failed")
            stopping.wait(TICK_S)
        finally:
            for fd in fds:
                os.close(fd)
        with contextlib.suppress(BlockingIOError):
            os.read(wake_r, 512)  # a signal's bytes, if one ended the wait
