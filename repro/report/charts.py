"""Small charts for the HTML report, where a curve says more than a table.

Data first (which numbers, per scenario), then geometry for an inline SVG the template draws:
no JavaScript, no external files. Values that are not finite are drawn at the top of the
plot and labelled, never dropped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from repro.outcome import StepRecord, TrialRecord
from repro.report.fmt import fmt_float

WIDTH, HEIGHT = 640, 240
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 16, 44


@dataclass
class Series:
    name: str
    points: list[tuple[Any, float | None]]     # (x, y); y None: not finite


@dataclass
class ChartData:
    title: str
    caption: str
    kind: str                                   # "line" | "bar"
    x_label: str
    y_label: str
    series: list[Series]
    threshold: float | None = None
    threshold_label: str = ""


def number(value: Any) -> float | None:
    """Finite float or None (NaN/Inf, also as read back from strict JSON)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def reload_error_chart(steps: list[StepRecord]) -> ChartData | str:
    """nvfp4-reload: the warm layer's error against a cold build of the same weights, per reload
    (the steps table's "scaled err" column). A str: why there is no chart."""
    if len({s.step for s in steps}) < 2:
        return "a single reload: the steps table says it all"
    scaled = all("max_scaled_err" in s.extra for s in steps)
    values = [number(s.extra["max_scaled_err"] if scaled else s.rel_err) for s in steps]
    if all(v == 0 for v in values):
        return "the error was 0 at every reload (a flat line says nothing the table does not)"
    series: dict[int, Series] = {}
    for s in sorted(steps, key=lambda s: (s.rank, s.step)):
        y = s.extra["max_scaled_err"] if scaled else s.rel_err
        series.setdefault(s.rank, Series(f"rank {s.rank}", [])).points.append((s.step, number(y)))
    tolerance = next((s.tolerance for s in steps if s.tolerance is not None), None)
    return ChartData(
        # "warm": the layer reloaded in place (replayed on GPU, run eagerly on CPU); the title
        # must hold for both.
        title="Error per reload: warm layer (reloaded in place) against cold (built fresh on the same weights)",
        caption=("max scaled error |y - y_cold| / (|y_cold| + rms(y_cold)); above the tolerance line an "
                 "element counts as a mismatch" if scaled else "relative error against the cold reference"),
        kind="line", x_label="reload", y_label="scaled err" if scaled else "rel err",
        series=list(series.values()) if len(series) > 1 else [Series("", next(iter(series.values())).points)],
        threshold=tolerance if scaled else None, threshold_label=f"tolerance {fmt_float(tolerance)}")


def graph_mismatch_chart(steps: list[StepRecord]) -> ChartData | str:
    """gemma4-mtp: share of draft tokens that differ from the reference, per captured batch size.
    A str: why there is no chart."""
    totals: dict[str, list[int]] = {}
    order: dict[str, int] = {}
    for s in steps:
        mismatched, compared = totals.setdefault(s.label, [0, 0])
        totals[s.label] = [mismatched + s.mismatches, compared + s.compared]
        order[s.label] = min(order.get(s.label, s.batch), s.batch)
    # All zero is said by the table already; the chart earns its place when graphs differ.
    if len(totals) < 2:
        return "one graph size only: the steps table says it all"
    if not any(m for m, _ in totals.values()):
        return "no draft token differed from the reference in any graph (every bar would be 0)"
    labels = sorted(totals, key=lambda k: (order[k], k))
    points = [(k, totals[k][0] / totals[k][1] if totals[k][1] else None) for k in labels]
    return ChartData(
        title="Draft tokens that differ from the reference, per batch size (one captured graph each)",
        caption="mismatched / compared tokens over all steps and ranks that used the graph",
        kind="bar", x_label="graph", y_label="mismatched share", series=[Series("", points)])


# Which chart a scenario's steps get; a scenario without an entry gets none.
CHARTS: dict[str, Callable[[list[StepRecord]], ChartData | str]] = {
    "nvfp4-reload": reload_error_chart,
    "gemma4-mtp": graph_mismatch_chart,
}


