"""The node's end of the direct route: a trainer's command read from the node's inbox,
proven under its sandbox's key (app/domain/direct.py), started as a command the
scheduler routed would be. Revocations come the same way, sealed by the scheduler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

from app.config import Settings
from app.consuming import dead_letter
from app.domain.base import utcnow
from app.domain.codec import DeadLetterReason
from app.domain.direct import DirectRefusal, DirectRules, admit_direct
from app.domain.node_tasks import NodeTask, revoked_keys, unseal
from app.domain.records import Record
from app.domain.requests import Exec
from workers import runtime
from workers.errors import DirectRefused, SandboxNotRunning

log = logging.getLogger(__name__)


def rules(settings: Settings, reply_partitions: Callable[[str], int | None]) -> DirectRules:
    """What a node checks of a direct record, from its settings."""
    return DirectRules(
        max_age=timedelta(seconds=settings.request_max_age_s),
        max_message_bytes=settings.max_message_bytes,
        replies_topic=settings.replies_topic,
        reply_partitions=reply_partitions,
    )


def carry_out(
    record: Record,
    rules: DirectRules,
    consumer: str,
    starts: list[tuple[Exec, bytes | None]],
) -> None:
    """Take the command a direct record carries, or refuse it: answered under the
    sandbox's key where it is proven, else dead-lettered and answered never. A command
    to start is added to ``starts``, to be claimed and started with the others read
    with it (workers/inbox.py)."""
    node = runtime.node()
    sandbox_id = record.key.decode(errors="replace") if record.key else ""
    route = node.routes.route(sandbox_id) if sandbox_id else None
    verdict = admit_direct(
        record, route.key if route else None, node.routes.revoked(), utcnow(), rules
    )
    if isinstance(verdict, DirectRefusal) and verdict.request is None:
        reason = verdict.dead_letter or DeadLetterReason.UNAUTHENTICATED
        log.warning("%s: refused a direct record for %r: %s", consumer, sandbox_id, verdict.detail)
        node.tally.task("direct", "unproven")
        node.tally.forged(consumer, "direct")
        dead_letter(node.courier.publisher, node.settings, consumer, record, reason, verdict.detail)
        return
    assert route is not None  # a proven record was proven under its key
    request = verdict.request if isinstance(verdict, DirectRefusal) else verdict
    assert request is not None
    reply_key = route.key.reply_key(request.request_id)
    failure: Exception | None = None
    if isinstance(verdict, DirectRefusal):
        failure = DirectRefused(verdict.detail)
    elif route.ended is not None:
        failure = SandboxNotRunning(f"sandbox {sandbox_id} has ended ({route.ended})")
    elif route.frozen:
        failure = SandboxNotRunning(f"sandbox {sandbox_id} is frozen")
    if failure is not None:
        node.tally.task("direct", "refused")
        with node.courier.answering(request.request_id, reply_key):
            node.failures.fail(request, failure)
        return
    node.tally.task("direct", "ok")
    starts.append((request, reply_key))


def revoke(args: list[str], consumer: str) -> None:
    """The credentials a sealed revocation names stop proving anything here."""
    node = runtime.node()
    cred = node.credential
    opened = unseal(NodeTask.REVOKE_KEYS, args, cred.key_id, cred.secret)
    found = revoked_keys(opened) if not isinstance(opened, str) else opened
    if isinstance(found, str):
        log.error("%s: refused a revocation: %s", consumer, found)
        node.tally.forged(consumer, "task")
        return
    node.routes.revoke(found)
    log.info("%s: %d credentials revoked", consumer, len(found))
