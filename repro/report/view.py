"""The view model: what a report says about a run and about each trial, decided once.

Console, JUnit, HTML and the progress display read these objects; none of them pulls a fact
out of a record or formats a number itself, so every renderer says the same thing. A new fact
is one line in one of the tables below: TRIAL_FACTS (trial-level lines), FINDING_FACTS (per
dead storage), STEP_COLUMNS, MANIFEST_COLUMNS, RANK_COLUMNS, SUMMARY_COLUMNS. A scenario's own
facts are in its spec (repro/scenarios/spec.py): its lines, step and summary columns join these.

Every sentence here must be true of the trial it describes: what ran (a graph replay, or the
eager path on CPU) decides the wording, not what usually runs. No torch import: this runs in
the parent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote

from repro.scenarios import SCENARIO_RUN_KEYS, SCENARIOS, RecordField, StepColumn, record_fields, step_columns
from repro.outcome import (
    Device,
    Finding,
    FirstFailure,
    GuardMode,
    Outcome,
    RankExit,
    Report,
    Status,
    StepRecord,
    TrialRecord,
)
from repro.report.groups import FindingGroup, group_findings, unique
from repro.report.fmt import (
    fmt_bytes,
    fmt_expected,
    fmt_float,
    fmt_ptr,
    fmt_ranges,
    fmt_seconds,
    fmt_value,
    last_lines,
    plain,
)

CPU_NOTE = "No CUDA graph was replayed (CPU run): the verdict comes from the stale-capture guard."
CPU_CLEAN_NOTE = (
    "No CUDA graph was replayed (CPU run): the eager path stood in, and the stale-capture "
    "guard found no captured tensor freed or moved."
)
CPU_GUARD_OFF_NOTE = (
    "No CUDA graph was replayed (CPU run) and the guard was off: a stale capture could not have been detected."
)
CPU_COMPARISON_NOTE = (
    "No CUDA graph was replayed (CPU run): the verdict comes from comparing the eager output with the reference."
)
CPU_FORENSICS_NOTE = "--forensics was ignored: CUDA memory history exists only on a GPU."

# Outcomes after which the ranks' exits and stderr explain more than the step table does.
EXIT_OUTCOMES = frozenset({Outcome.CRASH, Outcome.HANG, Outcome.ILLEGAL_ADDRESS, Outcome.DEVICE_ASSERT})

# Phases in the order a trial runs them; keys a trial adds beyond these follow in its own order.
TIMING_ORDER = ("start", "import", "cuda", "init", "build", "capture", "reload", "replays", "oracle", "total")

MAX_STEP_ROWS = 20  # a 500-step run must not bury the verdict
MAX_FINDING_GROUPS = 10  # distinct dead storages shown; one storage is often in 7+ graphs
CONTEXT_STEP_ROWS = 3  # clean rows kept before the failures, so the reader sees where it turned
STACK_FRAMES = 3

# What each outcome means, in one sentence; "{where}" becomes " on rank R at step S" when known.
MEANINGS: dict[Outcome, str] = {
    Outcome.CLEAN: "Every replay ran and its output was finite and equal to the reference within tolerance.",
    Outcome.ILLEGAL_ADDRESS: "CUDA error 700{where}: the replay touched memory returned to the driver.",
    Outcome.DEVICE_ASSERT: "CUDA error 710{where}: a device-side assert fired, typically an index read "
    "from memory another tensor had reused.",
    Outcome.NONFINITE: "NaN/Inf in the output{where}: the replay read stale or overwritten memory.",
    Outcome.MISMATCH: "Finite output that differs from the reference{where}: the replay silently "
    "computed with the wrong values.",
    Outcome.STALE_CAPTURE: "Captured memory was found freed, moved, reused or overwritten{where} (by the guard or "
    "the graph census) with no visible symptom yet: the bug is latent and shows "
    "once the memory is reused.",
    Outcome.HANG: "No rank made progress{where} (no record for the stall limit, or none by the deadline); "
    "the harness killed the process group.",
    Outcome.DEADLINE: "The trial's deadline came while it was still progressing{where}: too slow for its "
    "budget, not stuck; no verdict, so not a pass.",
    Outcome.CRASH: "A rank exited abnormally{where} (signal or uncaught exception); its stderr tail says why.",
    Outcome.UNSUPPORTED: "This environment cannot run the trial (e.g. fewer GPUs than --tp): "
    "nothing was tested, so this is not a pass.",
    Outcome.INTERRUPTED: "The run was interrupted (Ctrl-C or SIGTERM){where} before this trial finished: "
    "no verdict; the records up to then are kept.",
}
# The same outcomes when no graph was replayed (CPU, selftest): nothing may claim a replay.
NO_REPLAY_MEANINGS: dict[Outcome, str] = {
    Outcome.CLEAN: "Every step ran and its output was finite and equal to the reference within tolerance.",
    Outcome.NONFINITE: "NaN/Inf in the output{where}: the step computed with stale or overwritten values.",
    Outcome.MISMATCH: "Finite output that differs from the reference{where}: the step silently computed "
    "with the wrong values.",
}

# Tones say what a piece of text means; each renderer maps them to its own colours.
OK, WARN, SKIP, BAD, NOTE, DIM = "ok", "warn", "skip", "bad", "note", "dim"
OUTCOME_TONES = {Outcome.CLEAN: OK, Outcome.STALE_CAPTURE: WARN, Outcome.UNSUPPORTED: SKIP, Outcome.INTERRUPTED: SKIP}


# ---------------------------------------------------------------------------------------------
# Building blocks


@dataclass(frozen=True)
class Cell:
    text: str
    tone: str = ""


@dataclass(frozen=True)
class Column:
    """One table column, declared once for every renderer."""

    key: str
    header: str
    get: Callable[[Any], Cell]
    numeric: bool = False
    wrap: bool = False  # free text: wraps rather than widening the table
    drop: int = 0  # narrow consoles leave out the highest first; 0: always kept
    fold: bool = False  # one value in every row: said once, above the table
    stacked: str = ""  # two-line header where width is short

    @property
    def short_header(self) -> str:
        return self.stacked or self.header


@dataclass(frozen=True)
class Fact:
    label: str
    value: str
    tone: str = ""


def cell(value: Any, tone: str = "") -> Cell:
    return Cell("-" if value is None or value == "" else plain(str(value)), tone)


def outcome_tone(outcome: Outcome) -> str:
    return OUTCOME_TONES.get(Outcome(outcome), BAD)


# ---------------------------------------------------------------------------------------------
# Facts pulled from a trial


def run_config(trial: TrialRecord) -> dict[str, Any]:
    run = trial.config.get("run", {}) if isinstance(trial.config, dict) else {}
    return run if isinstance(run, dict) else {}


def trial_device(trial: TrialRecord) -> str:
    """'cpu' | 'cuda' where the trial ran; '' when it did not run (UNSUPPORTED)."""
    if trial.device:
        return trial.device
    forced = run_config(trial).get("device")  # reports written before the field existed
    return forced if forced in (Device.CPU, Device.CUDA) else ""


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
    parts = [
        k.replace("_", "-") if v is None else f"{k.replace('_', '-')}={v}" for k, v in config_params(trial).items()
    ]
    return sep.join(parts)


def trial_title(trial: TrialRecord) -> str:
    """'gemma4-mtp · unfixed · tp=2 · after-free=release'."""
    return " · ".join([trial.scenario, trial.mode, config_highlights(trial)])


def trial_seconds(trial: TrialRecord) -> float | None:
    return float(trial.timings["total"]) if "total" in trial.timings else None


def where_text(failure: FirstFailure | None) -> str:
    if failure is None:
        return ""
    parts = []
    if failure.rank is not None:
        parts.append(f"rank {failure.rank}")
    if failure.step is not None:
        parts.append(f"step {failure.step}")
    return (" on " + " at ".join(parts)) if parts else ""


def describe(outcome: Outcome, failure: FirstFailure | None = None, replayed: bool = True) -> str:
    """One plain sentence per outcome; names the rank and step when the first failure has them.

    replayed=False: no graph was replayed, so the sentence must not say one was.
    """
    outcome = Outcome(outcome)
    # Only place the failure when it is the same kind: a CLEAN trial has nothing to place.
    same_kind = failure is not None and Outcome(failure.kind) == outcome
    text = MEANINGS[outcome] if replayed else NO_REPLAY_MEANINGS.get(outcome, MEANINGS[outcome])
    return text.format(where=where_text(failure) if same_kind else "")


def verdict_basis(trial: TrialRecord) -> list[str]:
    """Where the verdict of a CPU run came from, when that differs from a GPU run.

    Only for verdicts the run itself produced: a HANG, CRASH or UNSUPPORTED (or a CUDA error
    from an injected fault) says nothing about the guard or the comparison.
    """
    if trial_device(trial) != Device.CPU or trial.graph_replayed:
        return []
    captured = "capture" in trial.timings  # a dry-run capture ran (selftest has none)
    guard_on = run_config(trial).get("guard", GuardMode.WARN) != GuardMode.OFF
    if trial.outcome is Outcome.STALE_CAPTURE:
        return [CPU_NOTE]
    if trial.outcome in (Outcome.MISMATCH, Outcome.NONFINITE):
        return [CPU_COMPARISON_NOTE]
    if trial.outcome is Outcome.CLEAN and captured:
        return [CPU_CLEAN_NOTE if guard_on else CPU_GUARD_OFF_NOTE]
    return []


def scenario_lines(trial: TrialRecord) -> list[str]:
    """What the trial's scenario says about its numbers (ScenarioSpec.report_lines)."""
    spec = SCENARIOS.get(trial.scenario)
    return spec.report_lines(trial) if spec is not None else []


