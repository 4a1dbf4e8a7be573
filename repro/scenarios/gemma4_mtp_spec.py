"""gemma4-mtp's facts for the parent: dims, modes, run keys, rules, expectation, footprint, the
speculative-decoding numbers of its records and what the report says about them.

Torch-free (the parent imports it); the ranks' code is repro/scenarios/gemma4_mtp.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from repro.outcome import Outcome, StepRecord, TrialRecord
from repro.scenarios.spec import (
    ChartData,
    ChartKind,
    Check,
    CpuCost,
    ITEMSIZE,
    ModeSpec,
    RecordField,
    RunKeySpec,
    ScenarioSpec,
    Series,
)

# vLLM's Gemma 4 examples draft 1 token per step, which never feeds a draft back into the
# drafter; 3 feeds it back twice per step, the path where a wrong draft poisons the rest.
DEFAULT_NUM_SPECULATIVE_TOKENS = 3
MAX_SPECULATIVE_TOKENS = 16

FP32 = 4
INT64 = 8
PAD_TO = 64  # gemma4_mtp pads the vocab to a multiple of 64 * tp


@dataclass
class Gemma4Dims:
    """Gemma 4 assistant (MTP drafter) dimensions; see repro/configs/gemma4-e2b.toml for sources."""

    vocab_size: int = 262144
    hidden_size: int = 256  # draft hidden; the centroid head and lm_head act on it
    backbone_hidden_size: int = 1536  # recorded for the report; the drafter head does not use it
    num_centroids: int = 2048
    centroid_top_k: int = 32
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    dtype: str = "bfloat16"


def validate(m: Gemma4Dims, r: Any, check: Check) -> None:
    validate_dims(m, r, check)
    if r.num_speculative_tokens == 0:
        r.num_speculative_tokens = DEFAULT_NUM_SPECULATIVE_TOKENS
    check(
        1 <= r.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
        "num_speculative_tokens",
        f"num_speculative_tokens = {r.num_speculative_tokens} must be between 1 and {MAX_SPECULATIVE_TOKENS}",
    )


def validate_dims(m: Gemma4Dims, r: Any, check: Check) -> None:
    """The drafter's and target's dims rules (every scenario built on them)."""
    for key in ("vocab_size", "hidden_size", "num_centroids", "centroid_top_k"):
        check(getattr(m, key) >= 1, "", f"model.{key} = {getattr(m, key)} must be >= 1")
    check(
        m.vocab_size % m.num_centroids == 0,
        "",
        f"model.vocab_size = {m.vocab_size} is not divisible by model.num_centroids = {m.num_centroids}; "
        "token_ordering views the vocab as [num_centroids, vocab/num_centroids]",
    )
    check(
        m.centroid_top_k <= m.num_centroids,
        "",
        f"model.centroid_top_k = {m.centroid_top_k} exceeds model.num_centroids = {m.num_centroids}",
    )
    bs = m.batch_sizes
    check(
        bool(bs) and all(b >= 1 for b in bs) and bs == sorted(set(bs)),
        "",
        f"model.batch_sizes = {bs} must be positive, strictly increasing integers",
    )
    check(r.tp <= m.vocab_size, "", f"tp = {r.tp} exceeds model.vocab_size = {m.vocab_size}")
    check(
        m.backbone_hidden_size >= m.hidden_size,
        "",
        f"model.backbone_hidden_size = {m.backbone_hidden_size} is smaller than model.hidden_size = "
        f"{m.hidden_size}; the drafter reads its hidden state from the target's backbone state",
    )


def expectation(r: Any) -> str:
    if r.mode == "unfixed" and r.tp == 1:
        return "clean"  # TP=1 takes a slice view of a live parameter: safe upstream too
    if r.mode == "fixed" and r.reload_drafter and r.tp > 1:
        return "reproduced"  # upstream's fix drops the cache on reload: the bug returns
    return ""


def footprint(m: Gemma4Dims, tp: int) -> int:
    """Per rank. Building the lm_head shard holds the padded full head in the model dtype and
    the fp32 random rows; a forward holds the full head and, at the largest batch, the
    gathered candidate rows [B, K*V/C, H] in the model dtype and in fp32."""
    item = ITEMSIZE[m.dtype]
    unit = PAD_TO * tp
    v_pad = (m.vocab_size + unit - 1) // unit * unit
    build = v_pad * m.hidden_size * item + m.vocab_size * m.hidden_size * FP32
    candidates = m.centroid_top_k * (m.vocab_size // m.num_centroids)
    forward = m.vocab_size * m.hidden_size * item + max(m.batch_sizes) * candidates * m.hidden_size * (item + FP32)
    return max(build, forward) + m.vocab_size * INT64  # + token_ordering


# Speculative decoding, over every recorded step of rank 0 (the ranks verify the same drafts).
RECORD_FIELDS = (
    RecordField("acceptance_rate", "accepted drafts / proposed drafts", column="accept", fmt=".0%"),
    RecordField("mean_accepted_length", "tokens emitted per target pass, bonus included"),
    RecordField("lossless", "emitted == target-only greedy decoding, every step"),
    RecordField("tokens_per_s", "emitted tokens / decode-loop seconds (propose + verify)"),
)


def measure(steps: list[StepRecord]) -> dict[str, Any]:
    """Trial-level acceptance, accepted length, lossless and tokens/s from the step records
    (rank 0: the ranks verify the same drafts); {} when no step measured them."""
    mine = [s for s in steps if s.rank == 0 and "proposed" in s.extra]
    if not mine:
        return {}
    proposed = sum(s.extra["proposed"] for s in mine)
    emitted = sum(s.extra["emitted"] for s in mine)
    seconds = sum(s.seconds for s in mine)
    return {
        "acceptance_rate": sum(s.extra["accepted"] for s in mine) / proposed if proposed else 0.0,
        "mean_accepted_length": emitted / sum(s.extra["passes"] for s in mine),
        "lossless": all(s.extra["lossless"] for s in mine),
        "tokens_per_s": emitted / seconds if seconds > 0 else None,
    }


def report_lines(trial: TrialRecord) -> list[str]:
    """The loop's numbers and, in one sentence, what an engine would show."""
    from repro.report.fmt import fmt_rate  # here: the report package imports the registry

    crashed = trial.outcome in (Outcome.ILLEGAL_ADDRESS, Outcome.DEVICE_ASSERT)
    m = trial.measures
    if m.get("acceptance_rate") is None:
        return (
            [
                "Speculative decoding: an engine would crash here (the CUDA error is sticky: the "
                "worker, and with it the engine, dies)."
            ]
            if crashed
            else []
        )
    tps = f", {fmt_rate(m['tokens_per_s'])} tokens/s" if m.get("tokens_per_s") else ""
    numbers = (
        f"Speculative decoding: acceptance {m['acceptance_rate']:.1%}, mean accepted length "
        f"{m['mean_accepted_length']:.2f}, lossless {'yes' if m.get('lossless') else 'NO'}{tps}."
    )
    if not m.get("lossless"):
        view = "The emitted text differs from target-only greedy decoding: a bug in the loop itself."
    elif crashed:
        view = "An engine would crash (the CUDA error is sticky: the worker, and with it the engine, dies)."
    elif trial.outcome in (Outcome.MISMATCH, Outcome.NONFINITE):
        view = (
            "An engine would show the same text and no error, only this acceptance "
            "(garbage drafts are rejected): lost throughput, silently."
        )
    elif trial.outcome is Outcome.STALE_CAPTURE:
        view = (
            "An engine would show nothing yet: the drafts are still right until the freed memory "
            "is reused (then an acceptance drop, or a crash)."
        )
    else:
        view = "An engine would show this acceptance and the same text as without a drafter."
    return [f"{numbers} {view}"]


