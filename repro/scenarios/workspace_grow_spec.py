"""workspace-grow's facts for the parent: dims, modes, the resize_() switch, rules, footprint, the
workspace's byte layout, its step columns and what the report says about a trial.

Torch-free (the parent imports it); the ranks' code is repro/scenarios/workspace_grow.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from repro.outcome import Outcome, TrialRecord
from repro.scenarios.spec import ITEMSIZE, Check, ModeSpec, RunKeySpec, ScenarioSpec, StepColumn
from repro.units import format_bytes

ALIGN = 256  # vLLM's WorkspaceManager.get_simultaneous aligns every view to 256 bytes
MIB = 1 << 20


class GrowthKind(StrEnum):
    """How the workspace's arena grew (workspace_grow.Growth.how), as the trial's details say."""

    ALLOCATE = "allocate"  # the first request: nothing to free
    REPLACE = "replace"  # del, empty_cache(), torch.empty (vLLM #55336)
    RESIZE = "resize_"  # resize_() in place: the storage stays, its memory moves (FlashInfer #4398)


def vllm_capture_sizes(largest: int) -> list[int]:
    """vLLM's default cudagraph_capture_sizes up to `largest` (vllm/config: [1, 2, 4], then every
    8 below 256, then every 16 from 256); largest 512 is min(2 * max_num_seqs, 512) at the
    default max_num_seqs 256: 51 sizes, captured in ascending order (#46067)."""
    sizes = [s for s in (1, 2, 4) if s <= largest]
    sizes += list(range(8, min(largest + 1, 256), 8))
    sizes += list(range(256, largest + 1, 16))
    return sizes


@dataclass
class WorkspaceDims:
    """TurboQuant's split-KV decode attention (vLLM #45670) at Llama-3.1-70B's per-rank shape at
    TP 2; repro/configs/turboquant-decode.toml says where each number comes from."""

    num_heads: int = 32  # query heads per rank
    num_kv_heads: int = 4  # KV heads per rank (GQA)
    head_size: int = 128
    num_kv_splits: int = 32  # vLLM tq_max_kv_splits_for_cuda_graph: fixed, so the grid is too
    max_seq_len: int = 1024  # KV tokens per sequence (ours: the KV cache holds this many)
    capture_sizes: list[int] = field(default_factory=lambda: vllm_capture_sizes(512))
    initial_workspace_mib: int = 32  # the arena before any request (FlashInfer's default; vLLM's: 0)
    dtype: str = "bfloat16"


def decode_workspace_views(m: WorkspaceDims, batch: int) -> tuple[tuple[tuple[int, ...], str], ...]:
    """The decode's scratch views, as TurboQuant asks the workspace for them (#46067):
    mid_o [B, Hq, S, D+1] (each split's output and log-sum-exp), output [B, Hq, D], lse [B, Hq]."""
    h, s, d = m.num_heads, m.num_kv_splits, m.head_size
    return (((batch, h, s, d + 1), "float32"), ((batch, h, d), "float32"), ((batch, h), "float32"))


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def workspace_bytes(m: WorkspaceDims, batch: int) -> int:
    """Bytes the arena must hold for a decode of `batch` sequences (every view 256-aligned)."""
    total = 0
    for shape, dtype in decode_workspace_views(m, batch):
        n = ITEMSIZE[dtype]
        for extent in shape:
            n *= extent
        total += round_up(n, ALIGN)
    return total


def validate(m: WorkspaceDims, r: Any, check: Check) -> None:
    for key in ("num_heads", "num_kv_heads", "head_size", "num_kv_splits", "max_seq_len"):
        check(getattr(m, key) >= 1, "", f"model.{key} = {getattr(m, key)} must be >= 1")
    check(m.initial_workspace_mib >= 0, "", f"model.initial_workspace_mib = {m.initial_workspace_mib} must be >= 0")
    check(
        m.num_heads % m.num_kv_heads == 0,
        "",
        f"model.num_heads = {m.num_heads} is not a multiple of model.num_kv_heads = {m.num_kv_heads} "
        "(each KV head serves a whole group of query heads)",
    )
    check(
        m.max_seq_len % m.num_kv_splits == 0,
        "",
        f"model.max_seq_len = {m.max_seq_len} is not a multiple of model.num_kv_splits = {m.num_kv_splits} "
        "(the decode cuts the KV cache into that many equal splits)",
    )
    bs = m.capture_sizes
    check(
        bool(bs) and all(b >= 1 for b in bs) and bs == sorted(set(bs)),
        "",
        f"model.capture_sizes = {bs} must be positive, strictly increasing integers",
    )


def footprint(m: WorkspaceDims, tp: int) -> int:
    """One rank holds the KV cache [B, L, Hkv, D] x 2, the static query and output [B, Hq, D],
    the arena for the largest batch and, inside its decode, the scores and probabilities
    [B, Hq, L] in fp32 and each split's output [B, Hq, S, D] in fp32 at once."""
    b, item = max(m.capture_sizes), ITEMSIZE[m.dtype]
    kv = 2 * b * m.max_seq_len * m.num_kv_heads * m.head_size * item
    io = 2 * b * m.num_heads * m.head_size * item
    decode = 2 * b * m.num_heads * m.max_seq_len * 4 + b * m.num_heads * m.num_kv_splits * m.head_size * 4
    return kv + io + workspace_bytes(m, b) + decode


def decode_scratch(m: WorkspaceDims, batch: int) -> int:
    """The decode's own temporaries at `batch` near their peak (split_kv_stage1 in
    workspace_grow.py): K (then V) in fp32 and the copy einsum makes of it for its batched GEMM,
    [B, L, Hkv, D] each; the scores, the masked scores and the probabilities [B, Hq, L] fp32;
    each split's output and its normalized copy [B, Hq, S, D] fp32."""
    f32 = 4
    kv = batch * m.max_seq_len * m.num_kv_heads * m.head_size * f32
    scores = batch * m.num_heads * m.max_seq_len * f32
    splits = batch * m.num_heads * m.num_kv_splits * m.head_size * f32
    return 2 * kv + 3 * scores + 2 * splits


def peak(m: WorkspaceDims, r: Any) -> int:
    """What one rank is expected to reach: an estimate from the caching allocator's rules, well
    above the footprint. The sizes are captured ascending into one shared pool, so each
    capture's temporaries are larger than every block an earlier capture freed there: the pool
    keeps them all (the sum over sizes; a graph pool gives nothing back while its graphs live).
    The eager warm-up before each capture leaves the same sum in the allocator's cache, unless
    something empties it: the unfixed replace path calls empty_cache() at every growth.
    The per-size term is checked against the decode's own ops on CPU (tests/test_ledger.py:
    4.90 MiB a sequence at turboquant-decode's dims, 5.38 estimated); the sum rule is not yet
    checked against a GPU's peak: trial records carry each rank's peak reserved bytes
    (RankExit.peak_reserved_bytes) for that."""
    scratch = [decode_scratch(m, b) for b in m.capture_sizes]
    emptied = r.mode == "unfixed" and not r.resize_in_place
    return footprint(m, 1) + sum(scratch) + (max(scratch) if emptied else sum(scratch))


# The worst graph's error against the eager reference, and the bytes of other tensors (the
# after-free knob's fills) that the replays wrote over.
STEP_COLUMNS = (
    StepColumn("worst_scaled_err", "worst err", drop=2),
    StepColumn("overwritten_bytes", "overwritten", drop=1),
)


def report_lines(trial: TrialRecord) -> list[str]:
    """How the workspace grew, and in one sentence what an engine would show."""
    ws = trial.details.get("workspace")
    if not ws:
        return []
    grows = sum(1 for g in ws["grows"] if g["how"] != GrowthKind.ALLOCATE)
    graphs, stale = ws["graphs"], ws["stale_graphs"]
    if ws["reserved_before_capture"]:
        how = (
            f"Workspace: reserved {format_bytes(ws['reserved_bytes'])} for the largest capture before "
            f"capturing{' and locked after it' if ws['locked'] else ''}; {stale} of {graphs} graphs "
            "captured an arena that is no longer the live one."
        )
    else:
        verb = "resized in place (resize_)" if ws["resize_in_place"] else "replaced (del, empty_cache(), torch.empty)"
        how = (
            f"Workspace: {verb} {grows} times during capture, {format_bytes(ws['initial_bytes'])} -> "
            f"{format_bytes(ws['final_bytes'])}; {stale} of {graphs} graphs captured an arena that is "
            "no longer the live one."
        )
    if trial.outcome is Outcome.ILLEGAL_ADDRESS:
        view = (
            "An engine dies at start-up or on its first decode step (vLLM #45670: the fault surfaces at "
            "the next synchronizing call, far from the attention kernel)."
        )
    elif trial.outcome is Outcome.MISMATCH and any(
        "overwritten_bytes" in s.extra and s.mismatches for s in trial.steps
    ):
        view = (
            "The graphs' own outputs came out right: the stale graphs wrote their scratch over memory the "
            "allocator had handed to other tensors, which an engine shows as silent corruption elsewhere "
            "(FlashInfer #4398)."
        )
    elif trial.outcome is Outcome.STALE_CAPTURE:
        view = (
            "An engine would show nothing yet: the stale graphs write scratch into free memory, until an "
            "allocation takes it (corrupted) or it goes back to the driver (a fault)."
        )
    else:
        view = ""
    return [f"{how} {view}".strip()]


SPEC = ScenarioSpec(
    name="workspace-grow",
    module="repro.scenarios.workspace_grow",
    modes=(
        ModeSpec(
            "unfixed",
            {"reserve_before_capture": False, "lock_after_capture": False},
            "the arena grows as each larger capture asks (vLLM #45670, #55336)",
        ),
        ModeSpec(
            "fixed",
            {"reserve_before_capture": True, "lock_after_capture": True},
            "sized for the largest capture before capture, locked after it (#44053, #55341)",
        ),
    ),
    default_after_free="release",
    dims=WorkspaceDims,
    default_preset="turboquant-decode",
    cpu_preset="workspace-tiny",
    run_keys=(
        RunKeySpec(
            "resize_in_place",
            "--resize-in-place/--replace",
            "Grow the arena in place with resize_() (FlashInfer #4398: the storage moves) "
            "instead of replacing it (del, empty_cache(), torch.empty: vLLM #55336).",
            tag="resize",
        ),
    ),
    tensor_parallel=False,  # the decode runs on one rank's heads; TP adds nothing to the bug
    help="Decode graphs captured for ascending batch sizes over a shared, growable workspace "
    "(vLLM #45670, #55336; FlashInfer #4398).",
    steps_help="Decode steps: each replays the graph of every captured batch size once and checks it "
    "against an eager attention.",
    validate=validate,
    footprint=footprint,
    peak=peak,
    step_columns=STEP_COLUMNS,
    report_lines=report_lines,
)
