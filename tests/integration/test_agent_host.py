"""dsec-agent run directly on the host (no container) against the real host-side client.

The agent is compiled once per session with ``ensure_agent_dir`` and started per test
as a subprocess connecting to a socket in a short temporary directory. Outside a
container it is not PID 1 but a child subreaper, so orphans and zombies behave alike.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from workers.agent.build import ensure_agent_dir, is_static_elf
from workers.agent.connection import AgentConnection
from workers.agent.errors import AgentBuildError, AgentRefused, AgentUnavailable
from workers.agent.listener import AgentListener
from workers.agent.messages import Output
from workers.agent.pool import IDLE_KEPT, AgentPool

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def agent_bin() -> Iterator[Path]:
    dest = Path(tempfile.mkdtemp(prefix="dsec-agentbin-"))
    # A missing gcc or busybox-static fails here with AgentBuildError naming it.
    ensure_agent_dir(dest)
    yield dest / "dsec-agent"
    shutil.rmtree(dest, ignore_errors=True)


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    listener: AgentListener
    conn: AgentConnection
    work: Path


def _start_agent(agent_bin: Path, socket_path: Path, home: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(agent_bin), str(socket_path)],
        env={"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"},
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def run_dir() -> Iterator[Path]:
    # Short path: AF_UNIX socket paths are limited to 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="dsec-run-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def agent(agent_bin: Path, run_dir: Path, tmp_path: Path) -> Iterator[Agent]:
    listener = AgentListener(run_dir)
    proc = _start_agent(agent_bin, listener.path, tmp_path)
    try:
        conn = listener.accept(timeout_s=5)
        yield Agent(proc, listener, conn, tmp_path)
        conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=5)
        listener.close()


def _sh(agent: Agent, script: str, timeout_s: float | None = None) -> tuple[int, bytes, bytes]:
    result = agent.conn.exec(["sh", "-c", script], cwd=str(agent.work), timeout_s=timeout_s)
    return result.exit_code, result.stdout, result.stderr


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


# ------------------------------------------------------------------ exec


def test_hello_and_ping(agent: Agent) -> None:
    assert agent.conn.hello.pid == agent.proc.pid
    assert agent.conn.peer_pid == agent.proc.pid
    agent.conn.ping()


def test_echo_stdout_and_exit_zero(agent: Agent) -> None:
    result = agent.conn.exec(["echo", "hi"], cwd=str(agent.work))
    assert (result.exit_code, result.stdout, result.stderr) == (0, b"hi\n", b"")
    assert not (result.timed_out or result.stdout_truncated or result.stderr_truncated)
    assert 0 < result.duration_s < 1


def test_streaming_exec_sends_output_while_the_command_runs(agent: Agent) -> None:
    got: list[tuple[float, Output]] = []
    started = time.monotonic()
    result = agent.conn.exec(
        ["sh", "-c", "echo one; sleep 0.5; echo two >&2; sleep 0.5; echo three"],
        cwd=str(agent.work),
        on_output=lambda out: got.append((time.monotonic() - started, out)),
    )
    assert agent.conn.hello.version == 3
    assert [out for _, out in got] == [
        Output(1, b"one\n"),
        Output(2, b"two\n"),
        Output(1, b"three\n"),
    ]
    # "one" came long before the end (its linger is 50 ms, the command runs 1 s).
    assert got[0][0] < result.duration_s - 0.4
    assert (result.stdout, result.stderr) == (b"one\nthree\n", b"two\n")


def test_streamed_chunks_add_up_to_a_large_output(agent: Agent) -> None:
    pieces: list[Output] = []
    result = agent.conn.exec(
        ["sh", "-c", "head -c 3000000 /dev/urandom | od -An -v"],
        cwd=str(agent.work),
        max_output=1 << 22,
        on_output=pieces.append,
    )
    assert b"".join(p.data for p in pieces if p.stream == 1) == result.stdout
    assert len(result.stdout) > 3_000_000 and len(pieces) > 10


def test_stderr_is_separate_and_exit_code_kept(agent: Agent) -> None:
    assert _sh(agent, "echo out; echo err >&2; exit 3") == (3, b"out\n", b"err\n")


def test_killed_by_signal_is_negative(agent: Agent) -> None:
    assert _sh(agent, "kill -TERM $$")[0] == -signal.SIGTERM


def test_env_overrides_and_cwd_is_honoured(agent: Agent) -> None:
    sub = agent.work / "sub"
    sub.mkdir()
    result = agent.conn.exec(
        ["sh", "-c", 'echo "$FOO|$HOME|$LANG"; pwd'], env={"FOO": "bar baz"}, cwd=str(sub)
    )
    # FOO is added, HOME and LANG come from the agent's own (the container's) environment
    assert result.stdout == f"bar baz|{agent.work}|C.UTF-8\n{sub}\n".encode()
    # The inherited PATH gains /.dsec/bin (static busybox); an explicit PATH is kept as is
    assert _sh(agent, "echo $PATH")[1] == b"/usr/bin:/bin:/.dsec/bin\n"
    explicit = agent.conn.exec(
        ["/bin/sh", "-c", "echo $PATH"], env={"PATH": "/bin"}, cwd=str(agent.work)
    )
    assert explicit.stdout == b"/bin\n"


def test_missing_program_and_missing_cwd_exit_like_a_shell(agent: Agent) -> None:
    missing = agent.conn.exec(["no-such-program-dsec"], cwd=str(agent.work))
    assert missing.exit_code == 127
    assert b"no-such-program-dsec" in missing.stderr
    bad_cwd = agent.conn.exec(["true"], cwd="/no/such/dir")
    assert bad_cwd.exit_code == 126
    assert b"/no/such/dir" in bad_cwd.stderr


def test_stdin_is_fed_and_closed(agent: Agent) -> None:
    data = os.urandom(3 << 20)  # larger than a pipe buffer in both directions
    result = agent.conn.exec(["cat"], cwd=str(agent.work), stdin=data, max_output=4 << 20)
    assert result.stdout == data
    # Empty stdin reads as EOF at once
    assert agent.conn.exec(["cat"], cwd=str(agent.work), timeout_s=5).stdout == b""


def test_timeout_kills_the_command_not_the_agent(agent: Agent) -> None:
    started = time.monotonic()
    result = agent.conn.exec(["sleep", "30"], cwd=str(agent.work), timeout_s=0.5)
    elapsed = time.monotonic() - started
    assert result.timed_out
    assert result.exit_code == -signal.SIGKILL
    assert 0.5 <= elapsed < 1.5
    assert _sh(agent, "echo still here") == (0, b"still here\n", b"")


def test_timeout_kills_the_whole_process_group(agent: Agent) -> None:
    marker = agent.work / "grandchild.pid"
    result = agent.conn.exec(
        ["sh", "-c", f"sleep 30 & echo $! > {marker}; wait"], cwd=str(agent.work), timeout_s=0.3
    )
    assert result.timed_out
    grandchild = int(marker.read_text())
    time.sleep(0.2)  # the agent reaps it on SIGCHLD
    with pytest.raises(ProcessLookupError):
        os.kill(grandchild, 0)


def test_background_child_holding_the_pipes_does_not_hang(agent: Agent) -> None:
    # Given a command whose background child keeps stdout/stderr open
    started = time.monotonic()
    code, out, _ = _sh(agent, "sleep 100 & echo $!", timeout_s=10)
    elapsed = time.monotonic() - started
    # Then the result arrives shortly after the shell exits, not after the timeout
    assert code == 0
    assert elapsed < 1.0
    background = int(out)
    try:
        os.kill(background, 0)  # left running, as a shell would
    finally:
        os.kill(background, signal.SIGKILL)


def test_output_cap_sets_truncated_and_drains(agent: Agent) -> None:
    result = agent.conn.exec(
        ["sh", "-c", "yes | head -c 5000000; yes err | head -c 100 >&2"],
        cwd=str(agent.work),
        max_output=1 << 20,
        timeout_s=10,
    )
    assert result.exit_code == 0
    assert not result.timed_out
    assert len(result.stdout) == 1 << 20
    assert result.stdout[:4] == b"y\ny\n"
    assert result.stdout_truncated
    assert (len(result.stderr), result.stderr_truncated) == (100, False)


def test_orphans_are_reaped(agent: Agent) -> None:
    # Given commands that leave short-lived orphans behind
    for _ in range(5):
        _sh(agent, "(sleep 0.05 &) ; true")
    time.sleep(0.5)
    # Then none of them lingers as a zombie child of the agent
    zombies = []
    for child in _children(agent.proc.pid):
        with open(f"/proc/{child}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                zombies.append(child)
    assert zombies == []


def test_closing_the_connection_cancels_the_command_and_agent_reconnects(agent: Agent) -> None:
    marker = agent.work / "victim.pid"

    def close_soon() -> None:
        deadline = time.monotonic() + 5
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        agent.conn.close()

    closer = threading.Thread(target=close_soon)
    closer.start()
    with pytest.raises(AgentUnavailable):
        _sh(agent, f"echo $$ > {marker}.tmp; mv {marker}.tmp {marker}; exec sleep 30")
    closer.join()
    victim = int(marker.read_text())
    conn = agent.listener.accept(timeout_s=5)
    time.sleep(0.1)
    with pytest.raises(ProcessLookupError):
        os.kill(victim, 0)
    assert conn.exec(["echo", "back"], cwd=str(agent.work)).stdout == b"back\n"
    conn.close()


def test_agent_reconnects_after_host_closes(agent: Agent) -> None:
    agent.conn.close()
    with pytest.raises(AgentUnavailable):
        agent.conn.ping()
    conn = agent.listener.accept(timeout_s=5)
    assert conn.hello.pid == agent.proc.pid
    conn.ping()
    conn.close()


def test_agent_waits_for_a_listener_and_exits_on_sigterm(
    agent_bin: Path, run_dir: Path, tmp_path: Path
) -> None:
    # Given an agent started before anyone listens
    proc = _start_agent(agent_bin, run_dir / "agent.sock", tmp_path)
    try:
        time.sleep(0.3)
        # When the host starts listening, the agent connects within its retry interval
        listener = AgentListener(run_dir)
        conn = listener.accept(timeout_s=2)
        conn.ping()
        # And SIGTERM makes it exit cleanly
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=2) == 0
        conn.close()
        listener.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_unread_stdin_does_not_block(agent: Agent) -> None:
    result = agent.conn.exec(["true"], cwd=str(agent.work), stdin=bytes(8 << 20), timeout_s=5)
    assert (result.exit_code, result.timed_out) == (0, False)


def _recv_frame(sock: socket.socket) -> bytes:
    def exact(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "agent closed the connection"
            data += chunk
        return data

    return exact(int.from_bytes(exact(4), "big"))


def test_malformed_unknown_and_oversized_frames(
    agent_bin: Path, run_dir: Path, tmp_path: Path
) -> None:
    # Given a raw listener (no client library) and an agent connected to it
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(run_dir / "raw.sock"))
        server.listen(1)
        server.settimeout(5)
        proc = _start_agent(agent_bin, run_dir / "raw.sock", tmp_path)
        try:
            sock, _ = server.accept()
            sock.settimeout(5)
            assert _recv_frame(sock)[:5] == bytes.fromhex("1000000003")  # HELLO, version 3
            # Malformed EXEC and unknown op: an error reply, the connection stays usable
            sock.sendall(bytes.fromhex("0000000502ffffffff"))
            assert _recv_frame(sock)[0] == 1
            sock.sendall(bytes.fromhex("000000017f"))
            reply = _recv_frame(sock)
            assert reply[0] == 1 and b"unknown op" in reply
            sock.sendall(bytes.fromhex("0000000101"))
            assert _recv_frame(sock) == b"\x00"
            # An oversized frame: an error reply, then the agent hangs up and reconnects
            sock.sendall((64 << 20 | 1).to_bytes(4, "big"))
            reply = _recv_frame(sock)
            assert reply[0] == 1 and b"refused" in reply
            assert sock.recv(1) == b""
            sock.close()
            again, _ = server.accept()
            again.settimeout(5)
            assert _recv_frame(again)[0] == 0x10
            again.close()
        finally:
            proc.terminate()
            proc.wait(timeout=5)


# ------------------------------------------------------------ file ops


def test_binary_write_and_read_roundtrip(agent: Agent) -> None:
    data = bytes(range(256)) * 1000
    path = agent.work / "deep" / "er" / "blob.bin"
    assert agent.conn.write_file(str(path), data, mode=0o600) == len(data)
    assert path.read_bytes() == data
    assert path.stat().st_mode & 0o7777 == 0o600
    assert agent.conn.read_file(str(path), 1 << 20) == (data, False)
    assert agent.conn.read_file(str(path), 1000) == (data[:1000], True)
    assert agent.conn.read_file(str(path), len(data)) == (data, False)
    # Overwriting truncates
    assert agent.conn.write_file(str(path), b"short") == 5
    assert agent.conn.read_file(str(path), 100) == (b"short", False)


def test_empty_file_and_missing_file(agent: Agent) -> None:
    path = agent.work / "empty"
    assert agent.conn.write_file(str(path), b"") == 0
    assert agent.conn.read_file(str(path), 10) == (b"", False)
    with pytest.raises(AgentRefused) as info:
        agent.conn.read_file(str(agent.work / "missing"), 10)
    assert info.value.errno == errno.ENOENT
    agent.conn.ping()  # a refusal leaves the connection usable


@pytest.mark.parametrize("path", ["relative/file", "/tmp/../etc/passwd", "/tmp/x/..", "/tmp/"])
def test_relative_dotdot_and_directory_paths_are_refused(agent: Agent, path: str) -> None:
    with pytest.raises(AgentRefused, match="refused"):
        agent.conn.write_file(path, b"x")
    with pytest.raises(AgentRefused, match="refused"):
        agent.conn.read_file(path, 10)


def test_symlinks_are_never_followed(agent: Agent) -> None:
    target = agent.work / "target"
    target.write_bytes(b"original")
    link = agent.work / "link"
    link.symlink_to(target)
    linked_dir = agent.work / "linkdir"
    linked_dir.symlink_to(agent.work)
    # Final component is a symlink
    with pytest.raises(AgentRefused, match="symlink"):
        agent.conn.write_file(str(link), b"evil")
    with pytest.raises(AgentRefused, match="symlink"):
        agent.conn.read_file(str(link), 100)
    # A directory on the way is a symlink
    with pytest.raises(AgentRefused, match="symlink"):
        agent.conn.write_file(str(linked_dir / "target"), b"evil")
    with pytest.raises(AgentRefused, match="symlink"):
        agent.conn.read_file(str(linked_dir / "target"), 100)
    assert target.read_bytes() == b"original"


def test_fifo_is_refused_without_blocking(agent: Agent) -> None:
    fifo = agent.work / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(AgentRefused):
        agent.conn.read_file(str(fifo), 10)
    with pytest.raises(AgentRefused):
        agent.conn.write_file(str(fifo), b"x")


# ------------------------------------------------------------------ pool


def test_pool_waits_for_reconnect_and_serialises_threads(
    agent_bin: Path, run_dir: Path, tmp_path: Path
) -> None:
    with AgentPool() as pool:
        pool.register("sbx-1", run_dir)
        proc = _start_agent(agent_bin, run_dir / "agent.sock", tmp_path)
        try:
            conn = pool.connection("sbx-1", wait_s=5)
            assert conn.exec(["echo", "pooled"], cwd=str(tmp_path)).stdout == b"pooled\n"

            # When the connection breaks, connection() waits for the agent to come back
            conn.close()
            again = pool.connection("sbx-1", wait_s=5)
            assert again is not conn
            again.ping()

            # Many threads on one sandbox: requests are serialised, none is lost or mixed
            results: list[bytes] = []
            lock = threading.Lock()

            def work(i: int) -> None:
                for j in range(10):
                    out = pool.connection("sbx-1", wait_s=5).exec(
                        ["echo", f"{i}-{j}"], cwd=str(tmp_path)
                    )
                    with lock:
                        results.append(out.stdout)

            threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert sorted(results) == sorted(
                f"{i}-{j}\n".encode() for i in range(8) for j in range(10)
            )

            pool.unregister("sbx-1")
            assert not (run_dir / "agent.sock").exists()
            with pytest.raises(AgentUnavailable):
                pool.connection("sbx-1", wait_s=0.1)
        finally:
            proc.terminate()
            proc.wait(timeout=5)


def test_pool_runs_requests_of_one_sandbox_at_once(
    agent_bin: Path, run_dir: Path, tmp_path: Path
) -> None:
    # A reader that blocks until a second command writes: it can only end if the two
    # run at once, each on a connection (and in a handler process) of its own.
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with AgentPool() as pool:
        pool.register("sbx-3", run_dir)
        proc = _start_agent(agent_bin, run_dir / "agent.sock", tmp_path)
        try:
            got: list[bytes] = []

            def read() -> None:
                with pool.using("sbx-3", wait_s=5) as conn:
                    got.append(
                        conn.exec(["cat", str(fifo)], cwd=str(tmp_path), timeout_s=20).stdout
                    )

            reader = threading.Thread(target=read)
            reader.start()
            with pool.using("sbx-3", wait_s=5) as conn:
                writer = conn.exec(
                    ["sh", "-c", f"echo hello > {fifo}"], cwd=str(tmp_path), timeout_s=20
                )
            reader.join(timeout=30)
            assert writer.exit_code == 0 and got == [b"hello\n"]

            # Many at once: each request waits for its own, not behind the others.
            many = 20
            barrier_dir = tmp_path / "barrier"
            barrier_dir.mkdir()
            script = (
                f"touch {barrier_dir}/$0; "
                f"while [ $(ls {barrier_dir} | wc -l) -lt {many} ]; do sleep 0.02; done"
            )
            codes: list[int] = []

            def member(i: int) -> None:
                with pool.using("sbx-3", wait_s=10) as conn:
                    result = conn.exec(
                        ["sh", "-c", script, str(i)], cwd=str(tmp_path), timeout_s=30
                    )
                    codes.append(0 if result.ok else result.exit_code)

            threads = [threading.Thread(target=member, args=(i,)) for i in range(many)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            assert codes == [0] * many
            # After the burst the host keeps a few idle connections, not one per command.
            assert pool.connections("sbx-3") <= IDLE_KEPT + 1
        finally:
            proc.terminate()
            proc.wait(timeout=5)


def test_a_killed_handler_fails_its_request_only(agent: Agent) -> None:
    # The code in a sandbox may kill the process serving a request (same uid): that
    # request fails, the agent and its other connections carry on.
    marker = agent.work / "handler.pid"

    def kill_handler() -> None:
        deadline = time.monotonic() + 5
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(int(marker.read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_handler)
    killer.start()
    with pytest.raises(AgentUnavailable):
        _sh(agent, f"echo $PPID > {marker}.tmp; mv {marker}.tmp {marker}; exec sleep 30")
    killer.join()
    assert agent.proc.poll() is None
    conn = agent.listener.accept(timeout_s=5)  # the spare it opened meanwhile
    assert conn.exec(["echo", "still here"], cwd=str(agent.work)).stdout == b"still here\n"
    conn.close()


def test_signal_all_is_refused_outside_a_sandbox(agent: Agent) -> None:
    # Outside a pid namespace, kill(-1) would reach every process of the user.
    with pytest.raises(AgentRefused) as refused:
        agent.conn.signal_all(signal.SIGSTOP)
    assert refused.value.errno == errno.EPERM
    agent.conn.ping()


def test_pool_times_out_without_agent_and_drops_bad_handshakes(run_dir: Path) -> None:
    with AgentPool(hello_timeout_s=0.2) as pool:
        path = pool.register("sbx-2", run_dir)
        # A peer that sends garbage instead of HELLO is dropped, not handed out
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as rogue:
            rogue.connect(str(path))
            rogue.sendall(b"\x00\x00\x00\x09\x10\x00\x00\x00\x63\x00\x00\x00\x01")
            with pytest.raises(AgentUnavailable):
                pool.connection("sbx-2", wait_s=0.3)
        assert not pool.is_connected("sbx-2")


# ------------------------------------------------------- build + benchmark


def test_agent_dir_contents(agent_bin: Path) -> None:
    busybox = agent_bin.parent / "busybox"
    for binary in (agent_bin, busybox):
        st = binary.stat()
        assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o755)
        assert is_static_elf(binary)
    assert not is_static_elf(Path(shutil.which("python3") or "/usr/bin/python3"))
    # Up to date: a second call does not rebuild
    before = agent_bin.stat().st_mtime_ns
    ensure_agent_dir(agent_bin.parent)
    assert agent_bin.stat().st_mtime_ns == before


def test_agent_dir_errors_name_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(AgentBuildError, match="not found: install gcc"):
        ensure_agent_dir(tmp_path / "a", cc="no-such-cc-dsec")
    with pytest.raises(AgentBuildError, match="busybox-static"):
        ensure_agent_dir(tmp_path / "b", busybox=tmp_path / "no-busybox")
    with pytest.raises(AgentBuildError, match="dynamically linked"):
        ensure_agent_dir(tmp_path / "c", busybox=Path(sys.executable).resolve())


def test_round_trip_latency(agent: Agent) -> None:
    for _ in range(20):  # warm up
        agent.conn.exec(["true"], cwd=str(agent.work))
    samples = []
    for _ in range(200):
        started = time.perf_counter()
        agent.conn.exec(["true"], cwd=str(agent.work))
        samples.append(time.perf_counter() - started)
    samples.sort()
    p50, p99 = statistics.median(samples), samples[int(len(samples) * 0.99) - 1]
    print(f"\nagent exec `true` round trip: p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms")
    assert p50 < 0.010  # generous: ~1 ms expected on the CI machines