def option_notes(trial: TrialRecord) -> list[str]:
    """Options the trial asked for that could not act where it ran."""
    if trial_device(trial) == Device.CPU and run_config(trial).get("forensics"):
        return [CPU_FORENSICS_NOTE]
    return []


def failure_line(failure: FirstFailure) -> str:
    """'ILLEGAL_ADDRESS · rank 0 · step 0 · detail' for the verdict box."""
    # A part that is not known is left out: "rank -" read as a rank lost, where none is to blame.
    parts = [Outcome(failure.kind).value]
    parts += [f"rank {failure.rank}"] if failure.rank is not None else []
    parts += [f"step {failure.step}"] if failure.step is not None else []
    if failure.detail:
        parts.append(plain(failure.detail))
    return " · ".join(parts)


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


def met_cell(trial: TrialRecord) -> Cell:
    """The met mark; UNSUPPORTED never gets a pass mark."""
    if trial.outcome is Outcome.UNSUPPORTED:
        return Cell("skipped (not a pass)", SKIP) if trial.met else Cell("✗", BAD)
    if trial.outcome is Outcome.INTERRUPTED:
        return Cell("– interrupted", SKIP)
    if trial.outcome is Outcome.DEADLINE:
        return Cell("✗ no verdict", BAD)
    return Cell("✓", OK) if trial.met else Cell("✗", BAD)


