"""Rendering of trial records: rich text on a console, and JSON / JUnit XML / HTML artifacts.

Everything renders to a console passed in by the caller (the CLI passes Console(stderr=True)),
so stdout stays free for `--json -`. Record data (slot names, stderr tails, details) is always
wrapped in rich Text, never interpolated into markup: a stderr line such as "[rank0]: ..."
must print as written, not be eaten as a style tag. No torch import: this runs in the parent.
"""
from __future__ import annotations

import html
import io
import json
import math
import os
import re
import secrets
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Iterable

from rich import box
from rich.console import Console, Group, RenderableType
from rich.padding import Padding
from rich.markup import escape as escape_markup
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table
from rich.text import Text

from repro.config import SCENARIO_RUN_KEYS, SCENARIOS
from repro.outcome import REPRODUCED, Finding, FirstFailure, Outcome, Report, StepRecord, TrialRecord, to_jsonable

__all__ = [
    "CPU_NOTE", "Progress", "describe", "fmt_bytes", "fmt_ptr", "outcome_style", "render_report",
    "render_summary", "render_trial", "report_to_text", "summary_line", "write_html", "write_json",
    "write_junit", "write_text_atomic",
]

CPU_NOTE = "No CUDA graph was replayed (CPU run): the verdict comes from the stale-capture guard."

# Outcomes after which the ranks' exits and stderr explain more than the step table does.
EXIT_OUTCOMES = frozenset({Outcome.CRASH, Outcome.HANG, Outcome.ILLEGAL_ADDRESS, Outcome.DEVICE_ASSERT})

# Phases in the order a trial runs them; keys a trial adds beyond these follow in its own order.
TIMING_ORDER = ("start", "import", "init", "build", "capture", "reload", "replays", "oracle", "total")

MAX_STEP_ROWS = 20      # a 500-step nvfp4 run must not bury the verdict
MAX_FINDING_GROUPS = 10  # distinct dead storages shown; one storage is often in 7+ graphs
CONTEXT_STEP_ROWS = 3   # clean rows kept before the failures, so the reader sees where it turned
STACK_FRAMES = 3
TAIL_LINES = 12

# What each outcome means, in one sentence; "{where}" becomes " on rank R at step S" when known.
MEANINGS: dict[Outcome, str] = {
    Outcome.CLEAN: "Every replay ran and its output was finite and equal to the reference within tolerance.",
    Outcome.ILLEGAL_ADDRESS: "CUDA error 700{where}: the replay touched memory returned to the driver.",
    Outcome.DEVICE_ASSERT: "CUDA error 710{where}: a device-side assert fired, typically an index read "
                           "from memory another tensor had reused.",
    Outcome.NONFINITE: "NaN/Inf in the output{where}: the replay read stale or overwritten memory.",
    Outcome.MISMATCH: "Finite output that differs from the reference{where}: the replay silently "
                      "computed with the wrong values.",
    Outcome.STALE_CAPTURE: "The guard found a captured tensor freed or moved{where} with no visible "
                           "symptom yet: the bug is latent and shows once the memory is reused.",
    Outcome.HANG: "A rank passed its deadline{where} and the harness killed the process group.",
    Outcome.CRASH: "A rank exited abnormally{where} (signal or uncaught exception); its stderr tail says why.",
    Outcome.UNSUPPORTED: "This environment cannot run the trial (e.g. fewer GPUs than --tp): "
                         "nothing was tested, so this is not a pass.",
}

FAILURE_STYLE = "bold red"
STYLES: dict[Outcome, str] = {
    Outcome.CLEAN: "bold green",
    Outcome.STALE_CAPTURE: "bold yellow",
    Outcome.UNSUPPORTED: "bold magenta",
}
# Plain colours for the HTML page, same meaning as the console styles.
HTML_COLOURS = {"green": "#1a7f37", "red": "#cf222e", "yellow": "#9a6700", "magenta": "#8250df"}

ANSI_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
# Characters XML 1.0 forbids even escaped; one in a stderr tail would make the whole file unreadable.
XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


# ---------------------------------------------------------------------------------------------
# Small formatting helpers


def outcome_style(outcome: Outcome) -> str:
    """rich style: green CLEAN, yellow STALE_CAPTURE, magenta UNSUPPORTED, red for the rest."""
    return STYLES.get(Outcome(outcome), FAILURE_STYLE)


def where_text(failure: FirstFailure | None) -> str:
    if failure is None:
        return ""
    parts = []
    if failure.rank is not None:
        parts.append(f"rank {failure.rank}")
    if failure.step is not None:
        parts.append(f"step {failure.step}")
    return (" on " + " at ".join(parts)) if parts else ""


def describe(outcome: Outcome, failure: FirstFailure | None = None) -> str:
    """One plain sentence per outcome; names the rank and step when the first failure has them."""
    outcome = Outcome(outcome)
    # Only place the failure when it is the same kind: a CLEAN trial has nothing to place.
    same_kind = failure is not None and Outcome(failure.kind) == outcome
    return MEANINGS[outcome].format(where=where_text(failure) if same_kind else "")


def fmt_bytes(n: int | None) -> str:
    """Binary units, as allocators count: 134217728 -> '128 MiB'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(n)} B"
    return f"{value:.1f}".rstrip("0").rstrip(".") + f" {unit}"


def fmt_ptr(p: int | None) -> str:
    return "-" if p is None else f"0x{int(p):x}"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def fmt_float(x: Any) -> str:
    """Errors and tolerances; strings stand for NaN/Inf read back from strict JSON."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x:.3g}"


