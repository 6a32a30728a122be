"""The image hub as a host's root Podman reaches it: pull an image into the shared
layer store (what a node does for a create whose image it lacks, and `dsec image
prefetch`), push one from it (`dsec image push`, an operator's).

A client logs in with its platform credential (app/domain/hub_access.py): the login
goes in a root-only ``containers-auth.json``, the CA that proves the hub in a root-only
``--cert-dir``, so neither a password nor a trust decision is on a command line.
A pulled image is also named as an imported one is (``localhost/<repository>:<tag>``):
a sandbox names it the same way whether it came from the hub or from `dsec image
import`. Layers the store already holds are not fetched again (Podman compares
digests); concurrent creates of one missing image pull it once.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import stat
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path

from app import secret_files
from app.config import Settings
from app.credentials import Credential
from app.domain.hub_access import (
    HubReference,
    hub_password,
    hub_reference,
    oversize,
    owner_of,
)
from workers.errors import ImageNotFound, ImageRefused, NodeError
from workers.host.image_budget import ImageBudget
from workers.host.layer_store import find_image, image_exists, store_lock, store_podman
from workers.host.podman_service import refresh_podman_services

log = logging.getLogger(__name__)

#: How soon a node tries again the prefetched images it could not pull.
PREFETCH_RETRY_S = 30.0


def client_dir(settings: Settings) -> Path:
    """What a client of the hub on this host keeps (root only)."""
    return settings.state_dir / "hub-client"


def trust_dir(settings: Settings, ca_pem: bytes) -> Path:
    """A directory as Podman's ``--cert-dir`` reads it: the CA proving the hub."""
    path = client_dir(settings) / "certs"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    target = path / "ca.crt"
    if not target.exists() or target.read_bytes() != ca_pem:
        secret_files.write(target, ca_pem)
    return path


def write_login(settings: Settings, path: Path, user: str, password: str) -> Path:
    """``path``: a root-only login file (containers-auth.json) for the hub."""
    raw = base64.b64encode(f"{user}:{password}".encode()).decode()
    secret_files.write(path, json.dumps({"auths": {settings.hub: {"auth": raw}}}).encode())
    return path


def auth_file(settings: Settings, credential: Credential) -> Path:
    """A root-only login file for ``credential`` at the hub."""
    path = client_dir(settings) / f"auth-{credential.key_id}.json"
    return write_login(settings, path, credential.key_id, hub_password(credential.secret))


def _why(done: subprocess.CompletedProcess[bytes]) -> str:
    """What a failed Podman said last (or how it ended)."""
    said = done.stderr.decode(errors="replace").strip().splitlines()
    return said[-1] if said else f"podman exited {done.returncode}"


def ca_pem(settings: Settings, credential: Credential) -> bytes:
    """The CA a client checks the hub with: its credential's (a node host elsewhere),
    else the stack's own."""
    if credential.kafka is not None and credential.kafka.ca_pem:
        return credential.kafka.ca_pem.encode()
    return (settings.ca_dir / "ca.pem").read_bytes()


def device_files(root: Path, limit: int = 5) -> list[str]:
    """Paths under ``root`` (an image's files) that are device files, at most
    ``limit``; links are not followed."""
    found: list[str] = []
    for here, dirs, files in os.walk(root):
        for entry in (*dirs, *files):
            mode = os.lstat(os.path.join(here, entry)).st_mode
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                found.append(os.path.relpath(os.path.join(here, entry), root))
                if len(found) >= limit:
                    return found
    return found


def local_name(ref: HubReference) -> str:
    """How the layer store names an image that came from the hub."""
    return f"localhost/{ref}"


