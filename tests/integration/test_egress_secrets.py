"""Egress secrets: a tenant's header is added on the way out, over TLS verified for
its destination, and never reaches the sandbox; each attack is made from inside an
allowlisted sandbox and checked on the servers' side too.

A network namespace the test makes ("outside") runs the destinations: the API
(``api.secret.test``, TLS on 443, certificate from a CA of the test that the node
trusts through its egress CA file), and an echo service (``echo.secret.test``: plain
HTTP on 80 answering with the request it got, TLS on 443 with its own name's
certificate). ``hijacked.secret.test`` is a secret's destination whose name points
at the echo service (a poisoned record). Every request head a server receives is
written down.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from app.config import Settings
from app.control.egress_secrets import REFRESH_S
from app.domain.egress import NetworkPolicy
from app.errors import ConfigError
from app.sdk import Client
from app.sdk.hub_service import HubService, PushError
from app.stack.outside import Outside
from app.stack.tls import ensure_ca, ensure_leaf
from tests.conftest import ensure_tenant, wait_for
from workers.host.egress import SLOT_DIR

pytestmark = pytest.mark.integration

NS = "dsec-secret-test"
HOST_SIDE, API, ECHO = "10.96.0.1", "10.96.0.2", "10.96.0.3"
NAMES = {"api.secret.test": API, "echo.secret.test": ECHO, "hijacked.secret.test": ECHO}
POLICY = NetworkPolicy(
    allow=["api.secret.test:443", "echo.secret.test:80", "hijacked.secret.test:443"]
)

_SERVER = textwrap.dedent(
    """
    import json, socket, ssl, sys, threading
    log = open(sys.argv[1], "a", buffering=1)
    def serve(address, port, pem, echo):
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, port)); s.listen(64)
        context = None
        if pem:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); context.load_cert_chain(pem)
        while True:
            conn, _ = s.accept()
            try:
                if context:
                    conn = context.wrap_socket(conn, server_side=True)
                data = b""
                while b"\\r\\n\\r\\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                head = data.split(b"\\r\\n\\r\\n")[0].decode(errors="replace")
                log.write(json.dumps({"at": f"{address}:{port}", "head": head}) + "\\n")
                body = (head + "\\n") if echo else "OK-API\\n"
                conn.sendall((f"HTTP/1.1 200 OK\\r\\nContent-Length: {len(body)}\\r\\n"
                              f"Connection: close\\r\\n\\r\\n{body}").encode())
            except Exception as exc:
                log.write(json.dumps({"at": f"{address}:{port}", "error": str(exc)}) + "\\n")
            finally:
                conn.close()
    api_pem, echo_pem, api, echo = sys.argv[2:6]
    for args in ((api, 443, api_pem, False), (echo, 443, echo_pem, True), (echo, 80, None, True)):
        threading.Thread(target=serve, args=args, daemon=True).start()
    threading.Event().wait()
    """
)


def _keep(path: Path) -> bytes | None:
    return path.read_bytes() if path.exists() else None


def _put_back(path: Path, kept: bytes | None) -> None:
    if kept is None:
        path.unlink(missing_ok=True)
    else:
        path.write_bytes(kept)


@pytest.fixture(scope="module")
def outside(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The outside namespace and its servers; the node's hosts file names them and its
    egress CA file trusts their CA. Yields the servers' log."""
    if not stack.allow_egress:
        pytest.skip("this stack gives no network (DSEC_ALLOW_EGRESS=false)")
    work = tmp_path_factory.mktemp("secrets")
    log, script = work / "seen.log", work / "server.py"
    script.write_text(_SERVER)
    ca_dir = work / "ca"
    ca_pem = ensure_ca(ca_dir)
    api_pem = ensure_leaf(ca_dir, work, "api", ["api.secret.test"])
    echo_pem = ensure_leaf(ca_dir, work, "echo", ["echo.secret.test"])
    hosts = stack.egress_hosts or stack.state_dir / "egress-hosts"
    ca_file = stack.egress_ca_file or stack.state_dir / "egress-ca.pem"
    kept_hosts, kept_ca = _keep(hosts), _keep(ca_file)
    net = Outside(NS, "dsec-sct0", HOST_SIDE, (f"{API}/24", f"{ECHO}/24"))
    inside = net.make().inside
    server = subprocess.Popen(
        [*inside, sys.executable, str(script), str(log), str(api_pem), str(echo_pem), API, ECHO]
    )
    hosts.write_text("".join(f"{addr} {name}\n" for name, addr in NAMES.items()))
    ca_file.write_bytes(ca_pem.read_bytes())
    try:
        time.sleep(0.5)
        yield log
    finally:
        server.kill()
        net.remove()
        _put_back(hosts, kept_hosts)
        _put_back(ca_file, kept_ca)


