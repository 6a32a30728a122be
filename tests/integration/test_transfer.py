"""Files and directory trees go into and out of a sandbox intact; a hostile one's
archive does not reach past its destination on the host."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from app.errors import TransferFailed

pytestmark = pytest.mark.integration


def test_a_tree_goes_in_and_comes_back_byte_for_byte(client: Any, tmp_path: Path) -> None:
    src = tmp_path / "proj"
    (src / "sub").mkdir(parents=True)
    blob = os.urandom(2_500_000)  # several pieces each way
    (src / "blob.bin").write_bytes(blob)
    (src / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "sub" / "run.sh").chmod(0o755)
    with client.create() as box:
        assert box.upload(src, "/workspace/in") == "/workspace/in/proj"
        assert box.exec("/workspace/in/proj/sub/run.sh").stdout == b"ran\n"
        assert box.exec("wc -c < /workspace/in/proj/blob.bin").stdout.strip() == b"2500000"
        box.exec("echo made-inside > /workspace/in/proj/new.txt")
        back = box.download("/workspace/in/proj", tmp_path / "out")
        # and no staging file is left behind in the sandbox
        assert box.exec("ls -A /tmp").stdout == b""
    assert back == tmp_path / "out" / "proj"
    assert (back / "blob.bin").read_bytes() == blob
    assert (back / "sub" / "run.sh").stat().st_mode & 0o777 == 0o755
    assert (back / "new.txt").read_bytes() == b"made-inside\n"


def test_a_single_file_too(client: Any, tmp_path: Path) -> None:
    (tmp_path / "one.bin").write_bytes(bytes(range(256)))
    with client.create() as box:
        box.upload(tmp_path / "one.bin", "/tmp/x")
        back = box.download("/tmp/x/one.bin", tmp_path / "back")
    assert back.read_bytes() == bytes(range(256))


def test_a_link_out_of_the_destination_is_refused(client: Any, tmp_path: Path) -> None:
    with client.create() as box:
        box.exec("mkdir -p /workspace/trap && ln -s /etc/shadow /workspace/trap/key")
        with pytest.raises(TransferFailed):
            box.download("/workspace/trap", tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []
