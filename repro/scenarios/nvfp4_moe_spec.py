"""nvfp4-reload's facts for the parent: dims, modes, run keys, rules, expectation, footprint,
its scaled-error column and its chart.

Torch-free (the parent imports it); the ranks' code is repro/scenarios/nvfp4_moe.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from repro.outcome import StepRecord
from repro.scenarios.spec import (
    ChartData,
    ChartKind,
    Check,
    CpuCost,
    ITEMSIZE,
    ModeSpec,
    RunKeySpec,
    ScenarioSpec,
    Series,
    StepColumn,
    number,
)

NVFP4_BYTES = 0.5 + 1 / 16  # packed E2M1 codes + one E4M3 scale per 16 elements


@dataclass
class MoeDims:
    """One MoE layer (router + experts) in the shape of a real model."""

    num_experts: int = 128
    hidden_size: int = 2048
    intermediate_size: int = 768
    top_k: int = 8
    tokens: int = 64  # tokens per replay (decode batch)
    dtype: str = "bfloat16"


def validate(m: MoeDims, r: Any, check: Check) -> None:
    for key in ("num_experts", "hidden_size", "intermediate_size", "top_k", "tokens"):
        check(getattr(m, key) >= 1, "", f"model.{key} = {getattr(m, key)} must be >= 1")
    for key in ("hidden_size", "intermediate_size"):
        check(
            getattr(m, key) % 16 == 0,
            "",
            f"model.{key} = {getattr(m, key)} is not a multiple of 16 (the NVFP4 block size along K)",
        )
    check(m.top_k <= m.num_experts, "", f"model.top_k = {m.top_k} exceeds model.num_experts = {m.num_experts}")


def expectation(r: Any) -> str:
    if r.mode == "kernel-reuse":
        return "clean" if r.identity_reload else "MISMATCH"
    return ""


def footprint(m: MoeDims, tp: int) -> int:
    """A reload holds the new BF16 checkpoint, the re-materialised BF16 parameters, the live
    kernel's dequantised workspaces and the NVFP4 experts at once (measured peak on CPU:
    ~16 bytes per expert weight element; this counts 6.6)."""
    elements = m.num_experts * 3 * m.intermediate_size * m.hidden_size  # w13 [E, 2I, D] + w2 [E, D, I]
    return int(elements * (3 * ITEMSIZE[m.dtype] + NVFP4_BYTES))


# The verdict measure, |y - y_cold| / (|y_cold| + rms(y_cold)); its chart's axis.
STEP_COLUMNS = (StepColumn("max_scaled_err", "scaled err", drop=2),)


def reload_error_chart(steps: list[StepRecord]) -> Any:
    """The warm layer's error against a cold build of the same weights, per reload (the steps
    table's "scaled err" column): a ChartData, or why there is no chart (a str)."""
    # Imported here: the report layer brings rich along, and the registry (which imports this
    # module) is read by every process, ranks included.
    from repro.report.fmt import fmt_float

    if len({s.step for s in steps}) < 2:
        return "a single reload: the steps table says it all"
    scaled = all("max_scaled_err" in s.extra for s in steps)
    values = [number(s.extra["max_scaled_err"] if scaled else s.rel_err) for s in steps]
    if all(v == 0 for v in values):
        return "the error was 0 at every reload (a flat line says nothing the table does not)"
    series: dict[int, Series] = {}
    for s in sorted(steps, key=lambda s: (s.rank, s.step)):
        y = s.extra["max_scaled_err"] if scaled else s.rel_err
        series.setdefault(s.rank, Series(f"rank {s.rank}", [])).points.append((s.step, number(y)))
    tolerance = next((s.tolerance for s in steps if s.tolerance is not None), None)
    return ChartData(
        # "warm": the layer reloaded in place (replayed on GPU, run eagerly on CPU); the title
        # must hold for both.
        title="Error per reload: warm layer (reloaded in place) against cold (built fresh on the same weights)",
        caption=(
            "max scaled error |y - y_cold| / (|y_cold| + rms(y_cold)); above the tolerance line an "
            "element counts as a mismatch"
            if scaled
            else "relative error against the cold reference"
        ),
        kind=ChartKind.LINE,
        x_label="reload",
        y_label="scaled err" if scaled else "rel err",
        series=list(series.values()) if len(series) > 1 else [Series("", next(iter(series.values())).points)],
        threshold=tolerance if scaled else None,
        threshold_label=f"tolerance {fmt_float(tolerance)}",
    )


SPEC = ScenarioSpec(
    name="nvfp4-reload",
    module="repro.scenarios.nvfp4_moe",
    modes=(
        ModeSpec(
            "unfixed", {"reuse_kernel": False, "refresh_alphas": False}, "kernel rebuilt every reload (before #50074)"
        ),
        ModeSpec("kernel-reuse", {"reuse_kernel": True, "refresh_alphas": False}, "built once (#50074)"),
        ModeSpec(
            "fixed", {"reuse_kernel": True, "refresh_alphas": True}, "built once + alphas refreshed (#50074 + #57954)"
        ),
    ),
    default_after_free="poison",
    dims=MoeDims,
    default_preset="qwen3-30b-a3b-moe",
    cpu_preset="moe-tiny",
    # 2026-12-01, 2 cores under load: set-up (build + capture) 74-150 s, a reload step 228-304 s
    # (quantising 128 experts, the replay and the reference; pauses of 2-3 min without a record);
    # 2 steps took 12 min. The step's range is that widened by half either way.
    cpu_cost=CpuCost("qwen3-30b-a3b-moe", setup_s=(70, 150), step_s=(150, 460)),
    run_keys=(
        RunKeySpec(
            "identity_reload",
            "--identity-reload/--changing-reload",
            "Reload the same weights every step (hides #57954).",
            tag="identity",
        ),
    ),
    tensor_parallel=False,  # expert parallelism is not modelled
    help="NVFP4 MoE layer under a captured graph, reloaded with new BF16 weights (vLLM #50074, #57954).",
    steps_help="Reload steps: each loads new weights, then replays the captured MoE layer once.",
    validate=validate,
    expectation=expectation,
    footprint=footprint,
    step_columns=STEP_COLUMNS,
    chart=reload_error_chart,
)
