"""Small charts for the HTML report, where a curve says more than a table.

Data first (which numbers: each scenario's spec picks its own, ScenarioSpec.chart), then
geometry for an inline SVG the template draws: no JavaScript, no external files. Values that
are not finite are drawn at the top of the plot and labelled, never dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from repro.outcome import TrialRecord
from repro.report.fmt import fmt_float
from repro.scenarios import SCENARIOS
from repro.scenarios.spec import ChartData, ChartKind

WIDTH, HEIGHT = 640, 240
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 16, 44


def chart_or_reason(trial: TrialRecord) -> ChartData | str | None:
    """The trial's chart, or why its scenario's chart is left out; None: no chart exists for it."""
    spec = SCENARIOS.get(trial.scenario)
    make = spec.chart if spec is not None else None
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
    plot: tuple[float, float, float, float]  # left, top, right, bottom
    y_ticks: list[tuple[float, str]] = field(default_factory=list)
    x_ticks: list[tuple[float, str]] = field(default_factory=list)
    lines: list[tuple[str, str]] = field(default_factory=list)  # (points, css)
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

    every = max(1, math.ceil(len(xs) / 12))  # at most ~12 x labels
    svg.x_ticks = [(x_at(x), str(x)) for i, x in enumerate(xs) if i % every == 0]
    for k, s in enumerate(chart.series):
        css = f"s{k % 4}"
        if s.name:
            svg.legend.append((s.name, css))
        for x, y in s.points:
            tip = f"{s.name + ' ' if s.name else ''}{chart.x_label} {x}: {'not finite' if y is None else fmt_float(y)}"
            if chart.kind == ChartKind.BAR:
                h = (bottom - y_at(y)) if y is not None else bottom - top
                svg.bars.append(
                    Mark(
                        x_at(x) - slot * 0.3,
                        bottom - h,
                        slot * 0.6,
                        h,
                        tip,
                        "bad" if y is None else css,
                        "NaN" if y is None else "",
                    )
                )
            else:
                svg.marks.append(
                    Mark(
                        x_at(x),
                        top if y is None else y_at(y),
                        tip=tip,
                        css="bad" if y is None else css,
                        label="NaN" if y is None else "",
                    )
                )
        if chart.kind == ChartKind.LINE:
            finite = [(x_at(x), y_at(y)) for x, y in s.points if y is not None]
            if len(finite) > 1:
                svg.lines.append((" ".join(f"{px:.1f},{py:.1f}" for px, py in finite), css))
    if chart.threshold is not None:
        svg.threshold = Mark(left, y_at(chart.threshold), right - left, label=chart.threshold_label)
    return svg