def fmt_expected(expected: Iterable[Outcome]) -> str:
    allowed = {Outcome(e) for e in expected}
    if not allowed:
        return "-"
    if allowed == set(REPRODUCED):
        return "reproduced"
    if allowed == {Outcome.CLEAN}:
        return "CLEAN"
    if set(REPRODUCED) < allowed:
        rest = sorted((o.value for o in allowed - set(REPRODUCED)))
        return "|".join(["reproduced", *rest])
    return "|".join(o.value for o in sorted(allowed, key=lambda o: list(Outcome).index(o)))


def plain(text: str) -> str:
    """Strip ANSI colour codes and control characters from captured process output."""
    text = ANSI_ESCAPE.sub("", text or "").replace("\r\n", "\n").replace("\r", "\n")
    return "".join(c for c in text if c in "\n\t" or ord(c) >= 32)


def tail(text: str, lines: int = TAIL_LINES) -> str:
    kept = plain(text).rstrip("\n").splitlines()
    return "\n".join(kept[-lines:])


def cell(value: Any, style: str = "") -> Text:
    """Table cell from record data: Text, so brackets in data are never read as markup."""
    return Text("-" if value is None or value == "" else str(value), style=style)


# ---------------------------------------------------------------------------------------------
# Facts pulled from a trial


def run_config(trial: TrialRecord) -> dict[str, Any]:
    run = trial.config.get("run", {}) if isinstance(trial.config, dict) else {}
    return run if isinstance(run, dict) else {}


def after_free(trial: TrialRecord) -> str:
    value = run_config(trial).get("after_free") or ""
    if value:
        return value
    # An unresolved config means "the scenario's default"; say which one that is.
    spec = SCENARIOS.get(trial.scenario)
    return spec.default_after_free if spec else "default"


def lifecycle_flags(trial: TrialRecord) -> list[str]:
    """Scenario lifecycle switches that are on (reload_drafter, identity_reload, ...)."""
    run = run_config(trial)
    return [key for key in sorted(SCENARIO_RUN_KEYS) if run.get(key) is True]


def config_params(trial: TrialRecord) -> dict[str, str | None]:
    """The knobs that tell trials of one scenario and mode apart, in display order.

    Lifecycle switches that are on map to None: they are named, not valued.
    """
    params: dict[str, str | None] = {"tp": str(run_config(trial).get("tp", 1)), "after_free": after_free(trial)}
    for flag in lifecycle_flags(trial):
        params[flag] = None
    return params


def config_highlights(trial: TrialRecord, sep: str = " · ") -> str:
    """'tp=2 · after-free=release · reload-drafter'."""
    parts = [k.replace("_", "-") if v is None else f"{k.replace('_', '-')}={v}"
             for k, v in config_params(trial).items()]
    return sep.join(parts)


def trial_title(trial: TrialRecord) -> str:
    """'gemma4-mtp · unfixed · tp=2 · after-free=release'."""
    return " · ".join([trial.scenario, trial.mode, config_highlights(trial)])


def trial_seconds(trial: TrialRecord) -> float | None:
    if "total" in trial.timings:
        return float(trial.timings["total"])
    return None


def cpu_note_applies(trial: TrialRecord) -> bool:
    # An UNSUPPORTED trial ran nothing at all; saying the guard decided it would be false.
    return not trial.graph_replayed and trial.outcome is not Outcome.UNSUPPORTED


def step_failed(step: StepRecord) -> bool:
    return step.outcome() is not Outcome.CLEAN


def failure_summary(failure: FirstFailure | None) -> str:
    if failure is None:
        return ""
    where = where_text(failure).removeprefix(" on ")
    head = f"{Outcome(failure.kind).value}" + (f" ({where})" if where else "")
    return f"{head}: {failure.detail}" if failure.detail else head


def ordered_timings(timings: dict[str, float]) -> list[tuple[str, float]]:
    known = [(k, timings[k]) for k in TIMING_ORDER if k in timings]
    return known + [(k, v) for k, v in timings.items() if k not in TIMING_ORDER]


def met_label(trial: TrialRecord) -> tuple[str, str]:
    """(text, style) for the met column; UNSUPPORTED never gets a pass mark."""
    if trial.outcome is Outcome.UNSUPPORTED:
        return ("skipped (not a pass)", "magenta") if trial.met else ("✗", "bold red")
    return ("✓", "bold green") if trial.met else ("✗", "bold red")


def select_steps(steps: list[StepRecord], cap: int = MAX_STEP_ROWS) -> list[int]:
    """Indices of the rows worth showing: all when few; else a little context, then failures.

    A long run that fails keeps failing, so the first failing rows carry the story; the rest
    are summarised in numbers instead of rows.
    """
    if len(steps) <= cap:
        return list(range(len(steps)))
    failing = [i for i, s in enumerate(steps) if step_failed(s)]
    if not failing:
        return list(range(cap))
    first = failing[0]
    chosen = set(range(max(0, first - CONTEXT_STEP_ROWS), first))
    chosen.update(failing[: cap - len(chosen)])
    # Few failures in a long run: spend the spare rows on what followed the first one.
    for i in range(first, len(steps)):
        if len(chosen) >= cap:
            break
        chosen.add(i)
    return sorted(chosen)