def graph_mismatch_chart(steps: list[StepRecord]) -> Any:
    """Share of draft tokens that differ from the reference, per captured batch size (a
    ChartData), or why there is no chart (a str)."""

    totals: dict[str, list[int]] = {}
    order: dict[str, int] = {}
    for s in steps:
        mismatched, compared = totals.setdefault(s.label, [0, 0])
        totals[s.label] = [mismatched + s.mismatches, compared + s.compared]
        order[s.label] = min(order.get(s.label, s.batch), s.batch)
    # All zero is said by the table already; the chart earns its place when graphs differ.
    if len(totals) < 2:
        return "one graph size only: the steps table says it all"
    if not any(m for m, _ in totals.values()):
        return "no draft token differed from the reference in any graph (every bar would be 0)"
    labels = sorted(totals, key=lambda k: (order[k], k))
    points = [(k, totals[k][0] / totals[k][1] if totals[k][1] else None) for k in labels]
    return ChartData(
        title="Draft tokens that differ from the reference, per batch size (one captured graph each)",
        caption="mismatched / compared tokens over all steps and ranks that used the graph",
        kind=ChartKind.BAR,
        x_label="graph",
        y_label="mismatched share",
        series=[Series("", points)],
    )


SPEC = ScenarioSpec(
    name="gemma4-mtp",
    module="repro.scenarios.gemma4_mtp",
    modes=(
        ModeSpec(
            "unfixed",
            {"cache_gathered": False, "refresh_cache_on_reload": False},
            "gathered lm_head in a local (before vLLM #43909)",
        ),
        ModeSpec("fixed", {"cache_gathered": True, "refresh_cache_on_reload": False}, "cached on the module (#43909)"),
        ModeSpec(
            "reload-safe",
            {"cache_gathered": True, "refresh_cache_on_reload": True},
            "cache refreshed in place on reload",
        ),
    ),
    default_after_free="release",
    dims=Gemma4Dims,
    default_preset="gemma4-e2b",
    cpu_preset="gemma4-tiny",
    # At TP 2, 2026-12-01: all 14 steps in 94 s on a quiet machine (build 19 s, a step 3-28 s);
    # under load 5 steps in 180 s (set-up 60 s, a step 10-32 s).
    cpu_cost=CpuCost("gemma4-e2b", setup_s=(20, 60), step_s=(3, 32)),
    run_keys=(
        RunKeySpec(
            "reload_drafter",
            "--reload-drafter/--no-reload-drafter",
            "Reload drafter weights after capture and keep replaying (RL-style lifecycle).",
            tag="reload",
            after="forensics",
        ),
        RunKeySpec(
            "num_speculative_tokens",
            "--num-speculative-tokens",
            "Drafts per decode step, each fed back into the drafter (vLLM's Gemma 4 examples "
            "use 1, which never feeds a draft back); 0: the default.",
            type=int,
            default=str(DEFAULT_NUM_SPECULATIVE_TOKENS),
            after="forensics",
        ),
    ),
    help="Gemma 4 MTP speculative decoding (propose, verify, accept) under the drafter's per-batch-size "
    "centroid CUDA graphs (vLLM #43909).",
    steps_help="Decode steps: each drafts k tokens per sequence through the centroid graph of the step's "
    "batch size, then the target verifies them.",
    validate=validate,
    expectation=expectation,
    footprint=footprint,
    record_fields=RECORD_FIELDS,
    measure=measure,
    report_lines=report_lines,
    chart=graph_mismatch_chart,
)
