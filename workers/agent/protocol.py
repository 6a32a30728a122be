"""Wire protocol between the host and ``dsec-agent``, version 3: encode/decode only, no I/O
(the messages themselves: :mod:`workers.agent.messages`).

All integers are big-endian. ``frame`` = u32 length + payload; ``bytes`` = u32 length
+ bytes (strings are UTF-8, ``surrogateescape`` so any POSIX byte string round-trips,
and may not contain NUL); ``list`` = u32 count + items.

On connect the agent sends HELLO: ``u8 0x10, u32 version, u32 pid``. Then the host sends
one request at a time on that connection (payload ``u8 op`` + fields) and reads one
response (payload ``u8 status`` + body). An agent of version 3 keeps several
connections, one of them idle (it connects the next as a request arrives on the last
idle one) and serves each request in a process of its own, so requests on different
connections run at once; versions 1 and 2 hold one connection.

=========== ========================================= ================================
op          request fields                             ok body (status 0)
=========== ========================================= ================================
0x01 PING   (none)                                     (empty)
0x02 EXEC   list argv, list env ("K=V"), bytes cwd     i32 exit_code (-N: signal N),
            ("" = /workspace), u32 timeout_ms (0 =     u8 flags (1 timed_out, 2 stdout
            none), u32 max_output (per stream),        truncated, 4 stderr truncated),
            bytes stdin                                u64 duration_ns, bytes stdout,
                                                       bytes stderr
0x03 WRITE  bytes path, u32 mode, bytes data           u64 bytes_written
0x04 READ   bytes path, u32 max_bytes                  u8 truncated, bytes data
0x05 EXEC_  as EXEC                                    as EXEC, after any number of
     STREAM                                            OUTPUT frames (status 2):
                                                       u8 stream (1 out, 2 err),
                                                       bytes data
0x06 SIGNAL u32 signo (SIGSTOP, SIGCONT or SIGKILL;    (empty)
     _ALL   version 3): sent to every process of the
            sandbox but the agent and this request's
            own handler
=========== ========================================= ================================

OUTPUT frames (version 2) carry what a stream kept since its previous OUTPUT frame,
sent 50 ms after its first byte or once 32 KiB wait; together they are exactly the
final response's stdout and stderr. A version-1 agent knows no EXEC_STREAM: the host
then runs a plain EXEC and hands over the output when it ends.

An error (status 1, any op) carries ``u32 errno`` (0 if not an OS error) and ``bytes
message``. The agent refuses request frames above :data:`MAX_REQUEST_FRAME` (and then
closes the connection) and clamps ``max_output``/``max_bytes`` to
:data:`MAX_OUTPUT_BYTES`. Closing the connection during an EXEC cancels it. The C side
(``dsec_agent.c``) documents the same protocol in its header; keep them in step.
"""

from __future__ import annotations

import struct

from workers.agent.errors import AgentProtocolError
from workers.agent.messages import (
    HEADER_LEN,
    MAX_OUTPUT_BYTES,
    MAX_REQUEST_FRAME,
    AgentErrorReply,
    AgentExecResult,
    ExecRequest,
    Hello,
    Op,
    Output,
    PingRequest,
    Pong,
    ReadFileRequest,
    ReadFileResult,
    Request,
    Response,
    SignalAllRequest,
    Status,
    WriteFileRequest,
    WriteFileResult,
)

_U32_MAX = 0xFFFFFFFF
_FLAG_TIMED_OUT = 1
_FLAG_STDOUT_TRUNCATED = 2
_FLAG_STDERR_TRUNCATED = 4

# ---------------------------------------------------------------- encoding


def _u32(value: int, what: str) -> bytes:
    if not 0 <= value <= _U32_MAX:
        raise ValueError(f"{what} out of range: {value}")
    return value.to_bytes(4, "big")


def _bytes(data: bytes) -> bytes:
    return _u32(len(data), "length") + data


def _str(text: str, what: str) -> bytes:
    raw = text.encode("utf-8", "surrogateescape")
    if b"\0" in raw:
        raise ValueError(f"{what} contains a NUL byte: {text!r}")
    return _bytes(raw)


def _str_list(items: tuple[str, ...], what: str) -> bytes:
    return _u32(len(items), what) + b"".join(_str(item, what) for item in items)


def frame(payload: bytes) -> bytes:
    """Prefix ``payload`` with its u32 length."""
    return _u32(len(payload), "frame length") + payload


def frame_length(header: bytes | bytearray | memoryview, limit: int) -> int:
    """Length announced by a 4-byte frame header; refuses 0 and anything above ``limit``."""
    if len(header) != HEADER_LEN:
        raise AgentProtocolError(f"frame header must be 4 bytes, got {len(header)}")
    length = int.from_bytes(header, "big")
    if length == 0 or length > limit:
        raise AgentProtocolError(f"frame of {length} bytes refused (limit {limit})")
    return length


