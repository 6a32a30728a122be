"""Every error the SDK raises says why, in a reason a program can branch on."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from app.errors import (
    ConfigError,
    ConfigReason,
    ReasonedError,
    RequestTimeout,
    SandboxError,
    ServiceUnavailable,
    TimeoutReason,
    TransferFailed,
    TransferReason,
)
from app.sdk import credentials, transfer


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
