"""Archives from a sandbox are hostile: nothing in one may land outside its destination."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.errors import TransferFailed
from app.sdk.transfer import pack, pieces, unpack

REG, DIR, SYM, LNK = tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE


def _tar(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def _member(name: str, kind: bytes = REG, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o755 if kind == DIR else 0o644
    return info


def _archive(*members: tuple[str, bytes, str] | tuple[str, bytes]) -> bytes:
    """An archive of (name, kind[, link target]) members; files hold b"x"."""
    return _tar(*((_member(m[0], m[1], m[2] if len(m) > 2 else ""), b"x") for m in members))


def _snapshot(root: Path) -> dict[str, bytes | str]:
    """Everything under ``root``: file contents, link targets, directories."""
    seen: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            seen[key] = "-> " + os.readlink(path)
        elif path.is_dir():
            seen[key] = "dir"
        else:
            seen[key] = path.read_bytes()
    return seen


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A sibling of the destination, holding one file an attack would like to change."""
    sibling = tmp_path / "outside"
    sibling.mkdir()
    (sibling / "victim").write_bytes(b"untouched")
    return sibling


def _refused_whole(data: bytes, dest: Path, outside: Path) -> None:
    """Then: the archive is refused, nothing landed in ``dest``, nothing changed outside."""
    before = _snapshot(outside)
    with pytest.raises(TransferFailed):
        unpack(data, dest)
    assert list(dest.iterdir()) == []
    assert _snapshot(outside) == before
    assert sorted(p.name for p in dest.parent.iterdir()) == sorted(["dest", "outside"])


# --- what a trainer downloads ------------------------------------------------------


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


def test_links_inside_the_tree_round_trip(tmp_path: Path) -> None:
    # Given a project with relative symlinks (up and down the tree) and a hardlink
    src = tmp_path / "src" / "proj"
    (src / "lib").mkdir(parents=True)
    (src / "bin").mkdir()
    (src / "lib" / "tool.py").write_text("print(1)\n")
    (src / "bin" / "tool").symlink_to("../lib/tool.py")
    (src / "lib" / "here").symlink_to(".")
    (src / "latest").symlink_to("lib")
    (src / "dangling").symlink_to("not-there-yet")
    os.link(src / "lib" / "tool.py", src / "copy.py")
    # When it is downloaded
    out = tmp_path / "out"
    unpack(pack(src), out)
    # Then every link is there and leads where it did
    proj = out / "proj"
    assert (proj / "bin" / "tool").read_text() == "print(1)\n"
    assert os.readlink(proj / "bin" / "tool") == "../lib/tool.py"
    assert (proj / "latest" / "tool.py").exists()
    assert os.readlink(proj / "dangling") == "not-there-yet"
    assert (proj / "copy.py").stat().st_ino == (proj / "lib" / "tool.py").stat().st_ino


def test_unpacking_again_replaces_files_and_links_without_following_them(
    tmp_path: Path, outside: Path
) -> None:
    # Given a destination where the trainer left a symlink to a file outside
    dest = tmp_path / "dest"
    unpack(_archive(("proj", DIR), ("proj/f", REG), ("proj/l", SYM, "f")), dest)
    (dest / "proj" / "f").unlink()
    (dest / "proj" / "f").symlink_to(outside / "victim")
    # When an archive with a file of that name is unpacked there
    unpack(_tar((_member("proj/f"), b"new"), (_member("proj/l", SYM, "f"), b"")), dest)
    # Then the symlink was replaced, not written through
    assert not (dest / "proj" / "f").is_symlink()
    assert (dest / "proj" / "f").read_bytes() == b"new"
    assert (outside / "victim").read_bytes() == b"untouched"


def test_an_absolute_name_lands_inside_the_destination(tmp_path: Path) -> None:
    unpack(_tar((_member("/etc/escaped"), b"x")), tmp_path / "dest")
    assert (tmp_path / "dest" / "etc" / "escaped").read_bytes() == b"x"


def test_set_id_bits_are_dropped(tmp_path: Path) -> None:
    setuid = _member("tool")
    setuid.mode = 0o6777
    unpack(_tar((setuid, b"#!/bin/sh\n")), tmp_path)
    assert (tmp_path / "tool").stat().st_mode & 0o7777 == 0o755


def test_an_empty_archive_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TransferFailed, match="holds nothing"):
        unpack(_tar(), tmp_path / "dest")


def test_garbage_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TransferFailed):
        unpack(b"not a tar archive" * 100, tmp_path / "dest")


# --- what an attacker sends --------------------------------------------------------


