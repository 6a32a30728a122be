"""A trainer written in bash with Debian's kcat, openssl and jq, from docs/protocol.md
alone: it signs its requests, picks a replies partition from the broker's metadata,
fixes its position before sending, and checks every reply's proof.

Debian 12's kcat links librdkafka 2.0.2, whose SCRAM exchange Apache Kafka 4.x refuses
(librdkafka repeated the client nonce in its final message until 2.6.1; Kafka 4 checks
it as RFC 5802 says). The same kcat binary runs here with a newer librdkafka: the one
PyPI's confluent-kafka wheel carries (the dev extra), put first on its library path.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from app import credentials
from app.config import Settings
from tests.conftest import ensure_tenant

pytestmark = [pytest.mark.integration]

SCRIPT = Path(__file__).with_name("kcat_trainer.sh")


def newer_librdkafka(directory: Path) -> Path:
    """A directory holding ``librdkafka.so.1``: confluent-kafka's own librdkafka."""
    import confluent_kafka

    assert confluent_kafka.libversion()[1] >= 0x020601FF, "librdkafka 2.6.1 or newer"
    libs = Path(confluent_kafka.__file__).parent.parent / "confluent_kafka.libs"
    [found] = list(libs.glob("librdkafka*.so.1"))
    (directory / "librdkafka.so.1").symlink_to(found)
    return directory


def test_a_bash_trainer_creates_runs_and_destroys_with_kcat(
    stack: Settings, tmp_path: Path
) -> None:
    # Given a tenant's credential file, as `dsec tenant create` writes it
    ensure_tenant(stack, "kcat-team")
    path = credentials.tenant_file(stack, "kcat-team")
    # When the bash trainer drives a sandbox through the requests topic
    done = subprocess.run(
        [str(SCRIPT), str(path), stack.kafka_bootstrap, stack.topic_prefix],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "LD_LIBRARY_PATH": str(newer_librdkafka(tmp_path))},
    )  # fmt: skip
    # Then its command ran in the sandbox, and every step was answered and proven
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("hello from "), done.stdout
