"""The live view of running trials (stderr in the CLI, so results on stdout stay clean).

On a terminal it is a rich progress display; otherwise (CI logs, pipes) each event is one
plain line with no control codes, so logs stay greppable and nothing is redrawn.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rich.console import Console
from rich.markup import escape as escape_markup
from rich.progress import BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Column
from rich.text import Text

from repro.outcome import Outcome
from repro.report.console import outcome_style
from repro.report.fmt import fmt_seconds, plain


# Plain lines (logs, pipes): one per tenth of the steps and per new status, not one per step (a
# 5000-step trial wrote 5000 lines into a CI log), and one at least this often while it moves.
PLAIN_SHARES = 10
PLAIN_EVERY_S = 10.0


def worth_a_line(
    last: tuple[int, str] | None, last_at: float, steps_done: int, status: str, total: int | None, now: float
) -> bool:
    if last is None:
        return True
    last_steps, last_status = last
    if (last_steps, last_status) == (steps_done, status):
        return False
    if status != last_status or not total or steps_done >= total:
        return True
    new_tenth = steps_done * PLAIN_SHARES // total > last_steps * PLAIN_SHARES // total
    return new_tenth or now - last_at >= PLAIN_EVERY_S


class Progress:
    """Started, step counts and finished outcome per trial, from the runner's reader threads."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live = console.is_terminal and not console.is_dumb_terminal
        self.tasks: dict[str, Any] = {}  # trial_id -> rich task id (live mode)
        self.totals: dict[str, int | None] = {}
        self.started: dict[str, float] = {}
        self.last: dict[str, tuple[int, str]] = {}  # plain mode: the last line's count and status
        self.last_at: dict[str, float] = {}  # plain mode: when it was printed
        self.lock = threading.Lock()  # runners report from reader threads
        # On a narrow terminal the trial's name gives way (cut with an ellipsis), never the
        # counts or the timer ("0:00:…" said nothing).
        self.bar = (
            RichProgress(
                SpinnerColumn(),
                TextColumn("{task.description}", table_column=Column(ratio=1, no_wrap=True)),
                BarColumn(bar_width=20),
                MofNCompleteColumn(table_column=Column(no_wrap=True)),
                TextColumn("{task.fields[status]}", table_column=Column(no_wrap=True)),
                TimeElapsedColumn(table_column=Column(no_wrap=True, min_width=7)),
                console=console,
                transient=False,
                expand=True,
            )
            if self.live
            else None
        )

    def __enter__(self) -> "Progress":
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def emit(self, trial_id: str, text: Text) -> None:
        line = Text(f"[{trial_id}] ", style="dim")
        line.append_text(text)
        # soft_wrap: one event stays one line however narrow the log viewer thinks it is.
        self.console.print(line, soft_wrap=True, highlight=False)

    def add(self, trial_id: str, label: str, total_steps: int | None) -> None:
        with self.lock:
            self.totals[trial_id] = total_steps
            self.started[trial_id] = time.monotonic()
            if self.bar is not None:
                self.tasks[trial_id] = self.bar.add_task(escape_markup(label), total=total_steps, status="starting")
                return
        steps = f" ({total_steps} steps)" if total_steps else ""
        self.emit(trial_id, Text(f"started {label}{steps}"))

    def update(self, trial_id: str, steps_done: int, status_text: str = "") -> None:
        """steps_done: steps recorded so far. Polled, so a quick trial's lines skip counts; each
        line says what is done, and past the last step the trial is finishing, not running."""
        with self.lock:
            if trial_id not in self.started:
                self.started[trial_id] = time.monotonic()
                self.totals[trial_id] = None
                if self.bar is not None:
                    self.tasks[trial_id] = self.bar.add_task(escape_markup(trial_id), total=None, status="")
            total = self.totals.get(trial_id)
            status_text = status_text or ("finishing" if total and steps_done >= total else "running")
            if self.bar is not None:
                # The columns read markup; caller text is escaped so "[rank0]" prints as written.
                self.bar.update(self.tasks[trial_id], completed=steps_done, status=escape_markup(plain(status_text)))
                return
            now = time.monotonic()
            if not worth_a_line(
                self.last.get(trial_id), self.last_at.get(trial_id, now), steps_done, status_text, total, now
            ):
                return
            self.last[trial_id] = (steps_done, status_text)
            self.last_at[trial_id] = now
        count = f"{steps_done}/{total}" if total else f"{steps_done}"
        self.emit(trial_id, Text(f"{count} steps done · {plain(status_text)}"))

    def finish(self, trial_id: str, outcome: Outcome, detail: str = "") -> None:
        outcome = Outcome(outcome)
        with self.lock:
            elapsed = time.monotonic() - self.started.get(trial_id, time.monotonic())
            if self.bar is not None:
                if trial_id not in self.tasks:
                    self.tasks[trial_id] = self.bar.add_task(escape_markup(trial_id), total=None, status="")
                task = self.tasks[trial_id]
                total = self.totals.get(trial_id)
                status = f"[{outcome_style(outcome)}]{outcome.value}[/] {escape_markup(plain(detail))}".rstrip()
                # A finished trial stops its spinner and bar; the outcome stays on screen.
                self.bar.update(task, total=total or 1, completed=total or 1, status=status)
                self.bar.stop_task(task)
                return
        text = Text("finished ")
        text.append(outcome.value, style=outcome_style(outcome))
        text.append(f" in {fmt_seconds(elapsed)}" + (f": {plain(detail)}" if detail else ""))
        self.emit(trial_id, text)