def verdict_words(trial: TrialRecord) -> Cell:
    """'✓ met its expectation' / '✗ did NOT meet...'; UNSUPPORTED never reads as a pass."""
    if trial.outcome is Outcome.UNSUPPORTED and trial.met:
        return Cell("not a pass: skipped, as expected", SKIP)
    if trial.outcome is Outcome.INTERRUPTED:
        return Cell("– interrupted: no verdict (not a pass)", SKIP)
    if trial.outcome is Outcome.DEADLINE:
        return Cell("✗ deadline reached: no verdict (not a pass)", BAD)
    mark = met_cell(trial)
    words = "met its expectation" if trial.met else "did NOT meet its expectation"
    return Cell(f"{mark.text} {words}", mark.tone)


def ordered_timings(timings: dict[str, float]) -> list[tuple[str, float]]:
    known = [(k, timings[k]) for k in TIMING_ORDER if k in timings]
    return known + [(k, v) for k, v in timings.items() if k not in TIMING_ORDER]


def fault_text(trial: TrialRecord) -> str | None:
    f = trial.injected_fault
    if not f:
        return None
    state = "fired" if f.get("fired") else "never reached"
    return (
        f"{f['kind']} on rank {f['rank']} at step {f['step']} ({state}; test hook): never counts as reproducing the bug"
    )


def stack_text(frames: list[str], n: int = STACK_FRAMES) -> str:
    """'inject_fault (worker.py:35) <- begin_step (worker.py:88)', most recent first."""

    def one(frame: str) -> str:
        where, _, func = frame.rpartition(" in ")
        return f"{func} ({where.rsplit('/', 1)[-1]})"

    return " <- ".join(one(f) for f in frames[:n])


