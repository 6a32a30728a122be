"""Database errors classified by SQLSTATE: an outage waits, a refusal is set aside."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from app.db.errors import classify
from app.errors import LogTamperRefused, ServiceUnavailable, StorageRefused


class _DriverError(Exception):
    def __init__(self, sqlstate: str | None) -> None:
        super().__init__(f"driver said {sqlstate}")
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    ("wrapper", "sqlstate", "expected"),
    [
        (OperationalError, None, ServiceUnavailable),  # connection refused: no answer
        (OperationalError, "57P01", ServiceUnavailable),  # admin shutdown
        (OperationalError, "08006", ServiceUnavailable),  # connection failure
        (OperationalError, "40001", ServiceUnavailable),  # serialization failure
        (OperationalError, "40P01", ServiceUnavailable),  # deadlock
        (OperationalError, "53300", ServiceUnavailable),  # too many connections
        (DBAPIError, "42501", LogTamperRefused),  # the append-only trigger, a grant
        (DBAPIError, "22P05", StorageRefused),  # jsonb refuses a NUL character
        (IntegrityError, "23505", StorageRefused),  # unique violation
        (OperationalError, "54000", StorageRefused),  # program limit: never fits
        (DBAPIError, None, StorageRefused),
    ],
)
def test_a_database_error_becomes_the_platforms(
    wrapper: type[DBAPIError], sqlstate: str | None, expected: type[Exception]
) -> None:
    exc = wrapper("INSERT ...", None, _DriverError(sqlstate))
    found = classify(exc)
    assert type(found) is expected
    assert f"driver said {sqlstate}" in str(found)
