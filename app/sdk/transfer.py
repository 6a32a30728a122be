"""Copying files and directories into and out of sandboxes: tar archives, pure.

Upload: the local file or directory is packed here, written into the sandbox in
pieces small enough for one request each, and unpacked there by the sandbox's own
``tar``. Download: the sandbox packs it, the pieces are read back as the output of
``dd`` (exec output is binary-safe), and the archive is unpacked here.

What a sandbox sends back is hostile, so :func:`unpack` trusts neither the archive nor
tarfile's extraction filters (bypassed on Pythons before 3.11.13/3.12.11, CVE-2025-4517:
a symlink chain too long for ``realpath`` to follow hides where a link leads). Every
member is checked first, on names alone, against what the archive itself made before
it (and what the destination already holds); one bad member refuses the whole archive
before anything touches the host's disk:

- names: ``..`` is refused; a leading ``/`` is dropped (absolute names land inside the
  destination); no name may go through a symlink or a file, whether the archive made
  it earlier or the destination already holds it; a name may repeat only as the same
  kind of thing. Names are compared case-folded, so a case-insensitive disk (macOS)
  cannot make ``A`` and ``a/x`` one path;
- symlinks: relative, and leading inside the destination when resolved through the
  archive's own links the way the kernel would (a link followed by ``..`` climbs from
  where the link leads, not from where it sits);
- hardlinks: only to a regular file the archive made earlier;
- no devices, fifos or sparse files; set-id bits and group/other write bits dropped.

Then the members are written with ``*at`` calls on directory descriptors, each
directory opened with ``O_NOFOLLOW``, each file made under a fresh name with ``O_EXCL``
and renamed into place: nothing is ever written through a symlink, whatever changed on
disk since the check.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import shutil
import stat
import tarfile
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from app.errors import TransferFailed, TransferReason

#: Bytes per WriteFile on upload: base64 of it stays under a request's 1 MiB.
UPLOAD_PIECE = 512 << 10
#: Bytes per exec on download: base64 of it stays under a reply's 2 MiB.
DOWNLOAD_PIECE = 768 << 10
#: Largest archive either way (a sandbox's /tmp holds it while it moves).
MAX_ARCHIVE = 256 << 20

#: Symlinks followed, one inside another, to find where a link leads (Linux's limit).
_MAX_HOPS = 40
#: Longest name of one path component, and of a symlink's target, in bytes.
_NAME_MAX = 255
_PATH_MAX = 4095

_DIR, _FILE, _SYMLINK = "directory", "file", "symlink"
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

Parts = tuple[str, ...]


def pack(src: Path) -> bytes:
    """A tar archive holding ``src`` (a file or a directory tree) under its own name."""
    if not src.exists():
        raise TransferFailed(f"{src} does not exist", reason=TransferReason.MISSING)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(src, arcname=src.resolve().name)
    data = buf.getvalue()
    if len(data) > MAX_ARCHIVE:
        raise TransferFailed(
            f"{src} packs to {len(data)} bytes, more than {MAX_ARCHIVE}",
            reason=TransferReason.TOO_LARGE,
        )
    return data


def pieces(data: bytes, size: int) -> Iterator[bytes]:
    """``data`` cut into pieces of ``size`` bytes (the last may be shorter)."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


def unpack(data: bytes, dest: Path) -> list[Path]:
    """Unpack a sandbox-made archive into ``dest``; the top-level paths it made.

    Refuses the whole archive (:class:`TransferFailed`) if any member would land
    outside ``dest``, go through a link, link out of it, or is a device; nothing is
    written then. (An error of the disk itself, such as a full one, may leave the
    members written so far, all inside ``dest``.)
    """
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            plan = _Plan(dest)
            for member in tar.getmembers():
                plan.add(member)
            plan.check_symlinks()
            if not plan.entries:
                raise _refused("it holds nothing")
            _write(tar, plan.entries, dest)
    except TransferFailed:
        raise
    except (tarfile.TarError, OSError, ValueError, EOFError, OverflowError) as exc:
        raise _refused(str(exc) or type(exc).__name__) from exc
    tops = dict.fromkeys(entry.parts[0] for entry in plan.entries)
    return [dest / top for top in sorted(tops)]


