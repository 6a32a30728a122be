"""Every error the SDK raises says why, in a reason a program can branch on: the
log's RejectReason or FailReason on an error reply, the SDK's own reasons for the rest."""

from __future__ import annotations

import io
import tarfile
import uuid
from pathlib import Path

import pytest

from app import credentials
from app.domain.base import FailReason, RejectReason
from app.domain.replies import ErrorReply
from app.errors import (
    ConfigError,
    ConfigReason,
    ReasonedError,
    RequestTimeout,
    SandboxError,
    SandboxFailedError,
    SandboxIdInUse,
    SandboxNotFound,
    SandboxRejectedError,
    ServiceUnavailable,
    TimeoutReason,
    TransferFailed,
    TransferReason,
)
from app.sdk import transfer
from app.sdk.steps import error_for

SANDBOX = "sbx-errors"


def error_reply(reason: str, detail: str = "why") -> ErrorReply:
    return ErrorReply(request_id=uuid.uuid4(), sandbox_id=SANDBOX, reason=reason, detail=detail)


def test_every_error_the_sdk_raises_has_a_reason_by_default() -> None:
    for kind in (ConfigError, RequestTimeout, ServiceUnavailable, SandboxError, TransferFailed):
        assert issubclass(kind, ReasonedError)
    assert ConfigError("bad").reason is ConfigReason.INVALID
    assert RequestTimeout("late").reason is TimeoutReason.NO_REPLY
    assert ServiceUnavailable("down").reason == "unavailable"
    assert ConfigError("x", reason=ConfigReason.NO_CREDENTIAL).reason is ConfigReason.NO_CREDENTIAL


def test_credential_errors_say_whether_it_is_missing_or_malformed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as missing:
        credentials.load(tmp_path / "none.json")
    assert missing.value.reason is ConfigReason.NO_CREDENTIAL
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError) as malformed:
        credentials.load(tmp_path / "bad.json")
    assert malformed.value.reason is ConfigReason.BAD_CREDENTIAL


def test_transfer_errors_say_what_went_wrong(tmp_path: Path) -> None:
    with pytest.raises(TransferFailed) as missing:
        transfer.pack(tmp_path / "nothing-here")
    assert missing.value.reason is TransferReason.MISSING
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.addfile(tarfile.TarInfo("../escape"), io.BytesIO(b""))
    with pytest.raises(TransferFailed) as refused:
        transfer.unpack(buf.getvalue(), tmp_path / "dest")
    assert refused.value.reason is TransferReason.REFUSED
    with pytest.raises(TransferFailed) as garbled:
        transfer.unpack(b"not a tar archive" * 40, tmp_path / "dest")
    assert garbled.value.reason is TransferReason.REFUSED


# --- error replies become typed errors, with the log's reason as its enum ----------


@pytest.mark.parametrize(
    ("reason", "kind", "enum"),
    [
        ("capacity", SandboxRejectedError, RejectReason.CAPACITY),
        ("forbidden", SandboxRejectedError, RejectReason.FORBIDDEN),
        ("unknown_sandbox", SandboxNotFound, RejectReason.UNKNOWN_SANDBOX),
        ("id_in_use", SandboxIdInUse, RejectReason.ID_IN_USE),
        ("duplicate", SandboxRejectedError, RejectReason.DUPLICATE),
        ("quota", SandboxRejectedError, RejectReason.QUOTA),
        ("image_not_found", SandboxFailedError, FailReason.IMAGE_NOT_FOUND),
        ("no_space", SandboxFailedError, FailReason.NO_SPACE),
    ],
)
def test_an_error_reply_is_a_typed_error_with_its_reason(
    reason: str, kind: type[Exception], enum: str
) -> None:
    error = error_for(error_reply(reason, "no room on any node"))
    assert type(error) is kind
    assert error.reason is enum
    assert error.sandbox_id == SANDBOX and error.detail == "no room on any node"
    assert str(error) == f"{SANDBOX}: {reason}: no room on any node"


def test_a_reason_this_sdk_does_not_know_is_a_failure_that_keeps_it() -> None:
    # Given a newer platform's reason
    error = error_for(error_reply("quantum_flux"))
    # Then it fails, saying the reason as it came
    assert isinstance(error, SandboxFailedError) and error.reason == "quantum_flux"
