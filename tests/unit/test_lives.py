"""Every open state of a life has a deadline, an owner and the end that meets it."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from app.domain.base import StopReason
from app.domain.lives import (
    OpenLife,
    OpenState,
    Owner,
    Terms,
    deadline_of,
    declared_end,
    end_id,
    last_word,
    overdue,
    state_of,
)

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
TERMS = Terms(request_max_age_s=300, create_grace_s=60, lease_grace_s=300)


def _life(**fields: object) -> OpenLife:
    return OpenLife(sandbox_id="sb-1", tenant="t", job_id="j", requested_at=T0, **fields)  # type: ignore[arg-type]


def test_a_create_never_placed_ends_create_lost_when_no_node_could_start_it_any_more() -> None:
    life = _life()
    deadline = deadline_of(life, TERMS)
    assert (deadline.state, deadline.owner, deadline.reason) == (
        OpenState.REQUESTED, Owner.SCHEDULER, StopReason.CREATE_LOST,
    )  # fmt: skip
    # A node refuses a create older than the request age limit; the grace covers one
    # under way at that moment.
    assert deadline.at == T0 + timedelta(seconds=360)


def test_a_placement_never_started_has_the_same_deadline() -> None:
    deadline = deadline_of(_life(node_id="n0", scheduled=True), TERMS)
    assert deadline.state == OpenState.PLACED
    assert (deadline.at, deadline.reason) == (T0 + timedelta(seconds=360), StopReason.CREATE_LOST)


def test_a_running_life_ends_at_its_ttl_kept_by_its_node() -> None:
    started = T0 + timedelta(seconds=1)
    deadline = deadline_of(_life(node_id="n0", scheduled=True, started_at=started, ttl_s=60), TERMS)
    assert (deadline.state, deadline.owner, deadline.reason) == (
        OpenState.RUNNING, Owner.NODE, StopReason.TTL,
    )  # fmt: skip
    assert deadline.at == started + timedelta(seconds=60)


def test_a_frozen_leased_life_ends_after_the_lease_grace_unless_its_ttl_comes_first() -> None:
    started, frozen = T0, T0 + timedelta(seconds=100)
    leased = _life(started_at=started, ttl_s=3600, frozen_at=frozen, leased=True)
    deadline = deadline_of(leased, TERMS)
    assert (deadline.state, deadline.owner, deadline.reason) == (
        OpenState.FROZEN, Owner.SCHEDULER, StopReason.LEASE_LAPSED,
    )  # fmt: skip
    assert deadline.at == frozen + timedelta(seconds=300)
    short = _life(started_at=started, ttl_s=200, frozen_at=frozen, leased=True)
    assert deadline_of(short, TERMS).reason == StopReason.TTL
    assert deadline_of(short, TERMS).at == started + timedelta(seconds=200)


def test_a_life_frozen_without_a_lease_is_bounded_by_its_ttl() -> None:
    life = _life(started_at=T0, ttl_s=600, frozen_at=T0 + timedelta(seconds=5))
    deadline = deadline_of(life, TERMS)
    assert (deadline.state, deadline.owner, deadline.reason) == (
        OpenState.FROZEN, Owner.NODE, StopReason.TTL,
    )  # fmt: skip
    assert deadline.at == T0 + timedelta(seconds=600)


def test_a_lost_node_ends_every_life_on_it_whatever_its_state() -> None:
    lost = T0 + timedelta(seconds=30)
    for life in (
        _life(node_id="n0", scheduled=True, node_lost_at=lost),
        _life(node_id="n0", scheduled=True, started_at=T0, ttl_s=9, node_lost_at=lost),
    ):
        assert state_of(life) == OpenState.ON_LOST_NODE
        deadline = deadline_of(life, TERMS)
        assert (deadline.at, deadline.owner, deadline.reason) == (
            lost, Owner.SCHEDULER_AND_PROJECTOR, StopReason.NODE_LOST,
        )  # fmt: skip


def test_overdue_lists_the_lives_past_their_deadline_and_its_grace() -> None:
    placed = _life(node_id="n0", scheduled=True)
    fresh = OpenLife("sb-2", "t", "j", requested_at=T0 + timedelta(seconds=300))
    undated = OpenLife("sb-3", "t", "j")  # its request is not in the log: nothing dates it
    now = T0 + timedelta(seconds=400)
    found = overdue([placed, fresh, undated], now, TERMS)
    assert [life.sandbox_id for life, _ in found] == ["sb-1"]
    assert overdue([placed], now, TERMS, grace=timedelta(seconds=60)) == []


def test_the_last_word_is_the_latest_time_a_node_spoke_for_the_sandbox() -> None:
    assert last_word(None, T0, T0 + timedelta(seconds=3), None) == T0 + timedelta(seconds=3)
    assert last_word(None, None) is None


def test_an_end_declared_by_anyone_in_the_control_plane_has_one_id() -> None:
    life = _life(node_id="n0", scheduled=True, started_at=T0, ttl_s=60)
    by_scheduler = declared_end(life, StopReason.NODE_LOST, "n0: silent", T0)
    by_projector = declared_end(life, StopReason.NODE_LOST, "n0: lost", T0 + timedelta(seconds=1))
    assert by_scheduler.event_id == by_projector.event_id == end_id("sb-1", StopReason.NODE_LOST)
    assert end_id("sb-1", StopReason.CREATE_LOST) != by_scheduler.event_id
    assert (by_scheduler.node_id, by_scheduler.tenant, by_scheduler.key) == ("n0", "t", "sb-1")
    # The ids the scheduler gave its ends before: a restart across the upgrade appends
    # no second end.
    scheduler_ns = uuid.uuid5(uuid.NAMESPACE_URL, "dsec-scheduler")
    assert end_id("sb-1", StopReason.NODE_LOST) == uuid.uuid5(scheduler_ns, "sb-1:node_lost")
