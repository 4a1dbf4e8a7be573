"""The HTML reports: one self-contained page (inline CSS and SVG, no script, no external file)
per report kind, each a template extending templates/page.html: report.html (trials),
watch.html (`repro watch`).

Rendered by a jinja2 template with autoescaping on, so every piece of record data (slot names,
stderr tails, paths) is escaped by the engine, not by hand.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jinja2

from repro.files import write_text_atomic
from repro.outcome import Report
from repro.report.charts import layout, missing_charts, trial_charts
from repro.report.view import run_view

from repro.report.watch_view import WatchView

TEMPLATE = "report.html"
WATCH_TEMPLATE = "watch.html"


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("repro.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.globals["charts"] = lambda tv: [layout(c) for c in trial_charts(tv.record)]
    env.globals["no_charts"] = lambda tv: missing_charts(tv.record)
    return env


def render_page(template: str, **context: Any) -> str:
    return environment().get_template(template).render(**context)


def report_html(report: Report, link_base: Path | None = None) -> str:
    """link_base: the directory the page will live in, so artifact links are relative to it."""
    return render_page(TEMPLATE, run=run_view(report, link_base))


def watch_html(wv: WatchView) -> str:
    return render_page(WATCH_TEMPLATE, watch=wv)


def write_html(report: Report, path: str | os.PathLike) -> None:
    write_text_atomic(path, report_html(report, Path(path).parent))
