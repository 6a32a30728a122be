"""A tenant's own images, pushed from the trainer's machine to the hub (the unit's OCI
registry) with nothing but the SDK: ``client.images.push("tools:1", "rootfs.tar")``.

The push speaks the OCI distribution protocol over HTTPS, as any registry client
does: the hub sends it to the platform's token service, which it logs in to with the
tenant's credential (app/domain/hub_access.py), and grants pushing only under
``tenants/<tenant>/``. The image then belongs to the tenant: its sandboxes start from
it (``client.create(image=ref)``), nobody else's may (the scheduler refuses them), and
nodes pull it when a create needs it. Blobs the hub already holds are not sent again.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import IO, Any, Protocol

from app.config import Settings
from app.credentials import Credential
from app.domain.hub_access import (
    TAG,
    HubReference,
    oversize,
    tenant_repository,
    valid_repository,
)
from app.domain.proof import Role
from app.errors import ConfigError
from app.sdk.hub_service import HubService, PushError
from app.sdk.hub_service import challenge as read_challenge

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"
#: What a tag may name, as a HEAD asks for it (an index or list too: a deletion needs
#: the digest of whatever the tag holds).
ANY_MANIFEST = ", ".join((
    OCI_MANIFEST, DOCKER_MANIFEST, "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
))  # fmt: skip
#: The largest manifest or index an archive may hold (they are a few KiB).
_MAX_JSON = 1 << 20
#: What a rootfs image runs when a sandbox names no command, and finds its tools by.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_CHUNK = 1 << 20


class _Reader(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


class _Writer(Protocol):
    def write(self, data: bytes, /) -> int: ...


class Images:
    """A tenant's images in the hub (``client.images``)."""

    def __init__(self, settings: Settings, credential: Credential) -> None:
        self.settings = settings
        self.credential = credential
        self._hub = HubService(settings, credential)
        self._token: str | None = None

    def push(
        self, name: str, source: str | os.PathLike[str], *, tag: str = "latest",
        cmd: tuple[str, ...] = ("/bin/sh",), workdir: str = "/workspace",
    ) -> str:  # fmt: skip
        """Push ``source`` as the tenant's image ``name:tag``; returns the name a create
        starts sandboxes of it by. ``source``: a root filesystem tarball (plain or gzip:
        one layer, run with ``cmd`` in ``workdir``), or an image archive as ``podman
        save`` / ``docker save`` write it (docker-archive) or an OCI archive, whose own
        layers and configuration are kept. A name:tag that exists is refused: images
        are never changed under the sandboxes that run them."""
        repository = tenant_repository(self.credential.subject, name)
        if repository is None or TAG.fullmatch(tag) is None:
            raise ConfigError(f"{name}:{tag} is not an image name the hub can hold")
        ref = HubReference(repository, tag)
        if self._has(repository, tag):
            raise ConfigError(f"{ref} exists: images are never overwritten, push another tag")
        with tempfile.TemporaryDirectory(prefix="dsec-push-") as tmp:
            path = Path(source)
            kind = _archive_kind(path)
            why = oversize(_unpacked_at_least(path, kind), self.settings.image_max_mb)
            if why is not None:
                raise ConfigError(f"{ref} {why} (DSEC_IMAGE_MAX_MB): nodes would refuse it")
            if kind == "rootfs":
                layers, config = _rootfs_parts(path, Path(tmp), cmd, workdir)
                media = OCI_MANIFEST
            else:
                layers, config, media = _archive_parts(path, kind, Path(tmp))
            descriptors = []
            for layer, layer_media in layers:
                digest, size = _file_digest(layer), layer.stat().st_size
                self._blob(repository, digest, size, layer.open("rb"))
                descriptors.append({"mediaType": layer_media, "digest": digest, "size": size})
        config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
        self._blob(repository, config_digest, len(config), io.BytesIO(config))
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": media,
                "config": {
                    "mediaType": OCI_CONFIG if media == OCI_MANIFEST else DOCKER_CONFIG,
                    "digest": config_digest,
                    "size": len(config),
                },
                "layers": descriptors,
            }
        ).encode()
        self._call("PUT", f"/v2/{repository}/manifests/{tag}", repository, manifest,
                   {"Content-Type": media})  # fmt: skip
        return str(ref)

    def build(
        self, name: str, containerfile: str | os.PathLike[str] = "Containerfile",
        context: str | os.PathLike[str] = ".", *, tag: str = "latest",
        build_args: dict[str, str] | None = None, network: bool = False,
    ) -> str:  # fmt: skip
        """Build ``containerfile`` (in ``context``) with Podman where the SDK runs and
        push it as this tenant's image ``name:tag``; returns its name for a create.
        Every FROM must be an image of the hub this tenant may use (refused before a
        step runs otherwise); RUN steps get no network unless ``network``."""
        from app.sdk.image_build import build

        return build(self, name, Path(containerfile), Path(context), tag,
                     build_args or {}, network)  # fmt: skip

    def cannot_pull(self, ref: HubReference) -> str | None:
        """Why this tenant cannot start from ``ref`` (None: it can)."""
        try:
            found = self._has(ref.repository, ref.tag)
        except PushError:
            return "this tenant may not use it"
        return None if found else "the hub has no such image"

    def registry_auth(self) -> str:
        """This tenant's login as a registry auth file holds it (base64 user:password)."""
        return self._hub.basic().removeprefix("Basic ")

    def ca_pem(self) -> str | None:
        """The CA the hub's certificate is checked against (None: the system's)."""
        return self._hub.ca_pem()

    def _has(self, repository: str, tag: str) -> bool:
        """The hub holds ``repository:tag`` already."""
        accept = ", ".join((OCI_MANIFEST, DOCKER_MANIFEST))
        status, _ = self._call("HEAD", f"/v2/{repository}/manifests/{tag}", repository,
                               headers={"Accept": accept}, ok=(200, 404))  # fmt: skip
        return bool(status == 200)

    def share(self, name: str, tenants: list[str], *, remove: bool = False) -> None:
        """Let ``tenants`` start sandboxes from this tenant's image ``name`` (every
        tag), or with ``remove`` take that back; effective within seconds. Making an
        image public is an operator's decision (`dsec image share --public`)."""
        repository = tenant_repository(self.credential.subject, name)
        if repository is None:
            raise ConfigError(f"{name} is not an image name the hub can hold")
        body = {"repository": repository, "readers": tenants, "remove": remove}
        self._hub.call("POST", "/share", body, f"sharing {name}")

    def delete(self, name: str, *, tag: str = "latest") -> list[str]:
        """Delete this tenant's image ``name:tag`` from the hub; returns the manifest
        digests deleted. The content goes with every tag of it in the repository (the
        registry deletes by digest); creates of the name are refused from then on,
        sandboxes running it keep running, and what only it held stops counting
        against the tenant's quota and its bill (``image_storage``) at once. An
        operator's credential names any repository in full (``tenants/acme/tools``,
        a platform image) and deletes what its tag holds now."""
        operator = self.credential.role == Role.OPERATOR
        repository = (
            name if operator and valid_repository(name)
            else tenant_repository(self.credential.subject, name)
        )  # fmt: skip
        if repository is None or TAG.fullmatch(tag) is None:
            raise ConfigError(f"{name}:{tag} is not an image name the hub can hold")
        ref = HubReference(repository, tag)
        status, headers = self._call("HEAD", f"/v2/{repository}/manifests/{tag}", repository,
                                     headers={"Accept": ANY_MANIFEST}, ok=(200, 404),
                                     actions="pull,push,delete")  # fmt: skip
        current = headers.get("Docker-Content-Digest") if status == 200 else None
        digests = {str(current)} if current else set()
        # What the name means may be other content than the tag holds now (a tag moved
        # behind the SDK's back): that goes too.
        if not operator:
            held = self.list().get("images", [])
            digests |= {str(i["digest"]) for i in held if i.get("name") == str(ref)}
        if not digests:
            raise ConfigError(f"{ref}: the hub holds no such image")
        for digest in sorted(digests):
            self._call("DELETE", f"/v2/{repository}/manifests/{digest}", repository,
                       ok=(202, 404), actions="pull,push,delete")  # fmt: skip
        return sorted(digests)

    # --- the protocol ---------------------------------------------------------------

    def _blob(self, repository: str, digest: str, size: int, body: IO[bytes]) -> None:
        with body:
            head = self._call("HEAD", f"/v2/{repository}/blobs/{digest}", repository,
                              ok=(200, 404))  # fmt: skip
            if head[0] == 200:
                return  # the hub has it (another image's layer, or a push done before)
            _, headers = self._call("POST", f"/v2/{repository}/blobs/uploads/", repository,
                                    ok=(202,))  # fmt: skip
            location = headers.get("Location", "")
            sep = "&" if "?" in location else "?"
            self._call("PUT", f"{location}{sep}digest={urllib.parse.quote(digest)}", repository,
                       body, {"Content-Type": "application/octet-stream",
                              "Content-Length": str(size)}, ok=(201,))  # fmt: skip

    def _call(
        self, method: str, path: str, repository: str, body: Any = None,
        headers: dict[str, str] | None = None, ok: tuple[int, ...] = (200, 201, 202),
        actions: str = "pull,push",
    ) -> tuple[int, Any]:  # fmt: skip
        url = path if path.startswith("https://") else f"https://{self.settings.hub}{path}"
        for attempt in range(2):
            request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
            if self._token:
                request.add_header("Authorization", f"Bearer {self._token}")
            try:
                with urllib.request.urlopen(request, context=self._hub.context(), timeout=300) as r:
                    return r.status, r.headers
            except urllib.error.HTTPError as exc:
                if exc.code in ok:
                    return exc.code, exc.headers
                if exc.code == 401 and attempt == 0:
                    challenge = exc.headers.get("WWW-Authenticate", "")
                    self._token = self._login(challenge, repository, actions)
                    if hasattr(body, "seek"):
                        body.seek(0)
                    continue
                said = f"{method} {path}: the hub answered {exc.code} {exc.reason}"
                raise PushError(said) from exc
            except OSError as exc:
                raise PushError(f"the hub at {self.settings.hub} did not answer: {exc}") from exc
        raise PushError(f"{method} {path}: the hub refused this tenant's login")

    def _login(self, challenge: str, repository: str, actions: str) -> str:
        """A token for ``actions`` on ``repository``, from the realm the hub named."""
        fields = read_challenge(challenge)
        realm, service = fields.get("realm"), fields.get("service", "")
        if not challenge.startswith("Bearer ") or not realm or not realm.startswith("https://"):
            raise PushError(f"the hub asked for an unexpected login: {challenge!r}")
        scope = f"repository:{repository}:{actions}"
        query = urllib.parse.urlencode({"service": service, "scope": scope})
        request = urllib.request.Request(
            f"{realm}?{query}", headers={"Authorization": self._hub.basic()}
        )
        try:
            with urllib.request.urlopen(request, context=self._hub.context(), timeout=30) as r:
                return str(json.load(r)["token"])
        except (OSError, ValueError, KeyError) as exc:
            raise PushError(f"no token from the hub's token service: {exc}") from exc

    # Last in the class: its name would stand for the builtin in annotations below it.
    def list(self) -> dict[str, Any]:
        """This tenant's images the hub holds (``name``, ``digest``, ``pushed_at``,
        ``size``), with what they hold together and its quota: ``{"images": [...],
        "held_bytes": N, "quota_mb": M or None}``."""
        return dict(self._hub.call("GET", "/images", None, "listing images"))