def _refused(why: str) -> TransferFailed:
    return TransferFailed(f"refused the sandbox's archive: {why}", reason=TransferReason.REFUSED)


@dataclass(frozen=True)
class _Entry:
    """One checked member: where it goes and what it is."""

    member: tarfile.TarInfo
    parts: Parts
    kind: str
    #: A hardlink's earlier file (its parts); empty for anything else.
    link: Parts = ()


def _fold(part: str) -> str:
    """The name a case-insensitive, normalising disk (macOS) would see."""
    return unicodedata.normalize("NFC", part.casefold())


def _parts(name: str, what: str) -> Parts:
    """A member's (or a hardlink's) name as path components inside the destination."""
    if "\x00" in name:
        raise _refused(f"{what} {name[:300]!r} has a NUL character")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise _refused(f"{what} {name[:300]!r} goes up with '..'")
    for part in parts:
        if len(os.fsencode(part)) > _NAME_MAX:
            raise _refused(f"{what} {name[:300]!r} has a component longer than {_NAME_MAX}")
    return parts


class _Node:
    """A path under the destination: one the archive makes, or one a symlink's target
    goes through. Children are keyed by folded name (see :func:`_fold`)."""

    __slots__ = ("children", "disk", "kind", "leads", "name", "parent", "target")

    def __init__(self, name: str, parent: _Node | None, disk: int | None) -> None:
        self.name = name
        self.parent = parent
        self.children: dict[str, _Node] = {}
        #: What the archive makes here (None: nothing).
        self.kind: str | None = None
        #: A symlink's target (the last one given), and where it leads once known.
        self.target = ""
        self.leads: _Node | None = None
        #: The ``lstat`` mode of what the destination already holds here (None: nothing).
        self.disk = disk

    def path(self) -> Parts:
        names: list[str] = []
        node: _Node | None = self
        while node is not None and node.parent is not None:
            names.append(node.name)
            node = node.parent
        return tuple(reversed(names))

    def show(self) -> str:
        return repr("/".join(self.path())[:300])