def encode_hello(hello: Hello) -> bytes:
    """HELLO as a complete frame (what the agent sends first)."""
    return frame(bytes([Op.HELLO]) + _u32(hello.version, "version") + _u32(hello.pid, "pid"))


def encode_request(request: Request) -> bytes:
    """A request as a complete frame, ready to send."""
    match request:
        case PingRequest():
            payload = bytes([Op.PING])
        case ExecRequest():
            if not request.argv:
                raise ValueError("argv must not be empty")
            for entry in request.env:
                if "=" not in entry or entry.startswith("="):
                    raise ValueError(f"env entry is not K=V: {entry!r}")
            payload = b"".join(
                (
                    bytes([op_of(request)]),
                    _str_list(request.argv, "argv"),
                    _str_list(request.env, "env"),
                    _str(request.cwd, "cwd"),
                    _u32(request.timeout_ms, "timeout_ms"),
                    _u32(request.max_output, "max_output"),
                    _bytes(request.stdin),
                )
            )
        case WriteFileRequest():
            payload = b"".join(
                (
                    bytes([Op.WRITE_FILE]),
                    _str(request.path, "path"),
                    _u32(request.mode, "mode"),
                    _bytes(request.data),
                )
            )
        case SignalAllRequest():
            payload = bytes([Op.SIGNAL_ALL]) + _u32(request.signo, "signo")
        case ReadFileRequest():
            payload = (
                bytes([Op.READ_FILE])
                + _str(request.path, "path")
                + _u32(request.max_bytes, "max_bytes")
            )
    if len(payload) > MAX_REQUEST_FRAME:
        raise ValueError(f"request of {len(payload)} bytes exceeds {MAX_REQUEST_FRAME}")
    return frame(payload)


def encode_response(response: Response) -> bytes:
    """A response as a complete frame (what the agent sends; used by fakes and tests)."""
    ok = bytes([Status.OK])
    match response:
        case Pong():
            payload = ok
        case AgentExecResult():
            flags = (
                (_FLAG_TIMED_OUT if response.timed_out else 0)
                | (_FLAG_STDOUT_TRUNCATED if response.stdout_truncated else 0)
                | (_FLAG_STDERR_TRUNCATED if response.stderr_truncated else 0)
            )
            payload = b"".join(
                (
                    ok,
                    struct.pack(
                        ">iBQ", response.exit_code, flags, round(response.duration_s * 1e9)
                    ),
                    _bytes(response.stdout),
                    _bytes(response.stderr),
                )
            )
        case Output():
            payload = bytes([Status.OUTPUT, response.stream]) + _bytes(response.data)
        case WriteFileResult():
            payload = ok + struct.pack(">Q", response.bytes_written)
        case ReadFileResult():
            payload = ok + bytes([response.truncated]) + _bytes(response.data)
        case AgentErrorReply():
            payload = (
                bytes([Status.ERROR])
                + _u32(response.errno, "errno")
                + _bytes(response.message.encode("utf-8", "replace"))
            )
    return frame(payload)


# ---------------------------------------------------------------- decoding


class _Reader:
    """Cursor over one payload; every shortfall is a protocol error."""

    def __init__(self, payload: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(payload)
        self._pos = 0

    def take(self, n: int) -> memoryview:
        end = self._pos + n
        if end > len(self._view):
            raise AgentProtocolError("frame ends in the middle of a field")
        chunk = self._view[self._pos : end]
        self._pos = end
        return chunk

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "big")

    def unpack(self, fmt: struct.Struct) -> tuple[int, ...]:
        return fmt.unpack(self.take(fmt.size))

    def blob(self) -> bytes:
        return bytes(self.take(self.u32()))

    def text(self) -> str:
        raw = self.blob()
        if b"\0" in raw:
            raise AgentProtocolError("string contains a NUL byte")
        return raw.decode("utf-8", "surrogateescape")

    def text_list(self) -> tuple[str, ...]:
        count = self.u32()
        if count * 4 > len(self._view) - self._pos:
            raise AgentProtocolError(f"list of {count} items cannot fit in the frame")
        return tuple(self.text() for _ in range(count))

    def end(self) -> None:
        if self._pos != len(self._view):
            raise AgentProtocolError(f"{len(self._view) - self._pos} trailing bytes in frame")


_EXEC_HEAD = struct.Struct(">iBQ")
_U64 = struct.Struct(">Q")


def decode_hello(payload: bytes | bytearray | memoryview) -> Hello:
    """Parse a HELLO payload (without its frame header)."""
    r = _Reader(payload)
    if r.u8() != Op.HELLO:
        raise AgentProtocolError("first frame is not HELLO")
    hello = Hello(version=r.u32(), pid=r.u32())
    r.end()
    return hello


