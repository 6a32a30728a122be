"""Secret files of the local stack: made once, readable by root only, never logged."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from app.errors import ConfigError


def ensure(path: Path, nbytes: int = 32, *, text: bool = False) -> bytes:
    """The secret in ``path``, made (random, 0600, in a 0700 directory) if missing.

    ``text``: an URL-safe password instead of raw bytes (for Postgres, Redis, Flower).
    """
    try:
        return read(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    value = secrets.token_urlsafe(nbytes).encode() if text else secrets.token_bytes(nbytes)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # a concurrent `up` made it first: use theirs
        return read(path)
    with os.fdopen(fd, "wb") as f:
        f.write(value.hex().encode() if not text else value)
    return read(path)


def read(path: Path) -> bytes:
    """A secret made by :func:`ensure` (raises FileNotFoundError if there is none)."""
    raw = path.read_bytes().strip()
    if path.suffix == ".key":
        try:
            return bytes.fromhex(raw.decode())
        except ValueError as exc:
            raise ConfigError(f"{path} does not hold a hex key") from exc
    return raw


def read_text(path: Path) -> str | None:
    """A password file's content, or None if it is missing or unreadable (another
    user than root, on a host that keeps them)."""
    try:
        return read(path).decode()
    except (FileNotFoundError, PermissionError):
        return None


def write(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` whole (a new file put in place), 0600 in a 0700
    directory: a reader never sees half of it, nor another user any of it."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    staged = path.with_name(f".{path.name}.{os.getpid()}.new")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(staged, path)
    return path