def steps_summary(steps: list[StepRecord]) -> str:
    failing = [s for s in steps if step_failed(s)]
    kinds: dict[str, int] = {}
    for s in failing:
        kinds[s.outcome().value] = kinds.get(s.outcome().value, 0) + 1
    text = f"{len(steps)} step records: {len(steps) - len(failing)} clean, {len(failing)} failing"
    if kinds:
        text += " (" + ", ".join(f"{k} {n}" for k, n in kinds.items()) + ")"
    if failing:
        text += f"; first failing step {failing[0].step} on rank {failing[0].rank}"
    return text


def group_findings(findings: list[Finding]) -> list[list[Finding]]:
    """Findings grouped per storage: one dead tensor shows up once for every graph that captured it."""
    groups: dict[tuple, list[Finding]] = {}
    for f in findings:
        groups.setdefault((f.rank, f.slot, f.old_ptr, f.status, f.new_ptr), []).append(f)
    return list(groups.values())


def unique(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(v for v in values if v))


def finding_address(f: Finding) -> str:
    return fmt_ptr(f.old_ptr) + (f" → {fmt_ptr(f.new_ptr)}" if f.new_ptr is not None else "")


def finding_facts(group: list[Finding]) -> list[tuple[str, str]]:
    """(label, value) lines for one dead storage; stacks show their top frames only."""
    f = group[0]
    graphs = unique(x.graph for x in group)
    facts = [("address", finding_address(f)), ("tensor", f"{list(f.shape)} {f.dtype} · {fmt_bytes(f.nbytes)}"),
             ("seen", " | ".join(unique(x.when for x in group))
              + (f" in {len(graphs)} graphs: " if len(graphs) > 1 else " in graph ") + ", ".join(graphs))]
    facts += [(label, plain(site)) for label, site in (("created at", f.created_at), ("freed at", f.freed_at)) if site]
    for label, stack in (("alloc stack", f.alloc_stack), ("free stack", f.free_stack)):
        for i, frame in enumerate(stack[:STACK_FRAMES]):
            facts.append((label if i == 0 else "", plain(frame)))
        if len(stack) > STACK_FRAMES:
            facts.append(("", f"(+{len(stack) - STACK_FRAMES} more frames)"))
    if f.message:
        facts.append(("message", plain(f.message)))
    return facts


# ---------------------------------------------------------------------------------------------
# Console rendering


def verdict_panel(trial: TrialRecord) -> Panel:
    style = outcome_style(trial.outcome)
    head = Text.assemble((trial.outcome.value, style), "   ", verdict_words(trial))
    head.append(f" (expected {fmt_expected(trial.expected)})", "dim")
    lines: list[RenderableType] = [head, Text(describe(trial.outcome, trial.first_failure))]
    if trial.first_failure is not None:
        lines.append(first_failure_text(trial.first_failure))
    if cpu_note_applies(trial):
        lines.append(Text(CPU_NOTE, style="bold yellow"))
    subtitle = f"trial {trial.id}" + (f" · {fmt_seconds(trial_seconds(trial))}" if trial_seconds(trial) else "")
    return Panel(Group(*lines), title=Text(trial_title(trial), style="bold"), title_align="left",
                 subtitle=Text(subtitle, style="dim"), subtitle_align="right", border_style=style.split()[-1],
                 box=box.ROUNDED)


def verdict_words(trial: TrialRecord) -> Text:
    """'✓ met its expectation' / '✗ did NOT meet...'; UNSUPPORTED never reads as a pass."""
    met_text, met_style = met_label(trial)
    if trial.outcome is Outcome.UNSUPPORTED and trial.met:
        return Text("not a pass: skipped, as expected", style="magenta")
    words = "met its expectation" if trial.met else "did NOT meet its expectation"
    return Text(f"{met_text} {words}", style=met_style)


def first_failure_text(failure: FirstFailure) -> Text:
    text = Text("first failure: ", style="bold")
    text.append(Outcome(failure.kind).value, outcome_style(failure.kind))
    text.append(f" · rank {'-' if failure.rank is None else failure.rank}")
    text.append(f" · step {'-' if failure.step is None else failure.step}")
    if failure.detail:
        text.append(" · ")
        text.append(plain(failure.detail))
    return text


def findings_block(trial: TrialRecord) -> list[RenderableType]:
    """Per dead storage: a headline, then its facts in a hanging-indent grid (wraps stay aligned)."""
    groups = group_findings(trial.guard_findings)
    title = Text(f"Guard findings ({len(trial.guard_findings)}", style="bold")
    title.append(f" across {len(groups)} storages)" if len(groups) > 1 else ")")
    out: list[RenderableType] = [title]
    for group in groups[:MAX_FINDING_GROUPS]:
        f = group[0]
        out.append(Text.assemble("  ", (f.status.upper(), "bold red" if f.status == "freed" else "bold yellow"),
                                 " ", (f.slot, "bold"), f"  rank {f.rank}"))
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim", no_wrap=True)
        grid.add_column(overflow="fold")
        for label, value in finding_facts(group):
            grid.add_row(label, Text(value))
        out.append(Padding(grid, (0, 0, 0, 4)))
    hidden = len(groups) - MAX_FINDING_GROUPS
    if hidden > 0:
        out.append(Text(f"  {hidden} more storages hidden (all are in --json)", style="dim"))
    return out


def manifests_table(trial: TrialRecord) -> Table:
    table = Table(title=Text("Captured storages after reloads", style="bold"), title_justify="left",
                  box=box.SIMPLE_HEAVY, show_edge=False)
    for name, justify in (("when", "left"), ("rank", "right"), ("freed", "right"),
                          ("rebound", "right"), ("unchanged", "right")):
        table.add_column(name, justify=justify)
    for m in trial.manifests:
        table.add_row(cell(m.when), cell(m.rank), cell(m.freed, "bold red" if m.freed else ""),
                      cell(m.rebound, "yellow" if m.rebound else ""), cell(m.unchanged))
    return table


