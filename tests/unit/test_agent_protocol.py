"""Round-trips and malformed frames of the host <-> dsec-agent wire protocol (no I/O)."""

from __future__ import annotations

import os
import socket
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.agent.connection import AgentConnection, peer_is_sandbox_init
from workers.agent.errors import AgentProtocolError, AgentTimeout
from workers.agent.messages import (
    HEADER_LEN,
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
    WriteFileRequest,
    WriteFileResult,
)
from workers.agent.protocol import (
    decode_hello,
    decode_request,
    decode_response,
    encode_hello,
    encode_request,
    encode_response,
    frame,
    frame_length,
    op_of,
    response_limit,
)


def _payload(framed: bytes) -> bytes:
    assert frame_length(framed[:HEADER_LEN], len(framed)) == len(framed) - HEADER_LEN
    return framed[HEADER_LEN:]


def _request_roundtrip(request: Request) -> Request:
    return decode_request(_payload(encode_request(request)))


def _response_roundtrip(op: Op, response: Response) -> Response:
    return decode_response(op, _payload(encode_response(response)))


# -------------------------------------------------------------- round trips

# No lone surrogates: they are not text (only surrogateescape'd bytes are encodable).
_text = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\0"), max_size=40)
_env_entry = st.builds(
    lambda k, v: f"{k}={v}",
    st.text(alphabet="ABCXYZ_", min_size=1, max_size=8),
    _text,
)


@given(
    argv=st.lists(_text, min_size=1, max_size=5),
    env=st.lists(_env_entry, max_size=5),
    cwd=_text,
    timeout_ms=st.integers(0, 2**32 - 1),
    max_output=st.integers(0, 2**32 - 1),
    stdin=st.binary(max_size=300),
)
def test_exec_request_roundtrips(
    argv: list[str], env: list[str], cwd: str, timeout_ms: int, max_output: int, stdin: bytes
) -> None:
    request = ExecRequest(tuple(argv), tuple(env), cwd, timeout_ms, max_output, stdin)
    assert _request_roundtrip(request) == request


@given(path=_text, data=st.binary(max_size=600), mode=st.integers(0, 0o7777))
def test_file_requests_roundtrip(path: str, data: bytes, mode: int) -> None:
    write = WriteFileRequest(path, data, mode)
    read = ReadFileRequest(path, len(data))
    assert _request_roundtrip(write) == write
    assert _request_roundtrip(read) == read


def test_ping_and_hello_roundtrip() -> None:
    assert _request_roundtrip(PingRequest()) == PingRequest()
    hello = Hello(version=1, pid=12345)
    assert decode_hello(_payload(encode_hello(hello))) == hello
    assert encode_hello(hello) == bytes.fromhex("00000009100000000100003039")


def test_all_256_byte_values_survive_as_data_and_as_path() -> None:
    data = bytes(range(256)) * 3
    # A path that is not valid UTF-8 still round-trips (surrogateescape).
    path = "/workspace/" + bytes(range(1, 256)).decode("utf-8", "surrogateescape")
    request = WriteFileRequest(path, data, 0o600)
    assert _request_roundtrip(request) == request
    reply = ReadFileResult(data, truncated=False)
    assert _response_roundtrip(Op.READ_FILE, reply) == reply


@given(
    exit_code=st.integers(-(2**31), 2**31 - 1),
    stdout=st.binary(max_size=200),
    stderr=st.binary(max_size=200),
    flags=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    duration_ns=st.integers(0, 10**15),
)
def test_exec_result_roundtrips(
    exit_code: int,
    stdout: bytes,
    stderr: bytes,
    flags: tuple[bool, bool, bool],
    duration_ns: int,
) -> None:
    result = AgentExecResult(exit_code, stdout, stderr, *flags, duration_s=duration_ns / 1e9)
    decoded = _response_roundtrip(Op.EXEC, result)
    assert isinstance(decoded, AgentExecResult)
    assert decoded == AgentExecResult(
        exit_code, stdout, stderr, *flags, duration_s=decoded.duration_s
    )
    assert decoded.duration_s == pytest.approx(result.duration_s, abs=1e-9)


def test_other_responses_roundtrip() -> None:
    assert _response_roundtrip(Op.PING, Pong()) == Pong()
    assert _response_roundtrip(Op.WRITE_FILE, WriteFileResult(2**40)) == WriteFileResult(2**40)
    assert _response_roundtrip(Op.READ_FILE, ReadFileResult(b"", True)) == ReadFileResult(b"", True)
    error = AgentErrorReply(errno=2, message="cannot open /x: No such file or directory")
    for op in (Op.PING, Op.EXEC, Op.WRITE_FILE, Op.READ_FILE):
        assert _response_roundtrip(op, error) == error


