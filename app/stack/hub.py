"""The image hub of the embedded stack: Debian's Distribution registry
(``docker-registry``), serving TLS with a certificate of the stack's CA, and the
platform's token service in front of its door (:mod:`app.stack.hub_auth`).

What `dsec up` makes once, in root-only files under ``<state_dir>/hub``: the
registry's settings, its certificate (key and chain in one PEM, which Go reads for
both), the secret its upload sessions are signed with, the key the token service signs
with and its certificate (the registry's ``rootcertbundle``). Layers live once, by
digest, in ``storage/``: images and tenants that share a layer share its blob.

Decision: tokens, not the registry's htpasswd. htpasswd lets every user who logs in
read and write everything; the token service grants per principal and repository
(app/domain/hub_access.py), checks the platform's credentials (revocation included)
and needs no accounts of its own. The registry's storage health check is off: it read
the disk every 10 s of an idle stack for a report nobody asks for.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

from app import secret_files
from app.config import Settings
from app.control.hub_auth import (
    AUDIENCE,
    ISSUER,
    events_port,
    events_secret_file,
    hub_address,
    hub_dir,
    token_cert_file,
    token_key_file,
)
from app.errors import ConfigError
from app.stack import tls
from app.stack.process import Service, port_open


def config_file(settings: Settings) -> Path:
    return hub_dir(settings) / "config.yml"


def _bundle(settings: Settings) -> Path:
    """The token certificate under a name of its content: a new key is a new name in
    the settings file, which restarts a running registry (it reads the file once)."""
    pem = token_cert_file(settings).read_bytes()
    path = hub_dir(settings) / f"token-{hashlib.sha256(pem).hexdigest()[:12]}.pem"
    if not path.exists():
        secret_files.write(path, pem)
    return path


def prepare(settings: Settings) -> None:
    """Everything the hub and its token service start with (made once; the settings
    file is written again each time, and a change restarts the registry)."""
    home = hub_dir(settings)
    (home / "storage").mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(home, 0o700)
    host, port = hub_address(settings)
    leaf = tls.ensure_leaf(settings.ca_dir, home, "hub", [host, "localhost"])
    tls.ensure_self_signed(token_key_file(settings), token_cert_file(settings), "dsec hub tokens")
    secret = secret_files.ensure(home / "http.secret", text=True).decode()
    reports = secret_files.ensure(events_secret_file(settings), text=True).decode()
    body = {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {
            "filesystem": {"rootdirectory": str(home / "storage")},
            "delete": {"enabled": True},
            "cache": {"blobdescriptor": "inmemory"},
        },
        "http": {
            "addr": f"{host}:{port}",
            "secret": secret,
            "tls": {"certificate": str(leaf), "key": str(leaf)},
        },
        "auth": {
            "token": {
                "realm": token_realm(settings),
                "service": AUDIENCE,
                "issuer": ISSUER,
                "rootcertbundle": str(_bundle(settings)),
            }
        },
        "health": {"storagedriver": {"enabled": False}},
        # Pushes and deletions, reported to the token service for the audit trail; a
        # manifest's report names the blobs it references (what its deletion releases).
        "notifications": {
            "events": {"includereferences": True},
            "endpoints": [
                {
                    "name": "dsec-audit",
                    "url": f"http://127.0.0.1:{events_port(settings)}/events",
                    "headers": {"Authorization": [f"Bearer {reports}"]},
                    "timeout": "5s",
                    "threshold": 5,
                    "backoff": "5s",
                    "ignore": {"actions": ["pull"]},
                }
            ],
        },
    }
    # JSON is YAML: the registry reads this as its configuration.
    secret_files.write(config_file(settings), json.dumps(body, indent=2).encode())


def token_realm(settings: Settings) -> str:
    host, _ = hub_address(settings)
    return f"https://{host}:{settings.hub_auth_port}/token"


def registry_service(settings: Settings) -> Service:
    """The registry process."""
    host, port = hub_address(settings)
    return Service(
        "hub",
        ["docker-registry", "serve", str(config_file(settings))],
        endpoint=f"https://{host}:{port} (Distribution)",
        ready=lambda: port_open(host, port),
        runs_our_code=False,
        config=config_file(settings),
    )


def auth_service(settings: Settings) -> Service:
    """The token service the registry sends clients to."""
    host, _ = hub_address(settings)
    return Service(
        "hub-auth",
        [sys.executable, "-m", "app.cli", "run", "hub-auth"],
        endpoint=token_realm(settings),
        ready=lambda: port_open(host, settings.hub_auth_port),
    )


def services(settings: Settings) -> list[Service]:
    """The hub's processes, token service first ([] when the stack has no hub)."""
    return [auth_service(settings), registry_service(settings)] if settings.hub else []


def storage_bytes(settings: Settings) -> int:
    """Bytes the hub's storage holds on disk."""
    return sum(f.stat().st_size for f in (hub_dir(settings) / "storage").rglob("*") if f.is_file())


#: How long the hub may take to serve again after its garbage collection.
READY_S = 30.0


def collect_garbage(settings: Settings, dry_run: bool = False) -> tuple[int, int, str]:
    """Free the hub's disk of the blobs no manifest references any more (what deleted
    images held): the registry stops for the length of its garbage collection, which
    must not run beside it, and starts again. Manifests a tag no longer names are kept:
    a tenant's image name means its first push, which a moved tag leaves untagged.
    Returns the storage's bytes before and after, and the collector's summary line."""
    import subprocess

    registry = registry_service(settings)
    before = storage_bytes(settings)
    stopped = registry.stop(settings)
    try:
        argv = ["docker-registry", "garbage-collect", str(config_file(settings))]
        done = subprocess.run(
            argv + (["--dry-run"] if dry_run else []), capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise ConfigError(f"the hub's garbage collection failed: {done.stderr.strip()[-500:]}")
    finally:
        if stopped:
            registry.start(settings)
            deadline = time.monotonic() + READY_S
            while registry.ready is not None and not registry.ready():
                if time.monotonic() > deadline:
                    raise ConfigError(f"the hub did not serve again within {READY_S:.0f} s")
                time.sleep(0.1)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return before, storage_bytes(settings), lines[-1] if lines else ""


def run(settings: Settings) -> None:
    """The hub in one process tree, for a container of its own (docker/compose.yaml):
    the registry as a child, the token service in the foreground; when one ends, both
    do. The files come from `dsec control prepare` (made here when missing)."""
    import subprocess

    from app.control import hub_auth

    if not config_file(settings).exists():
        prepare(settings)
    registry = subprocess.Popen(registry_service(settings).argv)
    try:
        hub_auth.main(settings, alive=lambda: registry.poll() is None)
    finally:
        registry.terminate()
        registry.wait(timeout=30)