def _archive_kind(path: Path) -> str:
    """``docker`` (manifest.json at the top), ``oci`` (oci-layout / index.json) or
    ``rootfs`` (anything else: a root filesystem)."""
    if not path.is_file():
        raise ConfigError(f"{path} is not a file")
    try:
        with tarfile.open(path, "r:*") as tar:
            names = {m.name.lstrip("./") for m in tar.getmembers()[:4096]}
    except tarfile.TarError as exc:
        raise ConfigError(f"{path} is not a tar archive: {exc}") from exc
    if "manifest.json" in names:
        return "docker"
    if "oci-layout" in names or "index.json" in names:
        return "oci"
    return "rootfs"


def _unpacked_at_least(path: Path, kind: str) -> int:
    """A lower bound of what ``path`` unpacks to: a root filesystem's files, or an
    image archive's own size (its layers are often compressed)."""
    if kind != "rootfs":
        return path.stat().st_size
    with tarfile.open(path, "r:*") as tar:
        return sum(m.size for m in tar if m.isfile())


def _rootfs_parts(
    rootfs: Path, tmp: Path, cmd: tuple[str, ...], workdir: str
) -> tuple[list[tuple[Path, str]], bytes]:
    """One gzip layer of a root filesystem, and the configuration that runs it."""
    layer, diff_id = _gzip_layer(rootfs, tmp / "layer.tar.gz")
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Cmd": list(cmd), "Env": [f"PATH={DEFAULT_PATH}"], "WorkingDir": workdir},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }
    return [(layer, OCI_LAYER)], json.dumps(config, sort_keys=True).encode()