# Trial-level facts shown under the verdict; a value of None leaves the line out.
def guard_fact(trial: TrialRecord) -> str | None:
    if run_config(trial).get("guard") != GuardMode.OFF:
        return None
    if trial.details.get("census"):
        return (
            "off: captured tensors were not checked at the dispatcher; the graph census still "
            "checked the addresses the graphs hold"
        )
    return "off: captured tensors were not checked"


def census_fact(trial: TrialRecord) -> str | None:
    census = trial.details.get("census")
    if not census:
        return None
    refs = sum(c.get("references", 0) for c in census)
    return f"{len(census)} graphs read, {refs} captured addresses outside their pools checked"


def memory_fact(trial: TrialRecord) -> str | None:
    """Each rank's peak reserved GPU memory, where the ranks said it (CUDA trials)."""
    said = [(r.rank, r.peak_reserved_bytes) for r in trial.ranks if r.peak_reserved_bytes is not None]
    if not said:
        return None
    return "peak reserved " + ", ".join(f"{fmt_bytes(n)} (rank {rank})" for rank, n in said)


TRIAL_FACTS: tuple[tuple[str, Callable[[TrialRecord], Any]], ...] = (
    ("injected fault", fault_text),
    ("node", lambda t: t.node),
    ("after-free", lambda t: (t.details.get("after_free") or {}).get("note")),
    ("knob writes", lambda t: (t.details.get("after_free") or {}).get("writes")),
    ("guard", guard_fact),
    ("census", census_fact),
    ("GPU memory", memory_fact),
)


def trial_facts(trial: TrialRecord) -> list[Fact]:
    facts = []
    for label, get in TRIAL_FACTS:
        value = get(trial)
        if value is not None and value != "":
            facts.append(Fact(label, fmt_value(value)))
    # Where each rank was when the harness asked at the deadline (HANG).
    facts += [Fact(f"rank {r.rank} stack", stack_text(r.stack)) for r in trial.ranks if r.stack]
    return facts


# ---------------------------------------------------------------------------------------------
# Findings (guard and census)


# Findings are grouped by problem (repro/report/groups.py): one dead tensor in every graph and
# on every rank, or one mistake repeated across layers, is one group and one headline.


def finding_address(f: Finding) -> str:
    return fmt_ptr(f.old_ptr) + (f" → {fmt_ptr(f.new_ptr)}" if f.new_ptr is not None else "")


def group_address(g: FindingGroup) -> str:
    """The first member's address; the others have their own (each rank its own copy; each
    placement of a storage that moved between captures its own)."""
    text = finding_address(g.first)
    addresses = len({(f.rank, f.old_ptr) for f in g.findings})
    if addresses > 1:
        text += f" (rank {g.first.rank}; {addresses} addresses in all)"
    return text


def seen_text(group: list[Finding]) -> str:
    graphs = unique(x.graph for x in group if x.graph)
    where = f" in {len(graphs)} graphs: " if len(graphs) > 1 else " in graph "
    return " | ".join(unique(x.when for x in group if x.when)) + where + ", ".join(graphs)


def names_text(g: FindingGroup) -> str | None:
    names = g.names()
    if len(names) < 2:
        return None
    shown = ", ".join(names[:3])
    return shown + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + fmt_ranges(ranks)


# Per dead storage, in reading order; a value of None or "" leaves the line out.
def tensor_text(f: Finding) -> str:
    """A census finding knows bytes, not a dtype: it names the allocator block instead."""
    if not f.dtype:
        return f"allocator block · {fmt_bytes(f.nbytes)}"
    return f"{list(f.shape)} {f.dtype} · {fmt_bytes(f.nbytes)}"


def captured_by_text(f: Finding) -> str | None:
    if not f.census:
        return None
    sites = f.census.get("sites") or [""]
    return f"{f.census.get('references', 1)} words; first: {sites[0]}"


def block_text(f: Finding) -> str | None:
    c = f.census
    if not c:
        return None
    return (
        f"{fmt_ptr(c['block_start'])} · {fmt_bytes(c['block_size'])} · pool {tuple(c['block_pool'])} · "
        f"{c['status']} ({c['how']})"
    )


FINDING_FACTS: tuple[tuple[str, Callable[[FindingGroup], Any]], ...] = (
    ("names", names_text),
    ("address", group_address),
    ("tensor", lambda g: tensor_text(g.first)),
    ("seen by", lambda g: g.mechanism),
    ("seen", lambda g: seen_text(g.findings)),
    ("created at", lambda g: g.first.created_at),
    ("freed at", lambda g: g.freed_at),
    ("captured by", lambda g: captured_by_text(g.first)),
    ("block", lambda g: block_text(g.first)),
    ("disagreement", lambda g: g.first.disagreement),
)