STEP_COLUMNS = ("step", "rank", "label", "batch", "replayed", "nonfinite/numel", "mismatches/compared",
                "max abs err", "rel err", "tolerance", "ms")
# Two-line headers keep an 11-column table inside 80 columns, the width of most CI logs.
STEP_HEADERS = {"nonfinite/numel": "nonfinite\n/numel", "mismatches/compared": "mismatches\n/compared",
                "max abs err": "max abs\nerr"}
# Columns that are usually one value for the whole run; then they are said once, in the title.
FOLDABLE_STEP_COLUMNS = ("batch", "replayed", "tolerance")


def step_cells(s: StepRecord) -> dict[str, Text]:
    bad = step_failed(s)
    return {
        "step": cell(s.step), "rank": cell(s.rank), "label": cell(s.label), "batch": cell(s.batch),
        "replayed": cell("graph" if s.replayed else "eager", "" if s.replayed else "yellow"),
        "nonfinite/numel": cell(f"{s.nonfinite}/{s.numel}", "bold red" if s.nonfinite else ""),
        "mismatches/compared": cell(f"{s.mismatches}/{s.compared}", "bold red" if s.mismatches else ""),
        "max abs err": cell(fmt_float(s.max_abs_err), "red" if bad else ""), "rel err": cell(fmt_float(s.rel_err)),
        "tolerance": cell(fmt_float(s.tolerance)), "ms": cell(f"{s.seconds * 1000:.1f}"),
    }


def constant_columns(rows: list[dict[str, Text]]) -> dict[str, str]:
    if not rows:
        return {}
    return {name: rows[0][name].plain for name in FOLDABLE_STEP_COLUMNS
            if len({r[name].plain for r in rows}) == 1}


def steps_table(trial: TrialRecord) -> Table:
    steps = trial.steps
    shown = select_steps(steps)
    rows = [step_cells(steps[i]) for i in shown]
    constant = constant_columns(rows)
    title = Text(f"Steps ({len(steps)})", style="bold")
    for name, value in constant.items():
        if value != "-":
            title.append(f" · {name} {value}", style="dim")
    columns = [name for name in STEP_COLUMNS if name not in constant]
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAVY, show_edge=False)
    for name in columns:
        # Numbers never wrap; the free-text label folds into whatever width is left.
        if name == "label":
            table.add_column(name, overflow="fold", min_width=8)
        else:
            table.add_column(STEP_HEADERS.get(name, name), justify="right", no_wrap=True)
    previous = -1
    for i, row in zip(shown, rows):
        if i != previous + 1:
            gap = {name: Text("") for name in columns}
            gap["step"] = Text("…", style="dim")
            gap["label"] = Text(f"{i - previous - 1} rows hidden", style="dim")
            table.add_row(*gap.values())
        table.add_row(*(row[name] for name in columns))
        previous = i
    return table


def hidden_steps_text(trial: TrialRecord) -> Text | None:
    shown = len(select_steps(trial.steps))
    hidden = len(trial.steps) - shown
    if hidden <= 0:
        return None
    return Text(f"showing {shown} of {len(trial.steps)} rows, {hidden} rows hidden; {steps_summary(trial.steps)}",
                style="dim")


def timings_text(trial: TrialRecord) -> Text:
    text = Text("timings: ", style="bold")
    text.append(" · ".join(f"{k} {fmt_seconds(v)}" for k, v in ordered_timings(trial.timings)))
    return text


def rank_exits(trial: TrialRecord) -> list[RenderableType]:
    table = Table(title=Text("Rank exits", style="bold"), title_justify="left", box=box.SIMPLE_HEAVY,
                  show_edge=False)
    for name in ("rank", "pid", "exit", "error"):
        table.add_column(name, overflow="fold")
    out: list[RenderableType] = [table]
    for r in trial.ranks:
        table.add_row(cell(r.rank), cell(r.pid), cell(exit_text(r), "red" if abnormal(r) else ""),
                      cell(plain(r.error or "")))
        stderr = tail(r.stderr_tail)
        if stderr:
            out.append(Panel(Text(stderr), title=Text(f"rank {r.rank} stderr (last lines)"), title_align="left",
                             border_style="dim", box=box.SQUARE))
    return out


def exit_text(r) -> str:
    if r.killed_by_harness:
        return "killed by harness" + (f" ({r.signal})" if r.signal else "")
    if r.signal:
        return f"signal {r.signal}"
    return "-" if r.exitcode is None else f"exit {r.exitcode}"


def abnormal(r) -> bool:
    return bool(r.killed_by_harness or r.signal or (r.exitcode not in (0, None)))


def trial_sections(trial: TrialRecord) -> list[RenderableType]:
    """Everything below the verdict panel, in the order a reader asks: why, then how, then detail."""
    parts: list[RenderableType] = []
    if trial.guard_findings:
        parts.extend(findings_block(trial))
    if trial.manifests:
        parts.append(manifests_table(trial))
    if trial.steps:
        parts.append(steps_table(trial))
        hidden = hidden_steps_text(trial)
        if hidden is not None:
            parts.append(hidden)
    if trial.timings:
        parts.append(timings_text(trial))
    for note in trial.notes:
        parts.append(Text.assemble(("note: ", "bold"), plain(note)))
    for name, path in trial.artifacts.items():
        parts.append(Text.assemble(("artifact ", "bold"), f"{name}: ", (str(path), "cyan")))
    if trial.outcome in EXIT_OUTCOMES and trial.ranks:
        parts.extend(rank_exits(trial))
    return parts


