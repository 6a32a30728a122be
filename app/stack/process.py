"""One process the embedded stack runs: its pid file, its log, the code it was
started from, and how it is started, found, restarted and stopped
(:class:`Service`); :mod:`app.stack.services` plans which ones run."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from app.config import Settings
from app.errors import ServiceUnavailable

REPO_ROOT = Path(__file__).resolve().parents[2]


@cache
def code_fingerprint() -> str:
    """What code a process started from this checkout runs: its path, its
    interpreter and a digest of every Python source under app/ and workers/.

    Read once per process: ``up`` asks for every service, twice (stale? then start).
    A source edited after that is caught by the next ``up``, which restarts again.
    """
    digest = hashlib.sha256(f"{REPO_ROOT}\0{sys.executable}".encode())
    for package in ("app", "workers"):
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            digest.update(str(path.relative_to(REPO_ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _host_port(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host or "127.0.0.1", int(port)


def port_open(host: str, port: int, timeout_s: float = 0.3) -> bool:
    """Something accepts TCP connections there."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``check`` until it holds, or raise naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise ServiceUnavailable(f"{what} did not come up within {timeout_s:.0f}s")


@dataclass
class Service:
    """A process the stack starts and stops."""

    name: str
    argv: list[str]
    endpoint: str = ""
    env: dict[str, str] = field(default_factory=dict)
    ready: Callable[[], bool] | None = None
    # Our own processes run this checkout's code; the broker is a foreign binary.
    runs_our_code: bool = True
    #: What its /proc cmdline shows (default: its last argument); Redis retitles itself.
    title: bytes | None = None
    #: The settings file a foreign binary reads once, at start: one rewritten since
    #: (new settings of this checkout) makes the running process stale too.
    config: Path | None = None

    def pidfile(self, settings: Settings) -> Path:
        return settings.state_dir / "run" / f"{self.name}.pid"

    def logfile(self, settings: Settings) -> Path:
        return settings.state_dir / "logs" / f"{self.name}.log"

    def codefile(self, settings: Settings) -> Path:
        return settings.state_dir / "run" / f"{self.name}.code"

    def fingerprint(self) -> str | None:
        """What it runs: this checkout's code, or a foreign binary's settings file
        (None: nothing to compare)."""
        if self.runs_our_code:
            return code_fingerprint()
        if self.config is not None:
            try:
                return hashlib.sha256(self.config.read_bytes()).hexdigest()[:16]
            except FileNotFoundError:
                return None
        return None

    def stale(self, settings: Settings) -> bool:
        """It runs, but other code than this checkout's (another clone, an older
        commit, a tree since deleted: reusing it would test the wrong code), or a
        binary whose settings file changed since it started."""
        wanted = self.fingerprint()
        if wanted is None or self.pid(settings) is None:
            return False
        try:
            return self.codefile(settings).read_text().strip() != wanted
        except FileNotFoundError:
            return True

    def log_tail(self, settings: Settings, lines: int = 25) -> str:
        """The last lines of its log, for an error that says why it did not come up."""
        try:
            text = self.logfile(settings).read_text(errors="replace")
        except FileNotFoundError:
            return f"(no log at {self.logfile(settings)})"
        return "\n".join(text.splitlines()[-lines:])

    def pid(self, settings: Settings) -> int | None:
        """Pid of the running process, if it runs."""
        try:
            pid = int(self.pidfile(settings).read_text().strip())
            os.kill(pid, 0)
        except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
            return None
        # A recycled pid after a reboot would look alive: check it is ours. A process
        # caught in exec (just started) shows an empty command line for a moment; a
        # zombie shows one for good.
        for _ in range(50):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                return None
            if cmdline or not _alive(pid):
                break
            time.sleep(0.01)
        mark = self.title or self.argv[-1].encode()
        return pid if mark in cmdline or b"dsec" in cmdline else None

    def start(self, settings: Settings) -> bool:
        """Start unless running this checkout's code; True if it was started now.
        (Under a lock: `dsec up` and the supervisor may both try at once.)"""
        from app.stack.restarts import Restarts

        with self._locked(settings):
            started = self._start(settings)
        if started:
            Restarts.started_by_hand(settings, self.name)
        return started

    def restart_if_died(self, settings: Settings) -> bool:
        """Start it again if it died: its pid file is there (nobody stopped it on
        purpose) and its process is not. True if it was started."""
        with self._locked(settings):
            if not self.pidfile(settings).exists() or self.pid(settings) is not None:
                return False
            return self._start(settings)

    def _locked(self, settings: Settings) -> contextlib.AbstractContextManager[None]:
        from workers.host.file_lock import file_lock

        return file_lock(settings.state_dir / "run" / f"{self.name}.lock")

    def _start(self, settings: Settings) -> bool:
        if self.stale(settings):
            self._stop(settings)
        if self.pid(settings) is not None:
            return False
        for d in (self.pidfile(settings).parent, self.logfile(settings).parent):
            d.mkdir(parents=True, exist_ok=True)
        with open(self.logfile(settings), "ab") as logf:
            proc = subprocess.Popen(
                self.argv,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,
                cwd=REPO_ROOT,
            )
        self.pidfile(settings).write_text(str(proc.pid))
        started_with = self.fingerprint()
        if started_with is not None:
            self.codefile(settings).write_text(started_with)
        return True

    def stop(self, settings: Settings, timeout_s: float = 10.0) -> bool:
        """Stop if running (SIGTERM, then SIGKILL); True if it was running."""
        with self._locked(settings):
            return self._stop(settings, timeout_s)

    def _stop(self, settings: Settings, timeout_s: float = 10.0) -> bool:
        pid = self.pid(settings)
        # The pid file goes first: without it the supervisor knows the end is wanted.
        self.pidfile(settings).unlink(missing_ok=True)
        if pid is None:
            return False
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
        return True


def _alive(pid: int) -> bool:
    # A child of this very process (a test session's stack) stays a zombie until
    # reaped, and a zombie still answers kill(0).
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