def test_streaming_exec_roundtrips_with_its_output_frames() -> None:
    request = ExecRequest(("yes",), stream=True)
    assert op_of(request) == Op.EXEC_STREAM
    assert _request_roundtrip(request) == request
    for output in (Output(1, b"out\n"), Output(2, b"\0\xff")):
        assert _response_roundtrip(Op.EXEC_STREAM, output) == output
    # Output belongs to a streaming EXEC only, and names stdout or stderr.
    with pytest.raises(AgentProtocolError):
        _response_roundtrip(Op.EXEC, Output(1, b"x"))
    with pytest.raises(AgentProtocolError):
        _response_roundtrip(Op.EXEC_STREAM, Output(3, b"x"))
    result = AgentExecResult(0, b"a", b"b", duration_s=0.5)
    assert _response_roundtrip(Op.EXEC_STREAM, result) == result


def test_exec_ok_property() -> None:
    assert AgentExecResult(0, b"", b"").ok
    assert not AgentExecResult(1, b"", b"").ok
    assert not AgentExecResult(0, b"", b"", timed_out=True).ok


def test_op_of_matches_the_encoded_op_byte() -> None:
    requests: list[Request] = [
        PingRequest(),
        ExecRequest(("true",)),
        ExecRequest(("true",), stream=True),
        WriteFileRequest("/a", b""),
        ReadFileRequest("/a", 1),
        SignalAllRequest(19),
    ]
    for request in requests:
        assert encode_request(request)[HEADER_LEN] == op_of(request)
        assert decode_request(encode_request(request)[HEADER_LEN:]) == request


def test_signal_all_wire_layout_and_its_empty_answer() -> None:
    assert encode_request(SignalAllRequest(19)) == bytes.fromhex("000000050600000013")
    assert decode_response(Op.SIGNAL_ALL, b"\x00") == Pong()


def test_exec_wire_layout_is_what_the_c_agent_parses() -> None:
    # Pinned bytes: the C side reads exactly this layout.
    framed = encode_request(ExecRequest(("ls", "-l"), ("A=1",), "/w", 1500, 4096, b"in"))
    assert framed == bytes.fromhex(
        "00000030"  # frame length 48
        "02"  # EXEC
        "00000002"
        "00000002"
        "6c73"
        "00000002"
        "2d6c"  # argv
        "00000001"
        "00000003"
        "413d31"  # env
        "00000002"
        "2f77"  # cwd
        "000005dc"
        "00001000"  # timeout_ms, max_output
        "00000002"
        "696e"  # stdin
    )


# -------------------------------------------------------- malformed frames


def test_frame_length_refuses_zero_oversized_and_short_headers() -> None:
    assert frame_length(b"\x00\x00\x01\x00", 256) == 256
    with pytest.raises(AgentProtocolError):
        frame_length(b"\x00\x00\x00\x00", 256)
    with pytest.raises(AgentProtocolError):
        frame_length(b"\x00\x00\x01\x01", 256)
    with pytest.raises(AgentProtocolError):
        frame_length(b"\x00\x01", 256)


def test_truncated_and_padded_payloads_are_protocol_errors() -> None:
    payload = _payload(encode_request(ExecRequest(("echo", "hi"))))
    for cut in range(len(payload)):
        with pytest.raises(AgentProtocolError):
            decode_request(payload[:cut])
    with pytest.raises(AgentProtocolError):
        decode_request(payload + b"\x00")


def test_unknown_op_status_and_non_hello_are_refused() -> None:
    with pytest.raises(AgentProtocolError, match="unknown op"):
        decode_request(b"\x7f")
    with pytest.raises(AgentProtocolError, match="unknown status"):
        decode_response(Op.PING, b"\x02")
    with pytest.raises(AgentProtocolError, match="HELLO"):
        decode_hello(b"\x01" + bytes(8))


def test_huge_list_count_is_refused_before_allocating() -> None:
    # Given an EXEC claiming 2**32-1 argv entries in a tiny frame
    payload = bytes([Op.EXEC]) + b"\xff\xff\xff\xff"
    # Then decoding fails fast instead of looping or allocating
    with pytest.raises(AgentProtocolError, match="cannot fit"):
        decode_request(payload)


def test_encoding_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="NUL"):
        encode_request(ExecRequest(("echo", "a\0b")))
    with pytest.raises(ValueError):  # UnicodeEncodeError: not text, not escaped bytes
        encode_request(ReadFileRequest("/\ud800", 1))
    with pytest.raises(ValueError, match="argv"):
        encode_request(ExecRequest(()))
    with pytest.raises(ValueError, match="K=V"):
        encode_request(ExecRequest(("env",), ("NOEQUALS",)))
    with pytest.raises(ValueError, match="out of range"):
        encode_request(ExecRequest(("true",), timeout_ms=2**32))
    with pytest.raises(ValueError, match="exceeds"):
        encode_request(WriteFileRequest("/big", bytes(MAX_REQUEST_FRAME)))


def test_frame_prefixes_length() -> None:
    assert frame(b"abc") == b"\x00\x00\x00\x03abc"


