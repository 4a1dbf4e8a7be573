"""workspace-grow: decode graphs over a shared workspace that grows after they were captured.

The bug (docs/BACKGROUND.md section 7), the most frequent new shape of the family: one arena of
scratch memory, handed out in slices to every kernel that asks (vLLM's WorkspaceManager,
FlashInfer's cached GEMM workspace, Triton's scratch allocator). A captured graph bakes in the
address of its slice. When a later request needs more, the manager grows the arena, and every
graph captured before the growth keeps pointing at the old one:

  vLLM #45670 / #46067  TurboQuant's split-KV decode takes its scratch (mid_o, output, lse) from
                        the workspace; decode graphs are captured for ascending batch sizes, each
                        larger capture grows the arena, and `empty_cache()` unmaps what the smaller
                        graphs use: an illegal memory access on the first decode step.
  vLLM #55336 / #55341  Model Runner V2 never locks the workspace, so growth after capture is
                        silent; `_ensure_workspace_size` grows by replacing the tensor: `del`,
                        `empty_cache()`, `torch.empty(...)`. V1 locks it after capture, and a later
                        request for more raises a precise error instead.
  FlashInfer #4398      a 32 MiB shared workspace grown by `resize_()` in the middle of a capture:
                        the storage moves, the old block is freed, Xid 31 when its memory is
                        unmapped, silent corruption when another tensor gets it (#4399).
  Triton #9259          the scratch allocator grew from 8 KB to 16 KB and dropped the captured one.

Modes (the lines marked `# fix (#...)` in `capture_decode_graphs` are the whole difference):
  unfixed   the arena grows whenever a capture's warm-up asks for more (replaced, or with
            --resize-in-place grown by resize_())
  fixed     #44053: reserved for the largest capture size before capturing; #55341: locked after
            capture, so a later request for more raises WorkspaceLockedError and frees nothing

The decode (`split_kv_decode`) is TurboQuant's in torch ops: stage 1 writes each KV split's output
and log-sum-exp into mid_o, stage 2 merges the splits into output and lse, all three views of the
shared arena; the graph copies the result into a static output. A workspace is scratch: a graph
writes its slice before it reads it. So a stale graph computes the right answer wherever its old
slice is still mapped, and its writes land on whatever now lives there; unmapped, it faults. The
after-free knob decides which: `release` unmaps (ILLEGAL_ADDRESS), `reuse` and `poison` hand the
freed blocks to other tensors (the knob's fills), and the step record counts the bytes of them the
replays overwrote (MISMATCH: another tensor's contents changed under it), `keep` leaves them free
(STALE_CAPTURE). Replacing the arena calls `empty_cache()` itself: there an old arena that had a
segment of its own is unmapped before the knob acts, whatever it is (vLLM #45670's fault).

Every step replays the graph of every captured size (a decode batch of each size) and checks it
against an eager attention that uses no workspace. Upstream names: WorkspaceManager,
get_simultaneous, _ensure_workspace_size, lock_workspace (vllm/v1/worker/workspace.py),
_get_turboquant_decode_workspace_shapes (vllm/v1/attention/backends/turboquant_attn.py). Our code
is written from their description.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import weakref
from dataclasses import dataclass, field
from itertools import accumulate
from math import prod
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from repro.rank.graphs import AfterFree, Captured, capture
from repro.outcome import StepRecord
from repro.scenarios.compare import Comparison, compare
from repro.units import format_bytes
from repro.scenarios.workspace_grow_spec import (
    ALIGN,
    MIB,
    SPEC,
    GrowthKind,
    WorkspaceDims,
    decode_workspace_views,
    round_up,
    workspace_bytes,
)

if TYPE_CHECKING:
    from repro.rank.worker import WorkerContext

# Mismatch tolerance, per element: |y - y_ref| > TOLERANCE * (|y_ref| + rms(y_ref)). The graph and
# the reference compute in fp32 from the same bf16 inputs; they differ by the order of the sums
# (splits merged by their log-sum-exp vs one softmax: ~1e-6) and by the graph's bf16 output (at
# most 2**-9 of the value). 0.01 is 5x that rounding; tests/test_workspace_grow.py measures the
# fixed mode's worst scaled error below a third of it.
TOLERANCE = 0.01

CPU_NOTE = (
    "CPU: no CUDA graph was captured or replayed; each graph's decode ran eagerly through the live "
    "workspace, and the guard's findings name the arena a replay would have read"
)


class WorkspaceLockedError(RuntimeError):
    """A request for more workspace after the lock: growing would free what the graphs read."""


@dataclass(frozen=True)
class Fixes:
    reserve_before_capture: bool  # #44053: size the arena for the largest capture before capturing
    lock_after_capture: bool  # #55341 (V1's lock_workspace): growth after capture raises


# The fix flags of each mode are the spec's (ModeSpec.fixes); Fixes names and documents them.
MODES = {m.name: Fixes(**m.fixes) for m in SPEC.modes}


# ------------------------------------------------------------------------ the workspace


@dataclass
class Growth:
    """One growth of the arena, as the report tells it."""

    old_bytes: int
    new_bytes: int
    how: GrowthKind


def empty_cache(device: torch.device) -> None:
    """Upstream calls torch.accelerator.empty_cache(); host memory has no cache to give back."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


