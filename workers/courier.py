"""How a node tells the world: events to the log, replies to a waiting trainer.

Workers never write Postgres: every fact they know travels through Kafka. Each event
carries the proof of this node's credential; each reply the proof of the key the
scheduler handed over with its request (derived from the requester's own key), so
the trainer knows the platform made it. A reply nobody can verify is not sent.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from app.config import Settings
from app.credentials import Credential
from app.domain.codec import encode
from app.domain.events import CommandCompleted, EventBase
from app.domain.proof import Purpose, headers
from app.domain.replies import ExecOutput, FileContent, ReplyBase, ReplyPiece
from app.domain.requests import ReplyTo
from app.ports import Producer

log = logging.getLogger(__name__)


class Courier:
    """The node's courier: proves and sends its events and replies through its one
    producer (Kafka's, thread-safe, opened on first use by ``connect``, which the
    node's main hands in; an in-memory bus's in unit tests). The control plane's
    courier, :class:`app.control.outbox.Courier`, plays the same role into an outbox."""

    def __init__(
        self, settings: Settings, credential: Credential, connect: Callable[[], Producer]
    ) -> None:
        self.settings = settings
        self.credential = credential
        self._connect = connect
        self._publisher: Producer | None = None
        self._lock = threading.Lock()
        # The reply key of each request being answered now, and by how many threads
        # (the exec task's and its command's overlap; see :meth:`answering`).
        self._reply_keys: dict[uuid.UUID, bytes] = {}
        self._answering: dict[uuid.UUID, int] = {}

    @property
    def publisher(self) -> Producer:
        """The producer, opened on first use."""
        with self._lock:
            if self._publisher is None:
                self._publisher = self._connect()
            return self._publisher

    @contextmanager
    def answering(self, request_id: uuid.UUID, reply_key: bytes | None) -> Iterator[None]:
        """While a request is handled, its replies are proven with ``reply_key``."""
        if reply_key is None:
            yield
            return
        with self._lock:
            self._reply_keys[request_id] = reply_key
            self._answering[request_id] = self._answering.get(request_id, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._answering.pop(request_id, 1) - 1
                if left > 0:
                    self._answering[request_id] = left
                else:
                    self._reply_keys.pop(request_id, None)

    def event(self, event: EventBase) -> None:
        """Append a fact to the events topic, keyed by its subject, proven as this node."""
        value = encode(event)
        if len(value) > self.settings.max_message_bytes and isinstance(event, CommandCompleted):
            log.warning("%s: record of %d bytes cut to fit the log", event.sandbox_id, len(value))
            value = encode(event.without_outputs())
        cred = self.credential
        proof = headers(Purpose.EVENT, cred.key_id, cred.secret, value)
        self.publisher.publish(self.settings.topic_events, event.key, value, headers=proof)

    def reply(self, reply_to: ReplyTo | None, reply: ReplyBase) -> None:
        """Answer the trainer, if one waits (and its request came with a reply key)."""
        if reply_to is None:
            return
        with self._lock:
            key = self._reply_keys.get(reply.request_id)
        if key is None:
            log.warning("no reply key for %s: its answer would not be believed", reply.request_id)
            return
        value = encode(reply)
        self.publisher.publish(
            reply_to.topic, reply.sandbox_id, value, partition=reply_to.partition,
            headers=headers(Purpose.REPLY, None, key, value),
        )  # fmt: skip

    def reply_with_data(
        self, reply_to: ReplyTo | None, reply: ExecOutput | FileContent, parts: dict[str, bytes]
    ) -> None:
        """Answer with ``reply`` and its data (``parts``: stdout and stderr, or a file's
        data): in the reply itself when small, else first as ReplyPiece records of at
        most ``reply_piece_bytes`` each, then the reply with their count and digests."""
        limit = self.settings.reply_piece_bytes
        if sum(len(data) for data in parts.values()) <= limit:
            filled = {f"{p}_b64": base64.b64encode(data).decode() for p, data in parts.items()}
            self.reply(reply_to, reply.model_copy(update=filled))
            return
        seq = 0
        for part, data in parts.items():
            for start in range(0, len(data), limit):
                piece = ReplyPiece(
                    request_id=reply.request_id,
                    sandbox_id=reply.sandbox_id,
                    seq=seq,
                    part=part,
                    data_b64=base64.b64encode(data[start : start + limit]).decode(),
                )
                self.reply(reply_to, piece)
                seq += 1
        digests = {part: hashlib.sha256(data).hexdigest() for part, data in parts.items()}
        empty = {f"{part}_b64": "" for part in parts}
        self.reply(reply_to, reply.model_copy(update={**empty, "pieces": seq, "sha256": digests}))

    def flush(self) -> None:
        """Wait until everything sent is acknowledged."""
        self.publisher.flush()
