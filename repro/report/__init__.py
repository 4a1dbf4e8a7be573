"""Reports of a run and of a `repro watch` run: one view model per kind (view.py for trials,
watch_view.py for watch runs) read by every renderer.

console.py   rich panels and tables (stdout in the CLI; stderr when `--json -` holds stdout)
junit.py     the one JUnit writer (XML-safe): a testcase per trial, or per watched process
html.py      one self-contained page per kind from templates/ (jinja2, autoescaped): report.html,
             watch.html, both extending page.html
jsonfile.py  the one strict JSON writer (schemas repro.report/1 and repro.watch/1)
progress.py  the live display while trials run (stderr)

No torch import anywhere here: this runs in the parent.
"""

from __future__ import annotations

import os

from repro.outcome import Report
from repro.report.console import (
    output_console,
    outcome_style,
    render_report,
    render_summary,
    render_trial,
    report_to_text,
)
from repro.report.jsonfile import report_json, strict_json, write_json
from repro.report.junit import junit_xml, write_junit
from repro.report.progress import Progress
from repro.report.view import CPU_NOTE, describe, summary_line, trial_title

__all__ = [
    "CPU_NOTE",
    "Progress",
    "describe",
    "junit_xml",
    "output_console",
    "outcome_style",
    "render_report",
    "render_summary",
    "render_trial",
    "report_json",
    "report_to_text",
    "strict_json",
    "summary_line",
    "trial_title",
    "write_html",
    "write_json",
    "write_junit",
]


def write_html(report: Report, path: str | os.PathLike) -> None:
    # jinja2 is imported only when a page is asked for: the CLI's start-up stays light.
    from repro.report.html import write_html as write

    write(report, path)