class WorkspaceManager:
    """vLLM's WorkspaceManager for one micro-batch: views into one uint8 arena, handed out per call.

    resize_in_place: grow the arena with resize_() (FlashInfer's cached workspace, #4398) instead
    of replacing it (vLLM's `_ensure_workspace_size`, #55336).
    """

    def __init__(self, device: torch.device, resize_in_place: bool, initial_bytes: int = 0):
        self.device = device
        self.resize_in_place = resize_in_place
        self._current_workspaces: list[Tensor | None] = [
            torch.empty(initial_bytes, dtype=torch.uint8, device=device) if initial_bytes else None
        ]
        self._locked = False
        self.growths: list[Growth] = []

    @property
    def arena(self) -> Tensor | None:
        return self._current_workspaces[0]

    def size_bytes(self) -> int:
        arena = self.arena
        return 0 if arena is None else arena.numel() * arena.element_size()

    def lock(self) -> None:
        """From now on a request for more than the arena holds raises WorkspaceLockedError."""
        self._locked = True

    @property
    def locked(self) -> bool:
        return self._locked

    def get_simultaneous(self, *views: tuple[tuple[int, ...], torch.dtype]) -> list[Tensor]:
        """One view of the arena per (shape, dtype), each starting on a 256-byte boundary."""
        actual = [prod(shape) * dtype.itemsize for shape, dtype in views]
        aligned = [round_up(n, ALIGN) for n in actual]
        offsets = list(accumulate([0, *aligned[:-1]]))
        arena = self._ensure_workspace_size(sum(aligned))
        return [arena[o : o + n].view(dtype).view(shape) for o, n, (shape, dtype) in zip(offsets, actual, views)]

    def _ensure_workspace_size(self, required: int) -> Tensor:
        current = self.size_bytes()
        if current < required:
            if self._locked:
                raise WorkspaceLockedError(
                    f"workspace is locked at {current} bytes ({format_bytes(current)}) but {caller_site()} "
                    f"asks for {required} bytes ({format_bytes(required)}): growing it now would free the "
                    "arena the captured graphs read. Reserve the largest request before capture (ask for "
                    "the views of the largest capture size first), or keep this request within the lock"
                )
            self._grow(required)
        return self.arena

    def _grow(self, required: int) -> None:
        current = self.arena
        old = self.size_bytes()
        if current is None:
            self.growths.append(Growth(0, required, GrowthKind.ALLOCATE))
            self._current_workspaces[0] = torch.empty(required, dtype=torch.uint8, device=self.device)
            return
        if self.resize_in_place:
            self.growths.append(Growth(old, required, GrowthKind.RESIZE))
            # FlashInfer #4398: grown in place. The storage object stays, its memory moves: a new
            # block is allocated, the bytes copied, the old block freed under the captured graphs.
            current.resize_(required)
            return
        self.growths.append(Growth(old, required, GrowthKind.REPLACE))
        # vLLM #55336: replaced. The old arena is freed and its cached segment returned to the
        # driver before the new one is made, so graphs captured on it read unmapped memory.
        self._current_workspaces[0] = None
        del current
        empty_cache(self.device)
        self._current_workspaces[0] = torch.empty(required, dtype=torch.uint8, device=self.device)


