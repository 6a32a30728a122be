"""Projections built by other rules are rebuilt from the log when a projector starts."""

from __future__ import annotations

from typing import Any

import pytest

from app.config import Settings
from app.control.projector import Projector
from app.db import projections
from tests.conftest import scalar, wait_for

pytestmark = pytest.mark.integration


def test_a_projector_rebuilds_projections_that_other_rules_built(
    stack: Settings, client: Any, db: Any
) -> None:
    # Given a sandbox that ran one command, in the log and in the projections
    with client.create() as box:
        box.exec("true")
    count = "SELECT commands FROM sandboxes WHERE sandbox_id = :s AND state = 'stopped'"
    with db() as conn:
        wait_for(lambda: scalar(conn, count, s=box.id), what="the sandbox's row")
    # And projections as an older release's rules left them: another version, and a
    # row that differs from what those rules make of the log now
    with db() as conn:
        conn.exec_driver_sql(
            "UPDATE sandboxes SET commands = 1000 WHERE sandbox_id = %(s)s", {"s": box.id}
        )
        conn.exec_driver_sql("UPDATE projection_version SET version = 0")
    # When a projector starts
    projector = Projector(stack, partitions=[0], name="projection-version-test")
    projector.consumer.close()
    projector.publisher.close()
    # Then the projections are the log's again, and the rules' version is recorded
    with db() as conn:
        assert scalar(conn, count, s=box.id) == 1
        assert projections.recorded_version(conn) == projections.VERSION
        # And the next start finds them current and folds nothing again
        assert projections.ensure_current(conn) is None
