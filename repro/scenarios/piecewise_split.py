"""piecewise-split: piecewise CUDA graphs around an eager split op whose output is fresh every step.

The bug (vLLM PR #53915, the mechanism of issue #37363's "Bug 2"; docs/BACKGROUND.md section 7).
vLLM's piecewise mode cuts each forward at its splitting ops (attention by default) and captures
the pieces between them: one CUDA graph per piece and batch size, every graph in one shared
memory pool, largest batch first. The splitting op runs eagerly between the replays.
CUDAGraphWrapper copies no inputs: a piece replays reading its inputs at the addresses it saw
during capture, and compares those addresses only when VLLM_LOGGING_LEVEL=DEBUG. The attention
ops keep that contract by writing into a buffer whose address stays. A splitting op that returns
a FRESH tensor instead (vllm::moe_forward_shared's outputs are torch.empty_like; #37363's op
allocated through torch.bmm) puts this step's output at some address, while the next piece's
graph reads the capture-time output's address, freed since: silent garbage tokens, no error.

  unfixed   SplitAttention returns a fresh tensor every call (its last matmul allocates it)
  fixed     it writes into a static buffer per batch size, made once and kept (#53915's
            contract: an op between pieces writes into memory whose address stays)

The whole difference is in SplitAttention: the lines marked `# fix (#53915)`.

Where the fresh tensor lands decides what a replay reads. PyTorch's caching allocator hands a
freed block back to the next request of its size, so the fresh output can land on the very
block the graph captured, and the replay then reads this step's values by accident (the bug
hides). Every step records how many split outputs were not where the next piece reads them
(`moved`: the data_ptr check vLLM runs only under DEBUG) next to the wrong tokens. The
after-free knob decides what the freed capture-time blocks hold before the first replay:
`reuse` and `poison` fill them and keep them taken, so every fresh output lands elsewhere and
every replay reads the fill (garbage, or NaN); `keep` leaves them to the program's own
allocations; `release` returns empty segments to the driver, and there are none: the freed
outputs share their 2 MiB segment with live tensors. Measured on an H200 at llama3-8b
(docs/RESULTS.md): under `keep`, 13 of 16 steps read this step's values by accident, batch 64
read moved outputs in both rounds and batch 32's second round read non-finite leftovers; at
llama-tiny every fresh output landed back on its block (latent, found by the guard and census).

The decoder stand-in (Llama-style, real dims from the preset): token embedding, per layer RMS
norm + fused QKV + neox rotary (the piece before attention), attention over a static KV cache
(the split op, eager), o projection + RMS norm + SiLU-gated MLP (the piece after), final norm;
the lm_head and greedy sampling run eagerly after the last piece, as vLLM's compute_logits and
sampler do. Piece outputs stay referenced by their Captured records (vLLM keeps weak
references and lets the pool reuse their blocks; that reuse is the pool's contract and not
this bug). Each step checks the replayed hidden states and greedy tokens against eager
decoding of the same inputs on the same KV cache.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from repro.scenarios.compare import Comparison, compare
from repro.rank.graphs import Captured, capture
from repro.outcome import StepRecord
from repro.scenarios.piecewise_split_spec import SPEC, DecoderDims

if TYPE_CHECKING:
    from repro.diagnose.guard import CaptureGuard
    from repro.rank.worker import WorkerContext

# Mismatch tolerance, per element of the last piece's output (the final-normed hidden state):
# |y - y_ref| > TOLERANCE * (|y_ref| + rms(y_ref)) (repro/scenarios/compare.py). A replay runs the kernels
# the eager reference runs, on the same inputs and KV cache: expected bit-identical (measured
# 0.0 on CPU and on an H200, fixed mode). A stale read replaces one layer's attention output
# with another step's or batch size's (or the knob's fill) and every later layer builds on it:
# relative error 0.70-0.88 on the H200 at llama3-8b, 83-92% of the elements beyond 0.05;
# tests/test_piecewise_split.py checks one such read at llama-tiny stays far beyond it.
TOLERANCE = 0.05
RMS_EPS = 1e-5

CPU_NOTE = (
    "CPU: no CUDA graph was captured or replayed; the pieces ran eagerly around the split op, so the "
    "verdict comes from the guard (what a replay would read) and the comparison with eager decoding"
)


@dataclass(frozen=True)
class Fixes:
    static_output: bool  # #53915: the split op writes into a buffer whose address stays


# The fix flags of each mode are the spec's (ModeSpec.fixes); Fixes names and documents them.
MODES = {m.name: Fixes(**m.fixes) for m in SPEC.modes}


def piece_label(j: int, size: int) -> str:
    return f"piece {j} bs={size}"


# ------------------------------------------------------------------------ the decoder stand-in


def rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + RMS_EPS)).to(x.dtype) * weight


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox rotary: x [T, n, D], cos/sin [T, D/2] fp32 -> [T, n, D]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rope_tables(dims: DecoderDims, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin [context_len, D/2] fp32 for positions 0..context_len-1."""
    inv = dims.rope_theta ** (-torch.arange(0, dims.head_dim, 2, dtype=torch.float64) / dims.head_dim)
    angles = torch.arange(dims.context_len, dtype=torch.float64)[:, None] * inv[None]
    return angles.cos().float().to(device), angles.sin().float().to(device)