def render_trial(trial: TrialRecord, console: Console) -> None:
    console.print(verdict_panel(trial))
    for part in trial_sections(trial):
        console.print(part)


SUMMARY_COLUMNS = ("scenario", "mode", "config", "outcome", "expected", "met", "first failure", "seconds")
# Below this width the eight columns cannot all be read; one line per trial reads better.
SUMMARY_TABLE_MIN_WIDTH = 100


def short_failure(trial: TrialRecord) -> str:
    """'rank 0 · step 0: detail'; the kind is left out when the outcome column already says it."""
    failure = trial.first_failure
    if failure is None:
        return "-"
    where = where_text(failure).removeprefix(" on ").replace(" at ", " · ")
    kind = "" if Outcome(failure.kind) == trial.outcome else f"{Outcome(failure.kind).value} "
    head = (kind + where).strip()
    detail = plain(failure.detail)
    return f"{head}: {detail}" if head and detail else (head or detail or "-")


def summary_table(report: Report) -> Table:
    table = Table(title=Text("Summary", style="bold"), title_justify="left", box=box.SIMPLE_HEAVY,
                  show_edge=False)
    for name in SUMMARY_COLUMNS:
        # The first failure is the one column that gives up width (it wraps); the trial's own
        # panel and --json carry it in full.
        if name == "first failure":
            table.add_column(name, overflow="fold", min_width=16)
        else:
            table.add_column(name, no_wrap=True, justify="right" if name == "seconds" else "left")
    for t in report.trials:
        met_text, met_style = met_label(t)
        seconds = trial_seconds(t)
        table.add_row(cell(t.scenario), cell(t.mode), cell(config_highlights(t, sep=" ")),
                      cell(t.outcome.value, outcome_style(t.outcome)), cell(fmt_expected(t.expected)),
                      cell(met_text, met_style), cell(short_failure(t)),
                      cell(f"{seconds:.1f}" if seconds is not None else None))
    return table


def summary_grid(report: Report) -> Table:
    """The narrow-console summary: one entry per trial, continuation lines hang under the text."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    for t in report.trials:
        met_text, met_style = met_label(t)
        line = Text.assemble((f"{t.scenario} {t.mode}", "bold"), f" {config_highlights(t, sep=' ')}: ",
                             (t.outcome.value, outcome_style(t.outcome)), (f" (expected {fmt_expected(t.expected)})", "dim"))
        seconds = trial_seconds(t)
        if seconds is not None:
            line.append(f" {seconds:.1f} s", "dim")
        if t.first_failure is not None:
            line.append("\n" + short_failure(t))
        grid.add_row(Text("✓" if t.met and t.outcome is not Outcome.UNSUPPORTED else
                          ("–" if t.met else "✗"), style=met_style), line)
    return grid


def summary_line(report: Report) -> str:
    """'3/4 trials met their expectation' (+ unsupported count, + interrupted)."""
    met = sum(1 for t in report.trials if t.met)
    text = f"{met}/{len(report.trials)} trials met their expectation"
    unsupported = sum(1 for t in report.trials if t.outcome is Outcome.UNSUPPORTED)
    if unsupported:
        text += f"; {unsupported} UNSUPPORTED (not run, not a pass)"
    if report.interrupted:
        text += "; interrupted"
    return text


def environment_text(report: Report) -> str:
    env = report.environment or {}
    if env.get("summary"):
        return str(env["summary"])
    # No prepared summary: the scalar facts are still worth a line.
    return " · ".join(f"{k}={v}" for k, v in env.items() if isinstance(v, (str, int, float, bool)))


def render_summary(report: Report, console: Console) -> None:
    if console.width >= SUMMARY_TABLE_MIN_WIDTH:
        console.print(summary_table(report))
        return
    console.print(Text("Summary", style="bold"))
    console.print(summary_grid(report))


def render_report(report: Report, console: Console) -> None:
    env = environment_text(report)
    if env:
        console.print(Text.assemble(("environment: ", "bold"), env))
    if report.command:
        console.print(Text.assemble(("command: ", "bold"), report.command), style="dim")
    for trial in report.trials:
        console.print()
        render_trial(trial, console)
    if len(report.trials) > 1:
        console.print()
        render_summary(report, console)
    style = "bold green" if report.all_met() else "bold red"
    console.print(Text(summary_line(report), style=style))


def report_to_text(report: Report, width: int = 120) -> str:
    console = Console(record=True, width=width, file=io.StringIO(), color_system=None, force_terminal=False)
    render_report(report, console)
    return console.export_text(styles=False)


# ---------------------------------------------------------------------------------------------
# Artifacts


def write_text_atomic(path: str | os.PathLike, data: str) -> Path:
    """Write via a temp file in the same directory + fsync + os.replace.

    A reader (CI uploading artifacts, a watcher) sees the old file or the new one, never half
    of one, even if we are killed mid-write. The temp file is created with mode 0o666 so the
    process umask decides the final permissions, as with a plain open().
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_directory(target.parent)
    return target


