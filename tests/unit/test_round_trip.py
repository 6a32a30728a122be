"""A trainer's requests go all the way round in one process (issue 27): the real SDK
client signs them and checks the proofs of its replies, the real dispatcher admits,
places and routes them, the real node carries them out through the agent's wire
protocol, on the in-memory bus, task queue, driver and claims (tests/unit/in_process.py).
New behaviour gets its first test here."""

from __future__ import annotations

import base64
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from app.domain.base import RejectReason, StopReason
from app.domain.codec import decode_event
from app.domain.egress import NetworkPolicy
from app.domain.events import SandboxStarted, SandboxStopped
from app.domain.replies import ErrorReply, ExecOutput
from app.errors import SandboxFailedError, SandboxNotFound, SandboxRejectedError
from app.sdk import Client, Sandbox
from app.sdk.results import exec_request
from tests.unit.in_process import HOST_CPUS, NODE, PARTITIONS, Platform
from workers import runtime
from workers.agent.double import scripted
from workers.agent.messages import ExecRequest
from workers.containers.port import SandboxContainer
from workers.upkeep import held, reconcile


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch) -> Iterator[Platform]:
    # Short: the agents' sockets live under it, and AF_UNIX takes 107 bytes at most.
    with tempfile.TemporaryDirectory(prefix="rt-") as state_dir:
        yield from _platform(Path(state_dir), monkeypatch)


def _platform(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Platform]:
    built = Platform(state_dir)
    # The node's tasks find their node through the worker's runtime (one per process).
    monkeypatch.setattr(runtime, "_node", built.node)
    built.beat()
    built.settle()
    started = time.monotonic()
    yield built
    built.close()
    # Well under a second each: what the round trip costs is the code, not waiting.
    assert time.monotonic() - started < 1.0


def _events(platform: Platform) -> list[object]:
    topic = platform.settings.topic_events
    return [decode_event(r.value or b"") for r in platform.bus.read(topic, 0, 0, wait_s=0)]


def _create(platform: Platform) -> Sandbox:
    return platform.run(platform.client().create_many_steps(1))[0]


def test_a_create_comes_back_ready_on_the_node_that_started_it(platform: Platform) -> None:
    sandbox = _create(platform)

    assert sandbox.node_id == NODE
    container = platform.driver.get(sandbox.id)
    assert container is not None and container.running
    started = [e for e in _events(platform) if isinstance(e, SandboxStarted)]
    assert [e.sandbox_id for e in started] == [sandbox.id]
    # The agent's double was reached through the node's real socket: the create pinged it.
    assert any(sid == sandbox.id for sid, _ in platform.agent.served)


def test_an_exec_answers_its_output_and_exit_code(platform: Platform) -> None:
    sandbox = _create(platform)

    result = platform.run(sandbox.exec_steps("echo hello round trip; exit 3"))

    assert result.exit_code == 3
    assert result.stdout == b"hello round trip\n"
    assert not result.ok
    ran = [r for sid, r in platform.agent.served if isinstance(r, ExecRequest)]
    assert [r.argv for r in ran] == [("/bin/sh", "-c", "echo hello round trip; exit 3")]


def test_a_command_goes_straight_to_the_node_unless_the_platform_keeps_it_routed(
    platform: Platform,
) -> None:
    # Given a sandbox its tenant created: its ready reply says the node takes its
    # commands straight (the direct route)
    sandbox = _create(platform)
    assert sandbox.direct
    requests, partitions = platform.settings.topic_requests, range(PARTITIONS.requests_topic)
    asked = sum(len(platform.bus.read(requests, p, 0, wait_s=0)) for p in partitions)
    # When it runs a command, Then the command never reaches the scheduler's topic
    assert platform.run(sandbox.exec_steps("echo direct")).stdout == b"direct\n"
    assert sum(len(platform.bus.read(requests, p, 0, wait_s=0)) for p in partitions) == asked
    # And with the route off, a new sandbox's commands go through the scheduler
    platform.settings.direct_exec = False
    routed = _create(platform)
    assert not routed.direct
    assert platform.run(routed.exec_steps("echo routed")).stdout == b"routed\n"


