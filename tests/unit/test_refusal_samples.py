"""Refusals nobody answers for, sampled for the log (app/control/samples.py): the
first of a window is logged at once, the rest of it as one sample when it closes, and
the samples' ``folded`` add up to every refusal."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from app.control.samples import RefusalSamples
from app.domain.events import RejectedPayload, RejectReason, SandboxRejected


def _refused(n: int) -> SandboxRejected:
    return SandboxRejected(
        sandbox_id=f"sb-{n}", tenant="unauthenticated", occurred_at=datetime.now(UTC),
        payload=RejectedPayload(request_id=uuid.uuid4(), request_type="Exec",
                                reason=RejectReason.UNAUTHENTICATED, detail=f"bad_mac {n}"),
    )  # fmt: skip


def test_the_first_refusal_of_a_window_is_logged_at_once() -> None:
    samples = RefusalSamples(window_s=10)
    first = samples.add("bad_mac", _refused(0), now_s=0)
    assert first is not None and first.payload.folded == 1
    assert first.payload.detail == "bad_mac 0"
    # and a window with nothing after its first has nothing more to log
    assert samples.due(now_s=100) == []


def test_the_rest_of_a_window_is_one_sample_when_it_closes() -> None:
    samples = RefusalSamples(window_s=10)
    logged = [samples.add("bad_mac", _refused(n), now_s=n / 100) for n in range(50)]
    assert logged[0] is not None and logged[0].payload.folded == 1
    assert logged[1:] == [None] * 49
    assert samples.due(now_s=5) == []  # still open
    [rest] = samples.due(now_s=10)
    assert rest.payload.folded == 49 and "49 more like it" in rest.payload.detail
    assert rest.event_id != logged[0].event_id


def test_a_refusal_after_a_closed_window_opens_another_and_none_is_lost() -> None:
    samples = RefusalSamples(window_s=10)
    opened = [samples.add("dup", _refused(n), now_s=t) for n, t in enumerate([0, 1, 2, 12, 13])]
    # Then the refusal at 12 s opened a window of its own, logged at once
    assert [s.payload.folded if s else None for s in opened] == [1, None, None, 1, None]
    # and the first window's rest is kept until asked for, with the second's after it
    due = samples.due(now_s=30)
    assert [s.payload.folded for s in due] == [2, 1]
    total = sum(s.payload.folded or 0 for s in [*due, *(o for o in opened if o)])
    assert total == 5


def test_kinds_have_windows_of_their_own() -> None:
    samples = RefusalSamples(window_s=10)
    assert samples.add("a", _refused(0), now_s=0) is not None
    assert samples.add("b", _refused(1), now_s=1) is not None
    assert samples.add("a", _refused(2), now_s=2) is None
