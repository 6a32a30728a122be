"""The node's outlet keeps a request's reply key while anyone still answers it."""

from __future__ import annotations

import uuid

from app.config import Settings
from app.domain.proof import Role
from app.sdk.credentials import Credential
from workers.events_out import Outlet


def test_a_reply_key_outlives_the_task_that_handed_its_command_over() -> None:
    outlet = Outlet(Settings(), Credential("k-node-n0", bytes(32), Role.NODE, "n0"))
    request_id = uuid.uuid4()
    task = outlet.answering(request_id, b"k" * 32)
    task.__enter__()
    with outlet.answering(request_id, b"k" * 32):  # the command's thread
        task.__exit__(None, None, None)  # the task ends while the command runs
        assert outlet._reply_keys[request_id] == b"k" * 32
    assert request_id not in outlet._reply_keys