def test_a_direct_command_to_a_lost_nodes_sandbox_is_answered_by_the_scheduler(
    platform: Platform,
) -> None:
    # Given a sandbox whose node was declared lost (its life ended so)
    sandbox = _create(platform)
    platform.dispatcher.note_ended(sandbox.id, StopReason.NODE_LOST.value, "t")
    # When its trainer sends it a command straight, which only the scheduler reads now
    client = sandbox.client
    assert isinstance(client, Client)
    future = client.send(
        exec_request(client.request_fields(sandbox.id), "true", timeout_s=10), node=NODE
    )
    assert platform.node_lost() == 1
    # Then the trainer is told, under the sandbox's key, that its sandbox ended
    reply = future.result(timeout=2)
    assert isinstance(reply, ErrorReply) and reply.reason == "sandbox_not_running"
    assert "node_lost" in reply.detail
    # while a copy of the command under another tenant's key is answered by nobody
    other = platform.client("u")
    forged = other.send(
        exec_request(other.request_fields(sandbox.id), "true", timeout_s=10), node=NODE
    )
    assert platform.node_lost() == 1
    time.sleep(0.2)
    assert not forged.done()


def test_a_sandbox_no_node_can_hold_is_refused_with_its_reason(platform: Platform) -> None:
    client = platform.client()

    with pytest.raises(SandboxRejectedError) as refused:
        platform.run(client.create_many_steps(1, cpus=HOST_CPUS * 4))

    assert refused.value.reason == RejectReason.INVALID
    assert "16 CPU" in str(refused.value)
    assert platform.driver.list_sandboxes() == []


def test_another_tenants_sandbox_is_not_found(platform: Platform) -> None:
    mine = _create(platform)
    theirs = platform.client("u").sandbox(mine.id)

    with pytest.raises(SandboxNotFound):
        platform.run(theirs.exec_steps("echo not yours"))

    assert not any(isinstance(r, ExecRequest) for _, r in platform.agent.served)


def test_a_destroyed_sandbox_ends_and_is_gone(platform: Platform) -> None:
    sandbox = _create(platform)

    platform.run(sandbox.close_steps())
    platform.settle()

    assert platform.driver.get(sandbox.id) is None
    assert not platform.agents.is_registered(sandbox.id)
    stopped = [e for e in _events(platform) if isinstance(e, SandboxStopped)]
    assert [(e.sandbox_id, e.payload.reason) for e in stopped] == [
        (sandbox.id, StopReason.DESTROYED)
    ]
    # The scheduler followed the end: the sandbox is no one's to act on any more.
    with pytest.raises(SandboxRejectedError):
        platform.run(platform.client().sandbox(sandbox.id).exec_steps("echo late"))


def test_a_node_that_cannot_fence_egress_refuses_network_and_still_serves_the_rest(
    platform: Platform,
) -> None:
    # Given a node whose fence between sandboxes and its own addresses did not hold
    platform.node.egress_unfenced = "no iptables"
    client = platform.client()
    # When a trainer asks for a sandbox with network, it is refused, saying why
    with pytest.raises(SandboxFailedError) as refused:
        platform.run(client.create_many_steps(1, network=True))
    assert refused.value.reason == "refused"
    assert "no iptables" in str(refused.value) and "rather than unfenced" in str(refused.value)
    # Then sandboxes without network are still made there
    [sandbox] = platform.run(client.create_many_steps(1))
    assert sandbox.node_id == NODE


def test_a_node_that_cannot_enforce_allowlists_refuses_them(platform: Platform) -> None:
    # Given a node without nftables (the in-memory node has no fence at all)
    platform.node.egress, platform.node.egress_unenforced = None, "no nft"
    client = platform.client()
    # When a trainer asks for a sandbox with an allowlist, it is refused, saying why
    with pytest.raises(SandboxFailedError) as refused:
        platform.run(
            client.create_many_steps(1, network=NetworkPolicy(allow=["mirror.internal:443"]))
        )
    assert refused.value.reason == "refused"
    assert "no nft" in str(refused.value) and "rather than unfenced" in str(refused.value)


