"""``dsec create``, ``dsec exec`` and ``dsec destroy``: the SDK, from a shell.

Everything goes through :class:`app.sdk.Client` (Kafka only), exactly as a trainer's
requests do, signed with a local credential: ``--tenant NAME``'s, or for a sandbox
that already exists the operator's (an operator may act on any sandbox, and the log
says it was the operator; it never signs as the sandbox's owner). The one Postgres
read is optional: ``exec`` and ``destroy`` bill the job that owns the sandbox, looked
up in the ``sandboxes`` projection unless ``--job`` says otherwise.

Exit codes of ``dsec exec`` follow the shells' conventions: the command's own exit
code; 128+N when a signal N killed it; 124 when its timeout killed it (like
``timeout(1)``); 125 when the platform could not run it at all (like ``docker run``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from app.config import Settings
from app.errors import DsecError
from app.sdk.client import Client, ExecResult

#: Exit code when the command ran past its timeout and was killed.
EXIT_TIMED_OUT = 124
#: Exit code when the platform refused or failed the request.
EXIT_PLATFORM_ERROR = 125
#: The SDK's tenant and job when nothing better is known.
DEFAULT_OWNER = ("default", "default")
#: The local credential the CLI acts on other tenants' sandboxes with.
OPERATOR = "operator"


def owner(settings: Settings, sandbox_id: str) -> tuple[str, str] | None:
    """(tenant, job) of a sandbox from the projection; None if unknown or no Postgres."""
    from app.db import queries
    from app.db.engine import transaction

    try:
        with transaction(settings.database_url) as conn:
            return queries.sandbox_owner(conn, sandbox_id)
    except DsecError:
        return None


def resolve_owner(settings: Settings, sandbox_id: str, tenant: str, job: str) -> tuple[str, str]:
    """Whose credential to sign with (``tenant``, else the operator's) and which job
    to bill (``job``, else the sandbox's recorded one, else the SDK's default)."""
    if job:
        return tenant or OPERATOR, job
    known = owner(settings, sandbox_id) or DEFAULT_OWNER
    return tenant or OPERATOR, known[1]


def exit_code_of(result: ExecResult) -> int:
    """The shell-style exit code ``dsec exec`` ends with."""
    if result.timed_out:
        return EXIT_TIMED_OUT
    if result.exit_code < 0:
        return 128 - result.exit_code
    return min(result.exit_code, 255)


def result_json(sandbox_id: str, result: ExecResult) -> dict[str, Any]:
    """The result as a JSON object (output decoded as UTF-8, bad bytes replaced)."""
    return {
        "sandbox_id": sandbox_id,
        "exit_code": result.exit_code,
        "stdout": result.stdout.decode(errors="replace"),
        "stderr": result.stderr.decode(errors="replace"),
        "duration_ms": result.duration_ms,
        "timed_out": result.timed_out,
        "truncated": result.truncated,
        "replayed": result.replayed,
    }


def _fail(exc: Exception) -> int:
    if isinstance(exc, ValidationError):  # the request itself: a malformed sandbox id, say
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        print(f"dsec: invalid request: {detail}", file=sys.stderr)
    else:
        print(f"dsec: {type(exc).__name__}: {exc}", file=sys.stderr)
    return EXIT_PLATFORM_ERROR


def run_exec(
    settings: Settings,
    sandbox_id: str,
    argv: Sequence[str],
    *,
    timeout_s: float,
    tenant: str = "",
    job: str = "",
    as_json: bool = False,
) -> int:
    """Run a command in a sandbox, print what it printed; return the exit code.

    One argument is a shell string (``/bin/sh -c``); several are an argv list.
    """
    command: str | list[str] = argv[0] if len(argv) == 1 else list(argv)
    tenant, job = resolve_owner(settings, sandbox_id, tenant, job)
    try:
        with Client(settings, tenant=tenant, job_id=job) as client:
            box = client.sandbox(sandbox_id)
            if as_json:
                result = box.exec(command, timeout_s=timeout_s)
            else:
                # Streamed: a long command's output shows as it comes.
                run = box.stream(command, timeout_s=timeout_s)
                sys.stdout.flush()
                sys.stderr.flush()
                for chunk in run:
                    # Raw bytes, as the command wrote them: binary output survives a pipe.
                    out = sys.stdout if chunk.stream == "stdout" else sys.stderr
                    out.buffer.write(chunk.data)
                    out.buffer.flush()
                result = run.result
    except (DsecError, ValueError) as exc:
        return _fail(exc)
    if as_json:
        print(json.dumps(result_json(sandbox_id, result), indent=2))
    return exit_code_of(result)


def run_cp(
    settings: Settings,
    src: str,
    dest: str,
    *,
    tenant: str = "",
    job: str = "",
    as_json: bool = False,
) -> int:
    """``dsec cp``: exactly one side names a sandbox (``SANDBOX:PATH``); print where
    the copy landed."""
    inside = [":" in side and not side.startswith(("/", ".")) for side in (src, dest)]
    if inside.count(True) != 1:
        return _fail(ValueError("name a sandbox on exactly one side: SANDBOX:PATH"))
    remote = src if inside[0] else dest
    sandbox_id, _, path = remote.partition(":")
    tenant, job = resolve_owner(settings, sandbox_id, tenant, job)
    try:
        with Client(settings, tenant=tenant, job_id=job) as client:
            box = client.sandbox(sandbox_id)
            landed = (
                str(box.download(path, Path(dest))) if inside[0] else box.upload(Path(src), path)
            )
    except (DsecError, ValueError) as exc:
        return _fail(exc)
    if as_json:
        print(json.dumps({"sandbox_id": sandbox_id, "from": src, "to": landed}))
    else:
        print(landed)
    return 0


def run_create(
    settings: Settings,
    *,
    tenant: str,
    job: str,
    as_json: bool = False,
    **options: Any,
) -> int:
    """Create a sandbox (options left None take the request's defaults); print its id."""
    given = {k: v for k, v in options.items() if v is not None}
    try:
        with Client(settings, tenant=tenant, job_id=job) as client:
            sandbox = client.create(**given)
    except (DsecError, ValueError) as exc:
        return _fail(exc)
    if as_json:
        record = {"sandbox_id": sandbox.id, "node_id": sandbox.node_id, "tenant": tenant}
        print(json.dumps({**record, "job_id": job, **given}, indent=2))
    else:
        print(sandbox.id)
    return 0


def run_expose(
    settings: Settings, sandbox_id: str, port: int, ttl_s: int, *, tenant: str = "", job: str = ""
) -> int:
    """Open a port of a sandbox; print its URL."""
    tenant, job = resolve_owner(settings, sandbox_id, tenant, job)
    try:
        with Client(settings, tenant=tenant, job_id=job) as client:
            print(client.sandbox(sandbox_id).expose(port, ttl_s))
    except (DsecError, ValueError) as exc:
        return _fail(exc)
    return 0


def run_destroy(settings: Settings, sandbox_id: str, *, tenant: str = "", job: str = "") -> int:
    """Destroy a sandbox; 0 once the node confirmed it."""
    tenant, job = resolve_owner(settings, sandbox_id, tenant, job)
    try:
        with Client(settings, tenant=tenant, job_id=job) as client:
            client.sandbox(sandbox_id).close()
    except (DsecError, ValueError) as exc:
        return _fail(exc)
    return 0
