"""Node tasks as a reader of Redis or of an inbox topic sees them: nothing in them
answers a trainer, and none can be sent again under another task's name."""

from __future__ import annotations

import base64
import os

from app.domain.node_tasks import (
    NodeTask,
    Opened,
    TaskEnvelope,
    inbox_record,
    open_secret,
    read_inbox_record,
    seal,
    seal_secret,
    unseal,
)
from app.domain.proof import reply_key
from app.domain.requests import Exec

NODE_KEY = os.urandom(32)
TENANT_KEY = os.urandom(32)


def _sealed(task: NodeTask) -> tuple[list[str], bytes]:
    request = Exec(sandbox_id="sb-a", tenant="t", actor="t/k", command="true")
    key = reply_key(TENANT_KEY, request.request_id)
    envelope = TaskEnvelope(
        request=request.model_dump_json(), reply_key_sealed=seal_secret(NODE_KEY, key)
    )
    return seal(task, envelope, "k-node", NODE_KEY), key


def test_the_node_opens_its_task_and_its_reply_key() -> None:
    args, key = _sealed(NodeTask.EXEC)
    opened = unseal(NodeTask.EXEC, args, "k-node", NODE_KEY)
    assert isinstance(opened, Opened) and opened.reply_key == key


def test_a_reader_of_the_task_does_not_see_the_reply_key() -> None:
    # Given the sealed task, as anyone who reads Redis or the inbox topic has it
    args, key = _sealed(NodeTask.EXEC)
    # Then the reply key is in it neither in hex, nor in base64, nor raw
    text = "".join(args)
    assert key.hex() not in text and key.hex().upper() not in text
    assert base64.b64encode(key).decode() not in text
    # and another node's key does not open it
    assert (
        open_secret(
            os.urandom(32), TaskEnvelope.model_validate_json(args[0]).reply_key_sealed or ""
        )
        is None
    )


def test_a_sealed_task_sent_under_another_name_is_refused() -> None:
    # Given an Exec sealed for the node, sent again as a destroy (or a create)
    args, _key = _sealed(NodeTask.EXEC)
    for other in (NodeTask.DESTROY, NodeTask.CREATE, NodeTask.KILL_COMMAND):
        opened = unseal(other, args, "k-node", NODE_KEY)
        # Then the node refuses it, and has no reply key to answer anyone with
        assert isinstance(opened, str) and "proof" in opened


def test_a_reply_key_sealed_for_one_node_is_not_opened_by_another() -> None:
    sealed = seal_secret(NODE_KEY, b"k" * 32)
    assert open_secret(NODE_KEY, sealed) == b"k" * 32
    assert open_secret(os.urandom(32), sealed) is None
    assert open_secret(NODE_KEY, sealed[:-4] + "AAAA") is None
    assert open_secret(NODE_KEY, "not base64!") is None


def test_an_inbox_record_of_many_arrays_is_refused_before_it_is_parsed() -> None:
    # Given a record a trainer wrote to a node's inbox without the direct route's
    # header: anybody's until its seal is checked, and 1 MiB of empty arrays costs a
    # parser ~0.5 s of the node worker's CPU
    hostile = b'{"task":"exec","args":[' + b",".join([b"[]"] * 2000) + b"]}"
    # Then the inbox refuses it for its shape, without reading it
    refused = read_inbox_record(hostile)
    assert isinstance(refused, str) and "too_complex" in refused
    # While a sealed task, brackets and all in its strings, still opens
    args, _key = _sealed(NodeTask.EXEC)
    assert read_inbox_record(inbox_record(NodeTask.EXEC, args)) == (NodeTask.EXEC, args)