def test_a_version_1_agent_gets_a_plain_exec_and_the_output_comes_at_the_end() -> None:
    host, fake_agent = socket.socketpair()
    seen_ops: list[int] = []

    def serve() -> None:
        header = fake_agent.recv(HEADER_LEN, socket.MSG_WAITALL)
        payload = fake_agent.recv(int.from_bytes(header, "big"), socket.MSG_WAITALL)
        seen_ops.append(payload[0])
        fake_agent.sendall(encode_response(AgentExecResult(0, b"out", b"err")))

    server = threading.Thread(target=serve)
    server.start()
    got: list[Output] = []
    conn = AgentConnection(host, Hello(version=1, pid=1))
    result = conn.exec(["true"], on_output=got.append)
    server.join()
    conn.close()
    fake_agent.close()
    assert seen_ops == [Op.EXEC]
    assert got == [Output(1, b"out"), Output(2, b"err")]
    assert (result.stdout, result.stderr) == (b"out", b"err")


def _fake_agent(*responses: bytes) -> tuple[AgentConnection, threading.Thread, socket.socket]:
    """A connection whose peer answers the first request with ``responses``."""
    host, fake_agent = socket.socketpair()

    def serve() -> None:
        header = fake_agent.recv(HEADER_LEN, socket.MSG_WAITALL)
        fake_agent.recv(int.from_bytes(header, "big"), socket.MSG_WAITALL)
        for response in responses:
            try:
                fake_agent.sendall(response)
            except OSError:  # the host hung up: what the test wants
                return

    server = threading.Thread(target=serve)
    server.start()
    return AgentConnection(host, Hello(version=2, pid=1)), server, fake_agent


@pytest.mark.parametrize(
    "responses",
    [
        # A frame announcing far more than max_output: never read into memory.
        [(64 << 20).to_bytes(4, "big") + b"\x00"],
        # A well-formed result whose stdout exceeds what was asked.
        [encode_response(AgentExecResult(0, b"x" * 2048, b""))],
        # Streamed pieces that together exceed it.
        [encode_response(Output(1, b"x" * 1000)), encode_response(Output(1, b"x" * 1000))],
    ],
    ids=["huge-frame", "big-stdout", "streamed-too-much"],
)
def test_the_host_enforces_the_output_cap_it_asked_for(responses: list[bytes]) -> None:
    conn, server, fake_agent = _fake_agent(*responses)
    with pytest.raises(AgentProtocolError):
        conn.exec(["true"], max_output=1024, on_output=lambda _: None)
    assert conn.closed  # a peer that broke the protocol is never asked again
    fake_agent.close()
    server.join()


def test_the_host_enforces_the_file_size_it_asked_for() -> None:
    conn, server, fake_agent = _fake_agent(encode_response(ReadFileResult(b"y" * 100, False)))
    with pytest.raises(AgentProtocolError):
        conn.read_file("/workspace/x", max_bytes=10)
    fake_agent.close()
    server.join()


def test_bytes_after_a_response_are_refused_not_kept_for_the_next_request() -> None:
    # A forged answer sent ahead, in the same write as the real one: read as the next
    # request's answer, it would be believed.
    forged = encode_response(AgentExecResult(0, b"all tests passed", b""))
    conn, server, fake_agent = _fake_agent(
        encode_response(AgentExecResult(1, b"", b"failed")) + forged
    )
    with pytest.raises(AgentProtocolError, match="after its response"):
        conn.exec(["pytest"], max_output=1024)
    assert conn.closed
    fake_agent.close()
    server.join()


def test_a_silent_agent_times_out_and_a_slow_large_answer_is_read_whole() -> None:
    conn, server, fake_agent = _fake_agent()  # reads the request, never answers
    with pytest.raises(AgentTimeout):
        conn.request(PingRequest(), timeout_s=0.2)
    assert conn.closed
    fake_agent.close()
    server.join()
    # A frame larger than one read, coming in pieces, is read to its exact length.
    data = bytes(range(256)) * 1024  # 256 KiB
    whole = encode_response(ReadFileResult(data, False))
    conn, server, fake_agent = _fake_agent(whole[:1000], whole[1000:200_000], whole[200_000:])
    assert conn.read_file("/workspace/big", max_bytes=len(data)) == (data, False)
    assert not conn.closed
    conn.close()
    fake_agent.close()
    server.join()


def test_response_limits_follow_the_request() -> None:
    small = response_limit(ExecRequest(argv=("true",), max_output=1024))
    assert small < 1 << 20
    assert response_limit(ReadFileRequest("/x", 10)) < response_limit(
        ReadFileRequest("/x", 1 << 20)
    )
    assert response_limit(PingRequest()) < 1 << 20


def test_only_a_containers_init_is_taken_for_the_agent() -> None:
    # This test process is no container's init: a connection from it is refused, as a
    # process inside a sandbox connecting to its agent socket would be.
    host, peer = socket.socketpair()
    conn = AgentConnection(host, Hello(version=2, pid=1))
    assert conn.peer_pid == os.getpid()
    assert not peer_is_sandbox_init("sb-test", conn)
    conn.close()
    peer.close()
