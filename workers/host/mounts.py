"""Mount points as /proc's mountinfo lists them, and removing a directory tree that
may have filesystems mounted in it (a failed debootstrap's /proc, a node's idmapped
view of the shared store): unmount first, or the removal walks into what the mount
shows."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

#: This process's mount table.
MOUNTINFO = Path("/proc/self/mountinfo")


def mount_points(mountinfo: Path = MOUNTINFO) -> set[str]:
    """Every mount point ``mountinfo`` lists (its fifth field), unescaped."""
    points = set()
    for line in mountinfo.read_text().splitlines():
        fields = line.split(" ")
        if len(fields) > 4:
            points.add(unescape(fields[4]))
    return points


def unescape(field: str) -> str:
    """A mountinfo path field as the path: mountinfo writes space, tab, newline and
    backslash as ``\\ooo`` (octal)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def remove_tree(root: Path) -> None:
    """Unmount everything under ``root`` (deepest first), then remove it."""
    if not root.exists():
        return
    prefix = str(root.resolve()) + "/"
    for point in sorted((m for m in mount_points() if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
    shutil.rmtree(root, ignore_errors=True)
