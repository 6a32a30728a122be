"""Stage the host-owned agent directory mounted read-only at ``/.dsec/bin``.

It holds ``dsec-agent`` (compiled here from ``dsec_agent.c`` with ``gcc -static``) and a
static ``busybox`` (Debian's busybox-static) so that images without a shell still have
one. Everything is root-owned and 0755: sandboxes can run it, never change it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

from workers.agent.errors import AgentBuildError
from workers.containers.spec import RESOLV_CONF

#: The agent's C source, shipped inside the package.
AGENT_SOURCE = Path(__file__).with_name("dsec_agent.c")
#: Name of the compiled agent inside the agent directory.
AGENT_BINARY = "dsec-agent"
#: Name of the static busybox inside the agent directory.
BUSYBOX_BINARY = "busybox"
#: Where Debian's busybox-static installs its binary.
SYSTEM_BUSYBOX = Path("/bin/busybox")
CFLAGS = ("-static", "-O2", "-s", "-Wall", "-Wextra")

_PT_INTERP = 3


def _source_hash(source: Path, cc: str) -> str:
    digest = hashlib.sha256()
    digest.update(source.read_bytes())
    digest.update(repr((cc, CFLAGS)).encode())
    return digest.hexdigest()


def is_static_elf(path: Path) -> bool:
    """True if ``path`` is a 64-bit little-endian ELF without a program interpreter
    (i.e. it runs in an image that has no libc)."""
    with path.open("rb") as f:
        ident = f.read(64)
        if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            return False
        (phoff,) = struct.unpack_from("<Q", ident, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", ident, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum):
        (p_type,) = struct.unpack_from("<I", table, i * phentsize)
        if p_type == _PT_INTERP:
            return False
    return True


def _install(src: Path, dest: Path) -> None:
    """Atomically put a copy of ``src`` at ``dest`` (root-owned, 0755)."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        os.close(fd)
        shutil.copyfile(src, tmp)
        _own(Path(tmp))
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _own(path: Path) -> None:
    if os.geteuid() == 0:
        os.chown(path, 0, 0)
    os.chmod(path, 0o755)


def _compile(source: Path, dest: Path, cc: str) -> None:
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".build-") as tmp:
        out = Path(tmp) / AGENT_BINARY
        proc = subprocess.run(
            [cc, *CFLAGS, "-o", str(out), str(source)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise AgentBuildError(f"compiling {source} failed:\n{proc.stderr.strip()}")
        _install(out, dest)


#: The resolver every sandbox is told of (/etc/resolv.conf, bound read-only). Its
#: address matters not: an allowlisted sandbox's DNS to any address goes to its node's
#: resolver (workers/host/egress.py); any other sandbox's DNS goes nowhere.
RESOLVER = "nameserver 10.213.0.1\noptions timeout:2 attempts:2\n"


def ensure_agent_dir(
    dest: Path,
    *,
    cc: str = "gcc",
    busybox: Path = SYSTEM_BUSYBOX,
    source: Path = AGENT_SOURCE,
    prebuilt: Path | None = None,
) -> Path:
    """Make ``dest`` hold an up-to-date ``dsec-agent`` and a static ``busybox``.

    The agent is recompiled only when the source (or compiler flags) changed since the
    last build, recorded in ``dsec-agent.sha256``; files are replaced atomically, so a
    running sandbox keeps its old binary and concurrent callers are safe. With
    ``prebuilt`` (a node host without a compiler: see :func:`build_agent`), that binary
    is installed instead. Raises :class:`AgentBuildError` when gcc, a static agent or a
    static busybox is missing.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    _own(dest)

    agent = dest / AGENT_BINARY
    stamp = dest / f"{AGENT_BINARY}.sha256"
    current = stamp.read_text().strip() if stamp.exists() else ""
    if prebuilt is not None:
        if not prebuilt.is_file() or not is_static_elf(prebuilt):
            raise AgentBuildError(f"{prebuilt} is not a static agent binary (dsec node agent)")
        wanted = f"prebuilt:{_file_hash(prebuilt)}"
        if current != wanted or not agent.exists():
            _install(prebuilt, agent)
            _stamp(stamp, wanted)
    else:
        compiler = _compiler(cc)
        wanted = _source_hash(source, cc)
        if current != wanted or not agent.exists():
            _compile(source, agent, compiler)
            _stamp(stamp, wanted)

    if not busybox.exists():
        raise AgentBuildError(f"{busybox} not found: apt-get install busybox-static")
    if not is_static_elf(busybox):
        raise AgentBuildError(
            f"{busybox} is dynamically linked; it would not run in images without libc: "
            "apt-get install busybox-static"
        )
    staged = dest / BUSYBOX_BINARY
    if not staged.exists() or _file_hash(staged) != _file_hash(busybox):
        _install(busybox, staged)
    resolver = dest / RESOLV_CONF
    if not resolver.exists() or resolver.read_text() != RESOLVER:
        resolver.write_text(RESOLVER)
    return dest


def build_agent(out: Path, *, cc: str = "gcc", source: Path = AGENT_SOURCE) -> Path:
    """Compile the agent once, to ``out``: a release's binary for node hosts that have
    no compiler (``dsec node up --agent``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _compile(source, out, _compiler(cc))
    return out


def _compiler(cc: str) -> str:
    """The path of ``cc``; raises if the host has none."""
    compiler = shutil.which(cc)
    if compiler is None:
        raise AgentBuildError(f"{cc} not found: install gcc (apt-get install gcc libc6-dev)")
    return compiler


def _stamp(stamp: Path, value: str) -> None:
    stamp.write_text(value + "\n")
    _own(stamp)
    os.chmod(stamp, 0o644)


def _file_hash(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