def test_a_sandbox_destroyed_while_the_reconciler_lists_stays_ended(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a running sandbox, and a reconciler round whose listing (slow while Podman
    # removes thousands of containers) was taken before the sandbox's destroy ended
    client = platform.client()
    sandbox = _create(platform)
    listed = platform.driver.list_sandboxes

    def slow_listing() -> list[SandboxContainer]:
        listing = listed()
        platform.run(client.destroy_steps(sandbox.id))
        return listing

    monkeypatch.setattr(platform.driver, "list_sandboxes", slow_listing)
    # When the round goes through that listing
    assert reconcile(platform.node) == []
    # Then the sandbox gets no listener back, heartbeats leave it out (the scheduler
    # would take it for an orphan), and its life ends once in the log
    assert not platform.node.agents.is_registered(sandbox.id)
    assert held(platform.node) == []
    platform.settle()
    ends = [e for e in _events(platform) if isinstance(e, SandboxStopped)]
    assert [e.sandbox_id for e in ends] == [sandbox.id]


def test_commands_wait_for_their_agents_without_a_thread_each(platform: Platform) -> None:
    # Given sandboxes whose agents hold every command until told to answer
    sandboxes = [_create(platform) for _ in range(4)]
    release = threading.Event()
    platform.agent.run = lambda request: (release.wait(2), scripted(request))[1]
    client = sandboxes[0].client
    assert isinstance(client, Client)
    # When a command is sent to each at once
    futures = [
        client.send(exec_request(client.request_fields(s.id), f"echo {n}", timeout_s=10), node=NODE)
        for n, s in enumerate(sandboxes)
    ]
    platform.pump_until(
        lambda: platform.node.waiter.watched() >= len(sandboxes),
        "the commands were not all started",
        within_s=0.5,
    )
    # Then all of them are in flight, and no thread waits on any of them: the node's
    # one waiter does
    assert platform.node.commands.in_flight() == len(sandboxes)
    assert not [t for t in threading.enumerate() if t.name.startswith("dsec-command")]
    # And each is answered with what its own agent said once the agents answer
    release.set()
    platform.pump_until(
        lambda: all(future.done() for future in futures),
        "the commands were not all answered",
        within_s=0.5,
    )
    for n, future in enumerate(futures):
        reply = future.result(timeout=0)
        assert isinstance(reply, ExecOutput) and reply.exit_code == 0
        assert base64.b64decode(reply.stdout_b64) == f"{n}\n".encode()


def test_a_command_the_oom_killer_ended_is_answered_before_its_sandbox_stops(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a command in flight in a sandbox whose agent holds it until told to answer
    sandbox = _create(platform)
    release = threading.Event()
    platform.agent.run = lambda request: (release.wait(2), scripted(request))[1]
    client = sandbox.client
    assert isinstance(client, Client)
    future = client.send(
        exec_request(client.request_fields(sandbox.id), "true", timeout_s=10), node=NODE
    )
    platform.pump_until(
        lambda: platform.node.commands.in_flight() >= 1, "the command did not start", within_s=0.5
    )
    # When the reconciler lists the sandbox as hit by the OOM killer (its cgroup counts
    # the kill before the command's answer is read)
    listed = platform.driver.list_sandboxes
    monkeypatch.setattr(
        platform.driver,
        "list_sandboxes",
        lambda: [replace(box, oom_killed=True) for box in listed()],
    )
    # Then its round leaves the sandbox to the command: still running and listed
    assert reconcile(platform.node) == [sandbox.id]
    assert platform.driver.get(sandbox.id) is not None
    # And the command is answered with its own result
    release.set()
    platform.pump_until(future.done, "the command was not answered", within_s=0.5)
    assert isinstance(future.result(timeout=0), ExecOutput)
    # And once nothing runs there, the next round ends the sandbox with reason oom
    assert reconcile(platform.node) == []
    platform.settle()
    ends = [e for e in _events(platform) if isinstance(e, SandboxStopped)]
    assert [(e.sandbox_id, e.payload.reason) for e in ends] == [(sandbox.id, StopReason.OOM)]
