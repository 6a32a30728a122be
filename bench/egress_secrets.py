"""Egress secrets: what the node's proxy costs a sandbox's HTTP request, against the
same request sent straight to a plain HTTP server and the same request from the host.

    .venv/bin/python bench/egress_secrets.py [--requests 300] [--mb 200]

A network namespace of the bench's serves one HTTP handler on two addresses: TLS on
443 at ``api.bench.test`` (a certificate from a CA of the bench's, which the node
trusts through its egress CA file; it answers 401 without the secret's header) and
plain HTTP on 80 at ``plain.bench.test``. ``/small`` answers two bytes, ``/big``
``--mb`` MB. Three ways, in the same run:

- **proxy**: an allowlisted sandbox's busybox ``wget http://api.bench.test/...``: the
  node redirects it to its proxy, which adds the tenant's header and carries it over
  TLS verified for the name (a new TLS connection per request);
- **direct**: the same sandbox's ``wget http://plain.bench.test/...`` (allowed on
  80): veth and firewall, no proxy, no TLS;
- **host**: root's busybox ``wget`` of the plain server (the raw substrate).

Times are the agent's own (an exec's ``duration_ms``): a request is a wget run,
spawn included, the same in every way. The proxy is measured once with the node's
bandwidth cap (``proxy_capped``: it must hold there too), then the bench's sandbox has
its cap taken off (the mechanism alone). CPU per MB is the whole machine's (/proc/stat).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

from egress import HostRunner, SandboxRunner, busy_jiffies, recap, uncap

from app.config import get_settings
from app.control import tenants
from app.control.egress_secrets import REFRESH_S
from app.sdk import Client, NetworkPolicy
from app.stack.outside import Outside
from app.stack.tls import ensure_ca, ensure_leaf

HOST_SIDE, API, PLAIN = "10.95.0.1", "10.95.0.2", "10.95.0.3"
OUTSIDE = Outside("dsec-secret-bench", "dsec-seb0", HOST_SIDE, (f"{API}/24", f"{PLAIN}/24"))
NAMES = {"api.bench.test": API, "plain.bench.test": PLAIN}
HEADER = "X-Api-Key"

_SERVER = textwrap.dedent(
    """
    import http.server, socketserver, ssl, sys, threading
    pem, key, api, plain, size = *sys.argv[1:5], int(sys.argv[5])
    chunk = b"x" * (1 << 16)
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.server.server_address[1] == 443 and self.headers.get("X-Api-Key") != key:
                self.send_response(401); self.send_header("Content-Length", "0")
                self.end_headers(); return
            big = self.path == "/big"
            self.send_response(200)
            self.send_header("Content-Length", str(size if big else 2))
            self.end_headers()
            if not big:
                self.wfile.write(b"ok"); return
            for _ in range(size // len(chunk)):
                self.wfile.write(chunk)
        def log_message(self, *args):
            pass
    def serve(address, port, tls):
        # Not http.server's HTTPServer: its bind looks the address's name up, and
        # this namespace has no resolver to answer
        socketserver.ThreadingTCPServer.daemon_threads = True
        server = socketserver.ThreadingTCPServer((address, port), Handler)
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); context.load_cert_chain(pem)
            server.socket = context.wrap_socket(server.socket, server_side=True)
        server.serve_forever()
    threading.Thread(target=serve, args=(api, 443, True), daemon=True).start()
    threading.Thread(target=serve, args=(plain, 80, False), daemon=True).start()
    threading.Event().wait()
    """
)


def outside(work: Path, key: str, size: int) -> subprocess.Popen[bytes]:
    """The servers' namespace, routed through the host as the internet would be."""
    inside = OUTSIDE.make().inside
    pem = ensure_leaf(work / "ca", work, "api", ["api.bench.test"])
    script = work / "server.py"
    script.write_text(_SERVER)
    server = subprocess.Popen(
        [*inside, sys.executable, str(script), str(pem), key, API, PLAIN, str(size)]
    )
    time.sleep(0.5)
    return server


