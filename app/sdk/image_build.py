"""A tenant's image from a Containerfile (``client.images.build``): built by Podman on
the trainer's machine, FROM images of the hub this tenant may use, and pushed as its
own image.

The platform never runs a tenant's build steps outside a sandbox: the build happens
where the SDK runs, in a store of its own that is thrown away after. What the hub
checks is what matters: every FROM must name an image of the hub that this tenant may
pull (its own, one shared with it, or the platform's); anything else is refused before
a step runs, naming the FROM.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Protocol

from app.config import Settings
from app.credentials import Credential
from app.domain.hub_access import HubReference, hub_reference
from app.errors import ConfigError

#: ``FROM [--platform=...] image [AS stage]``, one instruction per line.
_FROM = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?\s*$", re.I | re.M)
#: A build this long is given up.
BUILD_TIMEOUT_S = 3600


class Hub(Protocol):
    """What a build needs of a tenant's images (:class:`app.sdk.images.Images`)."""

    settings: Settings
    credential: Credential

    def cannot_pull(self, ref: HubReference) -> str | None: ...
    def hub_password(self) -> str: ...
    def ca_pem(self) -> str | None: ...
    def push(self, name: str, source: Path, *, tag: str) -> str: ...


def froms(containerfile: str) -> list[tuple[str, str | None]]:
    """Each FROM's image and stage name, in order."""
    return [(m.group(1), m.group(2)) for m in _FROM.finditer(containerfile)]


def hub_froms(containerfile: str, hub: str) -> tuple[str, list[HubReference]]:
    """The Containerfile with each FROM naming its image in the hub, and the images;
    ConfigError for a FROM the hub cannot hold (another registry, a digest)."""
    stages: set[str] = set()
    needed: list[HubReference] = []
    for image, stage in froms(containerfile):
        if image.lower() not in stages and image != "scratch":
            ref = hub_reference(image)
            if ref is None:
                raise ConfigError(
                    f"FROM {image}: not an image of the hub (another registry, a digest"
                    " or a bad name); build FROM the hub's images"
                )
            needed.append(ref)
        if stage:
            stages.add(stage.lower())

    def rewrite(match: re.Match[str]) -> str:
        image = match.group(1)
        ref = hub_reference(image)
        if image.lower() in stages or image == "scratch" or ref is None:
            return match.group(0)
        start, end = match.span(1)
        line = match.group(0)
        offset = match.start(0)
        return line[: start - offset] + f"{hub}/{ref}" + line[end - offset :]

    return _FROM.sub(rewrite, containerfile), needed


def build(
    images: Hub,
    name: str,
    containerfile: Path,
    context: Path,
    tag: str,
    build_args: dict[str, str],
    network: bool,
) -> str:
    """Build ``containerfile`` in ``context`` and push it as ``name:tag``; returns the
    name a create starts sandboxes of it by."""
    podman = shutil.which("podman")
    if podman is None:
        raise ConfigError("building an image needs Podman where the SDK runs")
    if not containerfile.is_file() or not context.is_dir():
        raise ConfigError(f"{containerfile} must be a file and {context} a directory")
    text, needed = hub_froms(containerfile.read_text(), images.settings.hub)
    for ref in needed:
        why = images.cannot_pull(ref)
        if why is not None:
            raise ConfigError(f"FROM {ref}: {why}")
    with tempfile.TemporaryDirectory(prefix="dsec-build-", ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        store = [podman, "--root", str(work / "root"), "--runroot", str(work / "run")]
        (work / "Containerfile").write_text(text)
        login = f"{images.credential.key_id}:{images.hub_password()}"
        auth = {"auths": {images.settings.hub: {"auth": base64.b64encode(login.encode()).decode()}}}
        (work / "auth.json").touch(mode=0o600)
        (work / "auth.json").write_text(json.dumps(auth))
        certs = work / "certs"
        certs.mkdir()
        ca = images.ca_pem()
        if ca is not None:
            (certs / "ca.crt").write_text(ca)
        local = f"localhost/dsec-build-{uuid.uuid4().hex[:12]}:{tag}"
        args = [f"--build-arg={k}={v}" for k, v in build_args.items()]
        try:
            _run([*store, "build", "--pull=always", "--layers=false",
                  f"--network={'host' if network else 'none'}",
                  "--authfile", str(work / "auth.json"), "--cert-dir", str(certs), *args,
                  "-f", str(work / "Containerfile"), "-t", local, str(context)],
                 "build")  # fmt: skip
            archive = work / "image.tar"
            _run([*store, "save", "--format", "docker-archive", "-o", str(archive), local],
                 "save")  # fmt: skip
            return images.push(name, archive, tag=tag)
        finally:
            subprocess.run([*store, "system", "reset", "--force"], capture_output=True)


def _run(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise ConfigError(f"podman {what} failed: {' / '.join(said)[:800]}")