def stack_facts(label: str, stack: list[str]) -> list[Fact]:
    """Top frames only; the label on the first line."""
    facts = [Fact(label if i == 0 else "", plain(frame)) for i, frame in enumerate(stack[:STACK_FRAMES])]
    if len(stack) > STACK_FRAMES:
        facts.append(Fact("", f"(+{len(stack) - STACK_FRAMES} more frames)", DIM))
    return facts


@dataclass
class FindingView:
    """One problem: a group of findings (every graph, rank and layer that shows it)."""

    status: Status | str  # a Status; a record of another version may hold one this one lacks
    slot: str  # the name, or its pattern when the members' names differ
    rank: int  # the first member's
    tone: str
    facts: list[Fact]
    ranks: str = ""  # "rank 0" | "ranks 0, 1"
    count: int = 1  # findings in the group

    @property
    def where(self) -> str:
        return self.ranks + (f" · {self.count} findings" if self.count > 1 else "")


def finding_view(group: FindingGroup) -> FindingView:
    f = group.first
    facts = [Fact(label, plain(str(value))) for label, get in FINDING_FACTS if (value := get(group)) not in (None, "")]
    facts += stack_facts("alloc stack", f.alloc_stack) + stack_facts("free stack", f.free_stack)
    if f.message:
        facts.append(Fact("message", plain(f.message)))
    slot = f.slot if len(group.names()) == 1 else group.pattern
    return FindingView(
        status=f.status,
        slot=plain(slot),
        rank=f.rank,
        tone=BAD if f.status in (Status.FREED, Status.CONTENTS_CHANGED) else WARN,
        facts=facts,
        ranks=ranks_text(group.ranks() or [f.rank]),
        count=group.count,
    )


# ---------------------------------------------------------------------------------------------
# Tables


def step_failed(step: StepRecord) -> bool:
    return step.outcome() is not Outcome.CLEAN


def extra_column(c: StepColumn) -> Column:
    """A scenario's number in StepRecord.extra (ScenarioSpec.step_columns); '-' where a step has none,
    so the column is left out of trials that never recorded it."""
    return Column(c.key, c.header, lambda s: cell(fmt_float(s.extra.get(c.key))), numeric=True, drop=c.drop)


STEP_COLUMNS: tuple[Column, ...] = (
    Column("step", "step", lambda s: cell(s.step), numeric=True),
    Column("rank", "rank", lambda s: cell(s.rank), numeric=True),
    Column("label", "label", lambda s: cell(s.label), wrap=True),
    Column("batch", "tokens", lambda s: cell(s.batch), numeric=True, fold=True, drop=3),
    Column("replayed", "replayed", lambda s: Cell("graph") if s.replayed else Cell("eager", WARN), fold=True),
    Column(
        "nonfinite",
        "nonfinite/numel",
        lambda s: Cell(f"{s.nonfinite}/{s.numel}", BAD if s.nonfinite else ""),
        numeric=True,
        stacked="nonfinite\n/numel",
    ),
    Column(
        "mismatches",
        "mismatches/compared",
        lambda s: Cell(f"{s.mismatches}/{s.compared}", BAD if s.mismatches else ""),
        numeric=True,
        stacked="mismatches\n/compared",
    ),
    Column(
        "max_abs_err",
        "max abs err",
        lambda s: cell(fmt_float(s.max_abs_err), BAD if step_failed(s) else ""),
        numeric=True,
        stacked="max abs\nerr",
    ),
    Column("rel_err", "rel err", lambda s: cell(fmt_float(s.rel_err)), numeric=True, drop=2),
    *(extra_column(c) for c in step_columns()),
    Column("tolerance", "tolerance", lambda s: cell(fmt_float(s.tolerance)), numeric=True, fold=True, drop=4),
    Column("ms", "ms", lambda s: Cell(f"{s.seconds * 1000:.1f}"), numeric=True, drop=1),
)