def sync_directory(directory: Path) -> None:
    # The rename itself is durable only once the directory entry is flushed; best effort.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def strict_json(value: Any) -> Any:
    """NaN/Inf -> "NaN"/"Infinity"/"-Infinity" (the proto3 JSON convention).

    json.dumps would otherwise emit bare NaN tokens, which jq, JavaScript and most CI tools
    reject; a NONFINITE trial is exactly when such values appear.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strict_json(v) for v in value]
    return value


def report_json(report: Report) -> str:
    return json.dumps(strict_json(to_jsonable(report)), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def write_json(report: Report, path: str | os.PathLike) -> None:
    """`path` "-" writes the JSON alone to stdout (human output goes to stderr)."""
    text = report_json(report)
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    write_text_atomic(path, text)


def xml_text(text: Any) -> str:
    return XML_INVALID.sub("", plain(str(text)))


def junit_name(trial: TrialRecord) -> str:
    """'unfixed[tp=2,after_free=release]': stable across runs, so CI can track a case's history."""
    params = config_params(trial)
    if run_config(trial).get("device") == "cpu":
        params["device"] = "cpu"   # a forced-CPU run is a different test from the GPU one
    return f"{trial.mode}[{','.join(k if v is None else f'{k}={v}' for k, v in params.items())}]"


def junit_names(trials: list[TrialRecord]) -> list[str]:
    """Case names, made unique with the trial id: JUnit consumers silently merge equal names."""
    names = [junit_name(t) for t in trials]
    return [f"{n[:-1]},id={t.id}]" if names.count(n) > 1 else n for n, t in zip(names, trials)]


def failure_details(trial: TrialRecord) -> str:
    """Plain-text story of a trial for a JUnit failure body: what, where, why, last words."""
    lines = [f"{trial_title(trial)} (trial {trial.id})",
             f"outcome {trial.outcome.value}, expected {fmt_expected(trial.expected)}",
             describe(trial.outcome, trial.first_failure)]
    if trial.first_failure is not None:
        lines.append("first failure: " + failure_summary(trial.first_failure))
    if cpu_note_applies(trial):
        lines.append(CPU_NOTE)
    for group in group_findings(trial.guard_findings)[:MAX_FINDING_GROUPS]:
        f = group[0]
        lines.append(f"finding: rank {f.rank} {f.slot} {f.status}")
        lines += [f"    {label:<12} {value}" for label, value in finding_facts(group)]
    for r in trial.ranks:
        lines.append(f"rank {r.rank}: {exit_text(r)}" + (f": {r.error}" if r.error else ""))
        if tail(r.stderr_tail):
            lines.append(f"--- rank {r.rank} stderr tail ---\n{tail(r.stderr_tail)}")
    return xml_text("\n".join(lines))


def add_properties(parent: ET.Element, props: dict[str, Any]) -> None:
    node = ET.SubElement(parent, "properties")
    for name, value in props.items():
        ET.SubElement(node, "property", name=name, value=xml_text(value))


def junit_case(suite: ET.Element, trial: TrialRecord, name: str) -> str:
    """Append one <testcase>; returns 'failure', 'skipped' or 'passed' for the suite's counts."""
    seconds = trial_seconds(trial) or 0.0
    case = ET.SubElement(suite, "testcase", classname=f"repro.{trial.scenario}", name=name,
                         time=f"{seconds:.3f}")
    add_properties(case, {"outcome": trial.outcome.value, "expected": fmt_expected(trial.expected),
                          "trial_id": trial.id, "graph_replayed": str(trial.graph_replayed).lower()})
    message = f"outcome {trial.outcome.value}, expected {fmt_expected(trial.expected)}"
    if not trial.met:
        node = ET.SubElement(case, "failure", message=xml_text(message), type=trial.outcome.value)
        node.text = failure_details(trial)
        result = "failure"
    elif trial.outcome is Outcome.UNSUPPORTED:
        # Skipped, not passed: the environment could not run it, so nothing was tested.
        detail = trial.first_failure.detail if trial.first_failure else describe(trial.outcome)
        ET.SubElement(case, "skipped", message=xml_text(f"UNSUPPORTED: {detail}"))
        result = "skipped"
    else:
        result = "passed"
    stderr = "\n".join(f"--- rank {r.rank} ---\n{tail(r.stderr_tail)}" for r in trial.ranks if tail(r.stderr_tail))
    if stderr:
        ET.SubElement(case, "system-err").text = xml_text(stderr)
    return result


def junit_xml(report: Report) -> str:
    suites = ET.Element("testsuites", name="repro")
    suite = ET.SubElement(suites, "testsuite", name="repro")
    add_properties(suite, {"command": report.command, "environment": environment_text(report),
                           "interrupted": str(report.interrupted).lower(), "schema": report.schema})
    results = [junit_case(suite, t, n) for t, n in zip(report.trials, junit_names(report.trials))]
    total = sum(trial_seconds(t) or 0.0 for t in report.trials)
    counts = {"tests": str(len(results)), "failures": str(results.count("failure")), "errors": "0",
              "skipped": str(results.count("skipped")), "time": f"{total:.3f}"}
    suite.attrib.update(counts)
    if report.created:
        suite.set("timestamp", report.created)
    suites.attrib.update({k: v for k, v in counts.items()})
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def write_junit(report: Report, path: str | os.PathLike) -> None:
    write_text_atomic(path, junit_xml(report))


# ---- HTML: one self-contained page, every piece of record data through html.escape ----------

