"""One thread waits on many agents' answers (workers/agent/waiter.py): each request is
answered once, with what its own agent sent, and an agent that breaks the protocol,
says nothing or is cut off ends its request instead of holding the thread."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from workers.agent.connection import AgentConnection
from workers.agent.errors import (
    AgentError,
    AgentProtocolError,
    AgentRefused,
    AgentTimeout,
    AgentUnavailable,
)
from workers.agent.messages import (
    HEADER_LEN,
    AgentErrorReply,
    AgentExecResult,
    Hello,
    Output,
    Response,
)
from workers.agent.pool import AgentPool
from workers.agent.protocol import encode_hello, encode_response
from workers.agent.waiter import COMPACT_AFTER, Waiter
from workers.containers.spec import AGENT_SOCKET_NAME


class Answers:
    """What ``done`` was called with, per request, and on which thread."""

    def __init__(self) -> None:
        self.got: dict[int, list[tuple[Response | None, AgentError | None, str]]] = {}
        self.cond = threading.Condition()

    def done(self, n: int):
        def call(response: Response | None, error: AgentError | None) -> None:
            with self.cond:
                self.got.setdefault(n, []).append(
                    (response, error, threading.current_thread().name)
                )
                self.cond.notify_all()

        return call

    def wait(self, count: int, timeout_s: float = 10.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= count, timeout_s), self.got


def _pair(version: int = 3) -> tuple[AgentConnection, socket.socket]:
    host, agent = socket.socketpair()
    return AgentConnection(host, Hello(version=version, pid=1)), agent


def _read_request(agent: socket.socket) -> bytes:
    header = agent.recv(HEADER_LEN, socket.MSG_WAITALL)
    return agent.recv(int.from_bytes(header, "big"), socket.MSG_WAITALL)


def _exec(conn: AgentConnection, argv: list[str], **kw: object):
    return conn.exec_request(argv, **kw)  # type: ignore[arg-type]


def test_many_requests_are_answered_each_with_its_own_agents_answer_on_one_thread() -> None:
    waiter, answers = Waiter(), Answers()
    pairs = [_pair() for _ in range(200)]
    for n, (conn, _agent) in enumerate(pairs):
        request, wait = _exec(conn, ["echo", str(n)])
        waiter.watch(conn, request, wait, answers.done(n))
    assert waiter.watched() == 200
    # Answered in the reverse order, each with what only its request should get.
    for n, (_conn, agent) in reversed(list(enumerate(pairs))):
        _read_request(agent)
        agent.sendall(encode_response(AgentExecResult(n % 7, str(n).encode(), b"")))
    answers.wait(200)
    for n, calls in answers.got.items():
        assert len(calls) == 1
        response, error, thread = calls[0]
        assert error is None and isinstance(response, AgentExecResult)
        assert (response.exit_code, response.stdout) == (n % 7, str(n).encode())
        assert thread == "dsec-waiter"
    assert waiter.watched() == 0
    # The connections stay usable: each carries a second request the same way.
    conn, agent = pairs[0]
    request, wait = _exec(conn, ["true"])
    waiter.watch(conn, request, wait, answers.done(1000))
    _read_request(agent)
    agent.sendall(encode_response(AgentExecResult(0, b"", b"")))
    answers.wait(201)
    assert answers.got[1000][0][1] is None
    assert [t.name for t in threading.enumerate()].count("dsec-waiter") == 1


def test_streamed_output_is_handed_over_in_order_before_the_result() -> None:
    waiter, answers = Waiter(), Answers()
    conn, agent = _pair()
    pieces: list[Output] = []
    request, wait = _exec(conn, ["make"], stream=True)
    assert request.stream
    waiter.watch(conn, request, wait, answers.done(0), pieces.append)
    _read_request(agent)
    # Frames split across writes at odd places still come whole.
    wire = b"".join(
        encode_response(r) for r in (Output(1, b"a" * 5000), Output(2, b"oops"), Output(1, b"b"))
    ) + encode_response(AgentExecResult(2, b"a" * 5000 + b"b", b"oops"))
    for start in range(0, len(wire), 777):
        agent.sendall(wire[start : start + 777])
        time.sleep(0.001)
    answers.wait(1)
    assert pieces == [Output(1, b"a" * 5000), Output(2, b"oops"), Output(1, b"b")]
    response, error, _ = answers.got[0][0]
    assert error is None and isinstance(response, AgentExecResult) and response.exit_code == 2


def test_a_forged_answer_after_the_real_one_ends_the_connection() -> None:
    # Read as the next request's answer, it would be believed: the connection goes.
    waiter, answers = Waiter(), Answers()
    conn, agent = _pair()
    request, wait = _exec(conn, ["pytest"])
    waiter.watch(conn, request, wait, answers.done(0))
    _read_request(agent)
    forged = encode_response(AgentExecResult(0, b"all tests passed", b""))
    agent.sendall(encode_response(AgentExecResult(1, b"", b"failed")) + forged)
    answers.wait(1)
    response, error, _ = answers.got[0][0]
    assert response is None and isinstance(error, AgentProtocolError)
    assert conn.closed


@pytest.mark.parametrize(
    "wire",
    [
        (64 << 20).to_bytes(4, "big") + b"\x00",  # announces far more than asked
        encode_response(Output(1, b"x" * 700)) + encode_response(Output(1, b"x" * 700)),
    ],
    ids=["huge-frame", "streamed-too-much"],
)
def test_the_output_cap_holds_without_a_thread_too(wire: bytes) -> None:
    waiter, answers = Waiter(), Answers()
    conn, agent = _pair()
    request, wait = _exec(conn, ["yes"], max_output=1024, stream=True)
    waiter.watch(conn, request, wait, answers.done(0), lambda _o: None)
    _read_request(agent)
    agent.sendall(wire)
    answers.wait(1)
    assert isinstance(answers.got[0][0][1], AgentProtocolError)
    assert conn.closed


def test_a_silent_agent_is_ended_at_the_deadline_and_its_connection_closed() -> None:
    waiter, answers = Waiter(), Answers()
    conn, agent = _pair()
    request, _ = _exec(conn, ["sleep", "100"])
    began = time.monotonic()
    waiter.watch(conn, request, 0.3, answers.done(0))
    answers.wait(1)
    assert time.monotonic() - began >= 0.3
    assert isinstance(answers.got[0][0][1], AgentTimeout)
    assert conn.closed
    agent.settimeout(2)  # the agent sees the host hang up (and kills the command)
    _read_request(agent)
    assert agent.recv(1) == b""


def test_a_kill_that_closes_the_connection_ends_the_request_at_once() -> None:
    waiter, answers = Waiter(), Answers()
    conn, agent = _pair()
    request, wait = _exec(conn, ["sleep", "100"], timeout_s=100)
    waiter.watch(conn, request, wait, answers.done(0))
    _read_request(agent)
    began = time.monotonic()
    threading.Thread(target=conn.close).start()  # what a KillCommand does
    answers.wait(1, timeout_s=5)
    assert time.monotonic() - began < 5
    assert isinstance(answers.got[0][0][1], AgentUnavailable)
    assert conn.closed and conn.fileno() == -1


def test_an_agents_refusal_leaves_the_connection_usable() -> None:
    waiter, answers = Waiter(), Answers()
    conn, agent = _pair()
    request, wait = _exec(conn, ["nope"])
    waiter.watch(conn, request, wait, answers.done(0))
    _read_request(agent)
    agent.sendall(encode_response(AgentErrorReply(2, "no such file")))
    answers.wait(1)
    response, error, _ = answers.got[0][0]
    assert response is None and isinstance(error, AgentRefused) and error.errno == 2
    assert not conn.closed


def test_a_request_that_cannot_be_sent_is_answered_on_the_callers_thread() -> None:
    waiter, answers = Waiter(), Answers()
    conn, agent = _pair()
    agent.close()
    request, wait = _exec(conn, ["true"])
    waiter.watch(conn, request, wait, answers.done(0))
    # Answered before watch returned, on this thread.
    assert answers.got[0][0][2] == threading.current_thread().name
    assert isinstance(answers.got[0][0][1], AgentUnavailable)
    assert conn.closed and waiter.watched() == 0


def test_answered_requests_do_not_pile_up_behind_their_deadlines() -> None:
    # Long timeouts, answered at once: their deadlines must not keep every answered
    # request alive until they pass.
    waiter, answers = Waiter(), Answers()
    conn, agent = _pair()
    for n in range(3 * COMPACT_AFTER):
        request, _ = _exec(conn, ["true"])
        waiter.watch(conn, request, 3600, answers.done(n))
        _read_request(agent)
        agent.sendall(encode_response(AgentExecResult(0, b"", b"")))
        answers.wait(n + 1)
    assert len(waiter._deadlines) <= 2 * waiter.watched() + COMPACT_AFTER + 1


def test_a_connection_a_waiter_reads_is_never_shared(tmp_path: Path) -> None:
    # Given a sandbox whose agent holds one connection (an agent that queues requests
    # on it, so callers share it), held for a request another thread waits on
    pool = AgentPool(hello_timeout_s=1.0)
    pool.register("sbx", tmp_path)
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    agent.connect(str(tmp_path / AGENT_SOCKET_NAME))
    agent.sendall(encode_hello(Hello(version=2, pid=1)))
    deadline = time.monotonic() + 2
    while not pool.connections("sbx"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    held = pool.hold_idle("sbx")
    assert held is not None
    # When another caller asks for a connection of it, it waits instead of writing its
    # request where the first one's answer is read
    with pytest.raises(AgentUnavailable), pool.using("sbx", 0.3):
        pass
    # Then once it is given back, the next caller gets it
    pool.release("sbx", held)
    with pool.using("sbx", 0.3) as conn:
        assert conn is held
    pool.close()
    agent.close()


def test_work_of_a_round_of_answers_is_handed_over_once_for_the_round() -> None:
    waiter, answers = Waiter(), Answers()
    handed: list[tuple[list[int], str]] = []
    batch = waiter.batch(lambda items: handed.append((items, threading.current_thread().name)))
    pairs = [_pair() for _ in range(50)]
    everyone_answered = threading.Event()

    def done(n: int):
        told = answers.done(n)

        def call(response: Response | None, error: AgentError | None) -> None:
            batch.add(n)
            if n == 0:  # hold the first round until every other agent has answered
                assert everyone_answered.wait(10)
            told(response, error)

        return call

    for n, (conn, agent) in enumerate(pairs):
        request, wait = _exec(conn, ["true"])
        waiter.watch(conn, request, wait, done(n))
        _read_request(agent)
    pairs[0][1].sendall(encode_response(AgentExecResult(0, b"", b"")))
    for _conn, agent in pairs[1:]:
        agent.sendall(encode_response(AgentExecResult(0, b"", b"")))
    everyone_answered.set()
    answers.wait(50)
    deadline = time.monotonic() + 5
    while sum(len(items) for items, _ in handed) < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    # The first answer's round (the others may have come in it), then at most one for
    # those that came meanwhile: each answer handed over once, not one round trip each.
    assert len(handed) <= 2
    assert sorted(n for items, _ in handed for n in items) == list(range(50))
    assert {thread for _, thread in handed} == {"dsec-waiter"}
    # Off the waiter's thread, an item is handed over at once, alone.
    batch.add(99)
    assert handed[-1] == ([99], threading.current_thread().name)