MANIFEST_COLUMNS: tuple[Column, ...] = (
    Column("when", "when", lambda m: cell(m.when), wrap=True),
    Column("rank", "rank", lambda m: cell(m.rank), numeric=True),
    Column("freed", "freed", lambda m: cell(m.freed, BAD if m.freed else ""), numeric=True),
    Column("moved", "moved", lambda m: cell(m.moved, WARN if m.moved else ""), numeric=True),
    Column("rebound", "rebound", lambda m: cell(m.rebound, WARN if m.rebound else ""), numeric=True),
    Column("unchanged", "unchanged", lambda m: cell(m.unchanged), numeric=True),
)


def exit_text(r: RankExit) -> str:
    if r.killed_by_harness:
        return "killed by harness" + (f" ({r.signal})" if r.signal else "")
    if r.signal:
        return f"signal {r.signal}"
    return "-" if r.exitcode is None else f"exit {r.exitcode}"


def abnormal(r: RankExit) -> bool:
    return bool(r.killed_by_harness or r.signal or (r.exitcode not in (0, None)))


RANK_COLUMNS: tuple[Column, ...] = (
    Column("rank", "rank", lambda r: cell(r.rank), numeric=True),
    Column("pid", "pid", lambda r: cell(r.pid), numeric=True),
    Column("exit", "exit", lambda r: cell(exit_text(r), BAD if abnormal(r) else ""), wrap=True),
    Column("error", "error", lambda r: cell(r.error), wrap=True),
)


@dataclass
class Row:
    cells: dict[str, Cell]
    tone: str = ""  # BAD: a failing row
    gap: int = 0  # > 0: stands for that many hidden rows


@dataclass
class TableView:
    title: str
    columns: list[Column]
    rows: list[Row]
    folded: list[tuple[str, str]] = field(default_factory=list)  # (header, value) said once
    all_rows: list[Row] = field(default_factory=list)  # every row, when some are hidden
    hidden: int = 0
    summary: str = ""
    note: str = ""  # a line under the table, where a count would otherwise mislead


def table_rows(
    columns: tuple[Column, ...] | list[Column], items: list[Any], failed: Callable[[Any], bool] = lambda _: False
) -> list[Row]:
    return [Row({c.key: c.get(x) for c in columns}, BAD if failed(x) else "") for x in items]


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


def with_gaps(indices: list[int], rows: list[Row]) -> list[Row]:
    out, previous = [], -1
    for i, row in zip(indices, rows):
        if i != previous + 1:
            out.append(Row({}, gap=i - previous - 1))
        out.append(row)
        previous = i
    return out


def steps_title(steps: list[StepRecord]) -> str:
    """'Steps (1776 on 2 ranks)': the table has a row per step and rank, and its title counts
    steps, as the progress and the deadline do (not rows: 3552 beside 'step 1776')."""
    ranks = len({s.rank for s in steps})
    count = len({s.step for s in steps})
    return f"Steps ({count})" if ranks <= 1 else f"Steps ({count} on {ranks} ranks)"


def steps_view(steps: list[StepRecord]) -> TableView:
    """Columns with one value for every step are said once; columns with no value are left out."""
    every = table_rows(STEP_COLUMNS, steps, step_failed)
    shown = select_steps(steps)
    folded, columns = [], []
    for c in STEP_COLUMNS:
        values = {r.cells[c.key].text for r in every}
        if values == {"-"}:
            continue
        if c.fold and len(values) == 1:
            folded.append((c.header, values.pop()))
            continue
        columns.append(c)
    hidden = len(steps) - len(shown)
    return TableView(
        title=steps_title(steps),
        columns=columns,
        rows=with_gaps(shown, [every[i] for i in shown]),
        folded=folded,
        all_rows=every if hidden > 0 else [],
        hidden=hidden,
        summary=steps_summary(steps) if hidden > 0 else "",
    )


# ---------------------------------------------------------------------------------------------
# A trial


@dataclass
class Artifact:
    name: str
    path: str
    href: str = ""  # relative link from the page that shows it, when known


