"""Exposed ports: a real server in a sandbox, reached through the URL
``sandbox.expose`` answers, by Python and by headless Chromium (HTTP and WebSocket);
each way of getting in without the URL's token, attacked."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from app.config import Settings
from app.domain.egress import NetworkPolicy
from app.errors import DsecError
from tests.conftest import tenant_client, wait_for

pytestmark = pytest.mark.integration

PAGE = """<html><body><div id="out">loading</div><script>
const ws = new WebSocket("WS_URL");
ws.onmessage = (e) => { document.getElementById("out").textContent = "ws:" + e.data; };
ws.onerror = () => { document.getElementById("out").textContent = "ws error"; };
// A slow request holds the headless browser's virtual time while the frame comes.
fetch("cgi-bin/slow").then((r) => r.text()).then((t) => {
  document.getElementById("slow").textContent = t.trim(); });
</script><div id="slow"></div></body></html>
"""
SLOW_CGI = b"#!/bin/sh\nsleep 2\nprintf 'Content-Type: text/plain\\r\\n\\r\\nslow-ok\\n'\n"

# A WebSocket server in busybox sh: the handshake (SHA-1 and base64 of the key), then
# one text frame, unmasked as a server's are.
WS_SERVER = r"""#!/bin/sh
key=
while IFS= read -r line; do
  line=$(printf '%s' "$line" | tr -d '\r')
  [ -z "$line" ] && break
  case "$line" in [Ss]ec-[Ww]eb[Ss]ocket-[Kk]ey:*) key=$(echo "${line#*:}" | tr -d ' ');; esac
