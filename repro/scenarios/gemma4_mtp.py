"""Gemma 4 MTP drafter at tensor parallel > 1 under the centroid CUDA graphs (vLLM PR #43909).

The bug, in one place (`Gemma4Drafter.full_lm_head_weight`): at TP > 1 the vocab-sharded
lm_head is all-gathered into a NEW tensor. Before the fix, the proposer's capture routine
held it in a local, so it was freed when `setup_centroid_graphs` returned while the seven
captured graphs kept its address. Every replay then reads freed memory: an illegal memory
access when the block went back to the driver, garbage draft tokens when something else
moved in. The fix caches the gathered tensor on the module; `load_weights` resets the cache.

Modes (the lines marked `# fix (#43909)` are the upstream diff):
  unfixed      the gathered weight lives only in the capture routine's local
  fixed        cached on the module at TP > 1; load_weights drops the cache (upstream)
  reload-safe  ours: load_weights refreshes the cached tensor in place, so graphs captured
               before an RL-style drafter reload keep a live, current weight

Upstream names: Gemma4MTP._get_full_lm_head_weight, Gemma4Proposer._setup_centroids_cuda_graphs,
Gemma4Proposer._greedy_sample, masked_embedding.get_top_tokens (vllm/v1/spec_decode/gemma4.py,
vllm/model_executor/models/gemma4_mtp.py). Our code is written from their description.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from repro.config import Gemma4Dims
from repro.dist import TP, all_gather_dim0
from repro.graphs import Captured, capture
from repro.outcome import StepRecord

# Tokens per decode step, cycled; every captured batch size is hit within 14 steps at E2B.
SCHEDULE = [1, 2, 3, 5, 8, 13, 21, 34, 55, 64, 4, 16, 32, 7]
PAD_TO = 64  # vocab-parallel heads pad the vocab to a multiple of 64 * tp


@dataclass(frozen=True)
class Fixes:
    cache_gathered: bool            # #43909: keep the gathered lm_head on the module at TP > 1
    refresh_cache_on_reload: bool   # ours: load_weights refreshes the cache in place, never drops it


MODES = {
    "unfixed": Fixes(cache_gathered=False, refresh_cache_on_reload=False),
    "fixed": Fixes(cache_gathered=True, refresh_cache_on_reload=False),
    "reload-safe": Fixes(cache_gathered=True, refresh_cache_on_reload=True),
}


def graph_label(size: int) -> str:
    return f"centroids bs={size}"


def padded_vocab(vocab: int, tp: int) -> int:
    unit = PAD_TO * tp
    return (vocab + unit - 1) // unit * unit


class MaskedEmbedding(nn.Module):
    """Centroid-masked sparse argmax over the vocab.

    h [T, H] -> centroid logits [T, C] -> top-k centroids [T, K] -> their token groups
    from token_ordering.view(C, V/C) -> candidates [T, K*V/C] -> gather those rows of the
    full lm_head [T, K*V/C, H] -> dot with h -> argmax. Scores are fp32 so the oracle's
    ties break the same way as the graph's.
    """

    def __init__(self, dims: Gemma4Dims, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
        super().__init__()
        self.hidden_size, self.vocab_size = dims.hidden_size, dims.vocab_size
        self.num_centroids, self.top_k = dims.num_centroids, dims.centroid_top_k
        self.centroids = nn.Linear(dims.hidden_size, dims.num_centroids, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            self.centroids.weight.copy_(torch.randn(self.centroids.weight.shape, generator=gen, device=device))
        order = torch.randperm(dims.vocab_size, generator=gen, device=device)
        self.register_buffer("token_ordering", order)                       # [V] int64

    def get_top_tokens(self, h: torch.Tensor, lm_head_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h32 = h.float()                                                      # [T, H]
        logits = h32 @ self.centroids.weight.float().t()                     # [T, C]
        top = logits.topk(self.top_k, dim=-1).indices                        # [T, K]
        groups = self.token_ordering.view(self.num_centroids, -1)            # [C, V/C]
        candidates = groups[top].flatten(1)                                  # [T, K*V/C]
        rows = lm_head_weight[candidates]                                    # [T, K*V/C, H]
        scores = torch.einsum("tnh,th->tn", rows.float(), h32)               # [T, K*V/C]
        best_scores, best = scores.max(dim=-1)                               # [T]
        return candidates.gather(1, best[:, None]).squeeze(1), best_scores   # tokens [T], scores [T]


class Gemma4Drafter(nn.Module):
    """The slice of Gemma4MTP the bug lives in: masked embedding + vocab-parallel lm_head."""

    def __init__(self, dims: Gemma4Dims, tp: TP, mode: str, device: torch.device, seed: int):
        super().__init__()
        self.tp, self.fixes, self.vocab_size = tp, MODES[mode], dims.vocab_size
        self.dtype = getattr(torch, dims.dtype)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        self.masked_embedding = MaskedEmbedding(dims, self.dtype, device, gen)
        self.vocab_padded = padded_vocab(dims.vocab_size, tp.world_size)
        shard_rows = self.vocab_padded // tp.world_size
        self.lm_head = nn.Linear(dims.hidden_size, shard_rows, bias=False, device=device, dtype=self.dtype)
        self._stable_full_lm_head_weight: torch.Tensor | None = None        # fix (#43909)
        self.load_weights(make_lm_head_shard(dims, tp, device, seed))

    def full_lm_head_weight(self) -> torch.Tensor:
        """[vocab, H]: a view of the parameter at TP = 1, a freshly gathered tensor at TP > 1."""
        if self._stable_full_lm_head_weight is not None:                     # fix (#43909)
            return self._stable_full_lm_head_weight                          # fix (#43909)
        weight = self.lm_head.weight                                         # [V_pad / tp, H]
        if self.tp.active:
            weight = all_gather_dim0(weight, self.tp)                        # [V_pad, H]: a NEW tensor
        weight = weight[: self.vocab_size]
        if self.tp.active and self.fixes.cache_gathered:                     # fix (#43909)
            weight = weight.contiguous()                                     # fix (#43909)
            self._stable_full_lm_head_weight = weight                        # fix (#43909)
        return weight

    def load_weights(self, lm_head_shard: torch.Tensor) -> None:
        """Weight loaders copy into the parameter in place; the cache is what differs by mode."""
        cached = self._stable_full_lm_head_weight
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_shard)
            if self.fixes.refresh_cache_on_reload and cached is not None:
                # Refresh the storage the graphs captured instead of dropping it.
                cached.copy_(all_gather_dim0(self.lm_head.weight, self.tp)[: self.vocab_size])
                return
        self._stable_full_lm_head_weight = None                              # fix (#43909): reset


def make_lm_head_shard(dims: Gemma4Dims, tp: TP, device: torch.device, seed: int) -> torch.Tensor:
    """This rank's rows of a seeded full lm_head [V_pad, H]; padding rows are zero."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 7919 + 17)
    v_pad = padded_vocab(dims.vocab_size, tp.world_size)
    rows = v_pad // tp.world_size
    full = torch.zeros(v_pad, dims.hidden_size, device=device, dtype=getattr(torch, dims.dtype))
    full[: dims.vocab_size] = torch.randn(dims.vocab_size, dims.hidden_size, generator=gen, device=device) * 0.05
    return full[tp.rank * rows:(tp.rank + 1) * rows].clone()


