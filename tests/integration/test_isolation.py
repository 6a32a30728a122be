"""Isolation by default, each property attacked from inside a sandbox through the SDK.

What the sandbox cannot do is checked where it matters: a listener on the host that
must accept nothing, the uid of the sandbox's processes as the host sees them, the
host file systems its mount table exposes.
"""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.config import Settings
from app.errors import SandboxFailedError
from workers.containers.limits import CgroupLimiter
from workers.host.user import NodeUser, find_node_user

pytestmark = pytest.mark.integration

#: File systems that hold no host files of their own (fresh instances per sandbox, or
#: the sandbox's image).
VIRTUAL = {"proc", "sysfs", "tmpfs", "devpts", "mqueue", "cgroup", "cgroup2", "overlay"}
#: Device nodes Podman binds from the host's devtmpfs (and /dev/null over masked files).
DEVICES = {"/null", "/zero", "/full", "/tty", "/random", "/urandom"}


@pytest.fixture(scope="module")
def box(client: Any) -> Iterator[Any]:
    """One default sandbox for the probes that change nothing."""
    with client.create() as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def node_user(stack: Settings) -> NodeUser:
    user = find_node_user(stack.node_id, stack)
    if user is None:
        pytest.fail(f"node user of {stack.node_id} does not exist", pytrace=False)
    return user


@pytest.fixture
def listeners() -> Iterator[dict[str, socket.socket]]:
    """TCP listeners on the host's loopback and on its first non-loopback address."""
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True
    ).stdout
    found = re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
    if not found:
        pytest.fail("the host has no non-loopback IPv4 address to test against", pytrace=False)
    socks = {}
    for addr in ("127.0.0.1", found[0]):
        s = socket.socket()
        s.bind((addr, 0))
        s.listen(8)
        s.setblocking(False)
        socks[addr] = s
    yield socks
    for s in socks.values():
        s.close()


