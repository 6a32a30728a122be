"""Render the Grafana dashboard's panels to a PNG from a live Prometheus.

Reads docker/grafana/dashboards/dsec.json, runs each panel target's own PromQL
`expr` through Prometheus's HTTP API (/api/v1/query_range) over the last N
minutes, names each series from the target's `legendFormat`, and draws the
panels as a grid of small time-series plots in a dark, Grafana-like style.

Grafana itself is not available here, so this draws the dashboard's own
queries with matplotlib instead: the picture shows the same numbers Grafana
would, not a mock-up.

    python scripts/render_dashboard.py --prometheus http://127.0.0.1:9090 \
        --minutes 15 --out docs/img/dashboard.png

Needs only the standard library and matplotlib (not a dsec dependency: run it
from any venv that has matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib

# No display here, and none needed: we only write a file.
matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, MultipleLocator

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "dsec.json"
DEFAULT_OUT = ROOT / "docs" / "img" / "dashboard.png"

ROWS, COLS = 4, 3
# Three legend rows of three fit between one panel and the next.
LEGEND_MAX = 9
FIG_INCHES = (18.0, 15.0)
DPI = 100

# Grafana's dark theme and its "classic" palette, so the picture reads like
# the dashboard an operator would open.
BG = "#111217"
PANEL_BG = "#181b1f"
GRID = "#2c3235"
TEXT = "#ccccdc"
MUTED = "#8e8e9e"
PALETTE = [
    "#73bf69",
    "#f2cc0c",
    "#8ab8ff",
    "#ff780a",
    "#f2495c",
    "#5794f2",
    "#b877d9",
    "#705da0",
    "#37872d",
    "#fade2a",
]

LEGEND_VAR = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


@dataclass
class Series:
    name: str
    times: list[float]  # Unix seconds
    values: list[float]


@dataclass
class Panel:
    title: str
    unit: str
    x: int
    y: int
    targets: list[dict[str, Any]]


def load_panels(path: Path) -> tuple[str, list[Panel]]:
    board = json.loads(path.read_text())
    panels = []
    for raw in board.get("panels", []):
        # Rows and text panels have no queries to draw.
        if raw.get("type") != "timeseries":
            continue
        grid = raw.get("gridPos", {})
        unit = raw.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        panels.append(
            Panel(
                title=raw.get("title", ""),
                unit=unit,
                x=int(grid.get("x", 0)),
                y=int(grid.get("y", 0)),
                targets=raw.get("targets", []),
            )
        )
    # Grafana lays panels out by grid position, not by their order in the file.
    panels.sort(key=lambda p: (p.y, p.x))
    return board.get("title", "dashboard"), panels


def legend(fmt: str, labels: dict[str, str]) -> str:
    if not fmt:
        # Grafana's fallback when a target has no legendFormat.
        inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        return "{" + inner + "}"
    # Grafana leaves a missing label empty rather than failing.
    return LEGEND_VAR.sub(lambda m: labels.get(m.group(1), ""), fmt)


def query_range(
    base: str, expr: str, start: float, end: float, step: float
) -> list[dict[str, Any]]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    url = f"{base.rstrip('/')}/api/v1/query_range?{params}"
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            body = json.load(resp)
    except urllib.error.HTTPError as err:
        # Prometheus explains a bad query in the body of its 400.
        body = json.load(err)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body.get('errorType')}: {body.get('error')}")
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def fetch_panel(base: str, panel: Panel, start: float, end: float, step: float) -> list[Series]:
    series = []
    for target in panel.targets:
        expr = target.get("expr")
        if not expr:
            continue
        for item in query_range(base, expr, start, end, step):
            times = [float(ts) for ts, _ in item["values"]]
            # Prometheus sends values as strings; "NaN" (a quantile over an idle
            # window) parses to a float matplotlib leaves as a gap, as Grafana does.
            values = [float(raw) for _, raw in item["values"]]
            name = legend(target.get("legendFormat", ""), item.get("metric", {}))
            series.append(Series(name=name, times=times, values=values))
    return series


def format_value(unit: str, value: float) -> str:
    if unit == "s":
        if value == 0:
            return "0"
        if abs(value) < 1:
            return f"{value * 1000:.0f} ms"
        return f"{value:.3g} s"
    suffix = " req/s" if unit == "reqps" else ""
    if abs(value) >= 1000:
        return f"{value / 1000:.3g}K{suffix}"
    return f"{value:.3g}{suffix}"


def clock(t: float) -> str:
    return f"{datetime.fromtimestamp(t, tz=UTC):%H:%M}"


def tick_seconds(span: float) -> float:
    # Grafana's kind of steps: about five labels across a panel, on round minutes.
    for step in (60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400):
        if span / step <= 6:
            return float(step)
    return 86400.0 * max(1, round(span / 86400 / 6))


def style_axes(ax: Axes) -> None:
    ax.set_facecolor(PANEL_BG)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.grid(True, color=GRID, linewidth=0.6)
    ax.tick_params(colors=MUTED, labelsize=8, length=0)


def draw_panel(ax: Axes, panel: Panel, series: list[Series], start: float, end: float) -> None:
    style_axes(ax)
    ax.set_title(panel.title, color=TEXT, fontsize=10.5, loc="left", pad=8)
    # Time stays in Unix seconds (matplotlib's date helpers are untyped), with
    # ticks on whole minutes, in UTC as the dashboard's timezone says.
    ax.set_xlim(start, end)
    ax.xaxis.set_major_locator(MultipleLocator(tick_seconds(end - start)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda t, _pos: clock(t)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format_value(panel.unit, v)))

    if not series:
        ax.set_ylim(0, 1)
        ax.set_yticklabels([])
        ax.text(
            0.5,
            0.5,
            "No data",
            transform=ax.transAxes,
            ha="center",
            va="center",
            color=MUTED,
            fontsize=13,
        )
        return

    for i, s in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        ax.plot(s.times, s.values, color=color, linewidth=1.4, label=s.name)
        ax.fill_between(s.times, s.values, color=color, alpha=0.08, linewidth=0)
    # Every query here counts, waits or times something, so none goes below zero:
    # anchor the axis at 0 as Grafana does, and give an all-zero line some headroom
    # instead of matplotlib's symmetric band around it. The sliver below zero
    # keeps a flat zero line from hiding under the panel's edge.
    top = max((v for s in series for v in s.values if math.isfinite(v)), default=0.0)
    top = top * 1.08 if top > 0 else 1.0
    ax.set_ylim(-0.015 * top, top)

    # Grafana scrolls a long legend inside the panel; a picture cannot, so show
    # the first few names and say how many more lines are drawn.
    handles, labels = ax.get_legend_handles_labels()
    if len(handles) > LEGEND_MAX:
        hidden = len(handles) - (LEGEND_MAX - 1)
        handles = [*handles[: LEGEND_MAX - 1], Line2D([], [], alpha=0)]
        labels = [*labels[: LEGEND_MAX - 1], f"… and {hidden} more"]
    ax.legend(
        handles,
        labels,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.1),
        ncol=min(len(handles), 3),
        fontsize=7.5,
        frameon=False,
        labelcolor=TEXT,
        handlelength=1.2,
        columnspacing=1.2,
    )


def render(
    dashboard: Path, prometheus: str, minutes: float, out: Path, end: float | None = None
) -> None:
    title, panels = load_panels(dashboard)
    end = time.time() if end is None else end
    start = end - minutes * 60
    # About 240 points a panel, never finer than a 5 s scrape can justify.
    step = max(5.0, round(minutes * 60 / 240))

    plt.rcParams["font.family"] = "DejaVu Sans"
    fig, axes = plt.subplots(ROWS, COLS, figsize=FIG_INCHES, dpi=DPI, facecolor=BG)
    flat = list(axes.flat)
    for ax, panel in zip(flat, panels, strict=False):
        draw_panel(ax, panel, fetch_panel(prometheus, panel, start, end, step), start, end)
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    if len(panels) > len(flat):
        print(f"warning: {len(panels) - len(flat)} panels did not fit the grid", file=sys.stderr)

    span = (
        f"{datetime.fromtimestamp(start, tz=UTC):%Y-%m-%d %H:%M} to "
        f"{datetime.fromtimestamp(end, tz=UTC):%H:%M} UTC, step {step:g}s"
    )
    fig.suptitle(title, color=TEXT, fontsize=17, x=0.015, y=0.985, ha="left")
    fig.text(0.985, 0.982, span, color=MUTED, fontsize=9.5, ha="right")
    fig.subplots_adjust(left=0.055, right=0.985, top=0.935, bottom=0.05, hspace=0.62, wspace=0.2)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, facecolor=BG)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    parser.add_argument("--minutes", type=float, default=15.0, help="window ending now")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="PNG to write")
    parser.add_argument("--dashboard", type=Path, default=DEFAULT_DASHBOARD, help="dashboard JSON")
    args = parser.parse_args(argv)
    render(args.dashboard, args.prometheus, args.minutes, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
