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

import json
import re
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Protocol

from app.config import Settings
from app.domain.hub_access import HubReference, hub_reference
from app.errors import ConfigError

#: ``FROM [--platform=...] image [AS stage]``, one instruction per line.
_FROM = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?\s*$", re.I | re.M)
#: A build this long is given up.
BUILD_TIMEOUT_S = 3600


class Hub(Protocol):
    """What a build needs of a tenant's images (:class:`app.sdk.images.Images`)."""

    settings: Settings

    def cannot_pull(self, ref: HubReference) -> str | None: ...
    def registry_auth(self) -> str: ...
    def ca_pem(self) -> str | None: ...
    def push(self, name: str, source: Path, *, tag: str) -> str: ...


def hub_froms(containerfile: str, hub: str) -> tuple[str, list[HubReference]]:
    """The Containerfile with each FROM naming its image in the hub, and the images;
    ConfigError for a FROM the hub cannot hold (another registry, a digest). A FROM
    naming an earlier stage, or ``scratch``, stays as it is."""
    stages: set[str] = set()
    needed: list[HubReference] = []

    def rewrite(match: re.Match[str]) -> str:
        image, stage = match.group(1), match.group(2)
        named = image
        if image.lower() not in stages and image != "scratch":
            ref = hub_reference(image)
            if ref is None:
                raise ConfigError(
                    f"FROM {image}: not an image of the hub (another registry, a digest"
                    " or a bad name); build FROM the hub's images"
                )
            needed.append(ref)
            named = f"{hub}/{ref}"
        if stage:
            stages.add(stage.lower())
        text = match.string
        return text[match.start(0) : match.start(1)] + named + text[match.end(1) : match.end(0)]

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
        auth = {"auths": {images.settings.hub: {"auth": images.registry_auth()}}}
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
