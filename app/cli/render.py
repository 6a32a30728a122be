"""How every `dsec` command prints rows: a rich table for a person, or JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console()


def rows(title: str, found: Sequence[Mapping[str, Any]], as_json: bool) -> None:
    """Print ``found`` as a table titled ``title``, or as a JSON list."""
    if as_json:
        print(json.dumps(list(map(dict, found)), default=str, indent=2))
        return
    table = Table(title=title)
    for column in found[0].keys() if found else ["(none)"]:
        table.add_column(str(column))
    for row in found:
        table.add_row(*("" if v is None else str(v) for v in row.values()))
    console.print(table)
