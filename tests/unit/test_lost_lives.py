"""The projector's rule for lives on lost nodes: each ends node_lost as of the node's
last word on it, under the id every declarer gives that end (issue 28)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from app.control.lost_lives import ends_of
from app.domain.base import StopReason
from app.domain.lives import end_id

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def _row(sandbox_id: str, **fields: object) -> SimpleNamespace:
    base: dict[str, object] = {
        "tenant": "t", "job_id": "j", "node_id": "n0", "started_at": None,
        "last_heartbeat_at": T0, "lost_at": T0 + timedelta(seconds=25), "last_command_at": None,
    }  # fmt: skip
    return SimpleNamespace(sandbox_id=sandbox_id, **{**base, **fields})


def test_each_life_ends_at_the_nodes_last_word_on_it() -> None:
    # Given lives on a node last heard from at T0 and declared lost 25 s later
    ago = timedelta(minutes=5)
    rows = [
        _row("sb-quiet", started_at=T0 - ago),
        _row("sb-busy", started_at=T0 - ago, last_command_at=T0 + timedelta(seconds=3)),
        _row("sb-late", started_at=T0 + timedelta(seconds=2)),
        _row("sb-placed"),
    ]
    # When the rule states their ends
    ends = {e.sandbox_id: e for e in ends_of(rows)}
    # Then each is billed to the node's last word: a heartbeat, a command or its start
    assert ends["sb-quiet"].occurred_at == T0
    assert ends["sb-busy"].occurred_at == T0 + timedelta(seconds=3)
    assert ends["sb-late"].occurred_at == T0 + timedelta(seconds=2)
    assert ends["sb-placed"].occurred_at == T0
    for sandbox_id, end in ends.items():
        assert end.payload.reason == StopReason.NODE_LOST
        assert end.event_id == end_id(sandbox_id, StopReason.NODE_LOST)
        assert (end.node_id, end.tenant, end.job_id, end.key) == ("n0", "t", "j", sandbox_id)
        assert end.payload.last_state is not None
        assert end.payload.last_state.observed_by == "projector"
        assert end.payload.last_state.last_heartbeat_at == T0


def test_a_node_never_heard_from_ends_its_lives_at_its_loss() -> None:
    [end] = ends_of([_row("sb-1", last_heartbeat_at=None)])
    assert end.occurred_at == T0 + timedelta(seconds=25)


def test_the_projector_may_write_the_ends_it_states() -> None:
    from app.domain.kafka_access import PROJECTOR, Operation, service_grants

    grants = service_grants("dsec")
    writes = {g.name for g in grants if g.principal == PROJECTOR and g.operation == Operation.WRITE}
    assert writes == {"dsec.events", "dsec.deadletters"}