HTML_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1200px;color:#1f2328;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em} h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #d0d7de}
h3{font-size:1em;margin-bottom:.3em}
table{border-collapse:collapse;margin:.4em 0 1em;font-size:13px}
th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.bad td{background:#ffebe9} tr.gap td{color:#656d76;font-style:italic}
code,pre,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
pre{background:#f6f8fa;border:1px solid #d0d7de;padding:.6em;overflow-x:auto;white-space:pre-wrap}
.verdict{border:2px solid;border-radius:6px;padding:.6em 1em;margin:.6em 0}
.outcome{font-weight:700} .muted{color:#656d76} .cpu{font-weight:700;color:#9a6700}
.met{color:#1a7f37;font-weight:700} .unmet{color:#cf222e;font-weight:700} .skip{color:#8250df;font-weight:700}
"""


def esc(value: Any) -> str:
    return html.escape("-" if value is None or value == "" else plain(str(value)), quote=True)


def html_colour(outcome: Outcome) -> str:
    return HTML_COLOURS[outcome_style(outcome).split()[-1]]


def html_outcome(outcome: Outcome) -> str:
    return f'<span class="outcome" style="color:{html_colour(outcome)}">{esc(Outcome(outcome).value)}</span>'


def html_met(trial: TrialRecord) -> str:
    text, _ = met_label(trial)
    css = "skip" if trial.outcome is Outcome.UNSUPPORTED and trial.met else ("met" if trial.met else "unmet")
    return f'<span class="{css}">{esc(text)}</span>'


def html_table(headers: list[str], rows: list[tuple[str, list[str]]], numeric: set[int] = frozenset()) -> str:
    """rows: (tr class, already-escaped cells)."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = []
    for css, cells in rows:
        tds = "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(cells))
        body.append(f'<tr class="{css}">{tds}</tr>' if css else f"<tr>{tds}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def html_summary(report: Report) -> str:
    rows = []
    for i, t in enumerate(report.trials):
        seconds = trial_seconds(t)
        rows.append(("" if t.met else "bad", [
            f'<a href="#trial-{i}">{esc(t.scenario)}</a>', esc(t.mode), esc(config_highlights(t)),
            html_outcome(t.outcome), esc(fmt_expected(t.expected)), html_met(t),
            esc(failure_summary(t.first_failure)), esc(f"{seconds:.1f}" if seconds is not None else None)]))
    return html_table(["scenario", "mode", "config", "outcome", "expected", "met", "first failure", "seconds"],
                      rows, numeric={7})


def html_findings(trial: TrialRecord) -> str:
    rows = []
    for f in trial.guard_findings:
        address = esc(fmt_ptr(f.old_ptr)) + (f" → {esc(fmt_ptr(f.new_ptr))}" if f.new_ptr is not None else "")
        stacks = "".join(
            f"<div><b>{label}:</b><pre>{esc(chr(10).join(stack[:STACK_FRAMES]))}</pre></div>"
            for label, stack in (("allocated", f.alloc_stack), ("freed", f.free_stack)) if stack)
        rows.append(("bad" if f.status == "freed" else "", [
            esc(f.rank), f'<span class="mono">{esc(f.slot)}</span>', esc(f.status), esc(f"{f.graph} · {f.when}"),
            f'<span class="mono">{address}</span>', esc(f"{list(f.shape)} {f.dtype} {fmt_bytes(f.nbytes)}"),
            esc(f.created_at), esc(f.freed_at), stacks + (esc(f.message) if f.message else "")]))
    return f"<h3>Guard findings ({len(trial.guard_findings)})</h3>" + html_table(
        ["rank", "slot", "status", "where", "address old → new", "tensor", "created at", "freed at", "stacks"], rows)


def html_manifests(trial: TrialRecord) -> str:
    rows = [("bad" if m.freed else "", [esc(m.when), esc(m.rank), esc(m.freed), esc(m.rebound), esc(m.unchanged)])
            for m in trial.manifests]
    return "<h3>Captured storages after reloads</h3>" + html_table(
        ["when", "rank", "freed", "rebound", "unchanged"], rows, numeric={1, 2, 3, 4})


def html_step_rows(steps: list[StepRecord], indices: list[int]) -> list[tuple[str, list[str]]]:
    rows = []
    previous = -1
    for i in indices:
        if i != previous + 1:
            rows.append(("gap", [esc(f"… {i - previous - 1} rows")] + [""] * 10))
        rows.append(("bad" if step_failed(steps[i]) else "", [esc(t.plain) for t in step_cells(steps[i]).values()]))
        previous = i
    return rows


def html_steps(trial: TrialRecord) -> str:
    headers = list(STEP_COLUMNS)
    numeric = {0, 1, 3, 5, 6, 7, 8, 9, 10}
    steps = trial.steps
    shown = select_steps(steps)
    out = "<h3>Steps</h3>" + html_table(headers, html_step_rows(steps, shown), numeric)
    hidden = len(steps) - len(shown)
    if hidden > 0:
        # <details> keeps every row on the page without burying the verdict, and needs no script.
        out += (f'<p class="muted">showing {len(shown)} of {len(steps)} rows, {hidden} rows hidden; '
                f"{esc(steps_summary(steps))}</p><details><summary>all {len(steps)} rows</summary>"
                + html_table(headers, html_step_rows(steps, list(range(len(steps)))), numeric) + "</details>")
    return out


def html_ranks(trial: TrialRecord) -> str:
    rows = [("bad" if abnormal(r) else "", [esc(r.rank), esc(r.pid), esc(exit_text(r)), esc(r.error)])
            for r in trial.ranks]
    tails = "".join(f"<h3>rank {esc(r.rank)} stderr (last lines)</h3><pre>{esc(tail(r.stderr_tail))}</pre>"
                    for r in trial.ranks if tail(r.stderr_tail))
    return "<h3>Rank exits</h3>" + html_table(["rank", "pid", "exit", "error"], rows) + tails


def html_trial(index: int, trial: TrialRecord) -> str:
    colour = html_colour(trial.outcome)
    met_css = "skip" if trial.outcome is Outcome.UNSUPPORTED and trial.met else ("met" if trial.met else "unmet")
    verdict = [f'<div>{html_outcome(trial.outcome)} · <span class="{met_css}">{esc(verdict_words(trial).plain)}</span> '
               f'<span class="muted">(expected {esc(fmt_expected(trial.expected))})</span></div>',
               f"<div>{esc(describe(trial.outcome, trial.first_failure))}</div>"]
    if trial.first_failure is not None:
        verdict.append(f"<div><b>first failure:</b> {esc(failure_summary(trial.first_failure))}</div>")
    if cpu_note_applies(trial):
        verdict.append(f'<div class="cpu">{esc(CPU_NOTE)}</div>')
    parts = [f'<section id="trial-{index}"><h2>{esc(trial_title(trial))}</h2>',
             f'<p class="muted">trial {esc(trial.id)}</p>',
             f'<div class="verdict" style="border-color:{colour}">{"".join(verdict)}</div>']
    if trial.guard_findings:
        parts.append(html_findings(trial))
    if trial.manifests:
        parts.append(html_manifests(trial))
    if trial.steps:
        parts.append(html_steps(trial))
    if trial.timings:
        parts.append("<p><b>timings:</b> " + esc(" · ".join(f"{k} {fmt_seconds(v)}"
                                                             for k, v in ordered_timings(trial.timings))) + "</p>")
    if trial.notes:
        parts.append("<h3>Notes</h3><ul>" + "".join(f"<li>{esc(n)}</li>" for n in trial.notes) + "</ul>")
    if trial.artifacts:
        parts.append("<h3>Artifacts</h3><ul>" + "".join(
            f'<li>{esc(k)}: <span class="mono">{esc(v)}</span></li>' for k, v in trial.artifacts.items()) + "</ul>")
    if trial.outcome in EXIT_OUTCOMES and trial.ranks:
        parts.append(html_ranks(trial))
    parts.append("</section>")
    return "".join(parts)


def html_env_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(strict_json(to_jsonable(value)), ensure_ascii=False)
    return f'<span class="mono">{esc(text)}</span>'


def html_environment(report: Report) -> str:
    env = report.environment or {}
    rows = [("", [esc(k), html_env_value(v)]) for k, v in env.items() if k != "summary"]
    line = environment_text(report)
    return ("<h2>Environment</h2>" + (f"<p>{esc(line)}</p>" if line else "")
            + (html_table(["key", "value"], rows) if rows else ""))


def report_html(report: Report) -> str:
    verdict_css = "met" if report.all_met() else "unmet"
    head = [f'<h1>repro report</h1><p class="{verdict_css}">{esc(summary_line(report))}</p>']
    if report.command:
        head.append(f'<p>command: <code>{esc(report.command)}</code></p>')
    if report.created:
        head.append(f'<p class="muted">created {esc(report.created)} · schema {esc(report.schema)}</p>')
    body = "".join(head) + html_environment(report) + "<h2>Summary</h2>" + html_summary(report) + "".join(
        html_trial(i, t) for i, t in enumerate(report.trials))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>repro report: {esc(summary_line(report))}</title><style>{HTML_CSS}</style></head>"
            f"<body>{body}</body></html>\n")


def write_html(report: Report, path: str | os.PathLike) -> None:
    write_text_atomic(path, report_html(report))


# ---------------------------------------------------------------------------------------------
# Live progress


class Progress:
    """Live view of running trials on `console` (stderr in the CLI).

    On a terminal it is a rich progress display; otherwise (CI logs, pipes) each event is one
    plain line with no control codes, so logs stay greppable and nothing is redrawn.
    """

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live = console.is_terminal and not console.is_dumb_terminal
        self.tasks: dict[str, Any] = {}          # trial_id -> rich task id (live mode)
        self.totals: dict[str, int | None] = {}
        self.started: dict[str, float] = {}
        self.last: dict[str, tuple[int, str]] = {}  # plain mode: skip repeats of the same event
        self.lock = threading.Lock()              # runners report from reader threads
        self.bar = RichProgress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
            console=console, transient=False) if self.live else None

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
                self.tasks[trial_id] = self.bar.add_task(escape_markup(label), total=total_steps,
                                                         status="starting")
                return
        steps = f" ({total_steps} steps)" if total_steps else ""
        self.emit(trial_id, Text(f"started {label}{steps}"))

    def update(self, trial_id: str, steps_done: int, status_text: str = "") -> None:
        with self.lock:
            if trial_id not in self.started:
                self.started[trial_id] = time.monotonic()
                self.totals[trial_id] = None
                if self.bar is not None:
                    self.tasks[trial_id] = self.bar.add_task(escape_markup(trial_id), total=None, status="")
            if self.bar is not None:
                # The columns read markup; caller text is escaped so "[rank0]" prints as written.
                self.bar.update(self.tasks[trial_id], completed=steps_done,
                                status=escape_markup(plain(status_text)))
                return
            if self.last.get(trial_id) == (steps_done, status_text):
                return
            self.last[trial_id] = (steps_done, status_text)
        total = self.totals.get(trial_id)
        count = f"{steps_done}/{total}" if total else f"{steps_done}"
        self.emit(trial_id, Text(f"step {count}" + (f" {plain(status_text)}" if status_text else "")))

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
