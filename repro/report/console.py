"""The report on a terminal or in a log: rich panels and tables drawn from the view model.

Record data is always wrapped in rich Text, never interpolated into markup: a stderr line such
as "[rank0]: ..." must print as written, not be eaten as a style tag. Tables fit the console's
width (80 columns in pipes and CI logs) by leaving out the least useful columns, never by
cutting numbers or headers; paths are printed whole.
"""

from __future__ import annotations

import io
import os
import re
import sys
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from repro.outcome import Outcome, Report, TrialRecord
from repro.report.fmt import fmt_ranges, fmt_seconds
from repro.report.view import (
    BAD,
    DIM,
    NOTE,
    OK,
    SKIP,
    WARN,
    Artifact,
    Cell,
    Column,
    Row,
    RunView,
    TableView,
    TrialView,
    outcome_tone,
    run_view,
    trial_view,
)

from repro.report.watch_view import ProblemView, WatchView

STYLES = {
    OK: "bold green",
    WARN: "bold yellow",
    SKIP: "bold magenta",
    BAD: "bold red",
    NOTE: "bold yellow",
    DIM: "dim",
    "": "",
}


def outcome_style(outcome: Outcome) -> str:
    """rich style: green CLEAN, yellow STALE_CAPTURE, magenta UNSUPPORTED, red for the rest."""
    return STYLES[outcome_tone(outcome)]


def text(c: Cell) -> Text:
    return Text(c.text, style=STYLES.get(c.tone, ""))


# ---- a trial --------------------------------------------------------------------------------


def verdict_panel(tv: TrialView) -> Panel:
    style = STYLES[tv.tone]
    head = Text.assemble((tv.outcome, style), "   ", text(tv.verdict))
    head.append(f" (expected {tv.expected})", "dim")
    lines: list[RenderableType] = [head, Text(tv.meaning)]
    if tv.first_failure:
        lines.append(Text.assemble(("first failure: ", "bold"), tv.first_failure))
    lines += [Text(line, style=STYLES[NOTE]) for line in tv.basis]
    subtitle = f"trial {tv.id}" + (f" · {fmt_seconds(tv.seconds)}" if tv.seconds else "")
    return Panel(
        Group(*lines),
        title=Text(tv.title, style="bold"),
        title_align="left",
        subtitle=Text(subtitle, style="dim"),
        subtitle_align="right",
        border_style=style.split()[-1],
        box=box.ROUNDED,
    )