def _accepted(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def _dial_all(box: Any, targets: dict[str, int]) -> dict[str, int]:
    """Exit status of ``nc`` to each (address, port) from inside ``box``."""
    script = "; ".join(
        f"echo x | nc -w 2 {addr} {port} >/dev/null 2>&1; echo {addr}=$?"
        for addr, port in targets.items()
    )
    out = box.exec(script, timeout_s=20).text
    return {k: int(v) for k, v in re.findall(r"^(\S+)=(\d+)$", out, re.M)}


def test_no_network_reaches_the_host(box: Any, listeners: dict[str, socket.socket]) -> None:
    # Given listeners on the host's loopback and on its non-loopback address
    targets = {addr: s.getsockname()[1] for addr, s in listeners.items()}
    # When the sandbox dials both
    status = _dial_all(box, targets)
    # Then both fail inside, and nothing arrived on the host
    assert status and all(code != 0 for code in status.values()), status
    assert not any(_accepted(s) for s in listeners.values())
    # And the only interface is loopback
    assert box.exec("ls /sys/class/net").text.split() == ["lo"]


def test_all_capabilities_are_dropped_and_no_new_privileges(box: Any) -> None:
    status = dict(
        line.split(":\t", 1) for line in box.exec("cat /proc/self/status").text.splitlines()
    )
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert status[cap] == "0000000000000000", cap
    assert status["NoNewPrivs"] == "1"
    # What root could do with capabilities fails
    for attempt in ("mount -t tmpfs none /tmp", "chroot / true", "mknod /tmp/sda b 8 0"):
        assert box.exec(attempt).exit_code != 0, attempt


def test_root_is_read_only_and_scratch_is_writable(box: Any) -> None:
    for attempt in ("touch /etc/x", "touch /x", "mkdir /usr/x", "mount -o remount,rw /"):
        result = box.exec(attempt)
        assert result.exit_code != 0, attempt
    assert b"Read-only file system" in box.exec("touch /x").stderr
    with pytest.raises(SandboxFailedError):
        box.write_file("/etc/x", b"no")
    ok = box.exec("echo a > /workspace/a && echo b > /tmp/b && cat /workspace/a /tmp/b")
    assert ok.stdout == b"a\nb\n"


def test_processes_run_as_the_unprivileged_node_user(
    box: Any, limiter: CgroupLimiter, node_user: NodeUser
) -> None:
    # Given the agent (PID 1) and a command it started that keeps running
    box.exec("sleep 30 >/dev/null 2>&1 &")
    pids = limiter.pids(box.id)
    assert len(pids) >= 2, pids
    subuids = [range(start, start + count) for start, count in node_user.subuids]
    for pid in pids:
        status = Path(f"/proc/{pid}/status").read_text()
        uids = {int(u) for u in re.findall(r"^Uid:\s+(.*)$", status, re.M)[0].split()}
        # Then, seen from the host, every one runs as the node user (the sandbox's
        # root) or one of its subordinate ids, never as root
        assert 0 not in uids
        assert all(u == node_user.uid or any(u in r for r in subuids) for u in uids), uids
        assert re.search(r"^CapEff:\s+0+$", status, re.M)


def _mounts(box: Any) -> list[tuple[str, str, str]]:
    """(root within its file system, mount point, file system type) of each mount."""
    rows = []
    for line in box.exec("cat /proc/1/mountinfo").text.splitlines():
        fields = line.split(" ")
        sep = fields.index("-", 6)
        rows.append((fields[3], fields[4], fields[sep + 1]))
    return rows


def test_no_host_files_are_visible(box: Any, stack: Settings) -> None:
    run_dir = stack.state_dir / "nodes" / stack.node_id / "sandboxes" / box.id
    # The agent's directory, its resolver file (read-only, the same for all) and the run dir
    agent = stack.state_dir / "agent"
    allowed = (str(agent), str(agent / "resolv.conf"), str(run_dir))
    podman_files = ("/userdata/hosts", "/userdata/hostname", "/userdata/.containerenv")
    for root, point, fstype in _mounts(box):
        # Every mount of a host file system is the agent's, the sandbox's run dir, or
        # one of the files Podman writes for this container
        if fstype == "devtmpfs":
            assert root in DEVICES, (root, point)
        elif fstype not in VIRTUAL:
            assert root in allowed or root.endswith(podman_files), (root, point, fstype)
        # The sandbox sees its own cgroups, none of the host's or its neighbours'
        if fstype.startswith("cgroup"):
            assert root.endswith(f"/{box.id}"), (root, point)
        # Nothing is mounted outside the system trees and the sandbox's own paths
        own = {"/", "/tmp", "/workspace", "/.dsec/bin", "/.dsec/run", "/run/.containerenv",
               "/etc/resolv.conf"}  # fmt: skip
        own |= {"/etc/hosts", "/etc/hostname", "/etc/resolv.conf"}
        assert point in own or point.startswith(("/dev", "/proc", "/sys")), point
    probe = box.exec("ls /var/lib/dsec; ls /etc/shadow; ls -A /root")
    assert probe.stderr.decode().count("No such file") == 2 and probe.stdout == b""
    # Only the sandbox's own processes: the agent, this shell and perhaps a sleeper
    # (cmdlines hold NULs: the node must carry them to the log without harm)
    listing = box.exec("for p in /proc/[0-9]*; do cat $p/cmdline; echo; done").text
    cmdlines = [line for line in listing.splitlines() if line]
    assert cmdlines[0].startswith("/.dsec/bin/dsec-agent") and len(cmdlines) <= 4, cmdlines
    assert not [c for c in cmdlines if "postgres" in c or "podman" in c or "conmon" in c]


def test_egress_only_when_asked(
    client: Any, box: Any, stack: Settings, listeners: dict[str, socket.socket]
) -> None:
    if not stack.allow_egress:
        with pytest.raises(SandboxFailedError) as refused:
            client.create(network=True)
        assert refused.value.reason == "refused"
        return
    # Given a sandbox that asked for network, next to the default one
    with client.create(network=True) as online:
        # Then it has an interface besides loopback, and the default one has none
        assert len(online.exec("ls /sys/class/net").text.split()) >= 2
        assert box.exec("ls /sys/class/net").text.split() == ["lo"]
        # And its egress does not reach the node itself: not the host's loopback
        # (10.0.2.2) and not the host's own address (the node setup's firewall rule)
        host_addr = next(a for a in listeners if a != "127.0.0.1")
        targets = {
            "10.0.2.2": listeners["127.0.0.1"].getsockname()[1],
            host_addr: listeners[host_addr].getsockname()[1],
        }
        status = _dial_all(online, targets)
    assert status and all(code != 0 for code in status.values()), status
    assert not any(_accepted(s) for s in listeners.values())