def caller_site() -> str:
    """'file:line in function' of the first frame outside WorkspaceManager (who asked)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_qualname.split(".")[0] in ("WorkspaceManager", "caller_site"):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} in {frame.f_code.co_name}"


def torch_views(dims: WorkspaceDims, batch: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The decode's workspace views (the spec's shapes) with torch dtypes."""
    return [(shape, getattr(torch, dtype)) for shape, dtype in decode_workspace_views(dims, batch)]


# ------------------------------------------------------------------------ the decode


@dataclass
class DecodeState:
    """The engine's persistent decode tensors, allocated once for the largest batch (vLLM slices
    its persistent buffers [:B] for each captured size)."""

    k_cache: Tensor  # [B_max, L, Hkv, D]
    v_cache: Tensor  # [B_max, L, Hkv, D]
    q: Tensor  # [B_max, Hq, D], written before each step
    seq_lens: Tensor  # [B_max] int32, 1..L, written before each step
    out: Tensor  # [B_max, Hq, D], what each graph writes


def make_state(dims: WorkspaceDims, seed: int, dtype: torch.dtype, device: torch.device) -> DecodeState:
    b, hq, hkv, d, length = (
        max(dims.capture_sizes),
        dims.num_heads,
        dims.num_kv_heads,
        dims.head_size,
        dims.max_seq_len,
    )
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003)
    return DecodeState(
        k_cache=torch.randn(b, length, hkv, d, generator=gen, dtype=dtype, device=device),
        v_cache=torch.randn(b, length, hkv, d, generator=gen, dtype=dtype, device=device),
        q=torch.zeros(b, hq, d, dtype=dtype, device=device),
        seq_lens=torch.ones(b, dtype=torch.int32, device=device),
        out=torch.zeros(b, hq, d, dtype=dtype, device=device),
    )


def split_kv_stage1(q: Tensor, k: Tensor, v: Tensor, seq_lens: Tensor, mid_o: Tensor) -> None:
    """Each KV split's attention output and log-sum-exp, into mid_o [B, Hq, S, D+1] (the last
    column the split's lse; an empty split: output 0, lse -inf). q [B, Hq, D], k/v [B, L, Hkv, D]."""
    b, hq, d = q.shape
    length, hkv, s = k.shape[1], k.shape[2], mid_o.shape[2]
    g, c = hq // hkv, length // s
    qf = q.float().view(b, hkv, g, d) * d**-0.5
    scores = torch.einsum("bhgd,blhd->bhgl", qf, k.float()).view(b, hkv, g, s, c)
    valid = torch.arange(length, device=q.device).view(s, c) < seq_lens.view(b, 1, 1, 1, 1)
    scores = scores.masked_fill(~valid, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)  # [B, Hkv, G, S, 1]
    peak = torch.where(torch.isneginf(peak), 0.0, peak)  # an empty split has no peak
    p = (scores - peak).exp()
    total = p.sum(dim=-1, keepdim=True)
    pv = torch.einsum("bhgsc,bschd->bhgsd", p, v.float().view(b, s, c, hkv, d))
    mid_o[..., :d].copy_((pv / total.clamp_min(1e-30)).reshape(b, hq, s, d))
    split_lse = torch.where(total > 0, peak + total.log(), float("-inf"))
    mid_o[..., d].copy_(split_lse.reshape(b, hq, s))


def reduce_splits(mid_o: Tensor, output: Tensor, lse: Tensor) -> None:
    """Merge the splits of mid_o [B, Hq, S, D+1] into output [B, Hq, D] and lse [B, Hq]."""
    d = output.shape[-1]
    split_lse = mid_o[..., d]
    torch.logsumexp(split_lse, dim=-1, out=lse)  # seq_len >= 1: a split is valid
    weights = (split_lse - lse.unsqueeze(-1)).exp()  # 0 for an empty split
    torch.sum(weights.unsqueeze(-1) * mid_o[..., :d], dim=2, out=output)