class DecoderLayer(nn.Module):
    """qkv [(Hq + 2 Hkv) D, H], o [H, Hq D], gate_up [2I, H] (gate | up), down [H, I], two RMS norms."""

    def __init__(self, dims: DecoderDims, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
        super().__init__()
        h, i, d = dims.hidden_size, dims.intermediate_size, dims.head_dim
        self.q_size, self.kv_size = dims.num_heads * d, dims.num_kv_heads * d
        self.heads, self.kv_heads, self.head_dim = dims.num_heads, dims.num_kv_heads, d
        self.input_norm = nn.Parameter(torch.ones(h, dtype=dtype, device=device), requires_grad=False)
        self.post_norm = nn.Parameter(torch.ones(h, dtype=dtype, device=device), requires_grad=False)
        self.qkv = weight(self.q_size + 2 * self.kv_size, h, dtype, device, gen)
        self.o = weight(h, self.q_size, dtype, device, gen)
        self.gate_up = weight(2 * i, h, dtype, device, gen)
        self.down = weight(h, i, dtype, device, gen)

    def begin(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, H] -> q [T, Hq D], k, v [T, Hkv D]: the part before attention."""
        t = x.shape[0]
        q, k, v = F.linear(rms_norm(x, self.input_norm), self.qkv).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q = rotate(q.reshape(t, self.heads, self.head_dim), cos, sin).reshape(t, -1)
        k = rotate(k.reshape(t, self.kv_heads, self.head_dim), cos, sin).reshape(t, -1)
        return q, k, v.contiguous()

    def finish(self, x: Tensor, attn: Tensor) -> Tensor:
        """x [T, H], attn [T, Hq D] -> [T, H]: the part after attention."""
        x = x + F.linear(attn, self.o)
        gate, up = F.linear(rms_norm(x, self.post_norm), self.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down)


def weight(rows: int, cols: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> nn.Parameter:
    """[rows, cols] ~ N(0, 1/cols): activations keep their scale through the layer."""
    w = torch.empty(rows, cols, dtype=dtype, device=device).normal_(0.0, cols**-0.5, generator=gen)
    return nn.Parameter(w, requires_grad=False)


class Decoder(nn.Module):
    """embed [V, H], the layers, final norm [H], lm_head [V, H]; rotary tables [C, D/2]."""

    def __init__(self, dims: DecoderDims, dtype: torch.dtype, device: torch.device, seed: int):
        super().__init__()
        gen = torch.Generator(device=device)
        gen.manual_seed(seed * 1_000_003 + 7)
        self.embed = nn.Parameter(
            torch.empty(dims.vocab_size, dims.hidden_size, dtype=dtype, device=device).normal_(0.0, 1.0, generator=gen),
            requires_grad=False,
        )
        self.layers = nn.ModuleList(DecoderLayer(dims, dtype, device, gen) for _ in range(dims.num_layers))
        self.final_norm = nn.Parameter(torch.ones(dims.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.lm_head = weight(dims.vocab_size, dims.hidden_size, dtype, device, gen)
        cos, sin = rope_tables(dims, device)
        self.register_buffer("rope_cos", cos)
        self.register_buffer("rope_sin", sin)

    def piece(self, j: int, x: Tensor, attn: Tensor | None, positions: Tensor) -> tuple[Tensor, ...]:
        """Piece j of the split forward (vLLM's submodule j), j = 0..L. Capturable: static shapes.

        j = 0: x is token ids [T] -> (residual [T, H], q, k, v of layer 0);
        0 < j < L: layer j-1's attention output in -> (residual, q, k, v of layer j);
        j = L: -> (final-normed hidden [T, H],).
        """
        if j == 0:
            x = F.embedding(x, self.embed)
        else:
            x = self.layers[j - 1].finish(x, attn)
        if j == len(self.layers):
            return (rms_norm(x, self.final_norm),)
        return (x, *self.layers[j].begin(x, self.rope_cos[positions], self.rope_sin[positions]))

    def greedy(self, hidden: Tensor) -> Tensor:
        """hidden [T, H] -> tokens [T]: eager, after the graphs (vLLM's compute_logits + sampler)."""
        return F.linear(hidden, self.lm_head).argmax(dim=-1)


class KVCache:
    """k, v [L, max T, context_len, Hkv, D]: row t of a batch is sequence t (a flat stand-in for
    vLLM's paged cache; the split op reads and writes it, no piece does)."""

    def __init__(self, dims: DecoderDims, dtype: torch.dtype, device: torch.device):
        shape = (dims.num_layers, max(dims.batch_sizes), dims.context_len, dims.num_kv_heads, dims.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def prefill(self, seed: int) -> None:
        """Seeded N(0, 1) keys and values at every position: the prompts, written after capture
        (as an engine prefills after start-up), over what the capture-time split ops wrote."""
        gen = torch.Generator(device=self.k.device)
        gen.manual_seed(seed * 1_000_003 + 11)
        self.k.normal_(0.0, 1.0, generator=gen)
        self.v.normal_(0.0, 1.0, generator=gen)


def attend(cache: KVCache, layer: int, q: Tensor, k: Tensor, v: Tensor, pos: int, out: Tensor | None = None) -> Tensor:
    """Decode attention of T sequences at position pos over layer's cache; GQA.

    q [T, Hq D], k, v [T, Hkv D] -> [T, Hq D], into `out` when given, else a new tensor.
    Eager: pos is this step's (vLLM reads it from the attention metadata of the step).
    """
    t = q.shape[0]
    hkv, d = cache.k.shape[3], cache.k.shape[4]
    g = q.shape[1] // (hkv * d)
    cache.k[layer, :t, pos] = k.view(t, hkv, d)
    cache.v[layer, :t, pos] = v.view(t, hkv, d)
    keys = cache.k[layer, :t, : pos + 1].transpose(1, 2)  # [T, Hkv, N, D]
    values = cache.v[layer, :t, : pos + 1].transpose(1, 2)  # [T, Hkv, N, D]
    scores = torch.matmul(q.view(t, hkv, g, d), keys.transpose(2, 3)).float() * d**-0.5  # [T, Hkv, G, N]
    probs = scores.softmax(dim=-1).to(q.dtype)
    if out is None:
        return torch.matmul(probs, values).view(t, -1)  # a new tensor [T, Hq D]
    torch.matmul(probs, values, out=out.view(t, hkv, g, d))
    return out


class SplitAttention:
    """The splitting op between pieces (vLLM: the attention custom op, run eagerly between the
    piece graphs): writes this step's k, v into the static KV cache and attends."""

    def __init__(self, cache: KVCache, fixes: Fixes):
        self.cache, self.fixes = cache, fixes
        self.outputs: dict[int, Tensor] = {}  # fix (#53915): batch size -> [T, Hq D], kept

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, pos: int) -> Tensor:
        # Unfixed (out None): the last matmul allocates the output, a new tensor every call, like
        # vllm::moe_forward_shared's torch.empty_like (#53915) or the torch.bmm of #37363.
        out = self.static_output(q) if self.fixes.static_output else None  # fix (#53915)
        return attend(self.cache, layer, q, k, v, pos, out)

    def static_output(self, q: Tensor) -> Tensor:  # fix (#53915)
        """One buffer per batch size, made at its first call (the capture) and kept for the
        graphs' lifetime: the next piece reads this step's values where it captured them."""
        if q.shape[0] not in self.outputs:  # fix (#53915)
            self.outputs[q.shape[0]] = torch.empty_like(q)  # fix (#53915)
        return self.outputs[q.shape[0]]  # fix (#53915)


# ------------------------------------------------------------------------ the engine


@dataclass
class Engine:
    """What vLLM's model runner holds across steps: the model, the KV cache, the split op, its
    persistent input buffers, and the pieces of every batch size, all in one graph pool."""

    model: Decoder
    cache: KVCache
    split: SplitAttention
    input_ids: Tensor  # [max T] int64: pieces of size T read [:T]
    positions: Tensor  # [max T] int64
    pool: tuple[int, int] | None  # one graph pool handle for every piece (None on CPU)
    pieces: dict[int, list[Captured]] = field(default_factory=dict)  # size -> pieces 0..L
    # size -> the address each piece j+1 read layer j's split output at, during capture (the
    # addresses vLLM's DEBUG check compares; ints, so they keep nothing alive)
    captured_at: dict[int, list[int]] = field(default_factory=dict)


def build_engine(dims: DecoderDims, fixes: Fixes, seed: int, device: torch.device) -> Engine:
    dtype = getattr(torch, dims.dtype)
    cache = KVCache(dims, dtype, device)
    longest = max(dims.batch_sizes)
    return Engine(
        model=Decoder(dims, dtype, device, seed),
        cache=cache,
        split=SplitAttention(cache, fixes),
        input_ids=torch.zeros(longest, dtype=torch.int64, device=device),
        positions=torch.full((longest,), prompt_len(dims), dtype=torch.int64, device=device),
        pool=torch.cuda.graph_pool_handle() if device.type == "cuda" else None,
    )


def prompt_len(dims: DecoderDims) -> int:
    return dims.context_len // 2


def decode_position(dims: DecoderDims, step: int) -> int:
    """Step k appends at prompt_len + k, wrapping within the cache (a new request of the same prompt)."""
    p = prompt_len(dims)
    return p + step % (dims.context_len - p)


def capture_size(ctx: WorkerContext, engine: Engine, size: int) -> None:
    """Capture pieces 0..L of one batch size, the split op running eagerly between them (vLLM's
    capture forward: each piece captured into the shared pool as the forward reaches it)."""
    model, ids, positions = engine.model, engine.input_ids[:size], engine.positions[:size]
    pos = prompt_len(ctx.cfg.model)

    def capture_piece(j: int, fn: Any, first: Tensor) -> Captured:
        return capture(
            fn, (first,), piece_label(j, size), ctx.guard, pool=engine.pool, on_replay=ctx.replaying, census=ctx.census
        )

    def capture_after(j: int, x: Tensor, attn_out: Tensor) -> Captured:
        """Piece j+1, which reads layer j's split output. The output is referenced only here:
        it is freed when this returns, as the forward vLLM generates frees every value after
        its last use, and then only piece j+1's graph remembers its address (unfixed: its
        storage dies; fixed: the split op keeps it)."""
        addresses.append(attn_out.data_ptr())
        return capture_piece(j + 1, lambda x: model.piece(j + 1, x, attn_out, positions), x)

    pieces = [capture_piece(0, lambda i: model.piece(0, i, None, positions), ids)]
    addresses: list[int] = []
    for j in range(len(model.layers)):
        x, q, k, v = pieces[-1].output
        pieces.append(capture_after(j, x, engine.split(j, q, k, v, pos)))
    engine.pieces[size], engine.captured_at[size] = pieces, addresses


@dataclass
class Decoded:
    hidden: Tensor  # [T, H]: the last piece's output
    moved: int  # split outputs not at the address the next piece reads
    replayed: bool


def decode(engine: Engine, size: int, pos: int) -> Decoded:
    """One decode forward of batch `size`: each piece's graph replayed (on CPU: run eagerly on
    the live tensors instead), the split op eager between them."""
    model, pieces = engine.model, engine.pieces[size]
    positions = engine.positions[:size]
    out = pieces[0].replay()
    replayed = out is not None
    if not replayed:
        out = model.piece(0, engine.input_ids[:size], None, positions)
    moved = 0
    for j in range(len(model.layers)):
        x, q, k, v = out
        attn_out = engine.split(j, q, k, v, pos)
        moved += attn_out.data_ptr() != engine.captured_at[size][j]
        out = pieces[j + 1].replay()  # reads layer j's split output where the capture saw it
        if out is None:
            out = model.piece(j + 1, x, attn_out, positions)
        del attn_out  # freed after its last use, as in capture_size
    return Decoded(hidden=out[0], moved=moved, replayed=replayed)


def decode_eager(engine: Engine, size: int, pos: int) -> Tensor:
    """The reference: the same forward with no graph, the attention output passed on directly.
    It rewrites this step's KV-cache slots with their correct values before reading them."""
    model, positions = engine.model, engine.positions[:size]
    out = model.piece(0, engine.input_ids[:size], None, positions)
    for j in range(len(model.layers)):
        x, q, k, v = out
        out = model.piece(j + 1, x, attend(engine.cache, j, q, k, v, pos), positions)
    return out[0]


def make_tokens(dims: DecoderDims, seed: int, step: int, size: int, device: torch.device) -> Tensor:
    """[size] seeded token ids for decode step `step`."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + 500_000 + step)
    return torch.randint(0, dims.vocab_size, (size,), generator=gen, device=device)


# ------------------------------------------------------------------------ the trial


def watch_engine(guard: CaptureGuard, engine: Engine) -> None:
    """Readable names for what the pieces read (weights, input buffers) and the static outputs."""
    guard.watch("model", engine.model)
    guard.watch("split_op", engine.split)
    guard.watch("runner", {"input_ids": engine.input_ids, "positions": engine.positions})


def dims_detail(dims: DecoderDims) -> dict[str, Any]:
    return {
        **dataclasses.asdict(dims),
        "pieces_per_size": dims.num_layers + 1,
        "graphs": (dims.num_layers + 1) * len(dims.batch_sizes),
        "split_output_bytes": {
            b: b * dims.num_heads * dims.head_dim * getattr(torch, dims.dtype).itemsize for b in dims.batch_sizes
        },
    }


@torch.no_grad()
def run(ctx: WorkerContext) -> None:
    dims, r = ctx.cfg.model, ctx.cfg.run
    with ctx.phase("build"):
        engine = build_engine(dims, MODES[r.mode], r.seed, ctx.device)
    watch_engine(ctx.guard, engine)
    with ctx.phase("capture"), ctx.guard.tracking():
        for size in sorted(dims.batch_sizes, reverse=True):  # largest first, as vLLM captures
            capture_size(ctx, engine, size)
    with ctx.phase("prefill"):
        engine.cache.prefill(r.seed)
    after_free = ctx.after_free("after set-up")
    ctx.detail(
        dims=dims_detail(dims),
        mode_fixes=dataclasses.asdict(MODES[r.mode]),
        tolerance=TOLERANCE,
        after_free=after_free.as_record(),
        guard_mechanism=ctx.guard.mechanism,
        harness_pool_isolated=ctx.memory.isolated,
    )
    if not ctx.on_gpu:
        ctx.note(CPU_NOTE)
    for step in range(r.steps):
        ctx.begin_step(step)
        size = dims.batch_sizes[step % len(dims.batch_sizes)]
        pos = decode_position(dims, step)
        # A deep check once (the set-up's findings are already out); liveness before each replay.
        if step == 0:
            ctx.check_guard("before replay, step 0")
        else:
            for j in range(dims.num_layers + 1):
                ctx.check_guard(f"before replay, step {step}", graph=piece_label(j, size), deep=False)
        ctx.step(decode_step(ctx, engine, step, size, pos))
    ctx.sync()
    del after_free


def decode_step(ctx: WorkerContext, engine: Engine, step: int, size: int, pos: int) -> StepRecord:
    dims, r = ctx.cfg.model, ctx.cfg.run
    with ctx.memory.use():
        engine.input_ids[:size].copy_(make_tokens(dims, r.seed, step, size, ctx.device))
        engine.positions[:size].fill_(pos)
    start = time.perf_counter()
    with ctx.phase("replays"):
        decoded = decode(engine, size, pos)
        tokens = engine.model.greedy(decoded.hidden)  # in the engine's memory, as vLLM samples
    seconds = time.perf_counter() - start
    with ctx.phase("oracle"), ctx.memory.use():  # never in the blocks the knob decided on
        reference = decode_eager(engine, size, pos)
        cmp: Comparison = compare(decoded.hidden, reference, TOLERANCE)
        wrong = int((tokens != engine.model.greedy(reference)).sum())
    return StepRecord(
        step=step,
        rank=ctx.rank,
        batch=size,
        replayed=decoded.replayed,
        **cmp.step_fields(),
        tolerance=TOLERANCE,
        seconds=seconds,
        label=f"{'graph' if decoded.replayed else 'eager'} bs={size} pos={pos}",
        extra={
            "moved": decoded.moved,
            "split_calls": dims.num_layers,
            "wrong_tokens": wrong,
            "max_scaled_err": cmp.max_scaled_err,
        },
    )
