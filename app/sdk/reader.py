"""The replies partition a client reads alone, on a thread of its own.

Each reply is proven (its MAC, under the key of the very request it answers) before it
counts; output chunks of a streamed command go to its handler in order, the pieces of a
large reply are kept until the reply that closes them, and the future waiting for the
reply completes with it. Nothing here sends: :class:`app.sdk.Client` does.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import threading
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol

from app.domain import proof
from app.domain.codec import DecodeError, decode_reply
from app.domain.records import Record
from app.domain.replies import (
    ExecOutput,
    FileContent,
    IncompletePieces,
    OutputChunk,
    Reply,
    ReplyPiece,
    join_pieces,
)
from app.errors import ServiceUnavailable, TransferFailed, TransferReason
from app.sdk.results import Chunk, OutputHandler

log = logging.getLogger(__name__)


class ReplySource(Protocol):
    """The replies partition a client follows: a Kafka consumer assigned to it at its
    end (:class:`app.sdk.transport.KafkaTransport`), or a bus's partition in memory."""

    def poll(self, timeout_ms: int) -> Mapping[Any, Sequence[Record]]:
        """The records that came since the last poll, waiting up to ``timeout_ms``
        for one; raises :class:`ServiceUnavailable` while the broker is away."""
        ...


class ReplyReader:
    """Reads one replies partition (assigned, at its end) and completes the futures
    of the requests awaited on it. Thread-safe."""

    def __init__(self, consumer: ReplySource, secret: bytes, max_bytes: int) -> None:
        self._consumer = consumer
        self._secret = secret
        self._max_bytes = max_bytes
        #: Replies dropped because their proof did not hold (forged or altered).
        self.forged = 0
        self._waiting: dict[uuid.UUID, Future[Reply]] = {}
        # The key each awaited request's replies are proven with.
        self._keys: dict[uuid.UUID, bytes] = {}
        self._output: dict[uuid.UUID, tuple[OutputHandler, list[int]]] = {}
        # The pieces of large replies not yet complete (see ReplyPiece).
        self._pieces: dict[uuid.UUID, list[ReplyPiece]] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, name="dsec-replies", daemon=True)
        self._thread.start()

    def expect(
        self,
        request_id: uuid.UUID,
        on_output: OutputHandler | None = None,
        secret: bytes | None = None,
    ) -> Future[Reply]:
        """A future for the reply to ``request_id`` (register before sending);
        ``on_output`` gets a streamed command's chunks, in order, on this reader's
        thread; ``secret``: the key its replies derive from, where it is not this
        client's (a direct command's sandbox key)."""
        future: Future[Reply] = Future()
        key = proof.reply_key(secret or self._secret, request_id)
        with self._lock:
            self._waiting[request_id] = future
            self._keys[request_id] = key
            if on_output is not None:
                self._output[request_id] = (on_output, [0])
        return future

    def forget(self, request_id: uuid.UUID) -> None:
        """Stop waiting for the reply to ``request_id`` (a late one is dropped)."""
        with self._lock:
            self._waiting.pop(request_id, None)
            self._output.pop(request_id, None)
            self._pieces.pop(request_id, None)
            self._keys.pop(request_id, None)

    def close(self) -> None:
        """Stop reading (the consumer is its owner's to close)."""
        self._closed.set()
        self._thread.join(timeout=2)

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                batches = self._consumer.poll(timeout_ms=100)
            except ServiceUnavailable as exc:
                # A broker away (or a partition moving to another leader): the reader
                # lives on, and reads on from where it stood once the broker is back.
                log.warning("replies: %s; reading again in a second", exc)
                self._closed.wait(1.0)
                continue
            for records in batches.values():
                for record in records:
                    try:
                        self._take(record.value or b"", record.headers)
                    except Exception:  # no record may stop the reader of every reply
                        log.exception("replies: a record at offset %s", record.offset)

    def _take(self, value: bytes, headers: proof.Headers | None) -> None:
        try:
            reply = decode_reply(value, self._max_bytes)
        except DecodeError:
            return  # not ours to judge: another client's garbage
        if not self._proven(reply, value, headers):
            return
        if isinstance(reply, OutputChunk):
            self._pass_output(reply)
            return
        with self._lock:
            if isinstance(reply, ReplyPiece):
                self._pieces.setdefault(reply.request_id, []).append(reply)
                return
            future = self._waiting.pop(reply.request_id, None)
            self._output.pop(reply.request_id, None)
            self._keys.pop(reply.request_id, None)
            pieces = self._pieces.pop(reply.request_id, [])
        if future is not None:
            _complete(future, reply, pieces)

    def _proven(self, reply: Reply, value: bytes, headers: proof.Headers | None) -> bool:
        """The reply answers a request awaited here, and the platform made it."""
        with self._lock:
            key = self._keys.get(reply.request_id)
        if key is None:
            return False  # nobody here waits for it
        if proof.check_mac(
            key, proof.Purpose.REPLY, value, proof.header(headers, proof.HEADER_MAC)
        ):
            return True
        self.forged += 1
        return False

    def _pass_output(self, chunk: OutputChunk) -> None:
        with self._lock:
            handler, expected = self._output.get(chunk.request_id, (None, [0]))
            # A producer retry can deliver a chunk twice; the partition keeps order.
            if handler is None or chunk.seq < expected[0]:
                return
            expected[0] = chunk.seq + 1
        try:
            handler(Chunk(chunk.stream, base64.b64decode(chunk.data_b64)))
        except Exception:  # the trainer's handler must not stop the reply reader
            with self._lock:
                self._output.pop(chunk.request_id, None)


def _complete(future: Future[Reply], reply: Reply, pieces: list[ReplyPiece]) -> None:
    """Hand ``reply`` over, with the data its pieces carried put back in. A future
    already settled stays as it is: a request the client gave up on as not stored
    (the broker's acknowledgement lost) may still be answered."""
    if isinstance(reply, ExecOutput | FileContent) and reply.pieces:
        try:
            reply = join_pieces(reply, pieces)
        except IncompletePieces as exc:
            with contextlib.suppress(InvalidStateError):
                future.set_exception(TransferFailed(str(exc), reason=TransferReason.INCOMPLETE))
            return
    with contextlib.suppress(InvalidStateError):
        future.set_result(reply)
