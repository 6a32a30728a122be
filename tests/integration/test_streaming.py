"""A long command's output reaches the trainer while it runs, and adds up to its result."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
import uuid
from typing import Any

import pytest
from kafka import TopicPartition

from app import bus
from app.config import Settings
from app.domain.replies import ExecOutput
from app.sdk.aio import AsyncClient
from app.sdk.client import Chunk, exec_request

pytestmark = pytest.mark.integration

# Prints, then works for a while: the first line can only be in hand long before
# the result if it was streamed.
SLOW = (
    "echo started; echo to-stderr >&2; sleep 2; "
    "i=0; while [ $i -lt 200 ]; do echo line-$i; i=$((i+1)); done"
)


def test_output_streams_while_the_command_runs(client: Any) -> None:
    with client.create() as box:
        run = box.stream(SLOW, timeout_s=60)
        chunks = iter(run)
        first = next(chunks)
        first_at = time.monotonic()
        rest = list(chunks)
        result = run.result
        ended_at = time.monotonic()
    assert first == Chunk("stdout", b"started\n")
    assert ended_at - first_at > 1.0, "the first line came with the result: not streamed"
    streamed = [first, *rest]
    stdout = b"".join(c.data for c in streamed if c.stream == "stdout")
    stderr = b"".join(c.data for c in streamed if c.stream == "stderr")
    assert result.exit_code == 0
    assert stdout == result.stdout
    assert stderr == result.stderr == b"to-stderr\n"
    assert stdout.splitlines()[-1] == b"line-199"


def test_exec_with_a_handler_gets_output_in_order(client: Any) -> None:
    seen: list[tuple[float, Chunk]] = []
    with client.create() as box:
        result = box.exec(
            "for i in 1 2 3; do echo $i; sleep 0.3; done",
            on_output=lambda c: seen.append((time.monotonic(), c)),
        )
        done_at = time.monotonic()
    assert result.stdout == b"1\n2\n3\n"
    assert b"".join(c.data for _, c in seen) == result.stdout
    assert len(seen) >= 2, "the output came in one piece: it was not streamed"
    assert seen[0][0] < done_at


def test_a_capped_stream_stops_at_the_cap(client: Any) -> None:
    with client.create() as box:
        run = box.stream("head -c 100000 /dev/zero", max_output_bytes=1000)
        data = b"".join(c.data for c in run)
        result = run.result
    assert data == result.stdout == b"\0" * 1000
    assert result.truncated


def test_async_stream(stack: Settings) -> None:
    async def scenario() -> tuple[list[Chunk], bytes]:
        async with AsyncClient(stack, tenant="tests", job_id="stream") as client:
            box = await client.create()
            try:
                run = box.stream("echo a; sleep 0.2; echo b >&2")
                chunks = [c async for c in run]
                return chunks, (await run.result()).stdout
            finally:
                await box.close()

    chunks, stdout = asyncio.run(scenario())
    assert chunks == [Chunk("stdout", b"a\n"), Chunk("stderr", b"b\n")]
    assert stdout == b"a\n"


def test_output_larger_than_a_record_comes_back_whole_in_pieces(client: Any) -> None:
    # Given a command whose output is three times Kafka's default record size
    with client.create() as box:
        box.exec("head -c 3000000 /dev/urandom > /tmp/out")
        digest = box.exec("sha256sum /tmp/out").stdout.split()[0].decode()
        request = exec_request(
            client.request_fields(box.id), "cat /tmp/out", timeout_s=60, max_output_bytes=4 << 20
        )
        reply = client.call(request, 90)
        # and a file of two MiB read back
        data = box.read_file("/tmp/out", max_bytes=2 << 20)
    # Then both come back whole, as the sandbox has them
    assert isinstance(reply, ExecOutput) and not reply.stdout_truncated
    stdout = base64.b64decode(reply.stdout_b64)
    assert len(stdout) == 3_000_000 and hashlib.sha256(stdout).hexdigest() == digest
    assert data == stdout[: 2 << 20]
    # and no record of the replies topic was larger than 1 MiB on the way
    sizes = _reply_record_sizes(client, {request.request_id})
    assert len(sizes) > 1 and max(sizes) <= 1 << 20, sizes


def _reply_record_sizes(client: Any, request_ids: set[uuid.UUID]) -> list[int]:
    """Sizes of the records on the client's replies partition for ``request_ids``."""
    reply_to = client._reply_to
    consumer = bus.make_consumer(client.settings)
    try:
        tp = TopicPartition(reply_to.topic, reply_to.partition)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        end = bus.high_watermarks(client.settings, [tp])[tp]
        sizes = []
        wanted = {str(r) for r in request_ids}
        while consumer.position(tp) < end:
            for records in consumer.poll(timeout_ms=500).values():
                for record in records:
                    if any(r.encode() in (record.value or b"")[:200] for r in wanted):
                        sizes.append(len(record.value or b""))
        return sizes
    finally:
        consumer.close()
