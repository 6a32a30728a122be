"""The node's resolver for its sandboxes with an egress allowlist: the only DNS they
have (workers/host/egress.py redirects their port 53 here).

It answers A queries for names the asking sandbox's allowlist allows, and nothing
else: a refused name is answered REFUSED without being looked up anywhere, so data
spelled into query names (DNS tunnelling) never leaves the node. An allowed name is
looked up in the node's hosts file (``DSEC_EGRESS_HOSTS``: a site's internal names)
and then by the host's resolver; answers pointing at addresses no sandbox may reach
(loopback, link-local, the node's own, the sandboxes' pool: DNS rebinding) are
dropped; the rest are pinned for that sandbox before the answer goes out, so its
connection finds them open and no other address under that name.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from app.domain.egress import pinnable
from workers.host.egress import EgressFence, is_host_address

log = logging.getLogger(__name__)

#: TTL of the answers the sandbox gets (its pins last longer: MIN_PIN_S).
ANSWER_TTL_S = 60

Lookup = Callable[[str], list[str]]


def host_lookup(hosts_file: Path) -> Lookup:
    """Addresses of a name: the hosts file first, then the host's resolver."""

    def lookup(name: str) -> list[str]:
        with contextlib.suppress(OSError):
            found = [
                fields[0]
                for line in hosts_file.read_text().splitlines()
                if (fields := line.split("#", 1)[0].split()) and name in fields[1:]
            ]
            if found:
                return found
        with contextlib.suppress(OSError):
            infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
            return sorted({str(info[4][0]) for info in infos})
        return []

    return lookup


class EgressResolver:
    """A UDP DNS server for one node's sandboxes (a daemon thread)."""

    def __init__(
        self,
        fence: EgressFence,
        lookup: Lookup,
        forbidden: tuple[ipaddress.IPv4Network, ...],
        port: int = 0,
    ) -> None:
        self.fence = fence
        self.lookup = lookup
        self.forbidden = forbidden
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", port))
        #: The port sandboxes' DNS is redirected to.
        self.port: int = self.sock.getsockname()[1]

    def start(self) -> None:
        threading.Thread(target=self._serve, name="dsec-egress-dns", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
                answer = self.answer(data, peer[0])
                if answer is not None:
                    self.sock.sendto(answer, peer)
            except Exception:  # one bad query must not end the resolver
                log.exception("egress resolver")

    def answer(self, data: bytes, source: str) -> bytes | None:
        """The reply to query ``data`` from a sandbox at ``source`` (None: no reply,
        for what is no query from a sandbox of this node)."""
        attachment = self.fence.of_address(source)
        if attachment is None:
            return None
        try:
            query = dns.message.from_wire(data)
        except Exception:
            return None
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.RA
        if len(query.question) != 1:
            reply.set_rcode(dns.rcode.FORMERR)
            return reply.to_wire()
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True).lower()
        ports = attachment.policy.ports_for(name)
        if not ports:
            self.fence.count_refused_name(attachment, name)
            reply.set_rcode(dns.rcode.REFUSED)
            return reply.to_wire()
        if question.rdtype != dns.rdatatype.A:
            return reply.to_wire()  # an allowed name has IPv4 addresses only: NOERROR, empty
        addresses = [
            str(address)
            for address in map(_ipv4, self.lookup(name))
            if address is not None
            and pinnable(address, self.forbidden)
            and not is_host_address(address)
        ]
        if not addresses:
            reply.set_rcode(dns.rcode.NXDOMAIN)
            return reply.to_wire()
        secret = bool(attachment.secrets_for(name))
        self.fence.pin(attachment, addresses, ANSWER_TTL_S, ports, secret)
        reply.answer.append(
            dns.rrset.from_text_list(
                question.name, ANSWER_TTL_S, dns.rdataclass.IN, dns.rdatatype.A, addresses
            )
        )
        return reply.to_wire()


def _ipv4(text: str) -> ipaddress.IPv4Address | None:
    try:
        return ipaddress.IPv4Address(text)
    except ValueError:
        return None