@dataclass
class TrialView:
    index: int
    id: str
    anchor: str
    title: str
    scenario: str
    mode: str
    config: str  # 'tp=2 after-free=release reload-drafter'
    device: str
    outcome: str
    tone: str
    expected: str
    met: bool
    met_mark: Cell
    verdict: Cell
    meaning: str
    first_failure: str  # '' when none
    first_failure_short: str
    basis: list[str]  # where the verdict came from, when that is not the usual
    facts: list[Fact]
    seconds: float | None
    findings_total: int
    findings: list[FindingView]
    hidden_finding_groups: int
    manifests: TableView | None
    steps: TableView | None
    timings: list[tuple[str, str]]
    notes: list[str]
    artifacts: list[Artifact]
    ranks: TableView  # every rank's exit
    show_ranks: bool  # the processes' ends explain the outcome: show them with it
    stderr_tails: list[tuple[int, str]]
    record: TrialRecord  # charts and JUnit names read the raw steps

    @property
    def seconds_text(self) -> str:
        return f"{self.seconds:.1f}" if self.seconds is not None else "-"

    @property
    def details_parts(self) -> list[str]:
        """What the HTML page folds under the trial's verdict, named in its summary line."""
        parts = [
            ("facts", self.facts),
            ("storages after reloads", self.manifests),
            ("steps", self.steps),
            ("timings", self.timings),
            ("notes", self.notes),
            ("artifacts", self.artifacts),
        ]
        return [name for name, present in parts if present]


def artifact_href(path: str, link_base: Path | None) -> str:
    if link_base is None:
        return ""
    try:
        rel = os.path.relpath(Path(path).resolve(), link_base.resolve())
    except ValueError:  # another drive (Windows): an absolute link still works
        return Path(path).resolve().as_uri()
    return quote(Path(rel).as_posix())


def manifest_note(trial: TrialRecord) -> str:
    """A finding may say a name now points at another tensor while `rebound` reads 0: each
    storage is counted once, and freed outranks rebound. Said where that happens."""
    renamed = {(f.rank, f.slot) for f in trial.guard_findings if f.status == Status.FREED and f.new_ptr is not None}
    if not renamed:
        return ""
    return (
        f"each storage is counted once, freed before rebound: the {len(renamed)} freed storage(s) whose "
        "name now points at another tensor are counted as freed"
    )


def trial_view(index: int, trial: TrialRecord, link_base: Path | None = None) -> TrialView:
    groups = group_findings(trial.guard_findings)
    return TrialView(
        index=index,
        id=trial.id,
        anchor=f"trial-{index}",
        title=trial_title(trial),
        scenario=trial.scenario,
        mode=trial.mode,
        config=config_highlights(trial, sep=" "),
        device=trial_device(trial),
        outcome=trial.outcome.value,
        tone=outcome_tone(trial.outcome),
        expected=fmt_expected(trial.expected),
        met=trial.met,
        met_mark=met_cell(trial),
        verdict=verdict_words(trial),
        meaning=describe(trial.outcome, trial.first_failure, replayed=trial.graph_replayed),
        first_failure=failure_line(trial.first_failure) if trial.first_failure else "",
        first_failure_short=short_failure(trial),
        basis=verdict_basis(trial) + option_notes(trial) + scenario_lines(trial),
        facts=trial_facts(trial),
        seconds=trial_seconds(trial),
        findings_total=len(trial.guard_findings),
        findings=[finding_view(g) for g in groups[:MAX_FINDING_GROUPS]],
        hidden_finding_groups=max(0, len(groups) - MAX_FINDING_GROUPS),
        manifests=TableView(
            "Captured storages after reloads",
            list(MANIFEST_COLUMNS),
            table_rows(MANIFEST_COLUMNS, trial.manifests),
            note=manifest_note(trial),
        )
        if trial.manifests
        else None,
        steps=steps_view(trial.steps) if trial.steps else None,
        timings=[(k, fmt_seconds(v)) for k, v in ordered_timings(trial.timings)],
        notes=[plain(n) for n in trial.notes],
        artifacts=[Artifact(k, str(v), artifact_href(str(v), link_base)) for k, v in trial.artifacts.items()],
        ranks=TableView("Rank exits", list(RANK_COLUMNS), table_rows(RANK_COLUMNS, trial.ranks, abnormal)),
        show_ranks=trial.outcome in EXIT_OUTCOMES and bool(trial.ranks),
        stderr_tails=[(r.rank, last_lines(r.stderr_tail)) for r in trial.ranks if last_lines(r.stderr_tail)],
        record=trial,
    )


# ---------------------------------------------------------------------------------------------
# A run


def record_column(f: RecordField) -> Column:
    """A scenario's trial field (ScenarioSpec.record_fields) as a summary column: '-' for trials
    that did not measure it, those of other scenarios among them."""

    def get(t: TrialView) -> Cell:
        value = t.record.measures.get(f.name)
        return Cell("-" if value is None else format(value, f.fmt))

    return Column(f.name, f.column, get, numeric=True)