done
hex=$(printf '%s258EAFA5-E914-47DA-95CA-C5AB0DC85B11' "$key" | sha1sum | cut -c1-40)
accept=$(printf "$(echo "$hex" | sed 's/../\\x&/g')" | base64)
printf 'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n'
printf 'Sec-WebSocket-Accept: %s\r\n\r\n' "$accept"
printf '\201\015hello-from-ws'
sleep 3
"""


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.fixture(scope="module")
def served(client: Any) -> Iterator[tuple[Any, str, str]]:
    """A sandbox without network serving a page on its loopback's 8080 and a
    WebSocket on 8081; yields it with both URLs."""
    with client.create() as sandbox:
        ws_url = sandbox.expose(8081)
        page = PAGE.replace("WS_URL", ws_url.replace("http://", "ws://", 1))
        sandbox.write_file("/workspace/www/index.html", page.encode())
        sandbox.write_file("/workspace/www/cgi-bin/slow", SLOW_CGI, mode=0o755)
        sandbox.write_file("/workspace/ws.sh", WS_SERVER.encode(), mode=0o755)
        sandbox.start("busybox httpd -f -p 127.0.0.1:8080 -h /workspace/www")
        sandbox.start("nc -ll -p 8081 -e /workspace/ws.sh")  # a process per connection
        time.sleep(0.5)
        yield sandbox, sandbox.expose(8080), ws_url


def test_the_url_reaches_a_server_on_the_sandboxs_loopback(served: Any, db: Any) -> None:
    sandbox, url, _ = served
    status, body = _get(url + "index.html")
    assert status == 200 and b"WebSocket" in body
    # The sandbox has no network: the proxy came in through its namespace
    assert sandbox.exec("ls /sys/class/net").text.split() == ["lo"]
    # And each opening is in the log, without its token

    def exposed() -> list[Any]:
        with db() as conn:
            return list(
                conn.execute(
                    text(
                        "SELECT payload FROM events WHERE sandbox_id = :s AND type = 'PortExposed'"
                    ),
                    {"s": sandbox.id},
                ).scalars()
            )

    ports = wait_for(lambda: len(exposed()) >= 2 and exposed(), 20, "PortExposed events")
    assert sorted(p["port"] for p in ports) == [8080, 8081]
    token = url.rstrip("/").rsplit("/", 1)[1]
    assert all(token not in json.dumps(p) for p in ports)


def test_guessed_or_altered_urls_get_nothing(served: Any) -> None:
    _, url, ws_url = served
    base, token = url.rstrip("/").rsplit("/", 1)
    body, _, sig = token.partition(".")
    # (the first character: the last of a base64 signature carries padding bits, and
    # two spellings of it can decode to the same signature)
    flipped = ("A" if sig[0] != "A" else "B") + sig[1:]
    for wrong in (
        f"{base}/index.html",
        f"{base}/{body}/index.html",
        f"{base}/{body}.{flipped}/index.html",
        f"{base}/x{token}/index.html",
    ):
        assert _get(wrong)[0] == 404, wrong
    # A token for one port opens that port only: the path cannot pick another
    assert _get(ws_url + "index.html")[0] != 200


def test_an_expired_url_gets_nothing(served: Any) -> None:
    sandbox, _, _ = served
    short = sandbox.expose(8080, ttl_s=1)
    assert _get(short + "index.html")[0] == 200
    time.sleep(1.5)
    assert _get(short + "index.html")[0] == 404


def test_another_tenant_cannot_open_a_port_of_the_sandbox(stack: Settings, served: Any) -> None:
    sandbox, _, _ = served
    with tenant_client(stack, "ports-intruder", "x") as intruder, pytest.raises(DsecError):
        intruder.sandbox(sandbox.id).expose(8080)


def _forwarder(target: tuple[str, int]) -> tuple[socket.socket, list[str]]:
    """A listener on every address of the host that hands connections to ``target``
    (as if an operator had put the port proxy on the LAN); returns it and the peers
    it served."""
    listener = socket.create_server(("0.0.0.0", 0))
    peers: list[str] = []

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, peer = listener.accept()
                peers.append(peer[0])
                upstream = socket.create_connection(target)
                for a, b in ((conn, upstream), (upstream, conn)):
                    threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener, peers


def test_an_allowlisted_sandbox_cannot_reach_another_sandboxs_port(
    client: Any, served: Any
) -> None:
    _, url, _ = served
    parsed = urllib.parse.urlsplit(url)
    listener, peers = _forwarder((parsed.hostname or "", parsed.port or 80))
    port = listener.getsockname()[1]
    try:
        # The forwarder serves the URL from the host: the attack below can succeed
        assert _get(f"http://127.0.0.1:{port}{parsed.path}index.html")[0] == 200
        peers.clear()
        # Rules whose networks cover the host's addresses and the sandboxes' pool
        policy = NetworkPolicy(allow=["128.0.0.0/1", "10.0.0.0/8"])
        addresses = [
            line.split()[3].split("/")[0]
            for line in subprocess.run(
                ["ip", "-4", "-o", "addr", "show", "scope", "global"],
                capture_output=True, text=True, check=True,
            ).stdout.splitlines()
        ]  # fmt: skip
        with client.create(network=policy) as attacker:
            gateway = attacker.exec("ip route | sed -n 's/default via \\([0-9.]*\\).*/\\1/p'")
            for host in {*addresses, gateway.text.strip(), "127.0.0.1"}:
                for path in ("/", f"{parsed.path}index.html"):  # without and with its token
                    got = attacker.exec(
                        f"printf 'GET {path} HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {host} {port}",
                        timeout_s=30,
                    ).text
                    assert got == "", (host, path, got)
        assert peers == []  # nothing from the sandbox reached the forwarder
    finally:
        listener.close()


def test_the_url_closes_when_the_sandbox_ends(client: Any) -> None:
    sandbox = client.create()
    sandbox.write_file("/workspace/www/index.html", b"up\n")
    sandbox.start("busybox httpd -f -p 127.0.0.1:8080 -h /workspace/www")
    url = sandbox.expose(8080)
    time.sleep(0.3)
    assert _get(url + "index.html") == (200, b"up\n")
    sandbox.close()
    assert _get(url + "index.html")[0] == 404


def test_headless_chromium_loads_the_page_and_its_websocket(served: Any) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is missing: the bootstrap installs it", pytrace=False)
    _, url, _ = served
    dom = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--virtual-time-budget=5000", "--dump-dom", url + "index.html"],
        capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert '<div id="out">ws:hello-from-ws</div>' in dom, dom[-500:]
    assert '<div id="slow">slow-ok</div>' in dom, dom[-500:]


def test_the_cli_prints_a_url_that_serves(served: Any) -> None:
    from tests.integration.test_cli import dsec

    sandbox, _, _ = served
    made = dsec("expose", sandbox.id, "8080", "--ttl", "60")
    assert made.exit_code == 0, made.output
    assert _get(made.stdout.strip() + "index.html")[0] == 200
