"""Per-sandbox egress on a node host: a veth pair into the sandbox's own network
namespace and one nftables table that lets each interface through to what its
allowlist (app/domain/egress.py) allows.

Why not slirp4netns with a firewall rule: its traffic leaves as the node user, which
every sandbox of the node shares, so a rule cannot tell sandboxes apart. A veth per
sandbox gives each one an interface of its own on the host (``dsb<slot>``), and every
rule below matches it. The sandbox keeps no capability, so it can change neither its
address nor its routes; whatever it sends arrives on its own interface.

The table (``inet dsec_egress``, shared by the nodes of a host, made once):

- DNS (UDP/TCP 53 to any address) from a sandbox is redirected to its node's
  resolver (workers/egress_dns.py), which answers allowed names only and pins the
  addresses it answered into ``allowed`` (interface . address . ports);
- everything else new from a sandbox goes to the host itself: refused; to
  loopback, link-local, multicast, reserved or the sandboxes' pool: refused; beyond
  the cap of open connections: refused; in ``allowed``: accepted and masqueraded;
  anything else refused and counted per interface (``refused``);
- nothing new enters a sandbox's interface from outside (another sandbox, the LAN);
- plain HTTP (port 80) to an address the resolver answered for a name the sandbox
  holds an egress secret for (``secret_dst``) is redirected to its node's secrets
  proxy (workers/egress_proxy.py), which adds the header and goes on over TLS.

Bandwidth is capped both ways with a token bucket on each end of the pair.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from app.domain.egress import NEVER, SECRET_PLAIN_PORT, EgressSecret, NetworkPolicy, carries
from app.domain.node_tasks import open_egress_secrets, seal_egress_secrets
from workers.errors import NodeError
from workers.host.file_lock import file_lock
from workers.host.nft_sets import elements, keys_of, readd

log = logging.getLogger(__name__)

TABLE = "dsec_egress"
#: Host interfaces of sandboxes: ``dsb<slot>``; the sandbox sees its end as ``eth0``.
PREFIX = "dsb"
#: Which slots are taken on this host, by whom (tmpfs: a reboot frees them all, as it
#: removes every interface).
SLOT_DIR = Path("/run/dsec-egress")
#: Names the ruleset a table was made by: a node of another version makes it again.
RULESET = "dsec egress 5"
#: A freshly taken slot whose interface is not there yet is not stale before this.
_SLOT_GRACE_S = 60.0
#: Most refusals one sandbox's end reports (Stopped's ``egress_refused_sample``).
SAMPLE = 16
#: How long an address the resolver answered stays pinned, at least (an answer's TTL
#: is often shorter than clients cache it).
MIN_PIN_S = 600
#: A pin is made this much longer than asked, so the same answer given again within
#: it needs no new one (each is an ``nft`` run, ~10 ms here, on every lookup).
PIN_SLACK_S = 300


@dataclass(frozen=True)
class Attachment:
    """One sandbox's interface: its slot, names and addresses."""

    sandbox_id: str
    slot: int
    policy: NetworkPolicy
    host_ip: ipaddress.IPv4Address
    sandbox_ip: ipaddress.IPv4Address
    #: The tenant's egress secrets this sandbox's requests carry (held in this
    #: process only: a worker restarted does not have them, and their requests are
    #: then refused rather than sent without).
    secrets: tuple[EgressSecret, ...] = field(default=(), repr=False)

    @property
    def iface(self) -> str:
        return f"{PREFIX}{self.slot}"

    def secrets_for(self, name: str) -> list[EgressSecret]:
        """The secrets requests to ``name`` carry (none unless the allowlist reaches it)."""
        found = [s for s in self.secrets if s.destination == name.lower().rstrip(".")]
        return found if found and carries(self.policy, found[0].destination) else []


def _run(argv: list[str], stdin: str | None = None) -> str:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NodeError(f"{' '.join(argv[:4])}: {done.stderr.strip()[:300]}")
    return done.stdout


#: An interface, the addresses and ports pinned for it, and whether for a secret.
_PinKey = tuple[str, tuple[str, ...], tuple[tuple[int, int], ...], bool]


