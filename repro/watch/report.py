"""`repro watch`'s report: a run's records (repro/watch/records.py) through the view model
(repro/report/watch_view.py) to the trial report's writers: the terminal, JSON, JUnit, HTML.
"""

from __future__ import annotations

from rich.console import Console

from repro.files import write_text_atomic
from repro.report.console import render_watch
from repro.report.jsonfile import json_text
from repro.report.junit import junit_document, watch_suite
from repro.report.watch_view import watch_document, watch_view
from repro.watch.records import WatchReport


def render(rep: WatchReport, console: Console) -> None:
    render_watch(watch_view(rep), console)


def report_json(rep: WatchReport) -> str:
    return json_text(watch_document(rep))


def junit_xml(rep: WatchReport) -> str:
    return junit_document(watch_suite(watch_view(rep)))


def report_html(rep: WatchReport) -> str:
    # jinja2 is imported only when a page is asked for, as for the trial report.
    from repro.report.html import watch_html

    return watch_html(watch_view(rep))


def write_artifacts(rep: WatchReport, junit: str | None, html_path: str | None) -> None:
    """The JUnit and HTML files asked for; the JSON is the CLI's (output.Output.write_json of
    report_json), which writes it to a file or, after everything else, to stdout."""
    if junit:
        write_text_atomic(junit, junit_xml(rep))
    if html_path:
        write_text_atomic(html_path, report_html(rep))