@pytest.fixture(scope="module")
def value(client: Any) -> Iterator[str]:
    """The tenant's API key, set as a secret for api.secret.test (and for the
    hijacked name); deleted at the end."""
    key = f"Bearer sk-{uuid.uuid4().hex}"
    client.secrets.put("api.secret.test", header="Authorization", value=key)
    client.secrets.put("hijacked.secret.test", header="Authorization", value=key)
    time.sleep(REFRESH_S + 0.5)  # past what a scheduler may have read before
    yield key
    client.secrets.delete("api.secret.test")
    client.secrets.delete("hijacked.secret.test")


@pytest.fixture(scope="module")
def box(client: Any, outside: Path, value: str) -> Iterator[Any]:
    with client.create(network=POLICY) as sandbox:
        yield sandbox


def _http(box: Any, connect: str, head: str) -> str:
    """What a raw HTTP/1.1 request from the sandbox to ``connect``:80 got back."""
    request = head.replace("\n", "\\r\\n") + "\\r\\n\\r\\n"
    return str(box.exec(f"printf '{request}' | nc -w 5 {connect} 80", timeout_s=30).text)


def _seen(log: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_the_header_is_added_on_the_way_out_over_verified_tls(
    box: Any, outside: Path, value: str
) -> None:
    before = len(_seen(outside))
    got = _http(box, "api.secret.test", "GET /v1/models HTTP/1.1\nHost: api.secret.test\n"
                "Authorization: the-sandbox-s-own")  # fmt: skip
    assert "200 OK" in got and "OK-API" in got, got
    [arrived] = _seen(outside)[before:]
    assert arrived["at"] == f"{API}:443"  # over TLS, to the API's own address
    assert arrived["head"].startswith("GET /v1/models HTTP/1.1")
    assert f"Authorization: {value}" in arrived["head"]
    assert "the-sandbox-s-own" not in arrived["head"]  # replaced, never doubled
    assert value not in got


def test_the_value_never_exists_inside_the_sandbox(box: Any, value: str) -> None:
    token = value.split()[-1]
    # The token in two halves: the command itself is logged, and must not hold it.
    found = box.exec(
        f"a={token[:8]}; b={token[8:]}; env; cat /proc/*/environ 2>/dev/null;"
        ' grep -rl "$a$b" /etc /tmp /workspace /run 2>/dev/null; true',
        timeout_s=30,
    ).text
    assert token not in found


def test_an_echo_service_never_sees_the_secret(box: Any, outside: Path, value: str) -> None:
    before = len(_seen(outside))
    # The echo service's address with the API's name: not the API's address, so the
    # request goes straight there (allowed on 80) and carries only what the sandbox put.
    echoed = _http(box, "echo.secret.test", "GET / HTTP/1.1\nHost: api.secret.test")
    assert "Host: api.secret.test" in echoed, echoed
    # The API's address with the echo service's name: the proxy has no secret for it.
    other = _http(box, "api.secret.test", "GET / HTTP/1.1\nHost: echo.secret.test")
    assert "403" in other
    # An absolute URI naming the echo service, sent to the API's address.
    absolute = _http(box, "api.secret.test",
                     "GET http://echo.secret.test/ HTTP/1.1\nHost: api.secret.test")  # fmt: skip
    assert "400" in absolute
    # Two Host headers, the second the echo service's.
    doubled = _http(box, "api.secret.test",
                    "GET / HTTP/1.1\nHost: api.secret.test\nHost: echo.secret.test")  # fmt: skip
    assert "400" in doubled
    for answer in (echoed, other, absolute, doubled):
        assert value not in answer
    assert all(value not in json.dumps(seen) for seen in _seen(outside)[before:])


def test_a_destination_name_pointed_elsewhere_gets_no_secret(
    box: Any, outside: Path, value: str
) -> None:
    before = len(_seen(outside))
    got = _http(box, "hijacked.secret.test", "GET / HTTP/1.1\nHost: hijacked.secret.test")
    # The echo service's certificate is not the hijacked name's: no request is sent.
    assert "502" in got, got
    assert value not in got
    assert all(value not in json.dumps(seen) for seen in _seen(outside)[before:])
    assert not [s for s in _seen(outside)[before:] if "head" in s]


def test_another_tenants_sandbox_carries_no_secret(
    stack: Settings, outside: Path, value: str
) -> None:
    rival = ensure_tenant(stack, "secret-rival")
    with (
        Client(stack, credential=rival, job_id="secrets") as client,
        client.create(network=POLICY) as box,
    ):
        before = len(_seen(outside))
        got = _http(box, "api.secret.test", "GET / HTTP/1.1\nHost: api.secret.test")
    # Its plain HTTP is not even redirected: port 80 of the API is not on its list.
    assert "OK-API" not in got and value not in got
    assert all(value not in json.dumps(seen) for seen in _seen(outside)[before:])


def test_secrets_are_stored_sealed_listed_without_values_and_never_logged(
    client: Any, box: Any, value: str, db: Any
) -> None:
    listed = {(s.destination, s.header) for s in client.secrets.list()}
    assert ("api.secret.test", "Authorization") in listed
    assert value not in repr(client.secrets.list())
    token = value.split()[-1]
    with db() as conn:
        sealed = conn.execute(
            text("SELECT sealed FROM egress_secrets WHERE destination = 'api.secret.test'")
        ).scalars().all()  # fmt: skip
        logged = conn.execute(
            text("SELECT count(*) FROM events WHERE payload::text LIKE :v"), {"v": f"%{token}%"}
        ).scalar_one()
    assert sealed and all(token.encode() not in bytes(row) for row in sealed)
    assert logged == 0


def test_a_bad_secret_is_refused_and_the_refusal_does_not_echo_it(client: Any) -> None:
    with pytest.raises(ConfigError):
        client.secrets.put("api.secret.test", header="Host", value="x")
    hub = HubService(client.settings, client.credential)
    smuggled = "sk-never-echoed\r\nX-Injected: 1"
    with pytest.raises(PushError) as refused:
        hub.call("PUT", "/secrets",
                 {"destination": "api.secret.test", "header": "X-Key", "value": smuggled},
                 "a bad secret")  # fmt: skip
    assert "400" in str(refused.value) and "sk-never-echoed" not in str(refused.value)
    with pytest.raises(PushError):  # a wildcard or an address is no destination
        hub.call("PUT", "/secrets", {"destination": "*.secret.test", "header": "X-Key",
                                     "value": "v"}, "a bad secret")  # fmt: skip
    assert "X-Key" not in {s.header for s in client.secrets.list()}


def test_without_a_login_nothing_is_listed_or_set(client: Any) -> None:
    import urllib.error
    import urllib.request

    hub = HubService(client.settings, client.credential)
    for method in ("GET", "PUT"):
        request = urllib.request.Request(hub.url("/secrets"), method=method, data=b"{}")
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(request, context=hub.context(), timeout=10)
        assert answer.value.code == 401


def test_the_cli_sets_lists_and_removes_a_secret(client: Any) -> None:
    from tests.integration.test_cli import _json, cli, dsec, runner

    put = runner.invoke(cli, ["secret", "put", "cli.secret.test", "--header", "X-Api-Key",
                              "--tenant", "tests"], input="cli-value-1\n")  # fmt: skip
    assert put.exit_code == 0, put.output
    rows = _json(dsec("secret", "ls", "--tenant", "tests", "--json"))
    assert {"destination": "cli.secret.test", "header": "X-Api-Key"}.items() <= next(
        r for r in rows if r["destination"] == "cli.secret.test"
    ).items()
    assert "cli-value-1" not in json.dumps(rows)
    gone = dsec("secret", "rm", "cli.secret.test", "--tenant", "tests")
    assert gone.exit_code == 0 and "1 removed" in gone.stdout


def test_a_restarted_node_worker_carries_a_running_sandboxs_secret_on(
    stack: Settings, box: Any, outside: Path, value: str
) -> None:
    from tests.integration.test_interrupted import _worker

    worker = _worker(stack)
    before = worker.pid(stack)
    assert before is not None
    os.killpg(before, signal.SIGKILL)
    wait_for(lambda: (pid := worker.pid(stack)) is not None and pid != before, 60)
    head = "GET /v1/models HTTP/1.1\nHost: api.secret.test"
    # The slot's record kept the secrets sealed with the node's key: the new worker
    # opens them and its proxy adds the header as the old one did
    got = wait_for(lambda: "OK-API" in (g := _http(box, "api.secret.test", head)) and g, 60,
                   "the sandbox's requests served again")  # fmt: skip
    assert "200 OK" in got
    assert f"Authorization: {value}" in _seen(outside)[-1]["head"]
    # and the record holds them sealed, never as they are
    records = [p.read_text() for p in SLOT_DIR.glob("[0-9]*")]
    assert records and all(value.split()[-1] not in r for r in records)
