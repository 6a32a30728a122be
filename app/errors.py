"""The platform's own exception tree. Callers never catch a driver's exception.

Driver errors (psycopg, kafka-python, Celery) are translated here or at the adapter
that calls the driver; each class also inherits the matching builtin where one fits.
"""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """An exception in one line, for a log line or a terminal: its message's first
    line (drivers add hints and SQL below it), or its class name if it has none."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class DsecError(Exception):
    """Base of every dsec error."""


class ConfigError(DsecError, ValueError):
    """The configuration is unusable."""


class ServiceUnavailable(DsecError, ConnectionError):
    """A backing service (Kafka, Postgres, Redis, Podman) cannot be reached."""


class RequestTimeout(DsecError, TimeoutError):
    """No answer arrived in time."""


class SandboxError(DsecError):
    """A request about a sandbox failed; ``reason`` is the event's reason."""

    def __init__(self, sandbox_id: str, reason: str, detail: str) -> None:
        super().__init__(f"{sandbox_id}: {reason}: {detail}")
        self.sandbox_id = sandbox_id
        self.reason = reason
        self.detail = detail


class SandboxRejectedError(SandboxError, ValueError):
    """The platform refused the request (invalid, no capacity, unknown sandbox)."""


class SandboxFailedError(SandboxError, RuntimeError):
    """The node could not carry the request out (image missing, runtime error)."""


class SandboxNotFound(SandboxRejectedError, LookupError):
    """The sandbox does not exist (or no longer does)."""


class StorageRefused(DsecError, ValueError):
    """The database refused to store something (bad data, a violated constraint)."""


class LogTamperRefused(DsecError, PermissionError):
    """The database refused to change or remove a recorded event."""


class TransferFailed(DsecError, OSError):
    """A file or directory could not be copied into or out of a sandbox."""