def _ports(ports: tuple[int, int]) -> str:
    return str(ports[0]) if ports[0] == ports[1] else f"{ports[0]}-{ports[1]}"


class EgressFence:
    """This node's sandboxes' interfaces and their share of the host's table."""

    def __init__(
        self,
        node_id: str,
        pool: ipaddress.IPv4Network,
        dns_port: int,
        max_connections: int,
        mbit: int,
        key: bytes = b"",
    ) -> None:
        self.node_id = node_id
        #: The node's key: a slot's record keeps its sandbox's secrets sealed with it,
        #: so a worker started again carries them on (empty: records keep none).
        self._key = key
        self.pool = pool
        self.dns_port = dns_port
        #: Where this node's secrets proxy listens (0: none yet).
        self.proxy_port = 0
        self.max_connections = max_connections
        self.mbit = mbit
        self._by_sandbox: dict[str, Attachment] = {}
        self._by_ip: dict[ipaddress.IPv4Address, Attachment] = {}
        #: Names the resolver refused, per interface (the firewall counts connections),
        #: and the first few of them.
        self._names_refused: dict[str, int] = {}
        self._names_sample: dict[str, list[str]] = {}
        #: What was pinned for whom, until when (monotonic): see PIN_SLACK_S.
        self._pinned: dict[_PinKey, float] = {}
        self._lock = threading.Lock()

    # --- the host's table ---------------------------------------------------------

    def ensure(self) -> str | None:
        """Make the host's table once and turn forwarding on; returns why egress by
        allowlist cannot be enforced here, or None when it can."""
        for tool in ("nft", "ip", "nsenter"):
            if shutil.which(tool) is None:
                return f"no {tool} (the bootstrap installs nftables, iproute2, util-linux)"
        try:
            SLOT_DIR.mkdir(mode=0o700, exist_ok=True)
            with file_lock(SLOT_DIR / ".lock"):
                listed = subprocess.run(
                    ["nft", "list", "table", "inet", TABLE],
                    capture_output=True, text=True, check=False,
                )  # fmt: skip
                if f'comment "{RULESET}"' not in listed.stdout:
                    # Absent, or made by another version: made again (what this node's
                    # running sandboxes had in it is put back by _recover below).
                    if listed.returncode == 0:
                        _run(["nft", "delete", "table", "inet", TABLE])
                    _run(["nft", "-f", "-"], self._ruleset())
            Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
        except (OSError, NodeError) as exc:
            return f"nftables table {TABLE}: {exc}"
        self._recover()
        return None

    def _ruleset(self) -> str:
        never = ", ".join(str(net) for net in (*NEVER, self.pool))
        # Policing, each way: what passes the rate is dropped (TCP then slows down).
        kbytes = self.mbit * 1_000_000 // 8 // 1024
        rate = f"limit rate over {kbytes} kbytes/second burst {max(kbytes // 8, 64)} kbytes"
        return f"""
table inet {TABLE} {{
  comment "{RULESET}"
  set allowed {{ type ifname . ipv4_addr . inet_service; flags interval, timeout; }}
  map dns_port {{ type ifname : inet_service; }}
  set refused {{ type ifname; flags dynamic; counter; size 65535; }}
  set conns {{ type ifname; flags dynamic; size 65535; }}
  set up {{ type ifname; flags dynamic; size 65535; }}
  set down {{ type ifname; flags dynamic; size 65535; }}
  set refused_dst {{
    type ifname . ipv4_addr . inet_service; flags dynamic, timeout; timeout 1h; size 65535;
  }}
  set never {{ type ipv4_addr; flags interval; elements = {{ {never} }}; }}
  set secret_dst {{ type ifname . ipv4_addr; flags timeout; }}
  map proxy_port {{ type ifname : inet_service; }}
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "{PREFIX}*" meta l4proto {{ tcp, udp }} th dport 53 redirect to :iifname map @dns_port
    iifname "{PREFIX}*" tcp dport {SECRET_PLAIN_PORT} iifname . ip daddr @secret_dst \
      redirect to :iifname map @proxy_port
  }}
  chain input {{
    type filter hook input priority filter - 5; policy accept;
    iifname "{PREFIX}*" jump to_host
  }}
  chain to_host {{
    update @up {{ iifname {rate} }} drop
    ct state established,related accept
    ct status dnat meta l4proto udp accept
    ct status dnat meta l4proto tcp ct original proto-dst {SECRET_PLAIN_PORT} accept
    meta l4proto tcp add @refused_dst {{ iifname . ip daddr . tcp dport }}
    add @refused {{ iifname }} reject with icmpx admin-prohibited
  }}
  chain forward {{
    type filter hook forward priority filter - 5; policy accept;
    iifname "{PREFIX}*" jump from_sandbox
    oifname "{PREFIX}*" update @down {{ oifname {rate} }} drop
    oifname "{PREFIX}*" ct state established,related accept
    oifname "{PREFIX}*" drop
  }}
  chain from_sandbox {{
    meta nfproto ipv6 drop
    update @up {{ iifname {rate} }} drop
    ct state established,related accept
    meta l4proto tcp ip daddr @never add @refused_dst {{ iifname . ip daddr . tcp dport }}
    ip daddr @never add @refused {{ iifname }} reject with icmpx admin-prohibited
    meta l4proto tcp add @conns {{ iifname ct count over {self.max_connections} }} \\
      add @refused {{ iifname }} reject with tcp reset
    meta l4proto tcp iifname . ip daddr . tcp dport @allowed accept
    meta l4proto tcp add @refused_dst {{ iifname . ip daddr . tcp dport }}
    add @refused {{ iifname }} reject with icmpx admin-prohibited
  }}
  chain output {{
    type filter hook output priority filter - 5; policy accept;
    oifname "{PREFIX}*" update @down {{ oifname {rate} }} drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {self.pool} oifname != "{PREFIX}*" masquerade
  }}
}}
"""

    # --- slots --------------------------------------------------------------------

    def _slot_ips(self, slot: int) -> tuple[ipaddress.IPv4Address, ipaddress.IPv4Address]:
        base = self.pool.network_address + 4 * slot
        return base + 1, base + 2

    def _take_slot(
        self, sandbox_id: str, policy: NetworkPolicy, secrets: tuple[EgressSecret, ...]
    ) -> int:
        sealed = seal_egress_secrets(self._key, list(secrets)) if self._key else None
        record = json.dumps(
            {"sandbox_id": sandbox_id, "node_id": self.node_id, "allow": policy.allow,
             "secrets": sealed}
        )  # fmt: skip
        with file_lock(SLOT_DIR / ".lock"):
            for slot in range(1, self.pool.num_addresses // 4):
                path = SLOT_DIR / str(slot)
                if path.exists() and not self._stale(slot, path):
                    continue
                path.write_text(record)
                return slot
        raise NodeError(f"no free egress slot in {self.pool}")

    @staticmethod
    def _stale(slot: int, path: Path) -> bool:
        if Path(f"/sys/class/net/{PREFIX}{slot}").exists():
            return False
        with contextlib.suppress(OSError):
            return time.time() - path.stat().st_mtime > _SLOT_GRACE_S
        return True

    def _recover(self) -> None:
        """Take back this node's interfaces a previous worker made (their sandboxes
        live on): the resolver must know them again, and the table lead their DNS to
        it. Their pins come back as they ask again."""
        for path in SLOT_DIR.glob("[0-9]*"):
            with contextlib.suppress(OSError, ValueError, KeyError, NodeError):
                record = json.loads(path.read_text())
                slot = int(path.name)
                if record["node_id"] != self.node_id or self._stale(slot, path):
                    continue
                host_ip, sandbox_ip = self._slot_ips(slot)
                attachment = Attachment(
                    record["sandbox_id"], slot, NetworkPolicy(allow=record["allow"]),
                    host_ip, sandbox_ip, self._reopen(record.get("secrets")),
                )  # fmt: skip
                # This worker's resolver listens on another port; a table made again
                # holds nothing of it.
                for name in ("dns_port", "proxy_port"):
                    subprocess.run(
                        ["nft", f'delete element inet {TABLE} {name} {{ "{attachment.iface}" }}'],
                        capture_output=True, check=False,
                    )  # fmt: skip
                _run(["nft", "-f", "-"], self._elements(attachment))
                self._keep(attachment)

    def _reopen(self, sealed: str | None) -> tuple[EgressSecret, ...]:
        """A recovered slot's secrets (none if it kept none or they do not open: its
        requests are then refused, never sent without them)."""
        if not sealed or not self._key:
            return ()
        opened = open_egress_secrets(self._key, sealed)
        if isinstance(opened, str):
            log.warning("egress slot's secrets dropped: %s", opened)
            return ()
        return opened

    def _keep(self, attachment: Attachment) -> None:
        with self._lock:
            self._by_sandbox[attachment.sandbox_id] = attachment
            self._by_ip[attachment.sandbox_ip] = attachment

    # --- sandboxes ----------------------------------------------------------------

    def attach(
        self,
        sandbox_id: str,
        pid: int,
        policy: NetworkPolicy,
        secrets: tuple[EgressSecret, ...] = (),
    ) -> Attachment:
        """Give the sandbox whose init is ``pid`` its interface and its allowlist's
        addresses (and ``secrets``, its requests' headers); NodeError if any step
        fails (nothing is left behind then)."""
        slot = self._take_slot(sandbox_id, policy, secrets)
        host_ip, sandbox_ip = self._slot_ips(slot)
        attachment = Attachment(sandbox_id, slot, policy, host_ip, sandbox_ip, secrets)
        iface = attachment.iface
        # Three processes, each a batch: every spawn costs a create milliseconds.
        try:
            _run(["ip", "-batch", "-"], (
                f"link add {iface} type veth peer name eth0 netns {pid}\n"
                f"addr add {host_ip}/30 dev {iface}\n"
                f"link set {iface} up\n"
            ))  # fmt: skip
            _run(["nsenter", f"--net=/proc/{pid}/ns/net", "--", "ip", "-batch", "-"], (
                f"addr add {sandbox_ip}/30 dev eth0\n"
                "link set eth0 up\n"
                f"route add default via {host_ip}\n"
            ))  # fmt: skip
            _run(["nft", "-f", "-"], self._elements(attachment))
        except NodeError:
            self._release(attachment)
            raise
        self._keep(attachment)
        return attachment

    def _elements(self, attachment: Attachment) -> str:
        """What the table holds for one sandbox from its creation on: its resolver's
        port and its allowlist's address rules."""
        iface = attachment.iface
        script = f'add element inet {TABLE} dns_port {{ "{iface}" : {self.dns_port} }}\n'
        if attachment.secrets and self.proxy_port:
            script += f'add element inet {TABLE} proxy_port {{ "{iface}" : {self.proxy_port} }}\n'
        elements = [
            f'"{iface}" . {network} . {_ports(ports)}'
            for network, ports in attachment.policy.networks()
        ]
        if elements:
            script += f"add element inet {TABLE} allowed {{ {', '.join(elements)} }}\n"
        return script

    def pin(
        self,
        attachment: Attachment,
        addresses: Iterable[str],
        ttl_s: int,
        ports: list[tuple[int, int]],
        secret: bool = False,
    ) -> None:
        """Let the sandbox reach ``addresses`` (the resolver's answer for an allowed
        name) on ``ports``, for at least :data:`MIN_PIN_S`; with ``secret`` (the name
        is a secret's destination), its plain HTTP to them goes to the secrets proxy."""
        timeout = max(ttl_s, MIN_PIN_S)
        now = time.monotonic()
        key: _PinKey = (attachment.iface, tuple(sorted(addresses)), tuple(ports), secret)
        with self._lock:
            if self._pinned.get(key, 0.0) >= now + timeout:
                return  # pinned for longer than this answer asks already
        listed, timeout = list(key[1]), timeout + PIN_SLACK_S
        entries = [
            f'"{attachment.iface}" . {address} . {_ports(p)} timeout {timeout}s'
            for address in listed
            for p in ports
        ]
        script = readd(TABLE, "allowed", entries) if entries else ""
        if secret and listed:
            script += readd(
                TABLE,
                "secret_dst",
                [f'"{attachment.iface}" . {address} timeout {timeout}s' for address in listed],
            )
        if script:
            _run(["nft", "-f", "-"], script)
        with self._lock:
            self._pinned[key] = now + timeout

    def of_address(self, source: str) -> Attachment | None:
        """The attachment whose sandbox sends from ``source``."""
        with contextlib.suppress(ValueError):
            return self._by_ip.get(ipaddress.IPv4Address(source))
        return None

    def refused(self, sandbox_id: str) -> int | None:
        """Connections and names this sandbox was refused so far (None: it has no
        allowlist here)."""
        attachment = self._by_sandbox.get(sandbox_id)
        if attachment is None:
            return None
        return self._counters().get(attachment.iface, 0)

    def count_refused_name(self, attachment: Attachment, name: str) -> None:
        """A refusal the firewall does not see (a name the resolver refused, a
        connection the secrets proxy turned away) counts among the sandbox's
        refusals, ``name`` in its sample."""
        with self._lock:
            iface = attachment.iface
            self._names_refused[iface] = self._names_refused.get(iface, 0) + 1
            sample = self._names_sample.setdefault(iface, [])
            if len(sample) < SAMPLE and name[:253] not in sample:
                sample.append(name[:253])

    def refused_sample(self, sandbox_id: str) -> list[str] | None:
        """Some of what this sandbox was refused: names, then address:port (None: it
        has no allowlist here)."""
        attachment = self._by_sandbox.get(sandbox_id)
        if attachment is None:
            return None
        with self._lock:
            sample = list(self._names_sample.get(attachment.iface, []))
        for key in sorted(keys_of(_listing("refused_dst"), attachment.iface)):
            _, address, port = key.split(" . ")
            if len(sample) >= SAMPLE:
                break
            sample.append(f"{address}:{port}")
        return sample

    def _counters(self) -> dict[str, int]:
        counts: dict[str, int] = dict(self._names_refused)
        for entry in elements(_listing("refused")):
            elem = entry.get("elem", entry)
            if isinstance(elem, dict) and isinstance(elem.get("val"), str):
                packets = elem.get("counter", {}).get("packets", 0)
                counts[elem["val"]] = counts.get(elem["val"], 0) + int(packets)
        return counts

    def detach(self, sandbox_id: str) -> None:
        """Forget the sandbox's interface and what it was allowed (its container is
        gone or going: the interface goes with its namespace, or is deleted here)."""
        with self._lock:
            attachment = self._by_sandbox.pop(sandbox_id, None)
            if attachment is not None:
                self._by_ip.pop(attachment.sandbox_ip, None)
                self._names_refused.pop(attachment.iface, None)
                self._names_sample.pop(attachment.iface, None)
                for key in [k for k in self._pinned if k[0] == attachment.iface]:
                    del self._pinned[key]
        if attachment is not None:
            self._release(attachment)

    def _release(self, attachment: Attachment) -> None:
        iface = attachment.iface
        script = [
            f'delete element inet {TABLE} {name} {{ "{iface}" }}'
            for name in ("dns_port", "proxy_port", "refused", "conns", "up", "down")
        ]
        for name in ("allowed", "secret_dst", "refused_dst"):
            for key in keys_of(_listing(name), iface):
                script.append(f"delete element inet {TABLE} {name} {{ {key} }}")
        for line in script:  # one by one: a missing element must not stop the rest
            subprocess.run(["nft", line], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", iface], capture_output=True, check=False)
        with contextlib.suppress(OSError):
            (SLOT_DIR / str(attachment.slot)).unlink()


def _listing(name: str) -> str:
    """``nft -j list`` of the table's set ``name`` ('' if it cannot be listed)."""
    listed = subprocess.run(
        ["nft", "-j", "list", "set", "inet", TABLE, name],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return listed.stdout if listed.returncode == 0 else ""


def is_host_address(address: ipaddress.IPv4Address) -> bool:
    """Whether ``address`` is one of the host's own, now (only those can be bound):
    interfaces come and go while the node runs."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:
            return False
    return True