class _Plan:
    """The members, checked in archive order against what came before them."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.root = _Node("", None, stat.S_IFDIR)
        self.root.kind = _DIR
        self.entries: list[_Entry] = []
        #: Every symlink member and its own target, for the check of where it leads.
        self.symlinks: list[tuple[_Node, str]] = []

    def _child(self, node: _Node, name: str) -> _Node:
        """``node``'s child ``name``, looking at the disk the first time."""
        key = _fold(name)
        child = node.children.get(key)
        if child is None:
            disk: int | None = None
            if node.disk is not None and stat.S_ISDIR(node.disk):
                try:
                    disk = os.lstat(self.dest.joinpath(*node.path(), name)).st_mode
                except (FileNotFoundError, NotADirectoryError):
                    disk = None
            child = node.children[key] = _Node(name, node, disk)
        return child

    def add(self, member: tarfile.TarInfo) -> None:
        name = member.name
        kind = _kind_of(member)
        parts = _parts(name, "member")
        if not parts:
            if kind == _DIR:
                return  # "." or "/": the destination itself
            raise _refused(f"member {name[:300]!r} has no name")
        link: Parts = ()
        if member.islnk():
            link = _parts(member.linkname, f"hardlink {name[:300]!r} to")
            if self._made_file(link) is None:
                raise _refused(
                    f"hardlink {name[:300]!r} leads to {member.linkname[:300]!r}, which is"
                    " not a regular file made earlier in the archive"
                )
        elif member.issym():
            _check_target(name, member.linkname)
        node = self.root
        for part in parts[:-1]:
            node = self._child(node, part)
            self._claim(node, _DIR, name)
        node = self._child(node, parts[-1])
        if _SYMLINK in (kind, node.kind) and node.kind is not None and node.path() != parts:
            # Two spellings are two links on a case-sensitive disk, one on another.
            raise _refused(f"symlink {name[:300]!r} is also spelt {node.show()}")
        self._claim(node, kind, name)
        if member.issym():
            node.target = member.linkname
            self.symlinks.append((node, member.linkname))
        self.entries.append(_Entry(member, parts, kind, link))

    def _made_file(self, parts: Parts) -> _Node | None:
        node: _Node | None = self.root
        for part in parts:
            node = node.children.get(_fold(part)) if node is not None else None
        if node is None or node.kind != _FILE or node.path() != parts:
            return None
        return node

    @staticmethod
    def _claim(node: _Node, kind: str, name: str) -> None:
        """The archive makes ``node`` a ``kind``: the same kind each time it names it, and
        (the first time) nothing the destination holds that it could not replace."""
        if node.kind is not None and node.kind != kind:
            what = "goes through" if kind == _DIR else "repeats"
            raise _refused(f"member {name[:300]!r} {what} {node.show()}, made as a {node.kind}")
        if node.kind is None and node.disk is not None:
            if kind == _DIR and not stat.S_ISDIR(node.disk):
                raise _refused(
                    f"member {name[:300]!r} goes through {node.show()}, which the destination"
                    " already holds and is not a directory (a symlink?)"
                )
            if kind != _DIR and stat.S_ISDIR(node.disk):
                raise _refused(f"member {name[:300]!r} would replace directory {node.show()}")
        node.kind = kind

    def check_symlinks(self) -> None:
        """Refuse a symlink leading outside the destination, through other links too.

        Targets are followed as the kernel would: through the archive's symlinks (a link
        followed by ``..`` climbs from where the link leads, not from where it sits),
        and lexically through everything else, so that nothing the trainer makes later
        (a missing directory) can turn a link inside into one outside.
        """
        for node, target in self.symlinks:
            assert node.parent is not None  # a member is never the root
            self._walk(node.parent, target, node, 0)

    def _leads(self, link: _Node, hops: int) -> _Node:
        """Where the archive's symlink ``link`` leads."""
        if link.leads is None:
            if hops > _MAX_HOPS:
                raise _refused(f"symlink {link.show()} loops or chains too deep")
            assert link.parent is not None
            link.leads = self._walk(link.parent, link.target, link, hops)
        return link.leads

    def _walk(self, here: _Node, target: str, link: _Node, hops: int) -> _Node:
        for part in target.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                if here.parent is None:
                    raise _refused(
                        f"symlink {link.show()} leads to {target[:300]!r}, outside the destination"
                    )
                here = here.parent
                continue
            here = self._child(here, part)
            if here.kind == _SYMLINK:
                here = self._leads(here, hops + 1)
            elif here.kind is None and here.disk is not None and stat.S_ISLNK(here.disk):
                raise _refused(
                    f"symlink {link.show()} leads through {here.show()}, a symlink the"
                    " destination already holds"
                )
        return here


def _check_target(name: str, target: str) -> None:
    if not target or "\x00" in target:
        raise _refused(f"symlink {name[:300]!r} has an empty or NUL target")
    if target.startswith("/"):
        raise _refused(f"symlink {name[:300]!r} leads to absolute {target[:300]!r}")
    if len(os.fsencode(target)) > _PATH_MAX:
        raise _refused(f"symlink {name[:300]!r} has a target longer than {_PATH_MAX}")