def decode_request(payload: bytes | bytearray | memoryview) -> Request:
    """Parse a request payload (without its frame header)."""
    r = _Reader(payload)
    op = r.u8()
    request: Request
    if op == Op.PING:
        request = PingRequest()
    elif op in (Op.EXEC, Op.EXEC_STREAM):
        request = ExecRequest(
            argv=r.text_list(),
            env=r.text_list(),
            cwd=r.text(),
            timeout_ms=r.u32(),
            max_output=r.u32(),
            stdin=r.blob(),
            stream=op == Op.EXEC_STREAM,
        )
    elif op == Op.WRITE_FILE:
        request = WriteFileRequest(path=r.text(), mode=r.u32(), data=r.blob())
    elif op == Op.READ_FILE:
        request = ReadFileRequest(path=r.text(), max_bytes=r.u32())
    elif op == Op.SIGNAL_ALL:
        request = SignalAllRequest(signo=r.u32())
    else:
        raise AgentProtocolError(f"unknown op 0x{op:02x}")
    r.end()
    return request


def decode_response(op: Op, payload: bytes | bytearray | memoryview) -> Response:
    """Parse the response payload to a request with operation ``op``."""
    r = _Reader(payload)
    status = r.u8()
    response: Response
    if status == Status.ERROR:
        errno = r.u32()
        response = AgentErrorReply(errno=errno, message=r.blob().decode("utf-8", "replace"))
    elif status == Status.OUTPUT and op == Op.EXEC_STREAM:
        stream = r.u8()
        if stream not in (1, 2):
            raise AgentProtocolError(f"output frame for unknown stream {stream}")
        response = Output(stream=stream, data=r.blob())
    elif status != Status.OK:
        raise AgentProtocolError(f"unknown status {status}")
    elif op in (Op.PING, Op.SIGNAL_ALL):
        response = Pong()
    elif op in (Op.EXEC, Op.EXEC_STREAM):
        exit_code, flags, duration_ns = r.unpack(_EXEC_HEAD)
        response = AgentExecResult(
            exit_code=exit_code,
            timed_out=bool(flags & _FLAG_TIMED_OUT),
            stdout_truncated=bool(flags & _FLAG_STDOUT_TRUNCATED),
            stderr_truncated=bool(flags & _FLAG_STDERR_TRUNCATED),
            duration_s=duration_ns / 1e9,
            stdout=r.blob(),
            stderr=r.blob(),
        )
    elif op == Op.WRITE_FILE:
        (written,) = r.unpack(_U64)
        response = WriteFileResult(bytes_written=written)
    elif op == Op.READ_FILE:
        truncated = r.u8()
        response = ReadFileResult(truncated=bool(truncated), data=r.blob())
    else:
        raise AgentProtocolError(f"no response defined for op {op!r}")
    r.end()
    return response


#: Room in any response for its fixed fields and an error reply's message.
RESPONSE_SLACK = 64 << 10


def response_limit(request: Request) -> int:
    """The largest response frame the host accepts for ``request``: room for what it
    asked for and no more. The peer is the sandbox's, hence hostile: a frame beyond
    this is never read into memory."""
    match request:
        case ExecRequest():
            return 2 * min(request.max_output, MAX_OUTPUT_BYTES) + RESPONSE_SLACK
        case ReadFileRequest():
            return min(request.max_bytes, MAX_OUTPUT_BYTES) + RESPONSE_SLACK
        case _:
            return RESPONSE_SLACK


class CapCheck:
    """Checks that the responses to one request stay within what it asked for
    (``max_output`` per stream, streamed pieces included; ``max_bytes`` of a file)."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.streamed = {1: 0, 2: 0}

    def check(self, response: Response) -> None:
        """Raise :class:`AgentProtocolError` if ``response`` exceeds a cap."""
        request = self.request
        if isinstance(response, Output) and isinstance(request, ExecRequest):
            self.streamed[response.stream] += len(response.data)
            cap = min(request.max_output, MAX_OUTPUT_BYTES)
            self._within(self.streamed[response.stream], cap, "streamed output")
        elif isinstance(response, AgentExecResult) and isinstance(request, ExecRequest):
            cap = min(request.max_output, MAX_OUTPUT_BYTES)
            self._within(len(response.stdout), cap, "stdout")
            self._within(len(response.stderr), cap, "stderr")
        elif isinstance(response, ReadFileResult) and isinstance(request, ReadFileRequest):
            self._within(len(response.data), min(request.max_bytes, MAX_OUTPUT_BYTES), "file data")
        elif isinstance(response, WriteFileResult) and isinstance(request, WriteFileRequest):
            self._within(response.bytes_written, len(request.data), "bytes written")

    @staticmethod
    def _within(size: int, cap: int, what: str) -> None:
        if size > cap:
            raise AgentProtocolError(
                f"agent sent {size} bytes of {what}, more than the {cap} asked"
            )


def op_of(request: Request) -> Op:
    """The operation code of ``request`` (to decode its response)."""
    match request:
        case PingRequest():
            return Op.PING
        case ExecRequest():
            return Op.EXEC_STREAM if request.stream else Op.EXEC
        case WriteFileRequest():
            return Op.WRITE_FILE
        case ReadFileRequest():
            return Op.READ_FILE
        case SignalAllRequest():
            return Op.SIGNAL_ALL
