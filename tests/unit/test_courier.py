"""The node's courier keeps a request's reply key while anyone still answers it."""

from __future__ import annotations

import uuid

import pytest

from app.config import Settings
from app.credentials import Credential
from app.domain.proof import Role
from workers.courier import Courier


def test_a_reply_key_outlives_the_task_that_handed_its_command_over() -> None:
    credential = Credential("k-node-n0", bytes(32), Role.NODE, "n0")
    courier = Courier(Settings(), credential, lambda: pytest.fail("nothing is sent"))
    request_id = uuid.uuid4()
    task = courier.answering(request_id, b"k" * 32)
    task.__enter__()
    with courier.answering(request_id, b"k" * 32):  # the command's thread
        task.__exit__(None, None, None)  # the task ends while the command runs
        assert courier._reply_keys[request_id] == b"k" * 32
    assert request_id not in courier._reply_keys