def _kind_of(member: tarfile.TarInfo) -> str:
    if member.isdir():
        return _DIR
    if member.issym():
        return _SYMLINK
    if member.islnk():
        return _FILE
    if (
        member.type in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)
        and member.sparse is None
    ):
        return _FILE
    what = {
        tarfile.CHRTYPE: "character device",
        tarfile.BLKTYPE: "block device",
        tarfile.FIFOTYPE: "fifo",
        tarfile.GNUTYPE_SPARSE: "sparse file",
    }.get(member.type, f"member of type {member.type!r}")
    raise _refused(f"{member.name[:300]!r} is a {what}: only files, directories and links")


def _file_mode(mode: int) -> int:
    """tarfile's ``data`` filter's rule: no set-id, sticky or group/other write bits;
    executable by all only if by its owner; always readable and writable by its owner."""
    mode &= 0o755
    if not mode & 0o100:
        mode &= ~0o111
    return mode | 0o600


class _Dirs:
    """Descriptors of directories under the destination, made where missing and opened
    without following any symlink; the last one is kept for the next member."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.last: tuple[Parts, int] | None = None

    def get(self, parts: Parts) -> int:
        if self.last is not None and self.last[0] == parts:
            return self.last[1]
        fd = self.open(parts)
        self.close()
        self.last = (parts, fd)
        return fd

    def open(self, parts: Parts) -> int:
        """A new descriptor of ``parts`` (the caller closes it)."""
        fd = os.open(".", _OPEN_DIR, dir_fd=self.root)
        try:
            for part in parts:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o777, dir_fd=fd)  # the umask decides, as tar's would
                below = os.open(part, _OPEN_DIR, dir_fd=fd)
                os.close(fd)
                fd = below
        except BaseException:
            os.close(fd)
            raise
        return fd

    def close(self) -> None:
        if self.last is not None:
            os.close(self.last[1])
            self.last = None


def _write(tar: tarfile.TarFile, entries: list[_Entry], dest: Path) -> None:
    root = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    dirs = _Dirs(root)
    try:
        for entry in entries:
            if entry.kind == _DIR:
                dirs.get(entry.parts)
                continue
            parent = dirs.get(entry.parts[:-1])
            _place(tar, entry, parent, dirs)
        for entry in reversed(entries):  # directory times last: writing changes them
            if entry.kind == _DIR:
                fd = dirs.open(entry.parts)
                try:
                    _set_mtime(fd, entry.member.mtime)
                finally:
                    os.close(fd)
    finally:
        dirs.close()
        os.close(root)


def _place(tar: tarfile.TarFile, entry: _Entry, parent: int, dirs: _Dirs) -> None:
    """Make ``entry`` under a fresh name in ``parent``, then rename it into place: the
    rename replaces whatever was there (a symlink included) without following it."""
    member, name = entry.member, entry.parts[-1]
    fresh = f".dsec-unpack-{secrets.token_hex(8)}"
    try:
        if member.issym():
            os.symlink(member.linkname, fresh, dir_fd=parent)
        elif member.islnk():
            source = dirs.open(entry.link[:-1])
            try:
                os.link(
                    entry.link[-1], fresh, src_dir_fd=source, dst_dir_fd=parent,
                    follow_symlinks=False,
                )  # fmt: skip
            finally:
                os.close(source)
        else:
            fd = os.open(fresh, _NEW_FILE, 0o600, dir_fd=parent)
            try:
                body = tar.extractfile(member)
                if body is not None:
                    with os.fdopen(fd, "wb", closefd=False) as out:
                        shutil.copyfileobj(body, out)
                os.fchmod(fd, _file_mode(member.mode))
                _set_mtime(fd, member.mtime)
            finally:
                os.close(fd)
        os.replace(fresh, name, src_dir_fd=parent, dst_dir_fd=parent)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(fresh, dir_fd=parent)
        raise


def _set_mtime(fd: int, mtime: float) -> None:
    # A time the disk cannot hold is not worth refusing the archive for.
    with contextlib.suppress(OSError, OverflowError, ValueError):
        os.utime(fd, (mtime, mtime))