def facts_grid(facts, indent: int = 0) -> RenderableType:
    """label / value lines; a wrapped value stays under its own column."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(overflow="fold")
    for f in facts:
        grid.add_row(f.label, Text(f.value, style=STYLES.get(f.tone, "")))
    return Padding(grid, (0, 0, 0, indent)) if indent else grid


def findings_block(tv: TrialView) -> list[RenderableType]:
    """Per problem (a group of findings): a headline with its ranks and count, then its facts in
    a hanging-indent grid. The message, which says in a sentence what the facts say, is shown
    for the first group only (every one is in --json and --html)."""
    title = Text(f"Findings ({tv.findings_total}", style="bold")
    groups = len(tv.findings) + tv.hidden_finding_groups
    title.append(f" in {groups} groups)" if groups > 1 else ")")
    out: list[RenderableType] = [title]
    for i, fv in enumerate(tv.findings):
        headline = Text.assemble((fv.status.upper(), STYLES[fv.tone]), " ", (fv.slot, "bold"), f"  {fv.where}")
        out.append(Padding(headline, (0, 0, 0, 2)))  # a wrapped slot name hangs under itself
        facts = fv.facts if i == 0 else [f for f in fv.facts if f.label != "message"]
        out.append(facts_grid(facts, indent=4))
    if len(tv.findings) > 1 and any(f.label == "message" for fv in tv.findings[1:] for f in fv.facts):
        out.append(Text("  each finding's message is in --json and --html", style="dim"))
    if tv.hidden_finding_groups:
        out.append(Text(f"  {tv.hidden_finding_groups} more groups hidden (all are in --json)", style="dim"))
    return out


WRAP_MIN = 16  # free text narrower than this wraps every word onto its own line


def wrap_min(c: Column, tv: TableView) -> int:
    longest = max([len(r.cells[c.key].text) for r in tv.rows if not r.gap] + [len(c.header)])
    return min(WRAP_MIN, longest)


def rich_table(tv: TableView, columns: list[Column]) -> Table:
    title = Text(tv.title, style="bold")
    for header, value in tv.folded:
        if value != "-":
            title.append(f" · {header} {value}", style="dim")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAVY, show_edge=False)
    for c in columns:
        # Numbers and headers never wrap or shrink; free text folds into what is left.
        if c.wrap:
            table.add_column(c.short_header, overflow="fold", min_width=wrap_min(c, tv))
        else:
            table.add_column(c.short_header, justify="right" if c.numeric else "left", no_wrap=True)
    gap_key = next((c.key for c in columns if c.wrap), columns[0].key)
    for row in tv.rows:
        if row.gap:
            cells = {c.key: Text("") for c in columns}
            cells[columns[0].key] = Text("…", style="dim")
            cells[gap_key] = Text(f"{row.gap} rows hidden", style="dim")
            table.add_row(*cells.values())
            continue
        table.add_row(*(text(row.cells[c.key]) for c in columns))
    return table


def needed_width(tv: TableView, columns: list[Column]) -> int:
    """Characters the table needs without cutting anything: whole numbers and headers, free
    text at its minimum; each column is padded by one space a side and divided by one."""
    widths = []
    for c in columns:
        if c.wrap:
            widths.append(wrap_min(c, tv))
            continue
        cells = [len(r.cells[c.key].text) for r in tv.rows if not r.gap]
        widths.append(max([len(line) for line in c.short_header.splitlines()] + cells))
    return sum(w + 2 for w in widths) + len(widths) - 1


def fitted_table(tv: TableView, width: int) -> tuple[Table, list[str]]:
    """The table with the most columns that fits `width`; the headers left out."""
    columns, dropped = list(tv.columns), []
    while needed_width(tv, columns) > width:
        droppable = [c for c in columns if c.drop]
        if not droppable:
            break
        victim = max(droppable, key=lambda c: c.drop)
        columns.remove(victim)
        dropped.append(victim.header)
    return rich_table(tv, columns), dropped


def table_block(tv: TableView, console: Console) -> list[RenderableType]:
    table, dropped = fitted_table(tv, console.width)
    out: list[RenderableType] = [table]
    if dropped:
        out.append(
            Text(
                f"columns left out at {console.width} characters: {', '.join(dropped)} (all in --json and --html)",
                style="dim",
            )
        )
    if tv.note:
        out.append(Text(tv.note, style="dim"))
    if tv.hidden:
        shown = len([r for r in tv.rows if not r.gap])
        out.append(
            Text(f"showing {shown} of {len(tv.all_rows)} rows, {tv.hidden} rows hidden; {tv.summary}", style="dim")
        )
    return out


def packed(label: str, items: list[str], width: int, sep: str = " · ") -> Text:
    """'label: a · b · c' wrapped between items, never inside one ('1.09 s' stays whole)."""
    lines, line = [], label
    for item in items:
        joined = item if line == label else sep + item
        if line != label and len(line) + len(joined.rstrip()) > width:
            lines.append(line.rstrip())
            line = "  " + item
        else:
            line += joined
    lines.append(line)
    out = Text("\n".join(lines))
    out.stylize("bold", 0, len(label.rstrip()))
    return out


RANK_ARTIFACT = re.compile(r"rank (\d+) (.+)")
MAX_RANK_LINES = 4  # per kind of per-rank file; past it, one line names them all (TP 64: 64 lines)


def artifact_lines(artifacts: list[Artifact]) -> list[Text]:
    """Grouped by directory, each path on a line of its own: never broken inside a name. The
    same file of many ranks is one line, its first and last names whole."""
    by_dir: dict[str, list[Artifact]] = {}
    for a in artifacts:
        by_dir.setdefault(os.path.dirname(a.path), []).append(a)
    out = []
    for directory, items in by_dir.items():
        out.append(Text.assemble(("artifacts in ", "bold"), (directory + os.sep if directory else ".", "cyan")))
        out += directory_lines(items)
    return out


def directory_lines(items: list[Artifact]) -> list[Text]:
    by_kind: dict[str, list[tuple[int, Artifact]]] = {}
    for a in items:
        m = RANK_ARTIFACT.fullmatch(a.name)
        if m:
            by_kind.setdefault(m.group(2), []).append((int(m.group(1)), a))
    lines, said = [], set()
    for a in items:
        m = RANK_ARTIFACT.fullmatch(a.name)
        kind = m.group(2) if m else None
        if kind is None or len(by_kind[kind]) <= MAX_RANK_LINES:
            lines.append(Text.assemble(f"  {a.name}: ", (os.path.basename(a.path), "cyan")))
        elif kind not in said:
            said.add(kind)
            ranks = by_kind[kind]
            first, last = os.path.basename(ranks[0][1].path), os.path.basename(ranks[-1][1].path)
            lines.append(
                Text.assemble(
                    f"  ranks {fmt_ranges(r for r, _ in ranks)} {kind}: ",
                    (first, "cyan"),
                    " … ",
                    (last, "cyan"),
                    f" ({len(ranks)} files)",
                )
            )
    return lines


def rank_block(tv: TrialView, console: Console) -> list[RenderableType]:
    out = table_block(tv.ranks, console)
    for rank, stderr in tv.stderr_tails:
        out.append(
            Panel(
                Text(stderr),
                title=Text(f"rank {rank} stderr (last lines)"),
                title_align="left",
                border_style="dim",
                box=box.SQUARE,
            )
        )
    return out


def print_trial(tv: TrialView, console: Console) -> None:
    """The verdict, then in the order a reader asks: why, then how, then detail."""
    console.print(verdict_panel(tv))
    if tv.facts:
        console.print(facts_grid(tv.facts))
    parts: list[RenderableType] = []
    if tv.findings_total:
        parts += findings_block(tv)
    if tv.manifests:
        parts += table_block(tv.manifests, console)
    if tv.steps:
        parts += table_block(tv.steps, console)
    for part in parts:
        console.print(part)
    if tv.timings:
        console.print(packed("timings: ", [f"{k} {v}" for k, v in tv.timings], console.width))
    for note in tv.notes:
        console.print(Text.assemble(("note: ", "bold"), note))
    for line in artifact_lines(tv.artifacts):
        # soft_wrap: a path longer than the console runs on rather than breaking mid-name.
        console.print(line, soft_wrap=True)
    if tv.show_ranks:
        for part in rank_block(tv, console):
            console.print(part)


def render_trial(trial: TrialRecord, console: Console) -> None:
    print_trial(trial_view(0, trial), console)


# ---- a run ----------------------------------------------------------------------------------


def summary_view(rv: RunView) -> TableView:
    rows = [Row({c.key: c.get(tv) for c in rv.summary_columns}, "" if tv.met else BAD) for tv in rv.trials]
    return TableView("Summary", list(rv.summary_columns), rows)


def summary_table(tv: TableView) -> Table:
    table = Table(title=Text(tv.title, style="bold"), title_justify="left", box=box.SIMPLE_HEAVY, show_edge=False)
    for c in tv.columns:
        if c.wrap:
            # The first failure is the one column that gives up width (it wraps); the trial's
            # own panel and --json carry it in full.
            table.add_column(c.header, overflow="fold", min_width=wrap_min(c, tv))
        else:
            table.add_column(c.header, no_wrap=True, justify="right" if c.numeric else "left")
    for row in tv.rows:
        table.add_row(*(text(row.cells[c.key]) for c in tv.columns))
    return table


def summary_grid(rv: RunView) -> Table:
    """The narrow-console summary: one entry per trial, continuation lines hang under the text."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    skipped = unsupported_by_reason(rv.trials)
    for tv in rv.trials:
        same = skipped.get(tv.first_failure_short, [])
        if tv.outcome == Outcome.UNSUPPORTED.value and len(same) > 1:
            if tv is same[0]:  # one entry for every trial skipped for this reason
                line = Text.assemble(
                    (f"{len(same)} trials", "bold"),
                    f" ({trial_numbers(same)}): ",
                    (tv.outcome, STYLES[tv.tone]),
                    (" (not run, not a pass)", "dim"),
                    "\n" + tv.first_failure_short,
                )
                grid.add_row(Text("✗", style=STYLES[BAD]), line)
            continue
        line = Text.assemble(
            (f"{tv.scenario} {tv.mode}", "bold"),
            f" {tv.config}: ",
            (tv.outcome, STYLES[tv.tone]),
            (f" (expected {tv.expected})", "dim"),
        )
        if tv.seconds is not None:
            line.append(f" {tv.seconds_text} s", "dim")
        if tv.first_failure_short != "-":
            line.append("\n" + tv.first_failure_short)
        mark = tv.met_mark
        grid.add_row(Text("–" if mark.tone == SKIP else mark.text, style=STYLES[mark.tone]), line)
    return grid


