"""Archives from a sandbox are hostile: nothing in one may land outside its destination."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from app.errors import TransferFailed
from app.transfer import pack, pieces, unpack


def _tar(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    return info


def test_a_tree_round_trips_with_its_bytes_and_modes(tmp_path: Path) -> None:
    src = tmp_path / "src" / "proj"
    (src / "sub").mkdir(parents=True)
    (src / "bin.dat").write_bytes(bytes(range(256)) * 10)
    (src / "sub" / "run.sh").write_text("#!/bin/sh\n")
    (src / "sub" / "run.sh").chmod(0o755)
    out = tmp_path / "out"
    assert unpack(pack(src), out) == [out / "proj"]
    assert (out / "proj" / "bin.dat").read_bytes() == bytes(range(256)) * 10
    assert (out / "proj" / "sub" / "run.sh").stat().st_mode & 0o777 == 0o755


@pytest.mark.parametrize(
    "hostile",
    [
        _member("../escaped"),
        _member("ok/../../escaped"),
        _member("link", tarfile.SYMTYPE, "/etc/passwd"),
        _member("link", tarfile.SYMTYPE, "../../outside"),
        _member("hard", tarfile.LNKTYPE, "/etc/passwd"),
        _member("dev", tarfile.CHRTYPE),
    ],
    ids=[
        "dotdot",
        "nested-dotdot",
        "abs-symlink",
        "rel-symlink-out",
        "hardlink",
        "device",
    ],
)
def test_a_hostile_archive_is_refused_whole(tmp_path: Path, hostile: tarfile.TarInfo) -> None:
    dest = tmp_path / "a" / "b" / "dest"
    data = _tar((_member("first.txt"), b"written before the bad one?"), (hostile, b"x"))
    with pytest.raises(TransferFailed):
        unpack(data, dest)
    # Nothing at all was written: the check runs before the first member lands.
    assert list(dest.iterdir()) == []
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "a" / "escaped").exists()


def test_an_absolute_name_lands_inside_the_destination(tmp_path: Path) -> None:
    unpack(_tar((_member("/etc/escaped"), b"x")), tmp_path / "dest")
    assert (tmp_path / "dest" / "etc" / "escaped").read_bytes() == b"x"


def test_set_id_bits_are_dropped(tmp_path: Path) -> None:
    setuid = _member("tool")
    setuid.mode = 0o4755
    unpack(_tar((setuid, b"#!/bin/sh\n")), tmp_path)
    assert (tmp_path / "tool").stat().st_mode & 0o7777 == 0o755


def test_pieces_cover_the_data() -> None:
    data = bytes(range(256)) * 5
    assert b"".join(pieces(data, 300)) == data
    assert [len(p) for p in pieces(data, 512)] == [512, 512, 256]
    assert list(pieces(b"", 10)) == []
