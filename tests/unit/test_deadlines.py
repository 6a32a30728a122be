"""The node's deadlines thread: each sandbox is handed over once, at its deadline, in
deadline order; cancelled ones never; one in another transition is asked again."""

from __future__ import annotations

import threading
from datetime import timedelta

from app.domain.base import utcnow
from workers.deadlines import Deadlines, Due


def _collect(
    answers: dict[str, list[bool]] | None = None,
) -> tuple[Deadlines, list[Due], threading.Event]:
    seen: list[Due] = []
    done = threading.Event()

    def expire(due: Due) -> bool:
        queue = (answers or {}).get(due.sandbox_id)
        answer = queue.pop(0) if queue else True
        if answer:
            seen.append(due)
            done.set()
        return answer

    deadlines = Deadlines(expire)
    deadlines.start()
    return deadlines, seen, done


def _wait_for(seen: list[Due], n: int) -> None:
    end = utcnow() + timedelta(seconds=10)
    while len(seen) < n and utcnow() < end:
        threading.Event().wait(0.01)


def test_sandboxes_are_handed_over_at_their_deadline_in_order() -> None:
    deadlines, seen, _ = _collect()
    now = utcnow()
    deadlines.watch(Due(now + timedelta(milliseconds=300), "late", "t", "j"))
    deadlines.watch(Due(now + timedelta(milliseconds=100), "early", "t", "j"))
    deadlines.watch(Due(now - timedelta(seconds=1), "overdue", "t", "j"))
    _wait_for(seen, 3)
    deadlines.stop()
    assert [d.sandbox_id for d in seen] == ["overdue", "early", "late"]
    assert all(utcnow() >= d.at for d in seen)
    assert not deadlines.is_watched("late")


def test_a_cancelled_sandbox_is_never_handed_over() -> None:
    deadlines, seen, _ = _collect()
    now = utcnow()
    deadlines.watch(Due(now + timedelta(milliseconds=100), "gone", "t", "j"))
    deadlines.watch(Due(now + timedelta(milliseconds=200), "kept", "t", "j"))
    deadlines.cancel("gone")
    _wait_for(seen, 1)
    threading.Event().wait(0.1)
    deadlines.stop()
    assert [d.sandbox_id for d in seen] == ["kept"]


def test_a_busy_sandbox_is_asked_again_and_keeps_its_deadline() -> None:
    deadlines, seen, _ = _collect({"busy": [False, False, True]})
    at = utcnow() + timedelta(milliseconds=50)
    deadlines.watch(Due(at, "busy", "t", "j"))
    _wait_for(seen, 1)
    deadlines.stop()
    assert [d.sandbox_id for d in seen] == ["busy"]
    assert seen[0].at == at  # stamped with the deadline, not the retry


def test_a_moved_deadline_replaces_the_earlier_one() -> None:
    deadlines, seen, _ = _collect()
    now = utcnow()
    deadlines.watch(Due(now + timedelta(milliseconds=50), "moved", "t", "j"))
    later = now + timedelta(milliseconds=250)
    deadlines.watch(Due(later, "moved", "t", "j"))
    _wait_for(seen, 1)
    threading.Event().wait(0.3)
    deadlines.stop()
    assert [d.at for d in seen] == [later]
