"""What a scenario declares about itself: ScenarioSpec and the small types it is made of.

A scenario's spec module (repro/scenarios/NAME_spec.py, or any module an entry point of the
`repro.scenarios` group names) builds one ScenarioSpec; the registry (repro/scenarios/__init__.py)
collects them and every generic layer asks the spec: config (run keys, validation, the default
expectation), footprint (memory per rank), the runner (presets, trial ids), the CLI (one command
each), the records (extra trial fields) and the report (lines, columns, charts).

Torch-free, like every spec module: the parent imports them. Only `ScenarioSpec.module`, the
code the ranks run, imports torch, and only inside the ranks (load_scenario).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable

# Bytes per element of a model dtype, for footprint formulas.
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}

# A scenario's validator calls check(ok, key, message) once per rule. key is the [run] key the
# rule is about ("" for the preset's [model] table), so an error names the flag the user typed.
Check = Callable[[bool, str, str], None]


@dataclass(frozen=True)
class ModeSpec:
    name: str
    fixes: dict[str, bool]  # the scenario's fix flags in this mode; its module builds MODES from them
    help: str  # one clause for --mode help: what this mode does


@dataclass(frozen=True)
class RunKeySpec:
    """A scenario-only [run] key (a switch, or a number whose 0 means the scenario's default),
    its CLI flag and its help. Off (False, 0) by default; a trial of another scenario leaves it off."""

    name: str  # RunConfig field, e.g. reload_drafter
    flag: str  # Typer declaration, e.g. --reload-drafter/--no-reload-drafter
    help: str
    tag: str = ""  # appended to the trial id: a switch's when on (reload), a
    # number's with its value when set (level2)
    type: type = bool
    default: str = ""  # numbers: what 0 (left out) resolves to, for --help
    # The common [run] key it follows in a trial's config; the keys of schema repro.report/1
    # keep their places (a new scenario's keys go after share_gpu, before expect).
    after: str = "share_gpu"


@dataclass(frozen=True)
class RecordField:
    """A trial-level number a scenario computes from its step records (ScenarioSpec.measure).

    It is a key of every trial in a report: null where the trial's scenario does not measure it,
    so every trial of one schema has the same keys."""

    name: str  # the JSON key, e.g. acceptance_rate
    help: str
    column: str = ""  # header of its column in the run summary; "" for none
    fmt: str = ""  # format spec of that column, e.g. ".0%"


@dataclass(frozen=True)
class StepColumn:
    """A steps-table column for a number the scenario records in StepRecord.extra. Shown after
    the error columns, and only for trials that recorded it."""

    key: str  # the column key and the StepRecord.extra key
    header: str
    drop: int = 0  # narrow consoles leave out the highest first; 0: always kept


@dataclass(frozen=True)
class CpuCost:
    """A real-dims preset timed on a CPU without a GPU (2 cores, shared with other work): the
    set-up (model build and the capture dry run) and one step, each the (fastest, slowest)
    seconds seen. Load moves them by 2-3x, so the CLI says a range, up front, for any CPU trial
    of about this size (repro/cli.py: cpu_warnings)."""

    preset: str
    setup_s: tuple[float, float]
    step_s: tuple[float, float]

    def estimate(self, steps: int) -> tuple[float, float]:
        return self.setup_s[0] + steps * self.step_s[0], self.setup_s[1] + steps * self.step_s[1]


def no_rules(model: Any, run: Any, check: Check) -> None:
    """A scenario without dims rules of its own."""


def usual_expectation(run: Any) -> str:
    """'' : the usual rule holds (unfixed reproduces, the other modes are clean)."""
    return ""


def no_footprint(model: Any, tp: int) -> int:
    """0: negligible memory, nothing to check before the trial starts."""
    return 0


def no_measures(steps: list[Any]) -> dict[str, Any]:
    return {}


def no_lines(trial: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class ScenarioSpec:
    name: str  # CLI command, preset `scenario = ...`, trial records
    module: str  # the ranks' code, `run(ctx)`; imported in the ranks only
    modes: tuple[ModeSpec, ...]  # the first is the default
    default_after_free: str
    dims: type  # the [model] table: a dataclass whose defaults are valid dims
    default_preset: str = ""  # real dims, used on CUDA; "": none, the dims' defaults
    cpu_preset: str = ""  # tiny dims, used when no GPU is present and none was named
    run_keys: tuple[RunKeySpec, ...] = ()
    tensor_parallel: bool = True  # False: one rank only; the command has no --tp
    help: str = ""  # the CLI command's help
    steps_help: str = ""  # --steps help: what one step of this scenario does
    command: bool = True  # gets a generated scenario command; False: run through matrices only
    # Common [run] keys the scenario's code never reads (e.g. guard, without a graph): its
    # command leaves their flags off rather than offer a flag that does nothing.
    unused_run_keys: tuple[str, ...] = ()
    cpu_cost: CpuCost | None = None  # its real-dims preset timed on CPU: the estimate said up front
    # validate(model, run, check): the dims' rules, in order (a rule may assume those before it
    # hold); it may fill a run key's "0: the scenario's default" first.
    validate: Callable[[Any, Any, Check], None] = no_rules
    # expectation(run): the expected outcome where a mode's usual one does not hold, else "".
    expectation: Callable[[Any], str] = usual_expectation
    # footprint(model, tp): a lower bound of one rank's memory in bytes (repro/run/footprint.py).
    footprint: Callable[[Any, int], int] = no_footprint
    # peak(model, run): the device memory one rank is expected to reach, in bytes, where it is
    # well above the footprint (graph pools that keep what every capture allocated); `repro
    # matrix --jobs N` packs concurrent CUDA trials by it (repro/run/ledger.py). None: the footprint.
    peak: Callable[[Any, Any], int] | None = None
    record_fields: tuple[RecordField, ...] = ()
    # measure(steps): the record fields' values from the trial's step records; {} when unmeasured.
    measure: Callable[[list[Any]], dict[str, Any]] = no_measures
    step_columns: tuple[StepColumn, ...] = ()
    # report_lines(trial): sentences under the verdict, on what the trial's numbers mean.
    report_lines: Callable[[Any], list[str]] = no_lines
    # chart(steps): the HTML report's chart (ChartData, below), or why there is none
    # (a str); None: the scenario has no chart.
    chart: Callable[[list[Any]], Any] | None = None

    @property
    def mode_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.modes)

    @property
    def run_key_names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.run_keys)

    def mode_help(self) -> str:
        return "; ".join(f"{m.name}: {m.help}" for m in self.modes) + "."


# -- what a spec's chart() gives the HTML report (repro/report/charts.py lays it out as SVG) --


class ChartKind(StrEnum):
    LINE = "line"  # one polyline per series, a mark per point
    BAR = "bar"  # one bar per x value


@dataclass
class Series:
    name: str
    points: list[tuple[Any, float | None]]  # (x, y); y None: not finite


@dataclass
class ChartData:
    title: str
    caption: str
    kind: ChartKind
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
