"""What refusing a hostile record costs the consumer that decodes it.

    .venv/bin/python bench/refusals.py [--mb 0.9]

Any tenant may write a record of up to ``max_message_bytes`` (1 MiB) to the requests
topic or, on the direct route, to a node's inbox; a node writes events; a node's
replies reach trainers. The consumer decodes it before anything else (the scheduler
serves every tenant), so the CPU a refusal costs is CPU taken from everyone. Each
case takes one valid message of each decoder (tests/unit/test_decoders_fuzz.py's
corpus), puts a ~``--mb`` MB value of one hostile shape (many empty arrays, many
objects, many numbers, many strings, a dict of many keys) in one of its places, and
times the decoder refusing it; beside it, ``json.loads`` of the same bytes (the
standard library's parser: what reading it at all costs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.domain.codec import DecodeError, decode_event, decode_reply, decode_request, encode
from tests.unit.test_decoders_fuzz import VALID

Decoder = Callable[[bytes], Any]


def _shapes(size: int) -> dict[str, Any]:
    """Hostile values of about ``size`` bytes of JSON each."""
    return {
        "arrays": [[]] * (size // 3),
        "objects": [{}] * (size // 3),
        "numbers": [0] * (size // 2),
        "strings": ["x"] * (size // 4),
        "keys": {str(i): [] for i in range(size // 12)},
    }


def _places(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key path of a message body (a value anywhere may be replaced)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield (*path, key)
            yield from _places(item, (*path, key))


def _put(body: Any, path: tuple[Any, ...], new: Any) -> Any:
    copy = json.loads(json.dumps(body))
    at = copy
    for step in path[:-1]:
        at = at[step]
    at[path[-1]] = new
    return copy


def _decoder(message: Any) -> Decoder:
    for decoder in (decode_request, decode_event, decode_reply):
        try:
            decoder(encode(message))
            return decoder
        except DecodeError:
            continue
    raise AssertionError(f"no decoder takes {type(message).__name__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=0.9, help="size of each hostile value")
    args = parser.parse_args()
    shapes = _shapes(int(args.mb * 1_000_000))
    rows: list[tuple[float, float, str]] = []
    for message in VALID:
        decoder = _decoder(message)
        body = json.loads(encode(message))
        for place in _places(body):
            for shape, value in shapes.items():
                raw = json.dumps(_put(body, place, value), separators=(",", ":")).encode()
                started = time.process_time()
                with contextlib.suppress(DecodeError):
                    decoder(raw)
                took = time.process_time() - started
                started = time.process_time()
                json.loads(raw)
                floor = time.process_time() - started
                mb = len(raw) / 1_000_000
                name = f"{type(message).__name__}.{'.'.join(map(str, place))} {shape}"
                rows.append((took / mb * 1000, floor / mb * 1000, name))
    rows.sort(reverse=True)
    print(f"{len(rows)} hostile records of ~{args.mb} MB; the costliest, CPU ms per MB:")
    for took, floor, name in rows[:8]:
        print(f"  {name:55s} decoder {took:8.1f}   json.loads {floor:6.1f}")
    p50 = rows[len(rows) // 2][0]
    floor_worst = max(row[1] for row in rows)
    print(
        f"RESULT refusals cases={len(rows)} worst_ms_per_mb={rows[0][0]:.0f}"
        f" p50_ms_per_mb={p50:.0f} json_loads_worst_ms_per_mb={floor_worst:.0f}"
    )


if __name__ == "__main__":
    main()
