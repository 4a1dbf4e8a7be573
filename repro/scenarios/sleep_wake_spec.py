"""sleep-wake's facts for the parent: modes, the sleep level, rules, expectation, footprint, the
acceptance before the sleep and after the wake, and what the report says about them.

The dims are gemma4-mtp's (the same drafter and target stand-in); so are the speculative-decoding
record fields (acceptance_rate, mean_accepted_length, lossless, tokens_per_s: every trial carries
them), which sleep-wake fills from the steps after the wake. Torch-free (the parent imports it);
the ranks' code is repro/scenarios/sleep_wake.py.
"""

from __future__ import annotations

from typing import Any

from repro.outcome import StepRecord, TrialRecord
from repro.scenarios import gemma4_mtp_spec as gemma4
from repro.scenarios.gemma4_mtp_spec import FP32, PAD_TO, Gemma4Dims
from repro.scenarios.spec import ChartData, ChartKind, Check, CpuCost, ModeSpec, RunKeySpec, ScenarioSpec, Series

SLEEP_LEVELS = {
    1: "KV-cache pool discarded, weights copied to host and back",
    2: "weights discarded too, reloaded at wake",
}
DEFAULT_SLEEP_LEVEL = 1
# Drafts per step: #53508's reproduction ran MTP with num_speculative_tokens=3 (and the loop is
# gemma4-mtp's, whose default it is).
NUM_SPECULATIVE_TOKENS = gemma4.DEFAULT_NUM_SPECULATIVE_TOKENS


def validate(m: Gemma4Dims, r: Any, check: Check) -> None:
    gemma4.validate_dims(m, r, check)
    if r.sleep_level == 0:
        r.sleep_level = DEFAULT_SLEEP_LEVEL
    check(
        r.sleep_level in SLEEP_LEVELS,
        "sleep_level",
        f"sleep_level = {r.sleep_level} is not a vLLM sleep level; use "
        + " or ".join(f"{level} ({what})" for level, what in SLEEP_LEVELS.items()),
    )


def expectation(r: Any) -> str:
    if r.mode == "rebuild":
        return "reproduced"  # #53197's bug: the graphs read the layout the wake freed
    return ""


def footprint(m: Gemma4Dims, tp: int) -> int:
    """Per rank: gemma4-mtp's drafter bound plus the target stand-in's vocab-parallel head
    [V_pad / tp, backbone_hidden] fp32 (the checkpoint reload_weights reads is in host memory)."""
    unit = PAD_TO * tp
    v_pad = (m.vocab_size + unit - 1) // unit * unit
    return gemma4.footprint(m, tp) + v_pad // tp * m.backbone_hidden_size * FP32


def after_wake(steps: list[StepRecord]) -> list[StepRecord]:
    return [s for s in steps if s.extra.get("after_wake")]


def before_sleep(steps: list[StepRecord]) -> list[StepRecord]:
    return [s for s in steps if "after_wake" in s.extra and not s.extra["after_wake"]]


def measure(steps: list[StepRecord]) -> dict[str, Any]:
    """gemma4-mtp's speculative-decoding numbers over the steps after the wake."""
    return gemma4.measure(after_wake(steps))


def report_lines(trial: TrialRecord) -> list[str]:
    """Acceptance before the sleep against after the wake, then gemma4-mtp's lines on the steps
    after the wake (what an engine would show)."""
    level = trial.config.get("run", {}).get("sleep_level")
    before = gemma4.measure(before_sleep(trial.steps))
    if not before:
        head = f"Sleep level {level} before the first decode step: no step ran before it."
    else:
        head = (
            f"Sleep level {level} after {trial.details.get('sleep_before_step')} decode steps: before it, "
            f"acceptance {before['acceptance_rate']:.1%}, mean accepted length "
            f"{before['mean_accepted_length']:.2f}. After the wake:"
        )
    return [head, *gemma4.report_lines(trial)]


def acceptance_chart(steps: list[StepRecord]) -> Any:
    """Acceptance per decode step (rank 0), before the sleep and after the wake: a ChartData, or
    why there is no chart (a str)."""

    mine = [s for s in steps if s.rank == 0 and "acceptance_rate" in s.extra]
    if len(mine) < 2:
        return "a single decode step: the steps table says it all"
    parts = (("before the sleep", before_sleep(mine)), ("after the wake", after_wake(mine)))
    series = [Series(name, [(s.step, s.extra["acceptance_rate"]) for s in part]) for name, part in parts if part]
    return ChartData(
        title="Draft acceptance per decode step, before the sleep and after the wake",
        caption="accepted / proposed drafts of each step (rank 0: the ranks verify the same drafts)",
        kind=ChartKind.LINE,
        x_label="decode step",
        y_label="acceptance",
        series=series,
    )


SPEC = ScenarioSpec(
    name="sleep-wake",
    module="repro.scenarios.sleep_wake",
    modes=(
        ModeSpec(
            "unfixed",
            {"restore_layout": False, "layout_in_place": False, "reload_draft_weights": False},
            "the wake leaves the discarded layout as it is, reload_weights loads the target only "
            "(before #53508 / #52487)",
        ),
        ModeSpec(
            "rebuild",
            {"restore_layout": True, "layout_in_place": False, "reload_draft_weights": True},
            "post_kv_cache_wake_up rebuilds the layout as new tensors, the graphs keep the old (before #53197)",
        ),
        ModeSpec(
            "fixed",
            {"restore_layout": True, "layout_in_place": True, "reload_draft_weights": True},
            "the layout refreshed in place (#53197), the draft weights reloaded (#52487)",
        ),
    ),
    # reuse: memory pressure after the wake (#53197's setting); it acts only where the wake freed
    # what a graph reads (rebuild); the other modes free nothing.
    default_after_free="reuse",
    dims=Gemma4Dims,
    default_preset="sleep-wake-e2b",
    cpu_preset="sleep-wake-tiny",
    # 2026-12-01, 2 cores shared with other work: 14 steps at TP 1 in 149 s (set-up 17 s, a step
    # 1.6-31 s, the batch of 64 the slowest); one run, so both ends widened for load.
    cpu_cost=CpuCost("sleep-wake-e2b", setup_s=(15, 50), step_s=(1.5, 40)),
    run_keys=(
        RunKeySpec(
            "sleep_level",
            "--sleep-level",
            "vLLM sleep level: " + "; ".join(f"{k}: {v}" for k, v in SLEEP_LEVELS.items()) + "; 0: the default.",
            tag="level",
            type=int,
            default=str(DEFAULT_SLEEP_LEVEL),
        ),
    ),
    help="Speculative decoding across a sleep and wake: the draft graphs read block-table layout metadata and "
    "draft weights the sleep discards at the same addresses (vLLM #53197, #53508, #52487).",
    steps_help="Decode steps, half before the sleep and half after the wake: each drafts "
    f"{NUM_SPECULATIVE_TOKENS} tokens per sequence through the draft graph of the step's batch size, "
    "then the target verifies them.",
    validate=validate,
    expectation=expectation,
    footprint=footprint,
    measure=measure,
    report_lines=report_lines,
    chart=acceptance_chart,
)