def measure(runner: Any, base: str, requests: int, mb: int) -> dict[str, float]:
    """Per-request time of ``requests`` small GETs and the download of ``/big``."""
    loop = f"for i in $(seq {{n}}); do wget -q -O /dev/null {base}/small || exit 1; done"
    code, _ = runner.exec(loop.format(n=5))  # warm: page cache, first packets
    assert code == 0, f"requests to {base} failed"
    code, ms = runner.exec(loop.format(n=requests))
    assert code == 0, f"requests to {base} failed"
    before = busy_jiffies()
    code, big_ms = runner.exec(f"wget -q -O /dev/null {base}/big")
    cpu_s = (busy_jiffies() - before) / 100
    assert code == 0, f"download from {base} failed"
    return {
        "request_ms": ms / requests,
        "down_mbyte_s": mb / (big_ms / 1000),
        "cpu_ms_per_mb": cpu_s * 1000 / mb,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--mb", type=int, default=200)
    args = parser.parse_args()
    settings = get_settings()
    hosts = settings.egress_hosts or settings.state_dir / "egress-hosts"
    ca_file = settings.egress_ca_file or settings.state_dir / "egress-ca.pem"
    kept = {path: path.read_bytes() if path.exists() else None for path in (hosts, ca_file)}
    key = f"sk-{uuid.uuid4().hex}"
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ca_pem = ensure_ca(work / "ca")
        server = outside(work, key, args.mb << 20)
        hosts.write_text("".join(f"{addr} {name}\n" for name, addr in NAMES.items()))
        ca_file.write_bytes(ca_pem.read_bytes())
        bench = tenants.local(settings, "bench")
        client = Client(settings, credential=bench, job_id="bench-secrets", timeout_s=600)
        try:
            client.secrets.put("api.bench.test", header=HEADER, value=key)
            time.sleep(REFRESH_S + 0.5)  # past what a scheduler may have read before
            policy = NetworkPolicy(allow=["api.bench.test:443", "plain.bench.test:80"])
            results["host"] = measure(HostRunner(), f"http://{PLAIN}", args.requests, args.mb)
            with client.create(network=policy) as box:
                # The node's bandwidth cap holds through its proxy too
                results["proxy_capped"] = measure(
                    SandboxRunner(box), "http://api.bench.test", 20, args.mb
                )
                added = uncap(box.id)
                try:
                    runner = SandboxRunner(box)
                    results["direct"] = measure(
                        runner, "http://plain.bench.test", args.requests, args.mb
                    )
                    results["proxy"] = measure(
                        runner, "http://api.bench.test", args.requests, args.mb
                    )
                finally:
                    recap(added)
        finally:
            client.secrets.delete("api.bench.test")
            client.close()
            server.kill()
            OUTSIDE.remove()
            for path, content in kept.items():
                if content is None:
                    path.unlink(missing_ok=True)
                else:
                    path.write_bytes(content)
    for way, figures in results.items():
        print(way, " ".join(f"{k}={v:.2f}" for k, v in figures.items()))
    p, d, h = results["proxy"], results["direct"], results["host"]
    print(
        "RESULT egress_secrets"
        f" request_ms proxy={p['request_ms']:.2f} direct={d['request_ms']:.2f}"
        f" host={h['request_ms']:.2f}"
        f" down_MB_s proxy={p['down_mbyte_s']:.0f} direct={d['down_mbyte_s']:.0f}"
        f" host={h['down_mbyte_s']:.0f}"
        f" cpu_ms_per_MB proxy={p['cpu_ms_per_mb']:.2f} direct={d['cpu_ms_per_mb']:.2f}"
        f" host={h['cpu_ms_per_mb']:.2f}"
        f" proxy_capped_MB_s={results['proxy_capped']['down_mbyte_s']:.1f}"
    )


if __name__ == "__main__":
    main()
