"""piecewise-split's facts for the parent: dims, modes, rules, footprint, the split op's numbers
in the steps table and what the report says about them.

Torch-free (the parent imports it); the ranks' code is repro/scenarios/piecewise_split.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from repro.outcome import Outcome, TrialRecord
from repro.scenarios.spec import ITEMSIZE, Check, ModeSpec, ScenarioSpec, StepColumn


@dataclass
class DecoderDims:
    """A Llama-style decoder in the shape of a real model; see repro/configs/llama3-8b.toml for sources."""

    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 14336
    vocab_size: int = 128256
    rope_theta: float = 500000.0
    # KV-cache positions per sequence: the first half is the prompt, decode steps append after it.
    context_len: int = 256
    # Captured decode batch sizes, a subset of vLLM's defaults (1, 2, 4, then multiples of 8).
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128])
    dtype: str = "bfloat16"


def validate(m: DecoderDims, r: Any, check: Check) -> None:
    for key in (
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
    ):
        check(getattr(m, key) >= 1, "", f"model.{key} = {getattr(m, key)} must be >= 1")
    check(
        m.num_heads % m.num_kv_heads == 0,
        "",
        f"model.num_heads = {m.num_heads} is not a multiple of model.num_kv_heads = {m.num_kv_heads} "
        "(grouped-query attention shares each KV head among num_heads / num_kv_heads query heads)",
    )
    check(
        m.head_dim % 2 == 0,
        "",
        f"model.head_dim = {m.head_dim} must be even (rotary embedding rotates the two halves of each head)",
    )
    check(m.rope_theta > 1, "", f"model.rope_theta = {m.rope_theta} must be > 1")
    check(m.context_len >= 2, "", f"model.context_len = {m.context_len} must be >= 2 (a prompt half and a decode half)")
    bs = m.batch_sizes
    check(
        bool(bs) and all(isinstance(b, int) and b >= 1 for b in bs) and bs == sorted(set(bs)),
        "",
        f"model.batch_sizes = {bs} must be positive, strictly increasing integers",
    )


def footprint(m: DecoderDims, tp: int) -> int:
    """The weights (embedding, lm_head, final norm; per layer qkv, o, gate_up, down and two norms),
    the KV cache at the largest batch, and that batch's logits; the pieces' activations and the
    eager reference's are small beside them."""
    h, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * m.intermediate_size + 2 * h
    weights = 2 * m.vocab_size * h + h + m.num_layers * per_layer
    cache = 2 * m.num_layers * max(m.batch_sizes) * m.context_len * kv
    logits = max(m.batch_sizes) * m.vocab_size
    return (weights + cache + logits) * ITEMSIZE[m.dtype]


# The split op's side of each step: how many of its outputs were not where the next piece's
# graph reads, and what the tokens showed.
STEP_COLUMNS = (StepColumn("moved", "moved", drop=2), StepColumn("wrong_tokens", "wrong tok", drop=1))


def split_lines(trial: TrialRecord) -> list[str]:
    """Where the split op's outputs were, and what an engine would show."""
    steps = [s for s in trial.steps if "moved" in s.extra]
    if not steps:
        return []
    calls = sum(s.extra["split_calls"] for s in steps)
    moved = sum(s.extra["moved"] for s in steps)
    tokens = sum(s.batch for s in steps)
    wrong = sum(s.extra["wrong_tokens"] for s in steps)
    where = (
        f"Split op: {moved} of {calls} outputs were not at the address the next piece captured; "
        f"{wrong} of {tokens} greedy tokens differed from eager decoding."
    )
    if not trial.graph_replayed:
        return [
            where + " CPU: no piece was replayed, so no piece read a stale address; the guard's "
            "findings name what a replay would read."
        ]
    if trial.outcome in (Outcome.MISMATCH, Outcome.NONFINITE):
        view = (
            "An engine would show wrong tokens and no error (vLLM checks piece input addresses only "
            "with VLLM_LOGGING_LEVEL=DEBUG)."
        )
    elif trial.outcome is Outcome.STALE_CAPTURE and moved == 0:
        view = (
            "Every fresh output landed on its freed capture-time block, so each replay read this step's "
            "values by accident: latent until another allocation takes that block."
        )
    elif trial.outcome is Outcome.CLEAN:
        view = "Every piece read this step's output."
    else:
        view = ""
    return [f"{where} {view}".rstrip()]


SPEC = ScenarioSpec(
    name="piecewise-split",
    module="repro.scenarios.piecewise_split",
    modes=(
        ModeSpec(
            "unfixed", {"static_output": False}, "the split op returns a fresh tensor every call (vLLM #53915, #37363)"
        ),
        ModeSpec("fixed", {"static_output": True}, "it writes into a static buffer per batch size"),
    ),
    default_after_free="reuse",
    dims=DecoderDims,
    default_preset="llama3-8b",
    cpu_preset="llama-tiny",
    tensor_parallel=False,  # vLLM splits the same way at any TP; one rank shows it
    help="Piecewise CUDA graphs around an eager split op (attention) whose output is a fresh tensor every "
    "step (vLLM #53915, #37363).",
    steps_help="Decode steps: each replays the pieces of the step's batch size, the split op running eagerly "
    "between them, and compares hidden states and greedy tokens with eager decoding.",
    validate=validate,
    footprint=footprint,
    step_columns=STEP_COLUMNS,
    report_lines=split_lines,
)
