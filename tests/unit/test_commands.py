"""Commands on a node: fair share between tenants, and kills found by command id."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from workers.commands import Commands, FairQueue, Finish, Running
from workers.tally import NoNodeTally


class _Courier:
    @contextmanager
    def answering(self, request_id: uuid.UUID, reply_key: bytes | None) -> Iterator[None]:
        yield


def test_fair_queue_takes_tenants_in_turn() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        q.push("flood", f"f{i}")
    q.push("quiet", "q0")
    q.push("other", "o0")
    order = []
    while (turn := q.pop()) is not None:
        order.append(turn[1])
    assert order == ["f0", "q0", "o0", "f1", "f2"]


def test_fair_queue_skips_tenants_that_may_not_start() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("full", "a")
    q.push("free", "b")
    assert q.pop(lambda tenant: tenant != "full") == ("free", "b")
    assert q.pop(lambda tenant: tenant != "full") is None
    assert len(q) == 1


class _Gate:
    """Jobs that hold their slot until released, and record the order they began."""

    def __init__(self) -> None:
        self.began: list[str] = []
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)

    def job(self, name: str):  # type: ignore[no-untyped-def]
        def run(_running: Running) -> None:
            with self.changed:
                self.began.append(name)
                self.changed.notify_all()
            self.release.wait(10)

        return run

    def wait_began(self, n: int) -> list[str]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.began) >= n, 10)
            return list(self.began)


def _running(tenant: str) -> Running:
    return Running(uuid.uuid4(), f"sbx-{tenant}", tenant)


def test_a_flooding_tenant_leaves_room_for_another() -> None:
    gate = _Gate()
    commands = Commands(_Courier(), limit=4, per_tenant=2)
    for i in range(6):
        commands.submit(_running("flood"), None, gate.job(f"flood{i}"))
    assert gate.wait_began(2) == ["flood0", "flood1"]
    # The flood holds its share: the other tenant starts at once.
    commands.submit(_running("quiet"), None, gate.job("quiet0"))
    assert "quiet0" in gate.wait_began(3)
    assert commands.in_flight() == 7
    gate.release.set()
    gate.wait_began(7)
    commands.close()


def test_waiting_commands_start_one_tenant_after_the_other() -> None:
    gate = _Gate()
    commands = Commands(_Courier(), limit=1)
    first = threading.Event()

    def hold(_running: Running) -> None:
        first.wait(10)

    commands.submit(_running("a"), None, hold)
    for i in range(3):
        commands.submit(_running("a"), None, gate.job(f"a{i}"))
    for i in range(2):
        commands.submit(_running("b"), None, gate.job(f"b{i}"))
    gate.release.set()
    first.set()
    assert gate.wait_began(5) == ["a0", "b0", "a1", "b1", "a2"]
    commands.close()


def test_a_command_is_found_until_it_ends_and_a_kill_before_it_starts_sticks() -> None:
    commands = Commands(_Courier(), limit=1)
    done = threading.Event()
    ran = _running("t")

    def hold(_running: Running) -> None:
        done.wait(10)

    commands.submit(ran, None, hold)
    waiting = _running("t")
    commands.submit(waiting, None, lambda r: None)
    assert commands.find(waiting.sandbox_id, waiting.request_id) is waiting
    waiting.kill("t:key")
    assert waiting.killed_by == "t:key"
    assert not waiting.attach(object())  # type: ignore[arg-type]
    done.set()
    for _ in range(100):
        if commands.find(waiting.sandbox_id, waiting.request_id) is None:
            break
        threading.Event().wait(0.05)
    assert (
        commands.find(ran.sandbox_id, ran.request_id) is None
        and commands.find(waiting.sandbox_id, waiting.request_id) is None
    )
    commands.close()


class _Counted(NoNodeTally):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def commands(self, in_flight: int, waiting: int) -> None:
        self.seen.append((in_flight, waiting))


def test_the_node_counts_its_commands_through_its_tally() -> None:
    # Given a node's commands with room for one, counted by a tally of the test's own
    gate, tally = _Gate(), _Counted()
    commands = Commands(_Courier(), limit=1, tally=tally)
    # When two are claimed: one runs, one waits its turn
    commands.submit(_running("a"), None, gate.job("a0"))
    commands.submit(_running("a"), None, gate.job("a1"))
    gate.wait_began(1)
    # Then the tally heard of both, and of the one waiting
    assert (2, 1) in tally.seen
    gate.release.set()
    gate.wait_began(2)
    commands.close()


class _Startable:
    """A job started without a thread: its rest is run when the test says so."""

    def __init__(self, name: str, starts: bool, log: list[str]) -> None:
        self.name, self.starts, self.log = name, starts, log
        self.finish: Finish | None = None

    def __call__(self, _running: Running) -> None:
        self.log.append(f"{self.name} on {threading.current_thread().name}")

    def begin(self, _running: Running, finish: Finish) -> bool:
        if self.starts:
            self.finish = finish
            self.log.append(f"{self.name} began")
        return self.starts

    def end(self) -> None:
        assert self.finish is not None
        self.finish(lambda: self.log.append(f"{self.name} ended"))


def test_a_command_started_without_a_thread_holds_its_place_until_it_finishes() -> None:
    # Given room for one command, and a job that starts without a thread
    log: list[str] = []
    commands = Commands(_Courier(), limit=1)
    first = _Startable("first", starts=True, log=log)
    commands.submit(_running("a"), None, first)
    assert log == ["first began"] and commands.in_flight() == 1
    # When another comes, it waits: the first still holds the only place
    second = _Startable("second", starts=True, log=log)
    commands.submit(_running("b"), None, second)
    assert log == ["first began"] and commands.in_flight() == 2
    # Then the first's end runs its rest and lets the second begin
    first.end()
    assert log == ["first began", "first ended", "second began"]
    second.end()
    assert commands.in_flight() == 0
    # And a job that cannot start so runs on a thread of its own, as any job
    commands.submit(_running("a"), None, _Startable("third", starts=False, log=log))
    for _ in range(100):
        if commands.in_flight() == 0:
            break
        threading.Event().wait(0.01)
    assert log[-1].startswith("third on dsec-command")
    commands.close()