class Proposer:
    """The slice of Gemma4Proposer: one raw CUDA graph per batch size around get_top_tokens."""

    def __init__(self, drafter: Gemma4Drafter, batch_sizes: list[int], guard, device: torch.device,
                 on_replay=None, census=None):
        self.drafter, self.batch_sizes, self.guard, self.device = drafter, batch_sizes, guard, device
        self.on_replay = on_replay       # the harness records that a replay ran
        self.census = census             # repro.census.CensusBook: reads each captured graph
        self.graphs: dict[int, Captured] = {}

    def setup_centroid_graphs(self) -> None:
        masked = self.drafter.masked_embedding
        lm_head_weight = self.drafter.full_lm_head_weight()   # unfixed, TP > 1: the ONLY reference
        for size in self.batch_sizes:
            static_input = torch.zeros(size, masked.hidden_size, dtype=self.drafter.dtype, device=self.device)
            self.graphs[size] = capture(lambda x: masked.get_top_tokens(x, lm_head_weight), (static_input,),
                                        label=graph_label(size), guard=self.guard, warmup=3,
                                        on_replay=self.on_replay, census=self.census)
        # lm_head_weight dies here; the graphs keep its address.

    def greedy_sample(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """hidden [T, H] -> (tokens [T], scores [T], replayed). T > largest size runs eagerly."""
        t = hidden.shape[0]
        for size in self.batch_sizes:
            if size >= t:
                g = self.graphs[size]
                g.inputs[0][:t].copy_(hidden)
                out = g.replay()
                if out is None:   # CPU: no graph; the eager path on live weights stands in
                    out = self.drafter.masked_embedding.get_top_tokens(g.inputs[0], self.drafter.full_lm_head_weight())
                return out[0][:t].clone(), out[1][:t].clone(), g.graph is not None
        tokens, scores = self.drafter.masked_embedding.get_top_tokens(hidden, self.drafter.full_lm_head_weight())
        return tokens, scores, False


@dataclass
class Oracle:
    """Eager top tokens on live weights, computed on the same padded shape as the graph."""
    masked: MaskedEmbedding
    weight: torch.Tensor                 # [vocab, H], gathered by the harness from the live shard

    def top_tokens(self, hidden: torch.Tensor, size: int) -> torch.Tensor:
        padded = torch.zeros(size, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        padded[: hidden.shape[0]] = hidden
        return self.masked.get_top_tokens(padded, self.weight)[0][: hidden.shape[0]]


def hidden_states(step: int, tokens: int, dims: Gemma4Dims, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed * 1_000_003 + step)
    return torch.randn(tokens, dims.hidden_size, generator=gen).to(device=device, dtype=getattr(torch, dims.dtype))


def bucket(tokens: int, sizes: list[int]) -> int:
    return next((s for s in sizes if s >= tokens), tokens)


def rank_disagreements(tokens: torch.Tensor, tp: TP) -> int:
    """TP ranks must draft the same tokens; this is also the per-step collective a dead peer hangs in."""
    if not tp.active:
        return 0
    gathered = all_gather_dim0(tokens[None], tp)                            # [world, T]
    return int((gathered != gathered[0]).any(dim=0).sum())


def run(ctx) -> None:
    dims: Gemma4Dims = ctx.cfg.model
    run_cfg = ctx.cfg.run
    with ctx.phase("build"):
        drafter = Gemma4Drafter(dims, ctx.tp, run_cfg.mode, ctx.device, run_cfg.seed)
        proposer = Proposer(drafter, dims.batch_sizes, ctx.guard, ctx.device, on_replay=ctx.replaying,
                            census=ctx.census)
    ctx.guard.watch("drafter", drafter)
    ctx.guard.watch("proposer", proposer)
    with ctx.phase("capture"), ctx.guard.tracking():
        proposer.setup_centroid_graphs()
    if run_cfg.reload_drafter:
        with ctx.phase("reload"):
            drafter.load_weights(make_lm_head_shard(dims, ctx.tp, ctx.device, run_cfg.seed + 1))
        ctx.manifest("after drafter reload")
    after_free = ctx.after_free("after drafter reload" if run_cfg.reload_drafter else "after set-up")
    with ctx.memory.use():
        oracle = Oracle(drafter.masked_embedding,
                        all_gather_dim0(drafter.lm_head.weight.detach(), ctx.tp)[: dims.vocab_size].clone())
    ctx.detail(after_free=after_free.summary(), guard_mechanism=ctx.guard.mechanism,
               harness_pool_isolated=ctx.memory.isolated, vocab_padded=drafter.vocab_padded,
               gathered_lm_head_bytes=drafter.vocab_padded * dims.hidden_size * drafter.dtype.itemsize
               if ctx.tp.active else 0)
    if not ctx.on_gpu:
        # Only what is true of every CPU trial: the verdict's source depends on the outcome,
        # and the report says it per trial.
        ctx.note("CPU run: no CUDA graph was captured or replayed; the eager path stood in for the "
                 "centroid graphs")
    schedule = [t for t in SCHEDULE if t <= max(dims.batch_sizes)]
    for step in range(run_cfg.steps):
        ctx.begin_step(step)
        tokens_n = schedule[step % len(schedule)]
        with ctx.memory.use():
            hidden = hidden_states(step, tokens_n, dims, run_cfg.seed, ctx.device)
        size = bucket(tokens_n, dims.batch_sizes)
        # Deep (rebinding) check once after set-up and reload; liveness before every replay.
        ctx.check_guard(f"before replay, step {step}", graph=graph_label(size), deep=step == 0)
        start = time.perf_counter()
        with ctx.phase("replays"):
            tokens, scores, replayed = proposer.greedy_sample(hidden)
        seconds = time.perf_counter() - start
        with ctx.memory.use():
            reference = oracle.top_tokens(hidden, size)
            disagree = rank_disagreements(tokens, ctx.tp)
            ctx.step(StepRecord(
                step=step, rank=ctx.rank, batch=tokens_n, replayed=replayed, numel=scores.numel(),
                nonfinite=int((~torch.isfinite(scores)).sum()), compared=tokens_n,
                mismatches=int((tokens != reference).sum()), seconds=seconds,
                label=f"graph bs={size}" if replayed else f"eager bs={size}",
                extra={"rank_disagreements": disagree}))
    ctx.sync()
    del after_free
