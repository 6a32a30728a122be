"""The node's disk budget for images pulled from the hub: when the shared store holds
more than ``node_image_budget_mb``, the images pulled longest ago or last used longest
ago go, as long as no container of any node on this host uses them.

Decisions:

- Only images this host pulled from the hub are ever evicted: the hub has them, so a
  later create pulls again. What an operator imported or built here (`dsec image
  import/build`) may exist nowhere else, and stays whatever the budget says.
- In use means any container, running or stopped, of any node service of this host
  (the store is shared), the warm pool's waiting ones included. A node user with
  neither a conmon nor a Podman process (a node taken down) runs nothing and is passed
  over; one whose service runs and does not answer stops the eviction round: nothing
  is removed on a guess.
- Last use is what this worker saw (the pull, then each create that named the image),
  kept in a root-only file so a restarted worker keeps its order.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from app import secret_files
from app.config import Settings
from workers.host.layer_store import list_images, normalize_name, store_lock, store_podman
from workers.host.ops import live_processes_of
from workers.host.podman_service import container_images
from workers.host.user import node_users

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Held:
    """An image in the store as the budget sees it."""

    name: str
    id: str
    size: int
    #: When it was last pulled or used (epoch seconds); None: not pulled from the hub.
    used_at: float | None


def evictions(held: Iterable[Held], in_use: set[str], budget_bytes: int) -> list[Held]:
    """The images to remove, least recently used first, until the store's images fit
    ``budget_bytes``; never one in use or not pulled from the hub (may be fewer than
    needed: the budget is then exceeded, and said so by the caller)."""
    held = list(held)
    total = sum(h.size for h in {h.id: h for h in held}.values())
    out: list[Held] = []
    candidates = sorted(
        (h for h in held if h.used_at is not None and h.id not in in_use),
        key=lambda h: h.used_at or 0.0,
    )
    for image in candidates:
        if total <= budget_bytes:
            break
        out.append(image)
        total -= image.size
    return out


def _runs_containers(uid: int) -> bool:
    """``uid`` has a container running: a conmon of its, or its Podman service."""
    for pid in live_processes_of(uid):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm in ("conmon", "podman"):
            return True
    return False


class ImageBudget:
    """Last use of pulled images, and the eviction round after each pull."""

    def __init__(self, settings: Settings, record: Path) -> None:
        self.settings = settings
        self.record = record
        self._lock = threading.Lock()
        self._used = self._load()

    def _load(self) -> dict[str, float]:
        try:
            raw = json.loads(secret_files.read(self.record))
            return {str(k): float(v) for k, v in raw.items()}
        except (FileNotFoundError, ValueError, AttributeError):
            return {}

    def _save(self) -> None:
        secret_files.write(self.record, json.dumps(self._used).encode())

    def pulled(self, name: str) -> None:
        """``name`` came from the hub just now."""
        with self._lock:
            self._used[normalize_name(name)] = time.time()
            self._save()

    def used(self, name: str) -> None:
        """A create named ``name`` (kept in memory; written with the next pull)."""
        key = normalize_name(name)
        with self._lock:
            if key in self._used:
                self._used[key] = time.time()

    def enforce(self, keep: str = "") -> list[str]:
        """Remove what the budget says must go, never ``keep`` (the image a create
        just pulled) nor the settings' ``node_prefetch``; returns the names removed."""
        budget_mb = self.settings.node_image_budget_mb
        if not budget_mb:
            return []
        in_use: set[str] = set()
        for user in node_users(self.settings):
            if not _runs_containers(user.uid):
                continue  # a node taken down (no conmon, at most its pause process)
            found = container_images(user.socket_path)
            if found is None:
                log.warning("image budget: node %s's Podman is silent: no eviction", user.node_id)
                return []
            in_use |= found
        with self._lock:
            used = dict(self._used)
        # The image a create just pulled, and the unit's popular ones, never go
        for name in (keep, *self.settings.node_prefetch):
            if name:
                used.pop(normalize_name(name), None)
        held = [
            Held(name, image.id, image.size, used.get(name))
            for image in list_images(self.settings)
            for name in image.names
        ]
        removed = []
        with store_lock(self.settings):
            for image in evictions(held, in_use, budget_mb << 20):
                if store_podman(self.settings, "rmi", image.name, check=False).returncode == 0:
                    removed.append(image.name)
        with self._lock:
            for name in removed:
                self._used.pop(name, None)
            self._save()
        if removed:
            log.info("image budget (%d MB): evicted %s", budget_mb, ", ".join(removed))
        return removed