def split_kv_decode(
    q: Tensor, k: Tensor, v: Tensor, seq_lens: Tensor, workspace: WorkspaceManager, dims: WorkspaceDims
) -> Tensor:
    """TurboQuant's decode: scratch from the shared workspace, asked for on every call (#46067).
    Returns output [B, Hq, D] fp32, a view of the arena."""
    mid_o, output, lse = workspace.get_simultaneous(*torch_views(dims, q.shape[0]))
    split_kv_stage1(q, k, v, seq_lens, mid_o)
    reduce_splits(mid_o, output, lse)
    return output


def decode_body(state: DecodeState, workspace: WorkspaceManager, dims: WorkspaceDims, size: int):
    """What the graph of batch size `size` captures: q [size, Hq, D] -> state.out[:size]."""

    def body(q: Tensor) -> Tensor:
        out = split_kv_decode(q, state.k_cache[:size], state.v_cache[:size], state.seq_lens[:size], workspace, dims)
        return state.out[:size].copy_(out)

    return body


def reference_attention(q: Tensor, k: Tensor, v: Tensor, seq_lens: Tensor) -> Tensor:
    """One softmax over each sequence's KV in fp32, no splits, no workspace: [B, Hq, D]."""
    b, hq, d = q.shape
    length, hkv = k.shape[1], k.shape[2]
    qf = q.float().view(b, hkv, hq // hkv, d) * d**-0.5
    scores = torch.einsum("bhgd,blhd->bhgl", qf, k.float())
    valid = torch.arange(length, device=q.device) < seq_lens.view(b, 1, 1, 1)
    p = scores.masked_fill(~valid, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhgl,blhd->bhgd", p, v.float()).reshape(b, hq, d)


# ------------------------------------------------------------------------ capture


def graph_label(size: int) -> str:
    return f"decode bs={size}"


@dataclass
class CapturedArena:
    """The arena a graph was captured on: which tensor, and where its memory was then."""

    ref: weakref.ref[Tensor]  # the arena tensor, weakly: the graph must not keep it alive
    data_ptr: int


@dataclass
class DecodeGraphs:
    graphs: dict[int, Captured]
    bodies: dict[int, Any]  # size -> the captured function (CPU runs it eagerly)
    arenas: dict[int, CapturedArena]
    growths_at: dict[int, int] = field(default_factory=dict)  # size -> growths its warm-up made
    reserved_bytes: int = 0

    def stale_sizes(self, workspace: WorkspaceManager) -> list[int]:
        """Sizes whose graph was captured on an arena that is gone or has moved since."""
        live = workspace.arena
        return [
            s for s, a in self.arenas.items() if live is None or a.ref() is not live or a.data_ptr != live.data_ptr()
        ]


def graph_pool(device: torch.device) -> tuple[int, int] | None:
    """One memory pool for every size's graph, as vLLM shares one (None on CPU: no graphs)."""
    return torch.cuda.graph_pool_handle() if device.type == "cuda" else None


def capture_decode_graphs(
    ctx: WorkerContext, state: DecodeState, workspace: WorkspaceManager, fixes: Fixes
) -> DecodeGraphs:
    """Capture one decode graph per size, ascending, as vLLM does (#46067)."""
    dims = ctx.cfg.model
    sizes, pool = dims.capture_sizes, graph_pool(ctx.device)
    if fixes.reserve_before_capture:  # fix (#44053)
        workspace.get_simultaneous(*torch_views(dims, max(sizes)))  # fix (#44053)
    out = DecodeGraphs(
        graphs={}, bodies={}, arenas={}, reserved_bytes=workspace.size_bytes() if fixes.reserve_before_capture else 0
    )
    for size in sizes:
        body = decode_body(state, workspace, dims, size)
        before = len(workspace.growths)
        # The warm-up run before capture (vLLM's dummy runs): a larger size grows the arena here,
        # on this stream, while the graphs of the smaller sizes already hold the old one.
        body(state.q[:size])
        out.growths_at[size] = len(workspace.growths) - before
        out.arenas[size] = CapturedArena(weakref.ref(workspace.arena), workspace.arena.data_ptr())
        out.bodies[size] = body
        out.graphs[size] = capture(
            body, (state.q[:size],), graph_label(size), ctx.guard, pool=pool, on_replay=ctx.replaying, census=ctx.census
        )
    if fixes.lock_after_capture:  # fix (#55341)
        workspace.lock()  # fix (#55341)
    return out


# ------------------------------------------------------------------------ the other tensors


@dataclass
class Fills:
    """The after-free knob's fills (the tensors the allocator handed the freed blocks to) and a
    copy of what the knob wrote into them, kept in the harness's own pool."""

    holders: list[Tensor]
    written: list[Tensor]

    @property
    def nbytes(self) -> int:
        return sum(h.numel() for h in self.holders)

    def overwritten_bytes(self) -> int:
        """Bytes of the fills that are no longer what the knob wrote: a replay wrote them."""
        return sum(int((h != w).sum()) for h, w in zip(self.holders, self.written))


def keep_fills(ctx: WorkerContext, after_free: AfterFree) -> Fills:
    with ctx.memory.use():
        return Fills(holders=list(after_free.holders), written=[h.clone() for h in after_free.holders])


# ------------------------------------------------------------------------ the trial


@dataclass
class Trial:
    """What lives across the steps of one trial."""

    state: DecodeState
    workspace: WorkspaceManager
    decode: DecodeGraphs
    after_free: AfterFree  # its holders keep the fills alive
    fills: Fills


@torch.no_grad()
def run(ctx: WorkerContext) -> None:
    if not ctx.on_gpu:
        ctx.note(CPU_NOTE)
    trial = build_and_capture(ctx)
    stale = len(trial.decode.stale_sizes(trial.workspace))
    for k in range(ctx.cfg.run.steps):
        ctx.begin_step(k)
        start = time.perf_counter()
        write_step_inputs(ctx, trial.state, k)
        # Deep (moved, rebound) check before the first replays; liveness before the later ones.
        ctx.check_guard(f"before replay, step {k}", deep=k == 0)
        results = [replay_and_compare(ctx, trial, size) for size in ctx.cfg.model.capture_sizes]
        ctx.step(step_record(ctx, k, results, time.perf_counter() - start, stale))
        if trial.fills.holders:
            ctx.step(fills_record(ctx, k, trial.fills))
    ctx.sync()


def build_and_capture(ctx: WorkerContext) -> Trial:
    dims, r = ctx.cfg.model, ctx.cfg.run
    dtype, device, fixes = getattr(torch, dims.dtype), ctx.device, MODES[r.mode]
    with ctx.phase("build"):
        workspace = WorkspaceManager(device, r.resize_in_place, dims.initial_workspace_mib * MIB)
        initial = workspace.size_bytes()
        state = make_state(dims, r.seed, dtype, device)
    ctx.guard.watch("workspace", workspace)
    ctx.guard.watch("decode", state)
    with ctx.phase("capture"), ctx.guard.tracking():
        decode = capture_decode_graphs(ctx, state, workspace, fixes)
    ctx.manifest("after capture")
    after_free = ctx.after_free("after capture")
    fills = keep_fills(ctx, after_free)
    stale = decode.stale_sizes(workspace)
    ctx.detail(
        dims=dataclasses.asdict(dims),
        mode_fixes=dataclasses.asdict(fixes),
        tolerance=TOLERANCE,
        tolerance_rule="elementwise |y - y_ref| > tolerance * (|y_ref| + rms(y_ref)); mismatches "
        "counts such elements; the fills record counts overwritten bytes",
        after_free=after_free.as_record(),
        harness_pool_isolated=ctx.memory.isolated,
        workspace={
            "resize_in_place": r.resize_in_place,
            "initial_bytes": initial,
            "final_bytes": workspace.size_bytes(),
            "locked": workspace.locked,
            "reserved_before_capture": fixes.reserve_before_capture,
            "reserved_bytes": decode.reserved_bytes,
            "grows": [dataclasses.asdict(g) for g in workspace.growths],
            "grown_at_sizes": [s for s, n in decode.growths_at.items() if n],
            "graphs": len(decode.graphs),
            "stale_graphs": len(stale),
            "stale_sizes": stale,
            "largest_request_bytes": workspace_bytes(dims, max(dims.capture_sizes)),
        },
    )
    return Trial(state=state, workspace=workspace, decode=decode, after_free=after_free, fills=fills)


def write_step_inputs(ctx: WorkerContext, state: DecodeState, k: int) -> None:
    """Seeded queries and sequence lengths for step k into the static inputs every graph reads."""
    dims, seed = ctx.cfg.model, ctx.cfg.run.seed
    with ctx.memory.use():
        gen = torch.Generator(device=ctx.device)
        gen.manual_seed(seed * 1_000_003 + 500_000 + k)
        q = torch.randn(state.q.shape, generator=gen, dtype=state.q.dtype, device=ctx.device)
        lens = torch.randint(
            1, dims.max_seq_len + 1, state.seq_lens.shape, generator=gen, device=ctx.device, dtype=torch.int32
        )
        state.q.copy_(q)
        state.seq_lens.copy_(lens)


@dataclass
class GraphResult:
    size: int
    replayed: bool
    cmp: Comparison


def replay_and_compare(ctx: WorkerContext, trial: Trial, size: int) -> GraphResult:
    """Replay one size's graph (on CPU its decode runs eagerly instead) and check its output."""
    s = trial.state
    with ctx.phase("replays"):
        out = trial.decode.graphs[size].replay()
        replayed = out is not None
        if not replayed:
            out = trial.decode.bodies[size](s.q[:size])
    with ctx.phase("oracle"), ctx.memory.use():  # never in the blocks the knob decided on
        ref = reference_attention(s.q[:size], s.k_cache[:size], s.v_cache[:size], s.seq_lens[:size])
        cmp = compare(out, ref, TOLERANCE)
    return GraphResult(size=size, replayed=replayed, cmp=cmp)


def step_record(ctx: WorkerContext, k: int, results: list[GraphResult], seconds: float, stale: int) -> StepRecord:
    """One record for the step: every graph's output against the reference, summed."""
    worst = max(results, key=lambda g: (g.cmp.nonfinite, g.cmp.mismatches, g.cmp.max_scaled_err or 0.0))
    errs = [g.cmp.max_scaled_err for g in results if g.cmp.max_scaled_err is not None]
    rels = [g.cmp.rel_err for g in results if g.cmp.rel_err is not None]
    abss = [g.cmp.max_abs_err for g in results if g.cmp.max_abs_err is not None]
    sizes = [g.size for g in results]
    return StepRecord(
        step=k,
        rank=ctx.rank,
        batch=sum(sizes),
        replayed=any(g.replayed for g in results),
        numel=sum(g.cmp.numel for g in results),
        nonfinite=sum(g.cmp.nonfinite for g in results),
        compared=sum(g.cmp.compared for g in results),
        mismatches=sum(g.cmp.mismatches for g in results),
        max_abs_err=max(abss) if abss else None,
        rel_err=max(rels) if rels else None,
        tolerance=TOLERANCE,
        seconds=seconds,
        label=f"{len(sizes)} decode graphs, bs {sizes[0]}..{sizes[-1]}",
        extra={
            "worst_scaled_err": max(errs) if errs else None,
            "worst_graph": worst.size,
            "graphs_wrong": sum(1 for g in results if g.cmp.mismatches or g.cmp.nonfinite),
            "stale_graphs": stale,
        },
    )


def fills_record(ctx: WorkerContext, k: int, fills: Fills) -> StepRecord:
    """The other tensors' bytes after the step's replays: a stale graph writes its scratch over them."""
    with ctx.memory.use():
        changed = fills.overwritten_bytes()
    return StepRecord(
        step=k,
        rank=ctx.rank,
        batch=0,
        replayed=True,
        numel=fills.nbytes,
        compared=fills.nbytes,
        mismatches=changed,
        label="after-free fills (memory handed to other tensors)",
        extra={"overwritten_bytes": changed, "fills": len(fills.holders)},
    )
