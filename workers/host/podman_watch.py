"""Keeps a node's Podman service running.

The worker starts the node's ``podman system service`` once; if it dies (killed, out
of memory, a crash), nothing the sandboxes need goes with it (conmon keeps them, and
their agents talk to the worker directly), but every create, removal and listing
fails until a service answers again. The watch looks every few seconds and starts a
new one; a create, removal, listing or inspect that meets the gap first revives it
itself and tries again (:meth:`workers.containers.podman_driver.PodmanDriver._reviving`).
"""

from __future__ import annotations

import logging
import threading

from app.config import Settings
from workers.host.podman_service import ensure_podman_service, service_answers
from workers.host.user import NodeUser
from workers.tally import NodeTally

log = logging.getLogger(__name__)

#: How often the service is looked at. Every look wakes the service and this worker;
#: once a second cost an idle node ~0.3 % of a core, and whatever needs the service
#: does not wait for the look (a create, a removal and the reconciler's listing revive
#: the service themselves).
CHECK_S = 15.0


class PodmanWatch:
    """Starts the node's Podman service again whenever it no longer answers."""

    def __init__(self, user: NodeUser, settings: Settings, tally: NodeTally) -> None:
        self.user = user
        self.settings = settings
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._tally = tally
        self._process = f"node {user.node_id}"

    def revive(self) -> bool:
        """Start a new service if this one does not answer; True if it had to."""
        with self._lock:  # one revival at a time, whoever notices first
            if service_answers(self.user.socket_path):
                return False
            self._tally.waiting(self._process, "podman", True)
            log.warning(
                "node %s: its Podman service does not answer: starting one", self.user.node_id
            )
            try:
                ensure_podman_service(self.user, self.settings)
            finally:
                self._tally.waiting(self._process, "podman", False)
            log.warning("node %s: Podman service answers again", self.user.node_id)
            return True

    def start(self) -> None:
        threading.Thread(target=self._run, name="dsec-podman-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(CHECK_S):
            try:
                self.revive()
            except Exception:  # the next look tries again; the log says why
                log.exception("node %s: starting its Podman service failed", self.user.node_id)
