"""nftables set elements as text: what ``nft -f`` takes to put them afresh, and the
keys of one interface's elements read back from ``nft -j list set``."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any


def readd(table: str, name: str, elements: list[str]) -> str:
    """Elements put into set ``name`` of ``inet table`` afresh (add refreshes no
    timeout, so an element already there is deleted and added)."""
    joined = ", ".join(elements)
    return (
        f"add element inet {table} {name} {{ {joined} }}\n"
        f"delete element inet {table} {name} {{ {joined} }}\n"
        f"add element inet {table} {name} {{ {joined} }}\n"
    )


def elements(listing: str) -> Iterator[Any]:
    """The elements of the sets in an ``nft -j list`` answer (none if unreadable)."""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        for item in json.loads(listing)["nftables"]:
            if "set" in item:
                yield from item["set"].get("elem", [])


def keys_of(listing: str, iface: str) -> list[str]:
    """The keys of a concatenated set's elements that start with ``iface``, written
    as nft takes them back (``"dsb3" . 10.0.0.1 . 443``)."""
    keys = []
    for entry in elements(listing):
        elem = entry.get("elem", entry) if isinstance(entry, dict) else entry
        value = elem.get("val", elem) if isinstance(elem, dict) else elem
        parts = value.get("concat") if isinstance(value, dict) else None
        if not parts or parts[0] != iface:
            continue
        keys.append(" . ".join(_value(part, iface) for part in parts))
    return keys


def _value(part: object, iface: str) -> str:
    if isinstance(part, dict) and "prefix" in part:
        return f"{part['prefix']['addr']}/{part['prefix']['len']}"
    if isinstance(part, dict) and "range" in part:
        low, high = part["range"]
        return f"{low}-{high}"
    if part == iface:
        return f'"{part}"'
    return str(part)
