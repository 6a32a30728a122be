"""The SDK's reply reader outlives what its partition holds: a reply for a request
the client already gave up on, and a record it cannot take."""

from __future__ import annotations

import threading
import uuid
from collections import namedtuple
from concurrent.futures import Future
from typing import Any

from app.domain import proof
from app.domain.codec import encode
from app.domain.replies import Done, Reply
from app.errors import ServiceUnavailable
from app.sdk.reader import ReplyReader

SECRET = b"k" * 32
Record = namedtuple("Record", "value headers offset")


class Partition:
    """Stands in for the consumer: hands out what was put, once."""

    def __init__(self) -> None:
        self._records: list[Record] = []
        self._lock = threading.Lock()
        self._event = threading.Event()

    def put(self, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        with self._lock:
            self._records.append(Record(value, headers, len(self._records)))
        self._event.set()

    def poll(self, timeout_ms: int) -> dict[str, list[Record]]:
        self._event.wait(timeout_ms / 1000)
        with self._lock:
            taken, self._records = self._records, []
            self._event.clear()
        return {"p": taken} if taken else {}

    def close(self) -> None:
        pass


def _reply(request_id: uuid.UUID) -> tuple[bytes, list[tuple[str, bytes]]]:
    value = encode(Done(request_id=request_id, sandbox_id="sb", detail="ok"))
    key = proof.reply_key(SECRET, request_id)
    return value, proof.headers(proof.Purpose.REPLY, None, key, value)


def test_a_reply_to_a_request_given_up_on_does_not_stop_the_reader() -> None:
    partition = Partition()
    consumer: Any = partition
    reader = ReplyReader(consumer, SECRET, 1 << 20)
    try:
        # Given a request the client gave up on (Kafka's acknowledgement never came)
        late = uuid.uuid4()
        gave_up = reader.expect(late)
        gave_up.set_exception(ServiceUnavailable("not stored"))
        # When its reply arrives anyway, and then the reply to the next request
        following = uuid.uuid4()
        waiting: Future[Reply] = reader.expect(following)
        partition.put(*_reply(late))
        partition.put(*_reply(following))
        # Then the next request is answered: the reader lives on
        assert isinstance(waiting.result(timeout=5), Done)
        assert isinstance(gave_up.exception(), ServiceUnavailable)
    finally:
        reader.close()


class AwayOnce(Partition):
    """A partition whose broker is away for the first read."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def poll(self, timeout_ms: int) -> dict[str, list[Record]]:
        if not self.failed:
            self.failed = True
            raise ServiceUnavailable("broker away")
        return super().poll(timeout_ms)


def test_a_broker_away_does_not_stop_the_reader() -> None:
    partition = AwayOnce()
    consumer: Any = partition
    reader = ReplyReader(consumer, SECRET, 1 << 20)
    try:
        # Given a read that found the broker away
        waiting: Future[Reply] = reader.expect(uuid.uuid4())
        request_id = uuid.uuid4()
        answered: Future[Reply] = reader.expect(request_id)
        # When the reply comes once it is back
        partition.put(*_reply(request_id))
        # Then the reader read on and the request is answered
        assert isinstance(answered.result(timeout=10), Done)
        assert partition.failed and not waiting.done()
    finally:
        reader.close()