def unsupported_by_reason(trials: list[TrialView]) -> dict[str, list[TrialView]]:
    groups: dict[str, list[TrialView]] = {}
    for tv in trials:
        if tv.outcome == Outcome.UNSUPPORTED.value:
            groups.setdefault(tv.first_failure_short, []).append(tv)
    return groups


def trial_numbers(trials: list[TrialView]) -> str:
    """'00-22' for a run of consecutive trial numbers, else '00, 03, 07'."""
    numbers = [int(tv.id.split("-", 1)[0]) if tv.id[:2].isdigit() else tv.index for tv in trials]
    if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
        return f"{numbers[0]:02d}-{numbers[-1]:02d}"
    return ", ".join(f"{n:02d}" for n in numbers)


def print_summary(rv: RunView, console: Console) -> None:
    """The table where every column fits whole; else one entry per trial."""
    tv = summary_view(rv)
    if needed_width(tv, tv.columns) <= console.width:
        console.print(summary_table(tv))
        return
    console.print(Text("Summary", style="bold"))
    console.print(summary_grid(rv))


def render_summary(report: Report, console: Console) -> None:
    print_summary(run_view(report), console)


def render_report(report: Report, console: Console) -> None:
    rv = run_view(report)
    if rv.environment:
        # Wrapped between its parts, never after a dangling separator.
        console.print(packed("environment: ", rv.environment.split(" | "), console.width, sep=" | "))
    if rv.command:
        console.print(Text.assemble(("command: ", "bold"), rv.command), style="dim")
    for tv in rv.trials:
        console.print()
        print_trial(tv, console)
    if len(rv.trials) > 1:
        console.print()
        print_summary(rv, console)
    console.print(Text(rv.summary, style=STYLES[OK if rv.all_met else BAD]))