def _member(tar: tarfile.TarFile, name: str, out: Path | None = None) -> bytes:
    """An archive member's bytes (JSON, bounded), or written to ``out``."""
    wanted = name.removeprefix("./")
    found = [m for m in tar.getmembers() if m.name.removeprefix("./") == wanted]
    if not found:
        raise ConfigError(f"the archive names {name!r}, which it does not hold")
    source = tar.extractfile(found[0])
    if source is None:
        raise ConfigError(f"{name!r} in the archive is not a file")
    with source:
        if out is None:
            if found[0].size > _MAX_JSON:
                raise ConfigError(f"{name!r} in the archive is too large ({found[0].size} bytes)")
            return source.read()
        with out.open("wb") as sink:
            while chunk := source.read(_CHUNK):
                sink.write(chunk)
    return b""


def _archive_parts(path: Path, kind: str, tmp: Path) -> tuple[list[tuple[Path, str]], bytes, str]:
    """The layers (gzip), configuration and manifest type of an image archive."""
    layers: list[tuple[Path, str]] = []
    with tarfile.open(path, "r:*") as tar:
        if kind == "docker":
            entries = json.loads(_member(tar, "manifest.json"))
            if not isinstance(entries, list) or len(entries) != 1:
                raise ConfigError("the archive must hold exactly one image")
            config = _member(tar, str(entries[0]["Config"]))
            names = [str(n) for n in entries[0]["Layers"]]
            media, layer_media = DOCKER_MANIFEST, DOCKER_LAYER
        else:
            index = json.loads(_member(tar, "index.json"))
            manifests = index.get("manifests") or []
            if len(manifests) != 1:
                raise ConfigError("the archive must hold exactly one image")
            manifest = json.loads(_member(tar, _blob_path(manifests[0]["digest"])))
            config = _member(tar, _blob_path(manifest["config"]["digest"]))
            names = [_blob_path(d["digest"]) for d in manifest["layers"]]
            media, layer_media = OCI_MANIFEST, OCI_LAYER
        for i, name in enumerate(names):
            raw = tmp / f"raw-{i}"
            _member(tar, name, raw)
            with raw.open("rb") as head:
                packed = head.read(2) == b"\x1f\x8b"
            if packed:
                layers.append((raw, layer_media))
            else:
                layer, _ = _gzip_layer(raw, tmp / f"layer-{i}.tar.gz")
                raw.unlink()
                layers.append((layer, layer_media))
    return layers, config, media


def _blob_path(digest: str) -> str:
    algorithm, _, hexdigest = str(digest).partition(":")
    if algorithm != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexdigest):
        raise ConfigError(f"the archive names a blob {digest!r} that is not sha256")
    return f"blobs/sha256/{hexdigest}"


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def _copy(source: _Reader, sink: _Writer, digest: Any) -> None:
    while chunk := source.read(_CHUNK):
        digest.update(chunk)
        sink.write(chunk)


def _gzip_layer(rootfs: Path, out: Path) -> tuple[Path, str]:
    """The layer blob of a root filesystem tarball (gzip, as every registry client
    reads) and its diff id (the digest of the uncompressed tar)."""
    if not rootfs.is_file():
        raise ConfigError(f"{rootfs} is not a file")
    with rootfs.open("rb") as head:
        gzipped = head.read(2) == b"\x1f\x8b"
    digest = hashlib.sha256()
    with gzip.GzipFile(out, "wb", compresslevel=1, mtime=0) as sink:
        if gzipped:
            with gzip.GzipFile(rootfs, "rb") as packed:
                _copy(packed, sink, digest)
        else:
            with rootfs.open("rb") as plain:
                _copy(plain, sink, digest)
    return out, f"sha256:{digest.hexdigest()}"
