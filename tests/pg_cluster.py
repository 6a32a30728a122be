"""A throwaway Postgres cluster for the tests that must crash, fill or move one: the
machine's own must not be touched. Run by the postgres system user, on a spare port,
optionally on a small filesystem of its own or inside a network namespace."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import free_port

PG_BIN = Path("/usr/lib/postgresql/15/bin")


@dataclass
class Cluster:
    """A cluster in ``home``, listening on ``host:port``; ``prefix`` runs its commands
    elsewhere (``ip netns exec NS``)."""

    home: Path
    port: int
    host: str = "127.0.0.1"
    prefix: Sequence[str] = ()

    @property
    def data(self) -> Path:
        return self.home / "data"

    def url(self, user: str, database: str) -> str:
        """A psycopg URL for ``user`` (trusted: no password) on ``database``."""
        return f"postgresql+psycopg://{user}@{self.host}:{self.port}/{database}"

    def ctl(self, *args: str, check: bool = True) -> None:
        subprocess.run(
            [*self.prefix, "runuser", "-u", "postgres", "--", str(PG_BIN / "pg_ctl"),
             "-D", str(self.data), "-l", str(self.home / "server.log"), *args],
            check=check, capture_output=True, timeout=60,
        )  # fmt: skip

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.home / 'run'} -c listen_addresses={self.host} -c fsync=on"
        self.ctl("-o", opts, "-w", "start")

    def crash(self) -> None:
        """Stop as a crash does: no checkpoint, WAL replayed on the next start."""
        self.ctl("-m", "immediate", "stop")


@contextmanager
def own_cluster(
    data_mb: int | None = None,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    prefix: Sequence[str] = (),
    trust: str | None = None,
) -> Iterator[Cluster]:
    """A cluster of the test's own, removed after; with ``data_mb``, its data directory
    (not its WAL) is a filesystem of that size, to be filled. ``trust`` (a CIDR) lets
    every role of that network in without a password, as 127.0.0.1 is let in."""
    # Not under pytest's temporary directory: the postgres user cannot enter root's.
    home = Path(tempfile.mkdtemp(prefix="dsec-pg-"))
    os.chmod(home, 0o755)
    found = Cluster(home, port or free_port(), host, prefix)
    found.data.mkdir()
    if data_mb is not None:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={data_mb}m,mode=0700", "tmpfs",
             str(found.data)],
            check=True, capture_output=True,
        )  # fmt: skip
    (home / "wal").mkdir()
    (home / "run").mkdir()
    (home / "server.log").touch()
    for path in (found.data, home / "wal", home / "run", home / "server.log"):
        shutil.chown(path, "postgres", "postgres")
    subprocess.run(
        ["runuser", "-u", "postgres", "--", str(PG_BIN / "initdb"), "-D", str(found.data),
         "--waldir", str(home / "wal"), "--auth=trust", "-U", "postgres"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    if trust is not None:
        with open(found.data / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {trust} trust\n")
    found.start()
    try:
        yield found
    finally:
        found.ctl("-m", "immediate", "stop", check=False)
        if data_mb is not None:
            subprocess.run(["umount", str(found.data)], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)