class HubClient:
    """Root's Podman on this host, logged in to the hub as ``credential``."""

    def __init__(self, settings: Settings, credential: Credential) -> None:
        self.settings = settings
        self.credential = credential
        #: What was pulled when, and the eviction round after each pull.
        self.budget = ImageBudget(settings, client_dir(settings) / "pulled.json")
        self._locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        #: Names this worker checked are their first pushed digest (see pinned).
        self._verified: dict[str, str] = {}
        self._guard = threading.Lock()

    def login_args(self, authfile: Path | None = None) -> list[str]:
        """Podman's options that log in to the hub (as this client's credential, or
        as ``authfile`` says) and check it; no secret in them."""
        settings, credential = self.settings, self.credential
        return [
            "--authfile",
            str(authfile or auth_file(settings, credential)),
            "--cert-dir",
            str(trust_dir(settings, ca_pem(settings, credential))),
        ]

    def _lock(self, name: str) -> threading.Lock:
        with self._guard:
            return self._locks[name]

    def pull(self, image: str, refresh: bool = True) -> float:
        """Bring ``image`` from the hub into the shared store unless it is there;
        returns the seconds the pull took (0: it was there). Raises
        :class:`ImageNotFound` for a name the hub cannot hold or does not have."""
        ref = self._reference(image)
        name = local_name(ref)
        with self._lock(name):
            if image_exists(name, self.settings):
                return 0.0
            took = self._fetch(image, ref, f"{ref}", name)
        self._after_pull(name, refresh)
        return took

    def pinned(self, image: str, digest: str) -> float:
        """Make the store's ``image`` the manifest its name was first pushed with
        (``digest``), whatever its tag says now; returns the seconds a pull took (0:
        the store had it). A copy of other content under the name (pulled by its tag
        after the tag moved) is replaced, or the create refused while it is in use."""
        ref = self._reference(image)
        name = local_name(ref)
        with self._lock(name):
            held = self._verify(name, digest)
            if held:
                return 0.0
            if held is False and store_podman(self.settings, "rmi", name, check=False).returncode:
                raise ImageRefused(
                    f"image {image} on this node is not what its name was first pushed"
                    f" as ({digest[:19]}...) and a container uses it: refused"
                )
            took = self._fetch(image, ref, f"{ref.repository}@{digest}", name)
            self._verified[name] = digest
        self._after_pull(name, refresh=True)
        return took

    def holds(self, image: str, digest: str) -> bool:
        """Whether the store's ``image`` is already the manifest ``digest`` (never pulls:
        what a warm container of the name runs is checked with it)."""
        ref = hub_reference(image)
        if ref is None:
            return False
        name = local_name(ref)
        with self._lock(name):
            return self._verify(name, digest) is True

    def _verify(self, name: str, digest: str) -> bool | None:
        """Whether the store's ``name`` is the manifest ``digest`` (None: no such image
        in the store). Called under the name's lock; a match is remembered."""
        if self._verified.get(name) == digest:
            return True
        if not image_exists(name, self.settings):
            return None
        if digest not in self._digests_of(name):
            return False
        self._verified[name] = digest
        return True

    def prefetch(self, images: list[str], retry_s: float = PREFETCH_RETRY_S) -> None:
        """Pull each of ``images`` the store lacks, again every ``retry_s`` for those
        that failed (the hub may not answer yet as a node starts), until it has all."""
        left = list(images)
        while left:
            for image in list(left):
                try:
                    took = self.pull(image)
                    left.remove(image)
                    if took:
                        log.info("prefetched %s in %.1f s", image, took)
                except NodeError as exc:
                    log.warning("prefetch of %s: %s (trying again)", image, exc)
            if left:
                time.sleep(retry_s)

    def forget(self, image: str) -> None:
        """``image`` may have left the store: :meth:`pinned` checks it again."""
        ref = hub_reference(image)
        if ref is not None:
            self._verified.pop(local_name(ref), None)

    def _reference(self, image: str) -> HubReference:
        if not self.settings.hub:
            raise ImageNotFound(f"image {image!r} is not on this node (no hub to pull from)")
        ref = hub_reference(image)
        if ref is None:
            raise ImageNotFound(f"image {image!r} is not on this node, nor a name the hub holds")
        return ref

    def _fetch(self, image: str, ref: HubReference, remote: str, name: str) -> float:
        """Pull ``remote`` (``repository:tag`` or ``repository@digest``) and keep it
        under ``name`` alone, screened if a tenant's; the seconds it took."""
        began = time.monotonic()
        with store_lock(self.settings):
            done = store_podman(
                self.settings, "pull", "--quiet", *self.login_args(),
                f"docker://{self.settings.hub}/{remote}", check=False,
            )  # fmt: skip
            if done.returncode != 0:
                why = _why(done)
                raise ImageNotFound(f"image {image!r} could not be pulled from the hub: {why}")
            # One name, as an imported image has: removing it removes the image.
            pulled = f"{self.settings.hub}/{remote}"
            store_podman(self.settings, "tag", pulled, name)
            store_podman(self.settings, "untag", name, pulled)  # a digest's name too
            if owner_of(ref.repository) is not None:
                self._screen(name)
        self.budget.pulled(name)
        return time.monotonic() - began

    def _after_pull(self, name: str, refresh: bool) -> None:
        if refresh:
            refresh_podman_services(self.settings, image=name, present=True)
        self.budget.enforce(keep=name)

    def _digests_of(self, name: str) -> list[str]:
        """The manifest digests the store's ``name`` was pulled as."""
        done = store_podman(self.settings, "image", "inspect", "--format",
                            "{{json .RepoDigests}}", name, check=False)  # fmt: skip
        try:
            found = json.loads(done.stdout or b"[]") if done.returncode == 0 else []
        except ValueError:
            return []
        return [str(d).rpartition("@")[2] for d in found or []]

    def _screen(self, name: str) -> None:
        """Refuse (and remove again) a tenant's image bigger than ``image_max_mb``
        unpacked (one image must not push every other out of the node's budget), or
        one that holds device files. The
        nodes' read-only view of the store is ``nodev`` and ``nosuid`` and sandboxes
        run without capabilities and with ``no_new_privileges``, so neither device
        files nor setuid bits could do anything; device files are refused all the
        same, with a reason, rather than shipped inert. Setuid files are kept: Debian
        images have them, and they gain nothing here (docs/isolation.md)."""
        found = find_image(name, self.settings)
        why = oversize(found.size if found else 0, self.settings.image_max_mb)
        if why is not None:
            store_podman(self.settings, "rmi", name, check=False)
            raise ImageRefused(f"image {name} {why}: refused")
        mounted = store_podman(self.settings, "image", "mount", name, check=False)
        root = Path(mounted.stdout.decode().strip())
        if mounted.returncode != 0 or not root.is_dir():
            store_podman(self.settings, "rmi", name, check=False)
            raise ImageRefused(f"image {name} could not be looked into: refused")
        try:
            devices = device_files(root)
        finally:
            store_podman(self.settings, "image", "unmount", name, check=False)
        if devices:
            store_podman(self.settings, "rmi", name, check=False)
            shown = ", ".join(f"/{d}" for d in devices[:5])
            raise ImageRefused(f"image {name} holds device files ({shown}): refused")

    def used(self, image: str) -> None:
        """A create names ``image`` (its place in the eviction order)."""
        self.budget.used(image)

    def snapshot(
        self, base: str, workspace: Path, ref: HubReference, login: tuple[str, str]
    ) -> None:
        """Build ``base`` plus ``workspace`` (a tar of a sandbox's /workspace) into the
        store as ``ref``'s local name, and push it to the hub with ``login`` (a
        snapshot's ticket: that repository only)."""
        name = local_name(ref)
        context = workspace.parent
        (context / "Containerfile").write_text(f"FROM {base}\nADD {workspace.name} /workspace/\n")
        with store_lock(self.settings):
            built = store_podman(
                self.settings, "build", "--pull=never", "--network=none", "--layers=false",
                "--quiet", "--tag", name, "--file", str(context / "Containerfile"), str(context),
                check=False,
            )  # fmt: skip
        if built.returncode != 0:
            raise NodeError(f"snapshot build failed: {_why(built)}")
        auth = write_login(self.settings, context / "auth.json", *login)
        pushed = store_podman(
            self.settings, "push", "--quiet", *self.login_args(auth), name,
            f"docker://{self.settings.hub}/{ref}", check=False,
        )  # fmt: skip
        if pushed.returncode != 0:
            raise NodeError(f"snapshot push to the hub failed: {_why(pushed)}")
        # The hub holds it: this host's copy may go when the disk budget needs room.
        self.budget.pulled(name)

    def push(self, image: str) -> HubReference:
        """Copy ``image`` from the shared store to the hub (an operator's credential:
        nodes may not write); returns the name it has there."""
        ref = hub_reference(image)
        if ref is None:
            raise NodeError(f"{image!r} is not a name the hub can hold (lower-case repository:tag)")
        source = image if image.startswith("localhost/") else f"localhost/{ref}"
        if not image_exists(source, self.settings):
            raise ImageNotFound(f"image {image!r} is not in the layer store")
        remote = f"docker://{self.settings.hub}/{ref}"
        done = store_podman(self.settings, "push", "--quiet", *self.login_args(), source, remote,
                            check=False)  # fmt: skip
        if done.returncode != 0:
            raise NodeError(f"push of {image} to the hub failed: {_why(done)}")
        return ref