SUMMARY_COLUMNS: tuple[Column, ...] = (
    Column("scenario", "scenario", lambda t: Cell(t.scenario)),
    Column("mode", "mode", lambda t: Cell(t.mode)),
    Column("config", "config", lambda t: Cell(t.config)),
    Column("outcome", "outcome", lambda t: Cell(t.outcome, t.tone)),
    Column("expected", "expected", lambda t: Cell(t.expected)),
    Column("met", "met", lambda t: t.met_mark),
    *(record_column(f) for f in record_fields() if f.column),
    # The one column that gives up width (it wraps); the trial's own section carries it in full.
    Column("first_failure", "first failure", lambda t: Cell(t.first_failure_short), wrap=True),
    Column("seconds", "seconds", lambda t: Cell(t.seconds_text), numeric=True),
)


def summary_line(report: Report) -> str:
    """'3/4 trials met their expectation' (+ unsupported count, + CPU, + interrupted)."""
    trials = report.trials
    met = sum(1 for t in trials if t.met)
    text = f"{met}/{len(trials)} trials met their expectation"
    unsupported = sum(1 for t in trials if t.outcome is Outcome.UNSUPPORTED)
    if unsupported:
        text += f"; {unsupported} UNSUPPORTED (not run, not a pass)"
    ran = [t for t in trials if t.outcome is not Outcome.UNSUPPORTED]
    on_cpu = sum(1 for t in ran if trial_device(t) == Device.CPU)
    if on_cpu and on_cpu == len(ran):
        text += "; CPU run: no CUDA graph was replayed"
    elif on_cpu:
        text += f"; {on_cpu} on CPU (no CUDA graph replayed there)"
    if report.interrupted:
        text += f"; interrupted ({report.interrupted_by})" if report.interrupted_by else "; interrupted"
    if report.not_run:
        text += f"; {report.not_run} planned trial{'s' if report.not_run > 1 else ''} never ran"
    return text + shard_text(report)


def shard_text(report: Report) -> str:
    """Which part of the plan a shard's report covers, or which shards a merge joined (and what
    was missing or doubled: each such problem fails the run)."""
    shard = report.shard
    if not shard:
        return ""
    if "merged" in shard:
        text = f"; {len(shard['merged'])} of {shard['count']} shards merged"
        return text + "".join(f"; FAILED: {p}" for p in report.shard_problems())
    return f"; shard {shard['index']}/{shard['count']}: {len(shard['trials'])} of {len(shard['plan'])} planned trials"


def environment_line(env: dict[str, Any]) -> str:
    if env.get("summary"):
        return str(env["summary"])
    # No prepared summary: the scalar facts are still worth a line.
    return " · ".join(f"{k}={v}" for k, v in env.items() if isinstance(v, (str, int, float, bool)))


def environment_rows(env: dict[str, Any]) -> list[tuple[str, str]]:
    """One readable row per fact: nested sections flattened, lists of records one row each."""
    rows: list[tuple[str, str]] = []
    for key, value in env.items():
        if key == "summary":
            continue
        if isinstance(value, dict) and value:
            rows += [(f"{key} {k}", fmt_value(v)) for k, v in value.items()]
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            rows += [(f"{key} {v.get('index', i)}", fmt_value(v)) for i, v in enumerate(value)]
        else:
            rows.append((key, fmt_value(value)))
    return rows


@dataclass
class RunView:
    environment: str
    environment_rows: list[tuple[str, str]]
    command: str
    created: str
    schema: str
    summary: str
    all_met: bool
    interrupted: bool
    trials: list[TrialView]
    summary_columns: tuple[Column, ...] = SUMMARY_COLUMNS
    problems: list[str] = field(default_factory=list)  # a merge's missing / duplicated shards


def run_view(report: Report, link_base: Path | None = None) -> RunView:
    """link_base: the directory of the page that will link the artifacts (HTML)."""
    env = report.environment or {}
    return RunView(
        environment=environment_line(env),
        environment_rows=environment_rows(env),
        command=report.command,
        created=report.created,
        schema=report.schema,
        summary=summary_line(report),
        all_met=report.all_met(),
        interrupted=report.interrupted,
        trials=[trial_view(i, t, link_base) for i, t in enumerate(report.trials)],
        problems=report.shard_problems(),
    )