def _cve_2025_4517(dest: Path, then: list[tuple[str, bytes, str]]) -> bytes:
    """The CVE-2025-4517 archive: a chain of symlinks whose expansion is longer than
    PATH_MAX, so ``os.path.realpath`` (and tarfile's filter) stops resolving at a last
    link that really leads to the destination's parent; ``escape`` goes through it."""
    steps = "abcdefghijklmnop"
    component = "d" * min(255, (4096 - len(str(dest)) - 1) // (len(steps) + 1))
    members: list[tuple[str, bytes, str]] = []
    path = ""
    for step in steps:
        members += [(path + component, DIR, ""), (path + step, SYM, component)]
        path += component + "/"
    last = "/".join(steps) + "/" + "l" * 254
    members += [(last, SYM, "../" * len(steps)), ("escape", SYM, last + "/../outside")]
    return _archive(*members, *then)


@pytest.mark.parametrize(
    "then",
    [
        [("escape/pwned", REG, "")],
        [("flaglink", LNK, "escape/victim"), ("flaglink", REG, "")],
    ],
    ids=["file-through-it", "hardlink-then-overwrite"],
)
def test_cve_2025_4517_writes_nothing_outside(
    tmp_path: Path, outside: Path, then: list[tuple[str, bytes, str]]
) -> None:
    # On Python 3.11.7, tarfile's data filter let both of these write into `outside`.
    dest = tmp_path / "dest"
    dest.mkdir()
    _refused_whole(_cve_2025_4517(dest, then), dest, outside)


HOSTILE = {
    "dotdot": [("../escaped", REG)],
    "nested-dotdot": [("ok/../../escaped", REG)],
    "abs-symlink": [("link", SYM, "/etc/passwd")],
    "rel-symlink-out": [("link", SYM, "../../outside")],
    "hardlink-abs": [("hard", LNK, "/etc/passwd")],
    "hardlink-out": [("hard", LNK, "../outside/victim")],
    "device": [("dev", tarfile.CHRTYPE)],
    "block-device": [("dev", tarfile.BLKTYPE)],
    "fifo": [("fifo", tarfile.FIFOTYPE)],
    # a symlink inside, then a member written through it
    "symlink-then-file-through-it": [("sub", DIR), ("link", SYM, "sub"), ("link/file", REG)],
    "symlink-to-dot-then-file": [("link", SYM, "."), ("link/file", REG)],
    # each link lexically inside, the second climbing from where the first leads
    "link-then-dotdot-through-a-link": [("self", SYM, "."), ("up", SYM, "self/../outside")],
    "deep-link-then-dotdot": [
        ("a/b", DIR),
        ("a/b/top", SYM, "../.."),
        ("out", SYM, "a/b/top/../outside"),
    ],
    "link-made-later-in-the-archive": [("up", SYM, "self/../outside"), ("self", SYM, ".")],
    # hardlinks only to regular files made earlier
    "hardlink-to-earlier-symlink": [("link", SYM, "x"), ("hard", LNK, "link")],
    "hardlink-to-directory": [("d", DIR), ("hard", LNK, "d")],
    "hardlink-to-later-file": [("hard", LNK, "f"), ("f", REG)],
    "hardlink-through-symlink": [("d", DIR), ("d/f", REG), ("l", SYM, "d"), ("h", LNK, "l/f")],
    # one name, two kinds
    "file-then-directory": [("x", REG), ("x", DIR)],
    "directory-then-symlink": [("x/y", REG), ("x", SYM, "z")],
    "file-then-file-through-it": [("x", REG), ("x/y", REG)],
    # names a case-insensitive disk (macOS) would take as one
    "case-folded-through-symlink": [("Sub", DIR), ("A", SYM, "Sub"), ("a/x", REG)],
    "case-folded-second-symlink": [("A", SYM, "."), ("a", SYM, "sub")],
    # loops and chains no kernel would follow
    "symlink-loop": [("a", SYM, "b"), ("b", SYM, "a")],
    "empty-name-symlink": [("", SYM, ".")],
}


@pytest.mark.parametrize("members", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_hostile_archive_is_refused_whole(
    tmp_path: Path, outside: Path, members: list[tuple[str, bytes, str]]
) -> None:
    # A harmless member first: the check runs before the first member lands.
    data = _archive(("first.txt", REG), *members)
    _refused_whole(data, tmp_path / "dest", outside)


def test_a_symlink_already_in_the_destination_is_not_gone_through(
    tmp_path: Path, outside: Path
) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "pre").symlink_to("../outside")
    before = _snapshot(outside)
    for data in (
        _archive(("pre/pwned", REG)),
        _archive(("pre", DIR), ("pre/pwned", REG)),
        _archive(("l", SYM, "pre/..")),
    ):
        with pytest.raises(TransferFailed):
            unpack(data, dest)
    assert sorted(p.name for p in dest.iterdir()) == ["pre"]
    assert _snapshot(outside) == before


def test_a_nul_in_a_name_or_target_is_refused(tmp_path: Path, outside: Path) -> None:
    # A pax record carries a NUL that a plain header would cut the name at.
    for kind, headers in ((REG, {"path": "a\x00b"}), (SYM, {"linkpath": "x\x00/../.."})):
        info = _member("ab", kind, "x")
        info.pax_headers = headers
        _refused_whole(_tar((_member("first.txt"), b"x"), (info, b"x")), tmp_path / "dest", outside)


def test_a_sparse_member_is_refused(tmp_path: Path, outside: Path) -> None:
    sparse = _member("sparse")
    sparse.type = tarfile.GNUTYPE_SPARSE
    _refused_whole(_tar((sparse, b"")), tmp_path / "dest", outside)


# --- any archive at all --------------------------------------------------------------

_names = st.lists(st.sampled_from(["a", "b", "A", ".", "..", "", "c"]), min_size=1, max_size=4)
_members = st.lists(
    st.tuples(
        _names.map("/".join),
        st.sampled_from([REG, REG, DIR, SYM, SYM, LNK]),
        _names.map("/".join),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_members)
def test_no_archive_writes_outside_or_links_out(members: list[tuple[str, bytes, str]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "outside").mkdir()
        (root / "outside" / "victim").write_bytes(b"untouched")
        dest = root / "dest"
        try:
            unpack(_archive(*members), dest)
        except TransferFailed:
            assert list(dest.iterdir()) == []
        assert sorted(p.name for p in root.iterdir()) == ["dest", "outside"]
        assert _snapshot(root / "outside") == {"victim": b"untouched"}
        real_dest = dest.resolve()
        for path in dest.rglob("*"):
            if path.is_symlink():
                target = Path(os.path.realpath(path))
                assert target == real_dest or real_dest in target.parents, (path, target)


def test_pieces_cover_the_data() -> None:
    data = bytes(range(256)) * 5
    assert b"".join(pieces(data, 300)) == data
    assert [len(p) for p in pieces(data, 512)] == [512, 512, 256]
    assert list(pieces(b"", 10)) == []
