"""The messages of the host-agent protocol (:mod:`workers.agent.protocol` has their
wire format): HELLO, the requests the host sends, the responses the agent returns,
and the protocol's limits. Values only, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

#: Version the agent announces in HELLO; the host refuses any other.
PROTOCOL_VERSION = 3
#: Versions the host accepts in HELLO (1: no EXEC_STREAM; 1-2: one connection).
SUPPORTED_VERSIONS = frozenset({1, 2, 3})
#: The agent refuses larger request frames (so at most this much file data per write).
MAX_REQUEST_FRAME = 64 << 20
#: The agent clamps per-stream EXEC output and READ_FILE sizes to this.
MAX_OUTPUT_BYTES = 64 << 20
#: HELLO's payload length (op + version + pid).
HELLO_PAYLOAD_LEN = 9
#: Length of the frame header.
HEADER_LEN = 4


class Op(IntEnum):
    """Operation codes (first payload byte of HELLO and of every request)."""

    PING = 0x01
    EXEC = 0x02
    WRITE_FILE = 0x03
    READ_FILE = 0x04
    EXEC_STREAM = 0x05
    SIGNAL_ALL = 0x06
    HELLO = 0x10


class Status(IntEnum):
    """First payload byte of every response."""

    OK = 0
    ERROR = 1
    OUTPUT = 2


@dataclass(frozen=True)
class Hello:
    """The agent's first frame on every connection."""

    version: int
    """Protocol version the agent speaks."""
    pid: int
    """The agent's pid in its own pid namespace (1 inside a sandbox)."""


@dataclass(frozen=True)
class PingRequest:
    """Liveness check; answered with :class:`Pong`."""


@dataclass(frozen=True)
class ExecRequest:
    """Run one command to completion."""

    argv: tuple[str, ...]
    """Program and arguments; the program is looked up in PATH."""
    env: tuple[str, ...] = ()
    """``K=V`` entries overriding the sandbox's environment."""
    cwd: str = ""
    """Working directory; empty means ``/workspace``."""
    timeout_ms: int = 0
    """Kill the command's process group after this long; 0 means no limit."""
    max_output: int = 1 << 20
    """Keep at most this many bytes of stdout and (separately) of stderr."""
    stdin: bytes = b""
    """Fed to the command's stdin, which is then closed."""
    stream: bool = False
    """Send :class:`Output` frames while the command runs (``EXEC_STREAM``)."""


@dataclass(frozen=True)
class WriteFileRequest:
    """Create or truncate a regular file (parents are created) and write ``data``."""

    path: str
    """Absolute path without ``..``; no symlink is followed."""
    data: bytes
    """The whole new content."""
    mode: int = 0o644
    """Permission bits set on the file."""


@dataclass(frozen=True)
class ReadFileRequest:
    """Read a regular file, up to ``max_bytes``."""

    path: str
    """Absolute path without ``..``; no symlink is followed."""
    max_bytes: int
    """Read at most this much; more sets ``truncated``."""


@dataclass(frozen=True)
class SignalAllRequest:
    """Signal every process of the sandbox but the agent's own (protocol 3): how a
    sandbox is frozen and thawed while other requests' handlers run in it."""

    signo: int
    """SIGSTOP, SIGCONT or SIGKILL; the agent refuses any other."""


Request = PingRequest | ExecRequest | WriteFileRequest | ReadFileRequest | SignalAllRequest


@dataclass(frozen=True)
class Pong:
    """Answer to :class:`PingRequest`."""


@dataclass(frozen=True)
class AgentExecResult:
    """How a command ended and what it printed."""

    exit_code: int
    """Exit status, or ``-N`` when killed by signal N (``-9`` after a timeout)."""
    stdout: bytes
    """Captured stdout, at most ``max_output`` bytes."""
    stderr: bytes
    """Captured stderr, at most ``max_output`` bytes."""
    timed_out: bool = False
    """The timeout expired and the process group was killed."""
    stdout_truncated: bool = False
    """stdout exceeded ``max_output``; the rest was discarded."""
    stderr_truncated: bool = False
    """stderr exceeded ``max_output``; the rest was discarded."""
    duration_s: float = 0.0
    """Wall time from start to the end of output collection, as the agent saw it."""

    @property
    def ok(self) -> bool:
        """True when the command exited 0 within its timeout."""
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class Output:
    """Status 2: output of a running ``EXEC_STREAM``, before its :class:`AgentExecResult`."""

    stream: int
    """1 for stdout, 2 for stderr."""
    data: bytes
    """What the stream kept since its previous :class:`Output`."""


@dataclass(frozen=True)
class WriteFileResult:
    """Answer to :class:`WriteFileRequest`."""

    bytes_written: int
    """Bytes written (the length of the data)."""


@dataclass(frozen=True)
class ReadFileResult:
    """Answer to :class:`ReadFileRequest`."""

    data: bytes
    """The file's first ``max_bytes`` bytes (or all of it)."""
    truncated: bool
    """The file holds more than ``max_bytes``."""


@dataclass(frozen=True)
class AgentErrorReply:
    """Status 1: the agent refused or failed the request."""

    errno: int
    """OS error number, 0 if the refusal is not an OS error."""
    message: str
    """Human-readable reason."""


Response = Pong | AgentExecResult | Output | WriteFileResult | ReadFileResult | AgentErrorReply
