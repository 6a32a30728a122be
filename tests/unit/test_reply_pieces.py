"""A large reply travels as pieces and is put together again, checked, by the SDK."""

from __future__ import annotations

import base64
import hashlib
import uuid

import pytest

from app.domain.replies import ExecOutput, IncompletePieces, ReplyPiece, join_pieces

RID = uuid.uuid4()


def _piece(seq: int, part: str, data: bytes) -> ReplyPiece:
    return ReplyPiece(
        request_id=RID, sandbox_id="sb", seq=seq, part=part,  # type: ignore[arg-type]
        data_b64=base64.b64encode(data).decode(),
    )  # fmt: skip


def _reply(pieces: int, **digests: bytes) -> ExecOutput:
    return ExecOutput(
        request_id=RID, sandbox_id="sb", exit_code=0, stdout_b64="", stderr_b64="",
        duration_ms=1.0, pieces=pieces,
        sha256={part: hashlib.sha256(data).hexdigest() for part, data in digests.items()},
    )  # fmt: skip


def test_pieces_are_put_back_in_order_and_a_repeat_counts_once() -> None:
    out, err = b"a" * 10 + b"b" * 10, b"e" * 5
    pieces = [
        _piece(0, "stdout", out[:10]),
        _piece(1, "stdout", out[10:]),
        _piece(2, "stderr", err),
    ]
    joined = join_pieces(_reply(3, stdout=out, stderr=err), [*pieces, pieces[1]])
    assert isinstance(joined, ExecOutput)
    assert base64.b64decode(joined.stdout_b64) == out
    assert base64.b64decode(joined.stderr_b64) == err
    assert joined.pieces == 0


def test_a_missing_or_altered_piece_is_refused() -> None:
    out = b"x" * 20
    with pytest.raises(IncompletePieces, match="1 of 2"):
        join_pieces(_reply(2, stdout=out, stderr=b""), [_piece(0, "stdout", out[:10])])
    with pytest.raises(IncompletePieces, match="digest"):
        join_pieces(
            _reply(2, stdout=out, stderr=b""),
            [_piece(0, "stdout", out[:10]), _piece(1, "stdout", b"y" * 10)],
        )


def test_a_reply_without_pieces_is_left_as_it_is() -> None:
    whole = ExecOutput(
        request_id=RID, sandbox_id="sb", exit_code=0, stdout_b64="aGk=", stderr_b64="",
        duration_ms=1.0,
    )  # fmt: skip
    assert join_pieces(whole, []) is whole
