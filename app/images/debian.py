"""A Debian sandbox image made from Debian packages only: debootstrap, then a Containerfile.

``dsec/debian-python:12`` is built in three steps, each skipped when its result exists:

1. a root filesystem tarball: ``debootstrap --variant=minbase`` of bookworm with
   python3, git and ca-certificates, from the Debian mirror this machine's apt is
   configured with, cached at ``state_dir/cache/debootstrap/<key>.tar`` (the key
   covers suite, packages and mirror);
2. that tarball imported into the shared store as ``dsec/debootstrap:bookworm``;
3. ``sandbox-debian-python.Containerfile`` (beside this module) built FROM it (one thin layer:
   /workspace, git defaults, a non-root user, ENV).

The image already in the store costs nothing; a cached tarball saves the download and
debootstrap's package configuration (most of the time).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from app.config import Settings, get_settings
from app.images.build import build_image, import_image
from app.images.store import remove_image
from workers.errors import NodeError
from workers.host.file_lock import file_lock
from workers.host.layer_store import image_exists
from workers.host.mounts import remove_tree

#: The image trainers ask for.
DEBIAN_IMAGE = "dsec/debian-python:12"
#: debootstrap's output as an image: the FROM of the Containerfile.
DEBOOTSTRAP_IMAGE = "dsec/debootstrap:bookworm"
SUITE = "bookworm"
PACKAGES: tuple[str, ...] = ("python3", "git", "ca-certificates")
#: The Containerfile, package data beside this module (an installed wheel carries it).
CONTAINERFILE = Path(__file__).with_name("sandbox-debian-python.Containerfile")
_SOURCES = (Path("/etc/apt/sources.list"), Path("/etc/apt/sources.list.d"))
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class DebianBuild:
    """What :func:`build_debian_image` did, step by step (seconds; None = skipped)."""

    image: str
    debootstrap_s: float | None = None
    import_s: float | None = None
    build_s: float | None = None
    tarball: Path | None = None

    @property
    def skipped(self) -> bool:
        """The image was already in the store."""
        return self.build_s is None


def build_debian_image(
    settings: Settings | None = None,
    *,
    image: str = DEBIAN_IMAGE,
    mirror: str | None = None,
    fresh: bool = False,
    log: Callable[[str], None] = lambda _m: None,
) -> DebianBuild:
    """Make ``image`` exist in the store (see the module docstring); what was done.

    ``fresh`` ignores a cached root filesystem tarball and runs debootstrap again.
    """
    settings = settings or get_settings()
    if image_exists(image, settings):
        log(f"{image} is already in the store")
        return DebianBuild(image)
    tarball, debootstrap_s, import_s = ensure_debootstrap_image(
        settings, mirror=mirror, fresh=fresh, log=log
    )
    if not CONTAINERFILE.is_file():
        raise NodeError(f"{CONTAINERFILE} is missing (it ships in the repository's docker/)")
    started = time.monotonic()
    build_image(image, CONTAINERFILE, settings=settings, build_args={"BASE": DEBOOTSTRAP_IMAGE})
    build_s = time.monotonic() - started
    log(f"built {image} from {CONTAINERFILE.name} in {build_s:.1f}s")
    return DebianBuild(image, debootstrap_s, import_s, build_s, tarball)


def ensure_debootstrap_image(
    settings: Settings,
    *,
    mirror: str | None = None,
    fresh: bool = False,
    log: Callable[[str], None] = lambda _m: None,
) -> tuple[Path | None, float | None, float | None]:
    """Make ``dsec/debootstrap:bookworm`` exist in the store (the FROM of the Debian
    sandbox image and of the platform's own); (tarball, debootstrap s, import s), each
    None when skipped."""
    if not fresh and image_exists(DEBOOTSTRAP_IMAGE, settings):
        return None, None, None
    tarball, debootstrap_s = rootfs_tarball(settings, mirror=mirror, fresh=fresh, log=log)
    started = time.monotonic()
    if fresh and image_exists(DEBOOTSTRAP_IMAGE, settings):
        remove_image(DEBOOTSTRAP_IMAGE, settings, refresh=False)
    import_image(
        DEBOOTSTRAP_IMAGE,
        tarball,
        settings,
        changes=(f"ENV PATH={_PATH}", 'CMD ["/bin/bash"]', f"LABEL dsec.suite={SUITE}"),
        refresh=False,
    )
    import_s = time.monotonic() - started
    log(f"imported {DEBOOTSTRAP_IMAGE} in {import_s:.1f}s")
    return tarball, debootstrap_s, import_s


def rootfs_tarball(
    settings: Settings,
    *,
    suite: str = SUITE,
    packages: Sequence[str] = PACKAGES,
    mirror: str | None = None,
    fresh: bool = False,
    log: Callable[[str], None] = lambda _m: None,
) -> tuple[Path, float | None]:
    """The cached root filesystem tarball, made first if needed; (path, debootstrap seconds).

    The tarball leaves out what Podman provides or a sandbox cannot use: /dev entries,
    apt's package lists and downloaded .debs.
    """
    mirror = mirror or debian_mirror(suite)
    key = hashlib.sha256(f"{suite}|minbase|{','.join(packages)}|{mirror}".encode()).hexdigest()
    cache = settings.state_dir / "cache" / "debootstrap"
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    tarball = cache / f"{suite}-minbase-{key[:12]}.tar"
    # One debootstrap at a time per cache; a second caller then finds the tarball.
    with file_lock(cache / ".lock"):
        if tarball.is_file() and not fresh:
            log(f"root filesystem cached at {tarball}")
            return tarball, None
        if shutil.which("debootstrap") is None:
            raise NodeError("debootstrap is not installed: apt-get install debootstrap")
        started = time.monotonic()
        root = cache / f"root-{key[:12]}"
        remove_tree(root)
        try:
            log(f"debootstrap {suite} (minbase + {', '.join(packages)}) from {mirror}")
            _debootstrap(root, suite, packages, mirror, cache / f"{tarball.stem}.log")
            _trim(root)
            partial = tarball.with_suffix(".partial")
            subprocess.run(
                ["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."],
                check=True,
                capture_output=True,
            )
            partial.rename(tarball)
        finally:
            remove_tree(root)
        took = time.monotonic() - started
        log(f"root filesystem ready in {took:.1f}s: {tarball}")
        return tarball, took


def debian_mirror(suite: str = SUITE, sources: Sequence[Path] = _SOURCES) -> str:
    """The first ``deb`` URI of this machine's apt sources that carries ``suite`` main.

    Reads one-line ``*.list`` files and deb822 ``*.sources`` files.
    """
    files: list[Path] = []
    for src in sources:
        if src.is_dir():
            files += sorted(p for p in src.iterdir() if p.suffix in (".list", ".sources"))
        elif src.is_file():
            files.append(src)
    for path in files:
        entries = _deb822(path) if path.suffix == ".sources" else _one_line(path)
        for uris, suites, components in entries:
            if suite in suites and "main" in components and uris:
                return uris[0]
    raise NodeError(f"no Debian mirror for {suite} main in /etc/apt/sources.list*: pass --mirror")


def _one_line(path: Path) -> Iterator[tuple[list[str], list[str], list[str]]]:
    for raw in path.read_text(errors="replace").splitlines():
        words = raw.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        words = words[1:]
        if words and words[0].startswith("["):  # [arch=amd64 signed-by=...]
            while words and not words[0].endswith("]"):
                words.pop(0)
            words = words[1:]
        if len(words) >= 3:
            yield [words[0]], [words[1]], words[2:]


def _deb822(path: Path) -> Iterator[tuple[list[str], list[str], list[str]]]:
    for stanza in path.read_text(errors="replace").split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, value = line.split(":", 1)
            fields[key.strip().lower()] = value.strip()
        if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes") != "no":
            yield (
                fields.get("uris", "").split(),
                fields.get("suites", "").split(),
                fields.get("components", "").split(),
            )


def _debootstrap(root: Path, suite: str, packages: Sequence[str], mirror: str, log: Path) -> None:
    cmd = [
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(packages)}",
        "--components=main",
        suite,
        str(root),
        mirror,
    ]
    with open(log, "wb") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-10:])
        raise NodeError(f"debootstrap failed (exit {done.returncode}, log {log}):\n{tail}")


def _trim(root: Path) -> None:
    """Drop what the image must not carry: devices, package caches, the build host's names."""
    for pattern in ("dev/*", "var/cache/apt/archives/*.deb", "var/lib/apt/lists/*"):
        for path in root.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.name != "lock":
                path.unlink()
    (root / "etc" / "hostname").write_text("sandbox\n")
    (root / "etc" / "resolv.conf").unlink(missing_ok=True)