def chart_or_reason(trial: TrialRecord) -> ChartData | str | None:
    """The trial's chart, or why its scenario's chart is left out; None: no chart exists for it."""
    make = CHARTS.get(trial.scenario)
    if make is None:
        return None
    if not trial.steps:
        return "no step was recorded"
    return make(trial.steps)


def trial_charts(trial: TrialRecord) -> list[ChartData]:
    chart = chart_or_reason(trial)
    return [chart] if isinstance(chart, ChartData) else []


def missing_charts(trial: TrialRecord) -> list[str]:
    """Why the page shows no chart for a trial whose scenario has one."""
    chart = chart_or_reason(trial)
    return [chart] if isinstance(chart, str) else []


# ---- geometry -------------------------------------------------------------------------------


@dataclass
class Mark:
    x: float
    y: float
    w: float = 0.0
    h: float = 0.0
    tip: str = ""
    css: str = ""
    label: str = ""


@dataclass
class Svg:
    width: int
    height: int
    title: str
    caption: str
    x_label: str
    y_label: str
    plot: tuple[float, float, float, float]          # left, top, right, bottom
    y_ticks: list[tuple[float, str]] = field(default_factory=list)
    x_ticks: list[tuple[float, str]] = field(default_factory=list)
    lines: list[tuple[str, str]] = field(default_factory=list)   # (points, css)
    marks: list[Mark] = field(default_factory=list)
    bars: list[Mark] = field(default_factory=list)
    threshold: Mark | None = None
    legend: list[tuple[str, str]] = field(default_factory=list)  # (name, css)


def nice_top(value: float) -> float:
    """Round the axis top up to 1, 2 or 5 x 10^k."""
    if value <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    return next(m * exp for m in (1, 2, 5, 10) if m * exp >= value)


def tick_label(v: float) -> str:
    return f"{v:.3g}"


def layout(chart: ChartData) -> Svg:
    left, top, right, bottom = LEFT, TOP, WIDTH - RIGHT, HEIGHT - BOTTOM
    svg = Svg(WIDTH, HEIGHT, chart.title, chart.caption, chart.x_label, chart.y_label, (left, top, right, bottom))
    ys = [y for s in chart.series for _, y in s.points if y is not None]
    y_top = nice_top(max(ys + ([chart.threshold] if chart.threshold is not None else []) + [0.0]))

    def y_at(v: float) -> float:
        return bottom - (bottom - top) * (v / y_top)

    svg.y_ticks = [(y_at(y_top * i / 4), tick_label(y_top * i / 4)) for i in range(5)]
    xs = list(dict.fromkeys(x for s in chart.series for x, _ in s.points))
    slot = (right - left) / max(1, len(xs))

    def x_at(x: Any) -> float:
        return left + slot * (xs.index(x) + 0.5)

    every = max(1, math.ceil(len(xs) / 12))          # at most ~12 x labels
    svg.x_ticks = [(x_at(x), str(x)) for i, x in enumerate(xs) if i % every == 0]
    for k, s in enumerate(chart.series):
        css = f"s{k % 4}"
        if s.name:
            svg.legend.append((s.name, css))
        for x, y in s.points:
            tip = f"{s.name + ' ' if s.name else ''}{chart.x_label} {x}: {'not finite' if y is None else fmt_float(y)}"
            if chart.kind == "bar":
                h = (bottom - y_at(y)) if y is not None else bottom - top
                svg.bars.append(Mark(x_at(x) - slot * 0.3, bottom - h, slot * 0.6, h, tip,
                                     "bad" if y is None else css, "NaN" if y is None else ""))
            else:
                svg.marks.append(Mark(x_at(x), top if y is None else y_at(y), tip=tip,
                                      css="bad" if y is None else css, label="NaN" if y is None else ""))
        if chart.kind == "line":
            finite = [(x_at(x), y_at(y)) for x, y in s.points if y is not None]
            if len(finite) > 1:
                svg.lines.append((" ".join(f"{px:.1f},{py:.1f}" for px, py in finite), css))
    if chart.threshold is not None:
        svg.threshold = Mark(left, y_at(chart.threshold), right - left, label=chart.threshold_label)
    return svg
