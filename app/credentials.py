"""A credential as its holder keeps it: a key id and its secret, and the Kafka
principal that goes with it, in a file only its owner reads. Trainers (the SDK),
nodes and the CLI load theirs from here; nothing in this module talks to the
platform's stores.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from app.bus import KafkaLogin
from app.config import Settings
from app.domain.proof import KEY_ID, SUBJECT, Role
from app.errors import ConfigError, ConfigReason


@dataclass(frozen=True)
class Credential:
    """Who its holder is to the platform, and the key that proves it."""

    key_id: str
    secret: bytes
    role: Role
    #: The tenant (or node id) it belongs to.
    subject: str
    #: Its Kafka principal (None: the process's settings say how to reach Kafka).
    kafka: KafkaLogin | None = None

    def to_json(self) -> str:
        """The file's content."""
        doc: dict[str, object] = {
            "key_id": self.key_id,
            "secret": self.secret.hex(),
            "role": self.role.value,
            "subject": self.subject,
        }
        if self.kafka is not None:
            doc["kafka"] = self.kafka.to_json()
        return json.dumps(doc, indent=2)

    @classmethod
    def from_json(cls, text: str, source: str = "credential") -> Credential:
        """Parse a credential file; :class:`ConfigError` naming ``source`` otherwise."""
        try:
            raw = json.loads(text)
            found = cls(
                key_id=str(raw["key_id"]),
                secret=bytes.fromhex(str(raw["secret"])),
                role=Role(raw["role"]),
                subject=str(raw["subject"]),
                kafka=KafkaLogin.from_json(raw["kafka"]) if raw.get("kafka") else None,
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"{source} is not a dsec credential: {exc}", reason=ConfigReason.BAD_CREDENTIAL
            ) from exc
        if not KEY_ID.match(found.key_id) or not SUBJECT.match(found.subject):
            raise ConfigError(
                f"{source}: malformed key id or subject", reason=ConfigReason.BAD_CREDENTIAL
            )
        if len(found.secret) != 32:
            raise ConfigError(
                f"{source}: the secret must be 32 bytes", reason=ConfigReason.BAD_CREDENTIAL
            )
        return found


def save(credential: Credential, path: Path) -> Path:
    """Write ``credential`` to ``path``, readable by its owner only (0600 in a 0700
    directory it makes if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(credential.to_json() + "\n")
    os.chmod(path, 0o600)
    return path


def load(path: Path) -> Credential:
    """Read a credential file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(
            f"cannot read credential {path}: {exc.strerror}", reason=ConfigReason.NO_CREDENTIAL
        ) from exc
    return Credential.from_json(text, str(path))


def tenant_file(settings: Settings, tenant: str) -> Path:
    """Where the local stack keeps the credential of ``tenant`` (operators included)."""
    return settings.secrets_dir / "credentials" / f"{tenant}.json"


def node_file(settings: Settings, node_id: str) -> Path:
    """Where a node host keeps its node's credential."""
    return settings.secrets_dir / "nodes" / f"{node_id}.json"


def for_client(settings: Settings, tenant: str | None = None) -> Credential:
    """The credential a trainer's client uses: ``tenant``'s local file if named, else
    ``DSEC_CREDENTIALS`` (a file), else ``~/.config/dsec/credentials.json``, else the
    local stack's default tenant."""
    if tenant:
        path = tenant_file(settings, tenant)
        if not path.exists():
            raise ConfigError(
                f"no credential for tenant {tenant!r} at {path}: "
                f"an operator makes one with `dsec tenant create {tenant}`",
                reason=ConfigReason.NO_CREDENTIAL,
            )
        return load(path)
    candidates: list[Path | None] = [
        settings.credentials_file,
        Path.home() / ".config" / "dsec" / "credentials.json",
        tenant_file(settings, settings.default_tenant),
    ]
    for candidate in candidates:
        if candidate is not None and candidate.exists():
            return load(candidate)
    raise ConfigError(
        "no dsec credential found: set DSEC_CREDENTIALS to a credential file "
        "(an operator makes one with `dsec tenant create NAME`)",
        reason=ConfigReason.NO_CREDENTIAL,
    )
