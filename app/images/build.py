"""Adding images to the shared layer store: tarball imports and Containerfile builds.

Both run as root's Podman against the store (:func:`app.images.store.store_podman`)
and nothing ever reaches a registry:

- :func:`import_image` takes a root filesystem tarball (``podman import``) or an image
  archive made by ``podman save`` / ``docker save`` (``podman load``), plain or
  compressed, and names the result.
- :func:`build_image` runs ``podman build --pull=never``: a Containerfile can only
  start FROM an image already in the store, and its RUN steps have no network unless
  the caller asks for one.

Existing names are never overwritten: an image that sandboxes run must not change
under them. Remove it first (``dsec image rm``). Both hold the store's import lock for
the whole operation, so two builds of one name cannot race (a long build makes other
imports wait). Running node services are refreshed afterwards, as for every import.
"""

from __future__ import annotations

import contextlib
import shutil
import tarfile
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, Literal

from app.config import Settings, get_settings
from app.images.store import refresh_nodes
from workers.errors import NodeError
from workers.host.layer_store import (
    image_exists,
    normalize_name,
    store_conf_dir,
    store_lock,
    store_podman,
)

TarballKind = Literal["rootfs", "archive"]

#: Top-level members that only an image archive has (docker-archive, oci-archive).
_ARCHIVE_MARKERS = frozenset({"manifest.json", "oci-layout", "index.json", "repositories"})
#: Members after which a tarball is certainly a root filesystem.
_ROOTFS_MARKERS = frozenset({"bin", "etc", "usr", "lib", "sbin", "var"})


def tarball_kind(path: Path) -> TarballKind:
    """Whether ``path`` is an image archive (``podman save``) or a root filesystem.

    Reads members until one decides; a tarball Python cannot read (zstd) is handed
    to ``podman import`` as a root filesystem and Podman judges it.
    """
    try:
        with tarfile.open(path, mode="r|*") as tar:
            for member in tar:
                top = member.name.removeprefix("./").split("/", 1)[0]
                if top in _ARCHIVE_MARKERS:
                    return "archive"
                if top in _ROOTFS_MARKERS:
                    return "rootfs"
    except (tarfile.TarError, OSError, EOFError):
        pass
    return "rootfs"


def import_image(
    name: str,
    source: Path,
    settings: Settings | None = None,
    *,
    changes: Sequence[str] = (),
    refresh: bool = True,
) -> TarballKind | None:
    """Import tarball ``source`` as image ``name``; its kind, or None if ``name`` exists.

    ``changes`` (Containerfile instructions such as ``CMD ["/bin/sh"]``) apply to a root
    filesystem only; an archive brings its own configuration.
    """
    settings = settings or get_settings()
    if not source.is_file():
        raise NodeError(f"{source} is not a file")
    kind = tarball_kind(source)
    if kind == "archive" and changes:
        raise NodeError("--change applies to root filesystem tarballs, not image archives")
    with store_lock(settings):
        if image_exists(name, settings):
            return None
        if kind == "rootfs":
            args = ["import", "--quiet"]
            for change in changes:
                args += ["--change", change]
            store_podman(settings, *args, str(source), name)
        else:
            _load_as(settings, source, name)
    if refresh:
        refresh_nodes(settings, name, present=True)
    return kind


def build_image(
    name: str,
    containerfile: Path,
    context: Path | None = None,
    settings: Settings | None = None,
    *,
    network: str = "none",
    build_args: Mapping[str, str] | None = None,
    refresh: bool = True,
) -> str | None:
    """Build ``containerfile`` into the store as ``name``; Podman's output, or None if it exists.

    ``context`` defaults to the Containerfile's directory. One layer is committed on top
    of the FROM image (``--layers=false``): no intermediate images pile up in the store,
    and the FROM image's layers are shared, not copied.
    """
    settings = settings or get_settings()
    if not containerfile.is_file():
        raise NodeError(f"Containerfile {containerfile} does not exist")
    context = context or containerfile.parent
    if not context.is_dir():
        raise NodeError(f"build context {context} is not a directory")
    args = [
        "build",
        "--pull=never",
        f"--network={network}",
        "--layers=false",
        "--force-rm",
        "--file",
        str(containerfile.resolve()),
        "--tag",
        name,
    ]
    for key, value in (build_args or {}).items():
        args += ["--build-arg", f"{key}={value}"]
    with store_lock(settings):
        if image_exists(name, settings):
            return None
        done = store_podman(settings, *args, str(context.resolve()), check=False)
        output = (done.stdout + done.stderr).decode(errors="replace")
        if done.returncode != 0:
            tail = "\n".join(output.strip().splitlines()[-15:])
            hint = ""
            if "image not known" in output:
                hint = " (FROM must name an image in the store: `dsec image ls`)"
            raise NodeError(f"building {name} from {containerfile} failed{hint}:\n{tail}")
    if refresh:
        refresh_nodes(settings, name, present=True)
    return output


@contextlib.contextmanager
def spooled(stream: BinaryIO, settings: Settings | None = None) -> Iterator[Path]:
    """``stream`` (stdin) copied to a root-only temporary file, removed afterwards."""
    settings = settings or get_settings()
    tmp = store_conf_dir(settings) / "tmp"
    with tempfile.NamedTemporaryFile(dir=tmp, prefix="import-", suffix=".tar") as fh:
        shutil.copyfileobj(stream, fh, 1 << 20)
        fh.flush()
        yield Path(fh.name)


def _load_as(settings: Settings, archive: Path, name: str) -> None:
    """``podman load`` one image and name it ``name``, dropping names the load added."""
    before = {n for line in _names(settings) for n in line}
    out = store_podman(settings, "load", "--quiet", "--input", str(archive)).stdout.decode()
    loaded = [
        ref.strip()
        for line in out.splitlines()
        if ":" in line and line.lower().startswith("loaded image")
        for ref in line.split(":", 1)[1].split(",")
        if ref.strip()
    ]
    if len(loaded) != 1:
        raise NodeError(f"{archive} holds {len(loaded)} images, not one: {', '.join(loaded)}")
    store_podman(settings, "tag", loaded[0], name)
    # The archive's own name is dropped unless the store had it before.
    extra = normalize_name(loaded[0])
    if not loaded[0].startswith("sha256:") and extra not in before | {normalize_name(name)}:
        store_podman(settings, "untag", name, loaded[0])


def _names(settings: Settings) -> list[list[str]]:
    out = store_podman(settings, "images", "--format", "{{range .Names}}{{.}} {{end}}").stdout
    return [line.split() for line in out.decode().splitlines()]
