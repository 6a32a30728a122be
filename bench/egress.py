"""Egress through an allowlist against plain NAT: connect latency, throughput, CPU per
MB, create time, and the host memory the mechanism adds per sandbox.

    .venv/bin/python bench/egress.py [--connects 200] [--mb 200] [--creates 20] [--count 500]

A network namespace of the bench's ("outside", routed through the host as the
internet would be) serves three ports: one that accepts and closes (connect
latency), one that sends ``--mb`` MB (download), one that reads ``--mb`` MB
(upload). Three ways to it, in the same run:

- **allowlist**: a sandbox with ``NetworkPolicy(allow=[the server])`` (its veth, the
  nftables table, the node's resolver); measured with the node's bandwidth cap
  (``DSEC_EGRESS_MBIT``) and again with the bench's sandbox's caps taken off, which
  is the mechanism alone;
- **nat**: a sandbox with ``network=True`` (slirp4netns, user-mode NAT);
- **host**: the same busybox commands run by root on the host (the raw substrate).

Times are the agent's own (an exec's ``duration_ms``), so the platform's exec path is
not in them; a connect is a busybox ``nc`` run, spawn included, the same in every way.
CPU per MB is the whole machine's (/proc/stat) over the transfer. Memory: ``--count``
sandboxes with an allowlist, then as many without network, MemAvailable before and
after each fleet; the difference per sandbox is what the mechanism adds (veth pair,
qdiscs, set elements). Create time: ``--creates`` one at a time of each kind.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from density import SETTLE_S, SHAPE, cleanup

from app.config import get_settings
from app.control import tenants
from app.sdk import Client, NetworkPolicy
from app.stack.outside import Outside
from app.stats import percentile
from workers.host.egress import PREFIX, SLOT_DIR, TABLE

HOST_SIDE, SERVER = "10.97.0.1", "10.97.0.2"
OUTSIDE = Outside("dsec-egress-bench", "dsec-egb0", HOST_SIDE, (f"{SERVER}/24",))
CONNECT, SEND, SINK = 9000, 9001, 9002

_SERVER = textwrap.dedent(
    """
    import socket, sys, threading
    size = int(sys.argv[1])
    def serve(port, handle):
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port)); s.listen(256)
        while True:
            conn, _ = s.accept()
            threading.Thread(target=handle, args=(conn,), daemon=True).start()
    def close(conn): conn.close()
    def send(conn):
        chunk = b"x" * (1 << 16)
        for _ in range(size // len(chunk)): conn.sendall(chunk)
        conn.close()
    def sink(conn):
        left = size
        while left > 0:
            data = conn.recv(1 << 16)
            if not data: break
            left -= len(data)
        conn.close()
    for port, handle in ((9000, close), (9001, send), (9002, sink)):
        threading.Thread(target=serve, args=(port, handle), daemon=True).start()
    threading.Event().wait()
    """
)


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def outside(size: int, work: Path) -> subprocess.Popen[bytes]:
    inside = OUTSIDE.make().inside
    script = work / "server.py"
    script.write_text(_SERVER)
    server = subprocess.Popen([*inside, sys.executable, str(script), str(size)])
    time.sleep(0.5)
    return server


def busy_jiffies() -> int:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def _mem_available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    raise RuntimeError("no MemAvailable")


class HostRunner:
    """The raw substrate: the same busybox commands as root on the host."""

    def exec(self, command: str, timeout_s: float = 600) -> tuple[int, float]:
        began = time.monotonic()
        done = subprocess.run(
            ["busybox", "sh", "-c", command], capture_output=True, timeout=timeout_s
        )
        return done.returncode, (time.monotonic() - began) * 1000


class SandboxRunner:
    def __init__(self, sandbox: Any) -> None:
        self.sandbox = sandbox

    def exec(self, command: str, timeout_s: float = 600) -> tuple[int, float]:
        result = self.sandbox.exec(command, timeout_s=timeout_s)
        return result.exit_code, result.duration_ms


def measure(runner: Any, connects: int, mb: int) -> dict[str, float]:
    def loop(n: int) -> str:
        return f"for i in $(seq {n}); do nc -w 5 {SERVER} {CONNECT} </dev/null; done"

    runner.exec(loop(5))  # warm: page cache, the path's first packets
    code, ms = runner.exec(loop(connects))
    assert code == 0, "connect loop failed"
    figures = {"connect_ms": ms / connects}
    for name, command in (
        ("down", f"nc -w 30 {SERVER} {SEND} >/dev/null"),
        ("up", f"head -c {mb << 20} /dev/zero | nc -w 30 {SERVER} {SINK}"),
    ):
        before = busy_jiffies()
        code, ms = runner.exec(command)
        cpu_s = (busy_jiffies() - before) / 100
        figures[f"{name}_mbyte_s"] = mb / (ms / 1000)
        figures[f"{name}_cpu_ms_per_mb"] = cpu_s * 1000 / mb
    return figures


def creates(client: Client, count: int, policy: NetworkPolicy) -> tuple[list[float], list[float]]:
    """Create-to-ready times (ms) without network and with ``policy``, alternating
    (the warm pool serves both: an allowlisted sandbox is a warm one given its veth)."""
    took: tuple[list[float], list[float]] = ([], [])
    for _ in range(count):
        for kind, options in enumerate(({}, {"network": policy})):
            time.sleep(0.5)  # the pool refills after a lull
            began = time.monotonic()
            with client.create(**options) as sandbox:
                took[kind].append((time.monotonic() - began) * 1000)
                sandbox.exec("true")
    return took


def fleet_memory(client: Client, count: int, **options: Any) -> float:
    """Host memory per sandbox (KiB) of ``count`` sandboxes made with ``options``."""
    time.sleep(SETTLE_S)
    before = _mem_available_kib()
    boxes: list[Any] = []
    try:
        while len(boxes) < count:
            boxes += client.create_many(min(50, count - len(boxes)), **SHAPE, **options)
        time.sleep(SETTLE_S)
        return (before - _mem_available_kib()) / count
    finally:
        cleanup(client, boxes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connects", type=int, default=200)
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--creates", type=int, default=20)
    parser.add_argument("--count", type=int, default=500, help="sandboxes per memory fleet")
    args = parser.parse_args()
    settings = get_settings()
    policy = NetworkPolicy(allow=[f"{SERVER}:{CONNECT}-{SINK}"])
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = outside(args.mb << 20, Path(tmp))
        try:
            bench = tenants.local(settings, "bench")
            with Client(settings, credential=bench, job_id="bench-egress", timeout_s=600) as client:
                results["host"] = measure(HostRunner(), args.connects, args.mb)
                with client.create(network=True) as nat:
                    results["nat"] = measure(SandboxRunner(nat), args.connects, args.mb)
                with client.create(network=policy) as box:
                    results["allowlist"] = measure(SandboxRunner(box), args.connects, args.mb)
                    added = uncap(box.id)
                    try:
                        results["allowlist_uncapped"] = measure(
                            SandboxRunner(box), args.connects, args.mb
                        )
                    finally:
                        recap(added)
                for way, figures in results.items():
                    print(way, " ".join(f"{k}={v:.2f}" for k, v in figures.items()))
                plain, listed = creates(client, args.creates, policy)
                print(
                    f"create p50: none {percentile(plain, 50):.1f} ms,"
                    f" allowlist {percentile(listed, 50):.1f} ms"
                )
                mem_listed = mem_plain = 0.0
                if args.count:
                    mem_listed = fleet_memory(client, args.count, network=policy)
                    mem_plain = fleet_memory(client, args.count)
                    print(
                        f"memory per sandbox at {args.count}: allowlist {mem_listed:.0f} KiB,"
                        f" none {mem_plain:.0f} KiB"
                    )
        finally:
            server.kill()
            OUTSIDE.remove()
    a, n, h = results["allowlist_uncapped"], results["nat"], results["host"]
    print(
        "RESULT egress"
        f" connect_ms allowlist={a['connect_ms']:.2f} nat={n['connect_ms']:.2f}"
        f" host={h['connect_ms']:.2f}"
        f" down_MB_s allowlist={a['down_mbyte_s']:.0f}"
        f" (capped {results['allowlist']['down_mbyte_s']:.1f}) nat={n['down_mbyte_s']:.0f}"
        f" host={h['down_mbyte_s']:.0f}"
        f" cpu_ms_per_MB_down allowlist={a['down_cpu_ms_per_mb']:.2f}"
        f" nat={n['down_cpu_ms_per_mb']:.2f} host={h['down_cpu_ms_per_mb']:.2f}"
        f" create_p50_ms none={percentile(plain, 50):.1f} allowlist={percentile(listed, 50):.1f}"
        f" mem_added_KiB_per_sandbox={mem_listed - mem_plain:.0f}"
    )


def uncap(sandbox_id: str) -> list[tuple[str, str]]:
    """Let the bench's sandbox's established flows pass before the node's bandwidth
    policing (new connections still meet the whole allowlist): the mechanism alone.
    Returns the (chain, handle) of the rules to delete after."""
    for path in SLOT_DIR.glob("[0-9]*"):
        if json.loads(path.read_text())["sandbox_id"] != sandbox_id:
            continue
        iface = f"{PREFIX}{path.name}"
        added = []
        for chain, match in (
            ("forward", "oifname"), ("from_sandbox", "iifname"),
            ("to_host", "iifname"), ("output", "oifname"),  # its DNS and the node's proxies
        ):  # fmt: skip
            echoed = subprocess.run(
                ["nft", "--echo", "--handle", "insert", "rule", "inet", TABLE, chain, match,
                 f'"{iface}"', "ct", "state", "established,related", "accept"],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            added.append((chain, echoed.rsplit("# handle", 1)[1].split()[0]))
        return added
    raise RuntimeError(f"no egress slot for {sandbox_id}")


def recap(added: list[tuple[str, str]]) -> None:
    for chain, handle in added:
        _sh("nft", "delete", "rule", "inet", TABLE, chain, "handle", handle)


if __name__ == "__main__":
    main()
