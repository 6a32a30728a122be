"""Small things node setup does to the host as root: run a command, make a directory
for an owner, find and signal processes by what /proc says of them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from workers.errors import NodeError


def run(cmd: list[str]) -> None:
    """Run ``cmd``; a :class:`NodeError` with its stderr if it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NodeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")


def mkdir(path: Path, mode: int, uid: int = 0, gid: int = 0) -> None:
    """Make ``path`` (and its parents) if missing, then give it this owner and mode."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    st = path.stat()
    if (st.st_uid, st.st_gid) != (uid, gid):
        os.chown(path, uid, gid)
    if st.st_mode & 0o7777 != mode:
        path.chmod(mode)


def send_signal(pid: int, sig: signal.Signals) -> None:
    """Signal ``pid``; one that is already gone is no error."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def live_processes_of(uid: int) -> list[int]:
    """Pids of the live processes owned by ``uid`` (their /proc entry's owner; zombies,
    whose command line is empty anyway, excluded)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == uid and alive(int(entry.name)):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids
