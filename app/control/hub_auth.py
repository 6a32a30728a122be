"""The hub's token service: the registry sends every client here for a token
(Distribution's token authentication), and only what app/domain/hub_access.py grants
goes into it. It also serves what a tenant does through the hub's login besides
pulling, pushing and deleting: ``/images`` (what its images hold, against its quota),
``/share`` (its images' readers) and ``/secrets`` (its egress secrets:
app/control/egress_secrets.py).

A client logs in with HTTP Basic: its key id and the hub password derived from its
key's secret. The key is looked up in the platform's keyring (derived from the master
key, revocations read from Postgres every few seconds), so a revoked credential gets
no token within that time, and tokens last :data:`TOKEN_TTL_S`. A request without a
valid login gets 401 and nothing else: no anonymous pulls.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import ssl
import sys
import threading
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from app import secret_files
from app.config import Settings
from app.control.egress_secrets import SecretsService
from app.control.image_shares import StoredShares
from app.control.keyring import Keyring
from app.control.stored_quotas import StoredQuotas
from app.db import hub_events
from app.db.engine import transaction
from app.domain.codec import check_shape
from app.domain.hub_access import (
    TICKET,
    grant,
    parse_scopes,
    password_matches,
    read_ticket,
    share_refusal,
    ticket_actor,
)
from app.domain.hub_events import HubEvent, read_envelope
from app.domain.proof import Role
from app.errors import StorageRefused

log = logging.getLogger(__name__)

#: How long a token lets its holder act (a pull asks again for each image).
TOKEN_TTL_S = 300
#: Who the tokens say they are from, and whom they are for (the registry checks both).
ISSUER = "dsec-hub-auth"
AUDIENCE = "dsec-hub"


def key_id(public_key: ec.EllipticCurvePublicKey) -> str:
    """The registry's name for a signing key (libtrust's): the first 240 bits of the
    SHA-256 of its DER form, base32, in twelve groups of four."""
    der = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    b32 = base64.b32encode(hashlib.sha256(der).digest()[:30]).decode().rstrip("=")
    return ":".join(b32[i : i + 4] for i in range(0, len(b32), 4))


@dataclass(frozen=True)
class Login:
    """Who asks for a token."""

    #: The key id (what the audit trail names), or ``ticket:<node>:<job>``.
    key: str
    role: Role
    #: The tenant or node it belongs to.
    subject: str
    #: A snapshot ticket's one repository the node may push to.
    push_to: str | None = None


class TokenIssuer:
    """Checks a login and signs what it may do (pure but for the keyring)."""

    def __init__(
        self,
        keyring: Keyring,
        key: ec.EllipticCurvePrivateKey,
        kid: str,
        may_add: Callable[[str, str], bool] = lambda tenant, repository: True,
        readers: Callable[[str], Collection[str]] = lambda repository: (),
    ) -> None:
        """``may_add(tenant, repository)``: whether the tenant may push there (its
        quotas: room left of its megabytes, and a repository it has or room for one
        more)."""
        self.keyring = keyring
        self.key = key
        self.kid = kid
        self.may_add = may_add
        #: Who else may read a tenant's repository (app/control/image_shares.py).
        self.readers = readers

    def role_of(self, authorization: str | None) -> Login | None:
        """Who a Basic login is, or None: a platform credential's key, or a snapshot's
        ticket (checked under the platform's ticket key, unexpired)."""
        if not authorization or not authorization.startswith("Basic "):
            return None
        try:
            user, _, password = (
                base64.b64decode(authorization[6:], validate=True).decode().partition(":")
            )
        except (binascii.Error, UnicodeDecodeError):
            return None
        if user.startswith(TICKET):
            found_ticket = read_ticket(self.keyring.ticket_key(), user, password, time.time())
            if found_ticket is None:
                return None
            node, repository, job = found_ticket
            return Login(ticket_actor(node, job), Role.NODE, node, push_to=repository)
        found = self.keyring.lookup(user)
        if found is None or found.revoked or not password_matches(found.secret, password):
            return None
        return Login(user, found.principal.role, found.principal.subject)

    def token(self, login: Login, service: str, scopes: list[str]) -> str:
        """A signed token for ``login`` granting what it may do of ``scopes``."""
        now = int(time.time())
        access = []
        for scope in parse_scopes(scopes):
            g = grant(login.role, scope, login.subject, self.readers(scope.name))
            actions = list(g.actions)
            if login.push_to is not None and g.name == login.push_to and "push" in scope.actions:
                actions.append("push")  # a snapshot's ticket: this repository only
            tenant = login.role == Role.TENANT
            if tenant and "push" in actions and not self.may_add(login.subject, g.name):
                actions.remove("push")  # over an images quota: it may still pull
            access.append({"type": g.type, "name": g.name, "actions": actions})
        claims = {
            "iss": ISSUER,
            "sub": login.key,
            "aud": service,
            "iat": now,
            "nbf": now - 5,
            "exp": now + TOKEN_TTL_S,
            "jti": uuid.uuid4().hex,
            "access": access,
        }
        return jwt.encode(claims, self.key, algorithm="ES256", headers={"kid": self.kid})


Share = Callable[[str, list[str], str, bool], None]
#: A tenant's images in the hub and what they hold (``/images``).
Held = Callable[[str], dict[str, Any]]


def _json_body(raw: bytes) -> Any:
    """A tenant's JSON body, refused (``ValueError``) before it is parsed if it holds
    more arrays and objects than any call needs: one token service serves every
    tenant's logins and every node's pulls, and parsing 1 MiB of empty arrays costs it
    ~0.5 s (app/domain/codec.py)."""
    check_shape(raw)
    return json.loads(raw)


def _handler(
    issuer: TokenIssuer, share: Share, secrets: SecretsService | None = None,
    held: Held | None = None,
) -> type[BaseHTTPRequestHandler]:  # fmt: skip
    class Handler(BaseHTTPRequestHandler):
        def _secrets(self, method: str) -> None:
            """``/secrets``: a tenant's own egress secrets (app/control/egress_secrets.py)."""
            # The body is read first: a connection closed on unread bytes is reset, and
            # the client would never read the answer.
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if 0 < length <= MAX_REPORT_BYTES else b""
            who = issuer.role_of(self.headers.get("Authorization"))
            if secrets is None or who is None or who.role != Role.TENANT or who.push_to:
                self._answer(401, {"errors": [{"code": "UNAUTHORIZED", "message": "login"}]})
                return
            body: Any = None
            if method != "GET":
                try:
                    if not raw:
                        raise ValueError("no body, or too large")
                    body = _json_body(raw)
                except ValueError as exc:
                    self._answer(400, {"errors": [{"code": "INVALID", "message": str(exc)[:200]}]})
                    return
            self._answer(*secrets.handle(method, who.subject, who.key, body))

        def do_PUT(self) -> None:
            if self.path != "/secrets":
                self._answer(404, {"errors": [{"code": "NOT_FOUND"}]})
                return
            self._secrets("PUT")

        def do_DELETE(self) -> None:
            if self.path != "/secrets":
                self._answer(404, {"errors": [{"code": "NOT_FOUND"}]})
                return
            self._secrets("DELETE")

        def do_POST(self) -> None:
            """``/share``: an owner (or an operator) lets tenants use an image
            repository, or takes them back: ``{"repository", "readers", "remove"}``."""
            who = issuer.role_of(self.headers.get("Authorization"))
            if self.path != "/share" or who is None or who.push_to is not None:
                self._answer(401, {"errors": [{"code": "UNAUTHORIZED", "message": "login"}]})
                return
            length = int(self.headers.get("Content-Length") or 0)
            try:
                if not 0 < length <= MAX_REPORT_BYTES:
                    raise ValueError("no body, or too large")
                body = _json_body(self.rfile.read(length))
                repository, readers = str(body["repository"]), [str(r) for r in body["readers"]]
                remove = bool(body.get("remove", False))
            except (ValueError, KeyError, TypeError) as exc:
                self._answer(400, {"errors": [{"code": "INVALID", "message": str(exc)[:200]}]})
                return
            refused = share_refusal(who.role, who.subject, repository, readers)
            if refused is not None:
                self._answer(403, {"errors": [{"code": "DENIED", "message": refused}]})
                return
            try:
                share(repository, readers, who.key, remove)
            except StorageRefused as exc:  # past the readers a repository may have
                self._answer(403, {"errors": [{"code": "DENIED", "message": str(exc)}]})
                return
            self._answer(200, {"repository": repository, "readers": readers, "removed": remove})

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path == "/secrets":
                self._secrets("GET")
                return
            if url.path == "/images":
                who = issuer.role_of(self.headers.get("Authorization"))
                if held is None or who is None or who.role != Role.TENANT or who.push_to:
                    self._answer(401, {"errors": [{"code": "UNAUTHORIZED", "message": "login"}]})
                    return
                self._answer(200, held(who.subject))
                return
            if url.path != "/token":
                self._answer(404, {"errors": [{"code": "NOT_FOUND"}]})
                return
            who = issuer.role_of(self.headers.get("Authorization"))
            if who is None:
                self._answer(401, {"errors": [{"code": "UNAUTHORIZED", "message": "login"}]})
                return
            query = parse_qs(url.query)
            service = query.get("service", [""])[0]
            if service != AUDIENCE:
                self._answer(400, {"errors": [{"code": "DENIED", "message": "unknown service"}]})
                return
            token = issuer.token(who, service, query.get("scope", []))
            self._answer(200, {"token": token, "access_token": token, "expires_in": TOKEN_TTL_S})

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            if status == 401:
                self.send_header("WWW-Authenticate", 'Basic realm="dsec hub"')
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("hub-auth: " + format, *args)

    return Handler


def _events_handler(
    secret: str, record: Callable[[list[HubEvent]], None]
) -> type[BaseHTTPRequestHandler]:
    """The registry's reports of pushes and deletions, into the audit trail."""
    expected = f"Bearer {secret}"

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            offered = self.headers.get("Authorization") or ""
            if self.path != "/events" or not hmac.compare_digest(offered, expected):
                self._answer(401)
                return
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_REPORT_BYTES:
                self._answer(413)
                return
            try:
                events, dropped = read_envelope(json.loads(self.rfile.read(length)))
            except ValueError:
                events, dropped = [], 1
            if dropped:
                log.warning("hub-auth: %d malformed event(s) in a report from the hub", dropped)
            try:
                record(events)
            except Exception as exc:  # the registry sends it again: nothing is lost
                log.warning("hub-auth: cannot record %d hub event(s): %s", len(events), exc)
                self._answer(503)
                return
            self._answer(200)

        def _answer(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            log.debug("hub-auth events: " + format, *args)

    return Handler


#: Largest report the registry may send (it batches a few events).
MAX_REPORT_BYTES = 1 << 20


def events_port(settings: Settings) -> int:
    """Where the registry reports to (loopback of the hub's host, plain HTTP behind a
    shared secret: the registry checks no private CA for notifications)."""
    return settings.hub_auth_port + 1


def events_secret_file(settings: Settings) -> Path:
    return hub_dir(settings) / "events.secret"


class _TlsServer(ThreadingHTTPServer):
    """Each connection's TLS handshake on its own thread, with a deadline: a client
    that connects and says nothing holds only its own thread."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 context: ssl.SSLContext) -> None:  # fmt: skip
        super().__init__(address, handler)
        self.context = context

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(HANDSHAKE_S)
        with self.context.wrap_socket(request, server_side=True) as wrapped:
            super().finish_request(wrapped, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A probe that connects and hangs up (a readiness check), or a client that
        # speaks no TLS, is no error of ours; anything else is.
        if isinstance(sys.exc_info()[1], ssl.SSLError | ConnectionError | TimeoutError):
            log.debug("hub-auth: connection from %s dropped", client_address)
        else:
            log.exception("hub-auth: a request from %s failed", client_address)


#: How long a client has to finish its TLS handshake and send its request.
HANDSHAKE_S = 10.0


def hub_address(settings: Settings) -> tuple[str, int]:
    """The hub's host and port (its token service listens on that host too)."""
    host, _, port = settings.hub.rpartition(":")
    return host or "127.0.0.1", int(port)


def hub_dir(settings: Settings) -> Path:
    """The hub's settings, certificates and storage (root only)."""
    return settings.state_dir / "hub"


def token_key_file(settings: Settings) -> Path:
    """The key tokens are signed with (root only; `dsec up` makes it)."""
    return hub_dir(settings) / "token-key.pem"


def token_cert_file(settings: Settings) -> Path:
    """Its certificate: the registry's ``rootcertbundle``."""
    return hub_dir(settings) / "token.pem"


def server_pem(settings: Settings) -> Path:
    """The hub's key and certificate (the registry's and this service's)."""
    return hub_dir(settings) / "hub.pem"


def main(settings: Settings, alive: Callable[[], bool] | None = None) -> None:
    """Serve tokens on the hub's host at ``hub_auth_port`` (TLS, the hub's certificate);
    with ``alive``, only while it holds (checked every few seconds: the registry this
    process runs beside, in a container of their own)."""
    pem = secret_files.read(token_key_file(settings))
    key = serialization.load_pem_private_key(pem, None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    quotas = StoredQuotas.from_settings(settings)

    def may_add(tenant: str, repository: str) -> bool:
        quota = quotas.of(tenant)
        if quota.images is None and quota.image_mb is None:
            return True
        with transaction(settings.database_url) as conn:
            # Checked as a push begins: the push that crosses the line ends past it
            mb = quota.image_mb
            if mb is not None and hub_events.stored_bytes(conn, tenant) >= mb << 20:
                return False
            if quota.images is None:
                return True
            held = hub_events.repositories_of(conn, tenant)
        return repository in held or len(held) < quota.images

    def held(tenant: str) -> dict[str, Any]:
        with transaction(settings.database_url) as conn:
            images = hub_events.images_of(conn, tenant)
            held_bytes = hub_events.stored_bytes(conn, tenant)
        quota = quotas.of(tenant)
        return {
            "images": [
                {
                    "name": i.name,
                    "digest": i.digest,
                    "pushed_at": i.pushed_at.isoformat(),
                    "size": i.size,
                }
                for i in images
            ],
            "held_bytes": held_bytes,
            "quota_mb": quota.image_mb,
            "quota_images": quota.images,
        }

    def record(events: list[HubEvent]) -> None:
        with transaction(settings.database_url) as conn:
            hub_events.record(conn, events)

    keyring = Keyring.from_settings(settings)
    shares = StoredShares.from_settings(settings)
    issuer = TokenIssuer(keyring, key, key_id(key.public_key()), may_add, shares.readers)

    def share(repository: str, readers: list[str], by: str, remove: bool) -> None:
        with transaction(settings.database_url) as conn:
            hub_events.set_readers(conn, repository, readers, by, remove)
        said = "unshared" if remove else "shared"
        log.info("hub-auth: %s %s %s with %s", by, said, repository, readers)

    secret = secret_files.read(events_secret_file(settings)).decode()
    reports = ThreadingHTTPServer(
        ("127.0.0.1", events_port(settings)), _events_handler(secret, record)
    )
    reports.daemon_threads = True
    threading.Thread(
        target=reports.serve_forever, args=(3600,), name="hub-events", daemon=True
    ).start()
    host, _ = hub_address(settings)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(server_pem(settings))
    handler = _handler(issuer, share, SecretsService(settings), held)
    server = _TlsServer((host, settings.hub_auth_port), handler, context)
    log.info("hub-auth: tokens for %s on %s:%d", AUDIENCE, host, settings.hub_auth_port)
    if alive is None:
        # A long poll interval: it only sets how often an idle server checks for shutdown.
        server.serve_forever(poll_interval=3600)
        return
    serving = threading.Thread(target=server.serve_forever, args=(3600,), daemon=True)
    serving.start()
    while alive():
        time.sleep(5)
    log.error("hub-auth: the registry beside it ended; stopping")
    server.shutdown()