# ---- a watch run ----------------------------------------------------------------------------


def watch_table(tv: TableView) -> Table:
    """The processes watched: a row per process, red where it found something."""
    table = Table(title=tv.title, title_justify="left", show_edge=False, pad_edge=False)
    for c in tv.columns:
        table.add_column(c.header, justify="right" if c.numeric else "left", overflow="fold" if c.wrap else "ellipsis")
    for row in tv.rows:
        table.add_row(*(Text(row.cells[c.key].text) for c in tv.columns), style="red" if row.tone == BAD else "")
    return table


def problem_block(pv: ProblemView) -> list[RenderableType]:
    headline = Text.assemble("  ", (pv.status.upper(), STYLES[pv.tone]), " ", (pv.pattern, "bold"), f" · {pv.headline}")
    return [headline, facts_grid(pv.facts, indent=4)]


def wrapped_parts(parts: list[Text], width: int, sep: str = " · ") -> Text:
    """Parts joined by sep, a line break only between two parts (never after a dangling sep)."""
    lines: list[Text] = []
    for part in parts:
        if lines and lines[-1].cell_len + len(sep) + part.cell_len <= width:
            lines[-1].append(sep)
            lines[-1].append_text(part)
        else:
            lines.append(part.copy())
    return Text("\n").join(lines)


def processes_block(tv: TableView, console: Console) -> list[RenderableType]:
    """The table, with each command in its column where it fits whole; else the commands go
    under the table, one line each, so a path is never broken mid-word."""
    table = watch_table(tv)
    # Measured unbounded: a measurement within the console's width is clamped to it.
    if Measurement.get(console, console.options.update_width(10**6), table).maximum <= console.width:
        return [table]
    narrow = TableView(tv.title, [c for c in tv.columns if c.key != "command"], tv.rows)
    out: list[RenderableType] = [watch_table(narrow)]
    out += [Text.assemble((f"  pid {row.cells['pid'].text}: ", "dim"), row.cells["command"].text) for row in tv.rows]
    return out


def render_watch(wv: WatchView, console: Console) -> None:
    """The verdict, the processes, each problem once, then what the verdict relied on."""
    console.print(wrapped_parts([text(c) for c in wv.verdict], console.width))
    if wv.processes.rows:
        for item in processes_block(wv.processes, console):
            console.print(item)
    if wv.findings_total:
        console.print(Text(wv.findings_title, style="bold"))
        for pv in wv.problems:
            for part in problem_block(pv):
                console.print(part)
        if wv.hidden_groups:
            console.print(
                Text(
                    f"  {wv.hidden_groups} more groups ({wv.hidden_findings} findings; all are in --json)", style="dim"
                )
            )
    if wv.census:
        console.print(Text("census: " + wv.census, style="dim"))
    if wv.pool_note:
        console.print(Text(wv.pool_note, style="dim"))
    for error in wv.internal_errors:
        console.print(Text(error, style="yellow"))
    for note in wv.notes:
        console.print(Text(note, style="dim"))
    if wv.records:
        console.print(Text("records: " + wv.records, style="dim"))


class TrimmedLines(io.TextIOBase):
    """A text stream that drops the spaces rich pads lines with (tables and panels fill the
    console's width), so a log or a pipe gets each line as long as its text."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.pending = ""

    def write(self, text: str) -> int:
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        if lines:
            self.stream.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.stream.write(self.pending)
            self.pending = ""
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()


def output_console(stderr: bool = False) -> Console:
    """The CLI's console on stdout or stderr: a terminal as rich drives it; a pipe or a log
    without trailing padding."""
    stream = sys.stderr if stderr else sys.stdout
    probe = Console(file=stream)
    if probe.is_terminal:
        return probe
    return Console(file=TrimmedLines(stream), width=probe.width)


def report_to_text(report: Report, width: int = 120) -> str:
    console = Console(record=True, width=width, file=io.StringIO(), color_system=None, force_terminal=False)
    render_report(report, console)
    return console.export_text(styles=False)
