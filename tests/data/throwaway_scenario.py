"""A whole scenario in one file: what tests/test_throwaway_scenario.py registers through the
`repro.scenarios` entry-point group to show that a scenario touches no other file.

The bug it stands for: from step 1 on, the unfixed mode adds 1 to every element (a buffer
read after it was refilled). Its spec carries every fact a scenario can own: modes, a run
key, dims and their rule, an expectation of its own, a footprint, a record field with a
summary column, a steps-table column, a report line and a chart. It names no preset, so its
trials run on its dims' defaults.

The parent imports this module for SPEC, so torch is imported inside `run`, in the ranks only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from repro.outcome import StepRecord
from repro.scenarios.spec import ChartData, ModeSpec, RecordField, RunKeySpec, ScenarioSpec, Series, StepColumn


@dataclass
class ThrowawayDims:
    size: int = 8
    dtype: str = "float32"


def validate(m: ThrowawayDims, r: Any, check: Any) -> None:
    check(m.size >= 1, "", f"model.size = {m.size} must be >= 1")


def expectation(r: Any) -> str:
    if r.hide_bug:
        return "clean"
    return "MISMATCH" if r.mode == "unfixed" else ""


def footprint(m: ThrowawayDims, tp: int) -> int:
    return m.size * 4 * 2  # the output and the reference, float32


def measure(steps: list[StepRecord]) -> dict[str, Any]:
    return {"wrong_total": sum(s.mismatches for s in steps)}


def report_lines(trial: Any) -> list[str]:
    total = trial.measures.get("wrong_total")
    return [] if total is None else [f"Throwaway: {total} elements differed from the reference."]


def chart(steps: list[StepRecord]) -> Any:

    if not any(s.mismatches for s in steps):
        return "no element differed at any step"
    return ChartData(
        title="Wrong elements per step",
        caption="throwaway",
        kind="bar",
        x_label="step",
        y_label="wrong",
        series=[Series("", [(s.step, float(s.mismatches)) for s in steps])],
    )


def run(ctx: Any) -> None:
    import torch

    fixes = MODES[ctx.cfg.run.mode]
    for step in range(ctx.cfg.run.steps):
        ctx.begin_step(step)
        x = torch.arange(ctx.cfg.model.size, dtype=torch.float32) + step
        bug = 0.0 if fixes["correct"] or ctx.cfg.run.hide_bug or step == 0 else 1.0
        out = x * 2 + bug
        wrong = int((out != x + x).sum())
        ctx.step(
            StepRecord(
                step=step,
                rank=ctx.rank,
                batch=x.numel(),
                replayed=False,
                numel=out.numel(),
                compared=out.numel(),
                mismatches=wrong,
                label="double",
                extra={"offset": bug},
            )
        )


SPEC = ScenarioSpec(
    name="throwaway",
    module=__name__,
    modes=(
        ModeSpec("unfixed", {"correct": False}, "off by one from step 1"),
        ModeSpec("fixed", {"correct": True}, "right at every step"),
    ),
    default_after_free="keep",
    dims=ThrowawayDims,
    tensor_parallel=False,
    run_keys=(RunKeySpec("hide_bug", "--hide-bug/--show-bug", "Take the path that hides the bug.", tag="hidden"),),
    help="A throwaway scenario defined in one test file.",
    steps_help="Steps: each doubles a vector.",
    validate=validate,
    expectation=expectation,
    footprint=footprint,
    record_fields=(RecordField("wrong_total", "elements that differed, over every step", column="wrong", fmt="d"),),
    measure=measure,
    step_columns=(StepColumn("offset", "offset"),),
    report_lines=report_lines,
    chart=chart,
)

MODES = {m.name: m.fixes for m in SPEC.modes}
