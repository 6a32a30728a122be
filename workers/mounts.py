"""Removing a directory tree that may have filesystems mounted in it (a failed
debootstrap's /proc, a node's idmapped view of the shared store): unmount first, or
the removal walks into what the mount shows."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def remove_tree(root: Path) -> None:
    """Unmount everything under ``root`` (deepest first), then remove it."""
    if not root.exists():
        return
    prefix = str(root.resolve()) + "/"
    with open("/proc/self/mountinfo") as fh:
        mounts = [line.split()[4] for line in fh]
    for point in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
    shutil.rmtree(root, ignore_errors=True)
