"""Services can log one JSON object per line, tracebacks included."""

from __future__ import annotations

import json
import logging
import sys

from app.diagnostics import JsonFormatter


def test_a_record_is_one_json_object_with_its_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "dsec.test", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info()
        )
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["level"] == "ERROR" and entry["logger"] == "dsec.test"
    assert entry["message"] == "failed here"
    assert "ValueError: boom" in entry["exception"]
    assert entry["time"].endswith("+00:00")
