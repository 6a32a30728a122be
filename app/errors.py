"""The platform's own exception tree. Callers never catch a driver's exception.

Driver errors (psycopg, kafka-python, Celery) are translated here or at the adapter
that calls the driver; each class also inherits the matching builtin where one fits.

Every error the SDK can raise is a :class:`ReasonedError`: it carries a ``reason``, one
machine-readable word a program can branch on (an enum value where the platform has
one), while its message says it for a person. A raiser names the reason when it knows a
finer one than its class's default.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


def first_line(exc: BaseException) -> str:
    """An exception in one line, for a log line or a terminal: its message's first
    line (drivers add hints and SQL below it), or its class name if it has none."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class ConfigReason(StrEnum):
    """Why a configuration is unusable."""

    #: A setting or an argument is wrong (the message names it).
    INVALID = "invalid"
    #: No credential was found, or its file cannot be read.
    NO_CREDENTIAL = "no_credential"
    #: A credential file is not a dsec credential (malformed, wrong sizes).
    BAD_CREDENTIAL = "bad_credential"
    #: The tenant has no replies topic: it was never created, or the platform is down.
    NO_REPLIES_TOPIC = "no_replies_topic"


class TimeoutReason(StrEnum):
    """Why the SDK stopped waiting (its own decision: the log records nothing)."""

    #: No reply came in time; the request may still be carried out.
    NO_REPLY = "no_reply"
    #: A background command's wait ended first; the command runs on and may be
    #: waited for again.
    STILL_RUNNING = "still_running"


class TransferReason(StrEnum):
    """Why a file or a tree could not be copied into or out of a sandbox."""

    #: The local source does not exist.
    MISSING = "missing"
    #: The archive is larger than a transfer may be.
    TOO_LARGE = "too_large"
    #: The sandbox's archive was refused before anything was written: a member would
    #: leave the destination, go through a link, or is a device; or it does not read.
    REFUSED = "refused"
    #: Packing, unpacking or staging inside the sandbox failed.
    IN_SANDBOX = "in_sandbox"
    #: Pieces are missing or do not match their digest.
    INCOMPLETE = "incomplete"


class DsecError(Exception):
    """Base of every dsec error."""


class ReasonedError(DsecError):
    """A dsec error that says why in ``reason`` (the class's default unless the raiser
    named one); every error the SDK raises is one."""

    default_reason: ClassVar[str] = "error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason: str = self.default_reason if reason is None else reason


class ConfigError(ReasonedError, ValueError):
    """The configuration is unusable."""

    default_reason = ConfigReason.INVALID


class ServiceUnavailable(ReasonedError, ConnectionError):
    """A backing service (Kafka, Postgres, Redis, Podman) cannot be reached."""

    default_reason = "unavailable"


class AccessDenied(ServiceUnavailable):
    """A backing service refused this process's principal what it asked (Kafka's
    ACLs): waiting will not help, an operator's grant will."""

    default_reason = "access_denied"


class RequestTimeout(ReasonedError, TimeoutError):
    """No answer arrived in time."""

    default_reason = TimeoutReason.NO_REPLY


class SandboxError(ReasonedError):
    """A request about a sandbox failed; ``reason`` is the event's reason (the SDK
    gives it as :class:`app.domain.base.RejectReason` or ``FailReason``)."""

    def __init__(self, sandbox_id: str, reason: str, detail: str) -> None:
        super().__init__(f"{sandbox_id}: {reason}: {detail}", reason=reason)
        self.sandbox_id = sandbox_id
        self.detail = detail


class SandboxRejectedError(SandboxError, ValueError):
    """The platform refused the request (invalid, no capacity, unknown sandbox)."""


class SandboxFailedError(SandboxError, RuntimeError):
    """The node could not carry the request out (image missing, runtime error)."""


class SandboxNotFound(SandboxRejectedError, LookupError):
    """The sandbox is not one of the sender's live sandboxes: it does not exist (or no
    longer does), or it is another tenant's (the platform does not say which)."""


class SandboxIdInUse(SandboxRejectedError, FileExistsError):
    """A create named a sandbox id that is taken (ids are never reused): choose another."""


class StorageRefused(DsecError, ValueError):
    """The database refused to store something (bad data, a violated constraint)."""


class LogTamperRefused(DsecError, PermissionError):
    """The database refused to change or remove a recorded event."""


class TransferFailed(ReasonedError, OSError):
    """A file or directory could not be copied into or out of a sandbox; ``reason``
    is a :class:`TransferReason`."""

    def __init__(self, message: str, *, reason: TransferReason) -> None:
        super().__init__(message, reason=reason)
