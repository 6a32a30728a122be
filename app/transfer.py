"""Copying files and directories into and out of sandboxes: tar archives, pure.

Upload: the local file or directory is packed here, written into the sandbox in
pieces small enough for one request each, and unpacked there by the sandbox's own
``tar``. Download: the sandbox packs it, the pieces are read back as the output of
``dd`` (exec output is binary-safe), and the archive is unpacked here with Python's
``data`` filter: what a sandbox writes is hostile, so ``..``, links that leave the
destination and device files refuse the whole archive before anything touches the
host's disk, absolute names are taken relative to the destination, and set-id bits
are dropped.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

from app.errors import TransferFailed

#: Bytes per WriteFile on upload: base64 of it stays under a request's 1 MiB.
UPLOAD_PIECE = 512 << 10
#: Bytes per exec on download: base64 of it stays under a reply's 2 MiB.
DOWNLOAD_PIECE = 768 << 10
#: Largest archive either way (a sandbox's /tmp holds it while it moves).
MAX_ARCHIVE = 256 << 20


def pack(src: Path) -> bytes:
    """A tar archive holding ``src`` (a file or a directory tree) under its own name."""
    if not src.exists():
        raise TransferFailed(f"{src} does not exist")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(src, arcname=src.resolve().name)
    data = buf.getvalue()
    if len(data) > MAX_ARCHIVE:
        raise TransferFailed(f"{src} packs to {len(data)} bytes, more than {MAX_ARCHIVE}")
    return data


def pieces(data: bytes, size: int) -> Iterator[bytes]:
    """``data`` cut into pieces of ``size`` bytes (the last may be shorter)."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


def unpack(data: bytes, dest: Path) -> list[Path]:
    """Unpack a sandbox-made archive into ``dest``; the top-level paths it made.

    Refuses the whole archive if any member would land outside ``dest``, link out of
    it, or is a device; nothing is written then.
    """
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = tar.getmembers()
            for member in members:  # all checked before the first is written
                tarfile.data_filter(member, str(dest))
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise TransferFailed(f"refused the sandbox's archive: {exc}") from exc
    tops = sorted({m.name.split("/", 1)[0] for m in members})
    return [dest / top for top in tops]
