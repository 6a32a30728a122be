"""The deployment files check out: the systemd units pass `systemd-analyze verify`
(with this checkout's `dsec` in place of the installed one, which the tool insists
exists), each restarts its service on failure and logs to journald."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "docker" / "systemd"


def test_the_systemd_units_verify(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    assert tool is not None, "systemd-analyze is part of Debian's systemd"
    bin_dir = REPO / ".venv" / "bin"
    checked = []
    for unit in sorted(UNITS.glob("*.service")):
        text = unit.read_text().replace("/opt/dsec/bin/", f"{bin_dir}/")
        assert "Restart=on-failure" in text and "StandardOutput=journal" in text, unit.name
        # A template is verified as an instance of it.
        name = unit.name.replace("@.", "@node0." if "node" in unit.name else "@0.")
        (tmp_path / name).write_text(text)
        checked.append(str(tmp_path / name))
    assert len(checked) == 4
    done = subprocess.run([tool, "verify", *checked], capture_output=True, text=True, cwd=tmp_path)
    # It says what it ignores on stderr and still exits 0: both must be clean.
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr
