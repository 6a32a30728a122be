"""A trainer written in bash with Debian's kcat, openssl and jq, from docs/protocol.md
alone: it signs its requests, picks a replies partition from the broker's metadata,
fixes its position before sending, and checks every reply's proof."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from app.config import Settings
from app.sdk import credentials
from tests.conftest import ensure_tenant

pytestmark = [pytest.mark.integration]

SCRIPT = Path(__file__).with_name("kcat_trainer.sh")


def test_a_bash_trainer_creates_runs_and_destroys_with_kcat(stack: Settings) -> None:
    # Given a tenant's credential file, as `dsec tenant create` writes it
    ensure_tenant(stack, "kcat-team")
    path = credentials.tenant_file(stack, "kcat-team")
    # When the bash trainer drives a sandbox through the requests topic
    done = subprocess.run(
        [str(SCRIPT), str(path), stack.kafka_bootstrap, stack.topic_prefix],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    # Then its command ran in the sandbox, and every step was answered and proven
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("hello from "), done.stdout
