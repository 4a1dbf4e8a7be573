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

The loop (`run`): a speculative decoding step per decode step, for a batch of sequences whose
size cycles through SCHEDULE so every captured graph size is used: the drafter proposes k
tokens per sequence (`propose`: each position through `Proposer.greedy_sample`, its previous
draft fed back), the target stand-in (gemma4_target.py) verifies them in one pass (`verify`),
the longest agreeing prefix plus the target's bonus token are emitted (`repro.scenarios.specdec`). Every
step checks the graphs' drafts against the eager drafter on live weights (what makes `reuse` a
MISMATCH) and the emitted tokens against target-only greedy decoding (lossless).

Upstream names: Gemma4MTP._get_full_lm_head_weight, Gemma4Proposer._setup_centroids_cuda_graphs,
Gemma4Proposer._greedy_sample, masked_embedding.get_top_tokens (vllm/v1/spec_decode/gemma4.py,
vllm/model_executor/models/gemma4_mtp.py). Our code is written from their description.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager

import torch
from torch import nn

from repro.rank.dist import TP, all_gather_dim0
from repro.rank.graphs import Captured, capture
from repro.outcome import StepRecord
from repro.scenarios.gemma4_mtp_spec import SPEC, Gemma4Dims
from repro.scenarios.gemma4_target import TargetStandIn, padded_vocab
from repro.scenarios.specdec import SpecStats, accepted_lengths, emitted_tokens, first_divergence

if TYPE_CHECKING:
    from repro.rank.worker import WorkerContext

SHARED_GPU = "TP over gloo, ranks share one GPU (not NCCL)"

# Tokens per decode step, cycled; every captured batch size is hit within 14 steps at E2B.
SCHEDULE = [1, 2, 3, 5, 8, 13, 21, 34, 55, 64, 4, 16, 32, 7]


@dataclass(frozen=True)
class Fixes:
    cache_gathered: bool  # #43909: keep the gathered lm_head on the module at TP > 1
    refresh_cache_on_reload: bool  # ours: load_weights refreshes the cache in place, never drops it


# The fix flags of each mode are the spec's (ModeSpec.fixes); Fixes names and documents them.
MODES = {m.name: Fixes(**m.fixes) for m in SPEC.modes}


def graph_label(size: int) -> str:
    return f"centroids bs={size}"


class MaskedEmbedding(nn.Module):
    """Centroid-masked sparse argmax over the vocab.

    h [T, H] -> centroid logits [T, C] -> top-k centroids [T, K] -> their token groups
    from token_ordering.view(C, V/C) -> candidates [T, K*V/C] -> gather those rows of the
    full lm_head [T, K*V/C, H] -> dot with h -> argmax. Scores are fp32 so the oracle's
    ties break the same way as the graph's.

    The token ordering and the centroids come from the lm_head rows, as in the real
    checkpoint: token_ordering lists the tokens cluster by cluster, a centroid is the
    direction of its cluster's mean row.
    """

    def __init__(
        self, dims: Gemma4Dims, dtype: torch.dtype, device: torch.device, centroids: torch.Tensor, order: torch.Tensor
    ):
        super().__init__()
        self.hidden_size, self.vocab_size = dims.hidden_size, dims.vocab_size
        self.num_centroids, self.top_k = dims.num_centroids, dims.centroid_top_k
        self.centroids = nn.Linear(dims.hidden_size, dims.num_centroids, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            self.centroids.weight.copy_(centroids)  # [C, H]
        self.register_buffer("token_ordering", order.clone())  # [V] int64, the module's own

    def get_top_tokens(self, h: torch.Tensor, lm_head_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h32 = h.float()  # [T, H]
        logits = h32 @ self.centroids.weight.float().t()  # [T, C]
        top = logits.topk(self.top_k, dim=-1).indices  # [T, K]
        groups = self.token_ordering.view(self.num_centroids, -1)  # [C, V/C]
        candidates = groups[top].flatten(1)  # [T, K*V/C]
        rows = lm_head_weight[candidates]  # [T, K*V/C, H]
        scores = torch.einsum("tnh,th->tn", rows.float(), h32)  # [T, K*V/C]
        best_scores, best = scores.max(dim=-1)  # [T]
        return candidates.gather(1, best[:, None]).squeeze(1), best_scores  # tokens [T], scores [T]


class Gemma4Drafter(nn.Module):
    """The slice of Gemma4MTP the bug lives in: masked embedding + vocab-parallel lm_head."""

    def __init__(
        self,
        dims: Gemma4Dims,
        tp: TP,
        mode: str,
        device: torch.device,
        seed: int,
        scratch: Callable[[], ContextManager] = contextlib.nullcontext,
    ):
        """scratch: where the checkpoint is made (the harness passes its own memory pool), so
        that no build-time temporary shares an allocator segment with the drafter's tensors and
        what happens to the freed gathered weight is decided by the after-free knob alone."""
        super().__init__()
        self.tp, self.fixes, self.vocab_size = tp, MODES[mode], dims.vocab_size
        self.dtype = getattr(torch, dims.dtype)
        with scratch():  # the checkpoint, as if read from disk
            rows = full_lm_head(dims, seed, device)  # [V, H], every rank
            order = token_ordering(dims, seed, device)  # [V]
            centroids = centroid_directions(rows, order, dims.num_centroids)  # [C, H]
            shard = shard_of(rows, dims, tp)  # [V_pad / tp, H]
        self.masked_embedding = MaskedEmbedding(dims, self.dtype, device, centroids, order)
        self.vocab_padded = padded_vocab(dims.vocab_size, tp.world_size)
        shard_rows = self.vocab_padded // tp.world_size
        self.lm_head = nn.Linear(dims.hidden_size, shard_rows, bias=False, device=device, dtype=self.dtype)
        self._stable_full_lm_head_weight: torch.Tensor | None = None  # fix (#43909)
        self.load_weights(shard)

    def full_lm_head_weight(self) -> torch.Tensor:
        """[vocab, H]: a view of the parameter at TP = 1, a freshly gathered tensor at TP > 1."""
        if self._stable_full_lm_head_weight is not None:  # fix (#43909)
            return self._stable_full_lm_head_weight  # fix (#43909)
        weight = self.lm_head.weight  # [V_pad / tp, H]
        if self.tp.active:
            weight = all_gather_dim0(weight, self.tp)  # [V_pad, H]: a NEW tensor
        weight = weight[: self.vocab_size]
        if self.tp.active and self.fixes.cache_gathered:  # fix (#43909)
            weight = weight.contiguous()  # fix (#43909)
            self._stable_full_lm_head_weight = weight  # fix (#43909)
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
        self._stable_full_lm_head_weight = None  # fix (#43909): reset


# The drafter's lm_head, built so that its clustering is known: each token's row is its
# cluster's centre (unit norm) plus noise of norm TOKEN_NOISE. Real Gemma 4 assistants ship a
# token ordering and centroids learnt from their embeddings; clustering 262144 rows at start-up
# (k-means) would cost seconds, drawing rows around known centres costs one randn.
TOKEN_NOISE = 0.5
UPDATE_NOISE = 0.15  # an RL-style weight update (reload): small moves of every row


def token_ordering(dims: Gemma4Dims, seed: int, device: torch.device) -> torch.Tensor:
    """[V]: tokens listed cluster by cluster; view(C, V/C)[c] are the tokens of cluster c."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 7919 + 11)
    return torch.randperm(dims.vocab_size, generator=gen, device=device)


def full_lm_head(dims: Gemma4Dims, seed: int, device: torch.device, update: int = 0) -> torch.Tensor:
    """The full drafter lm_head [V, H] in the model dtype; update > 0: after that many weight updates."""
    order = token_ordering(dims, seed, device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 7919 + 17)
    centres = torch.randn(dims.num_centroids, dims.hidden_size, generator=gen, device=device)
    centres /= centres.norm(dim=-1, keepdim=True)  # [C, H]
    cluster = torch.empty_like(order)
    cluster[order] = torch.arange(dims.vocab_size, device=device) // (dims.vocab_size // dims.num_centroids)
    scale = dims.hidden_size**-0.5
    rows = centres[cluster] + torch.randn(dims.vocab_size, dims.hidden_size, generator=gen, device=device) * (
        TOKEN_NOISE * scale
    )
    for u in range(1, update + 1):
        gen.manual_seed(seed * 7919 + 17 + 1000 * u)
        rows += torch.randn(rows.shape, generator=gen, device=device) * (UPDATE_NOISE * scale)
    return rows.to(getattr(torch, dims.dtype))


def centroid_directions(rows: torch.Tensor, order: torch.Tensor, num_centroids: int) -> torch.Tensor:
    """[C, H]: the unit direction of each cluster's mean lm_head row."""
    mean = rows[order].view(num_centroids, -1, rows.shape[1]).float().mean(dim=1)
    return mean / mean.norm(dim=-1, keepdim=True)


def shard_of(rows: torch.Tensor, dims: Gemma4Dims, tp: TP) -> torch.Tensor:
    """This rank's rows of the vocab-padded head; padding rows are zero."""
    v_pad = padded_vocab(dims.vocab_size, tp.world_size)
    per_rank = v_pad // tp.world_size
    full = torch.zeros(v_pad, rows.shape[1], device=rows.device, dtype=rows.dtype)
    full[: dims.vocab_size] = rows
    return full[tp.rank * per_rank : (tp.rank + 1) * per_rank].clone()


def make_lm_head_shard(dims: Gemma4Dims, tp: TP, device: torch.device, seed: int, update: int = 0) -> torch.Tensor:
    """This rank's rows of a seeded full lm_head [V_pad, H]; padding rows are zero."""
    return shard_of(full_lm_head(dims, seed, device, update), dims, tp)


class Proposer:
    """The slice of Gemma4Proposer: one raw CUDA graph per batch size around get_top_tokens."""

    def __init__(
        self, drafter: Gemma4Drafter, batch_sizes: list[int], guard, device: torch.device, on_replay=None, census=None
    ):
        self.drafter, self.batch_sizes, self.guard, self.device = drafter, batch_sizes, guard, device
        self.on_replay = on_replay  # the harness records that a replay ran
        self.census = census  # repro.diagnose.census.CensusBook: reads each captured graph
        self.graphs: dict[int, Captured] = {}

    def setup_centroid_graphs(self) -> None:
        masked = self.drafter.masked_embedding
        lm_head_weight = self.drafter.full_lm_head_weight()  # unfixed, TP > 1: the ONLY reference
        for size in self.batch_sizes:
            static_input = torch.zeros(size, masked.hidden_size, dtype=self.drafter.dtype, device=self.device)
            self.graphs[size] = capture(
                lambda x: masked.get_top_tokens(x, lm_head_weight),
                (static_input,),
                label=graph_label(size),
                guard=self.guard,
                warmup=3,
                on_replay=self.on_replay,
                census=self.census,
            )
        # lm_head_weight dies here; the graphs keep its address.

    def greedy_sample(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """hidden [T, H] -> (tokens [T], scores [T], replayed). T > largest size runs eagerly."""
        t = hidden.shape[0]
        for size in self.batch_sizes:
            if size >= t:
                g = self.graphs[size]
                g.inputs[0][:t].copy_(hidden)
                out = g.replay()
                if out is None:  # CPU: no graph; the eager path on live weights stands in
                    out = self.drafter.masked_embedding.get_top_tokens(g.inputs[0], self.drafter.full_lm_head_weight())
                return out[0][:t].clone(), out[1][:t].clone(), g.graph is not None
        return self.eager_sample(hidden)

    def eager_sample(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The same sampling without graphs (T > 64 upstream; the eager baseline of the benchmark)."""
        tokens, scores = self.drafter.masked_embedding.get_top_tokens(hidden, self.drafter.full_lm_head_weight())
        return tokens, scores, False


@dataclass
class Oracle:
    """Eager top tokens on live weights, computed on the same padded shape as the graph."""

    masked: MaskedEmbedding
    weight: torch.Tensor  # [vocab, H], gathered by the harness from the live shard

    def top_tokens(self, hidden: torch.Tensor, size: int) -> torch.Tensor:
        padded = torch.zeros(size, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        padded[: hidden.shape[0]] = hidden
        return self.masked.get_top_tokens(padded, self.weight)[0][: hidden.shape[0]]


def bucket(tokens: int, sizes: list[int]) -> int:
    return next((s for s in sizes if s >= tokens), tokens)


@dataclass
class Sequences:
    """The decode state of every sequence: the target's backbone state before the last emitted
    token, and that token (the next target pass consumes it)."""

    state: torch.Tensor  # [S, backbone_hidden] fp32
    last: torch.Tensor  # [S] int64

    def clone(self) -> "Sequences":
        return Sequences(self.state.clone(), self.last.clone())


@dataclass
class Drafted:
    tokens: torch.Tensor  # [B, k] rank 0's drafts: what the scheduler verifies
    local: torch.Tensor  # [B, k] this rank's drafts
    hiddens: list[torch.Tensor]  # k x [B, H]: the drafter's input at each position
    scores: torch.Tensor  # [B, k]
    replayed: bool
    rank_disagreements: int  # sequences whose drafts differ between ranks


def propose(target: TargetStandIn, sample, seqs: Sequences, b: int, k: int, dtype: torch.dtype, tp: TP) -> Drafted:
    """k drafts per sequence, each position feeding the drafter's previous draft back.

    Like Gemma4Proposer: the drafter starts from the target's state and last token, and every
    position goes through `sample` (the centroid graphs' greedy_sample).
    """
    state, token = seqs.state[:b], seqs.last[:b]
    tokens, scores, hiddens, replayed = [], [], [], False
    for _ in range(k):
        state = target.advance(state, token)
        hidden = target.draft_hidden(state, dtype)  # [B, H]
        token, score, replayed = sample(hidden)
        tokens.append(token)
        scores.append(score)
        hiddens.append(hidden)
    local = torch.stack(tokens, dim=1)  # [B, k]
    # The engine verifies rank 0's drafts (its scheduler sees one output); every rank gathers them.
    everyone = all_gather_dim0(local[None], tp)  # [W, B, k]
    disagree = int((everyone != everyone[0]).any(dim=0).any(dim=1).sum())
    return Drafted(
        tokens=everyone[0],
        local=local,
        hiddens=hiddens,
        scores=torch.stack(scores, dim=1),
        replayed=replayed,
        rank_disagreements=disagree,
    )


def verify(target: TargetStandIn, seqs: Sequences, b: int, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One target pass over the last token and the k drafts -> (greedy tokens [B, k+1],
    states [B, k+1, Hb]: the state after consuming each input)."""
    inputs = torch.cat([seqs.last[:b, None], drafts], dim=1)  # [B, k+1]
    embedded = target.embed(inputs.flatten()).view(b, inputs.shape[1], -1)
    state, states = seqs.state[:b], []
    for j in range(inputs.shape[1]):
        state = target.advance_embedded(state, embedded[:, j])
        states.append(state)
    return target.greedy(states).t(), torch.stack(states, dim=1)


def commit(seqs: Sequences, b: int, target_tokens: torch.Tensor, states: torch.Tensor, accepted: torch.Tensor) -> None:
    """Advance every sequence past its accepted drafts; its bonus token becomes the last token."""
    rows = torch.arange(b, device=accepted.device)
    seqs.state[:b] = states[rows, accepted]
    seqs.last[:b] = target_tokens[rows, accepted]


def decode_step(
    target: TargetStandIn, sample, seqs: Sequences, b: int, k: int, dtype: torch.dtype, tp: TP
) -> tuple[Drafted, torch.Tensor, torch.Tensor]:
    """Propose, verify, accept for sequences [0, b): returns (drafted, target tokens, accepted)."""
    drafted = propose(target, sample, seqs, b, k, dtype, tp)
    target_tokens, states = verify(target, seqs, b, drafted.tokens)
    accepted = accepted_lengths(drafted.tokens, target_tokens)
    commit(seqs, b, target_tokens, states, accepted)
    return drafted, target_tokens, accepted


def target_only(target: TargetStandIn, ref: Sequences, b: int, counts: list[int]) -> list[list[int]]:
    """Target-only greedy decoding of sequences [0, b), counts[i] tokens each (no drafter)."""
    out = []
    state, last = ref.state[:b], ref.last[:b]
    for m in range(max(counts)):
        new_state = target.advance(state, last)
        token = target.greedy([new_state])[0]
        active = torch.tensor([m < c for c in counts], device=token.device)
        state = torch.where(active[:, None], new_state, state)
        last = torch.where(active, token, last)
        out.append(token)
    ref.state[:b], ref.last[:b] = state, last
    columns = torch.stack(out, dim=1).tolist()  # [B, max(counts)]
    return [row[:c] for row, c in zip(columns, counts)]


@dataclass
class Loop:
    """What every decode step of the speculative loop reads besides the drafter: the target, the
    sequences and their target-only twin (ref), the oracle of the drafts, k and the drafts' dtype."""

    target: TargetStandIn
    seqs: Sequences
    ref: Sequences
    oracle: Oracle
    k: int
    dtype: torch.dtype


def speculative_step(
    ctx: WorkerContext, loop: Loop, sample, step: int, b: int, size: int, label: str = "", extra: dict | None = None
) -> torch.Tensor:
    """One decode step for sequences [0, b), checked and recorded: propose through `sample` (the
    draft graph of batch size `size`), verify, accept; the drafts against the oracle, the emitted
    tokens against target-only greedy decoding. label: put before the step's own label; extra:
    added to the record's. Returns accepted [b]; raises, once the step is recorded, when the loop
    was not lossless."""
    k = loop.k
    start = time.perf_counter()
    with ctx.phase("replays"), ctx.memory.use():
        drafted, target_tokens, accepted = decode_step(loop.target, sample, loop.seqs, b, k, loop.dtype, ctx.tp)
    seconds = time.perf_counter() - start
    with ctx.phase("oracle"), ctx.memory.use():
        eager = torch.stack([loop.oracle.top_tokens(h, size) for h in drafted.hiddens], dim=1)  # [B, k]
        emitted = emitted_tokens(target_tokens, accepted)
        diverged = first_divergence(emitted, target_only(loop.target, loop.ref, b, [len(e) for e in emitted]))
    stats = SpecStats()
    stats.add(accepted, k)
    ctx.step(
        StepRecord(
            step=step,
            rank=ctx.rank,
            batch=b,
            replayed=drafted.replayed,
            numel=drafted.scores.numel(),
            nonfinite=int((~torch.isfinite(drafted.scores)).sum()),
            compared=drafted.local.numel(),
            mismatches=int((drafted.local != eager).sum()),
            seconds=seconds,
            label=f"{label}{'graph' if drafted.replayed else 'eager'} bs={size} k={k}",
            extra={
                "rank_disagreements": drafted.rank_disagreements,
                "passes": stats.passes,
                "proposed": stats.proposed,
                "accepted": stats.accepted,
                "emitted": stats.emitted,
                "acceptance_rate": stats.acceptance_rate,
                "mean_accepted_length": stats.mean_accepted_length,
                "lossless": diverged is None,
                **(extra or {}),
            },
        )
    )
    if diverged is not None:
        i, j = diverged
        raise RuntimeError(
            f"speculative decoding was not lossless at step {step}: sequence {i} token {j} "
            f"differs from target-only greedy decoding (a bookkeeping bug in the loop)"
        )
    return accepted


def run(ctx: WorkerContext) -> None:
    dims: Gemma4Dims = ctx.cfg.model
    run_cfg = ctx.cfg.run
    k = run_cfg.num_speculative_tokens
    with ctx.phase("build"):
        drafter = Gemma4Drafter(dims, ctx.tp, run_cfg.mode, ctx.device, run_cfg.seed, scratch=ctx.memory.use)
        proposer = Proposer(
            drafter, dims.batch_sizes, ctx.guard, ctx.device, on_replay=ctx.replaying, census=ctx.census
        )
        with ctx.memory.use():  # the stand-in target never lands in, or frees, the drafter's blocks
            target = TargetStandIn(dims, ctx.tp, ctx.device, run_cfg.seed, full_lm_head(dims, run_cfg.seed, ctx.device))
            seqs = Sequences(*target.initial(max(dims.batch_sizes), run_cfg.seed))
            ref = seqs.clone()
    ctx.guard.watch("drafter", drafter)
    ctx.guard.watch("proposer", proposer)
    with ctx.phase("capture"), ctx.guard.tracking():
        proposer.setup_centroid_graphs()
    if run_cfg.reload_drafter:
        with ctx.phase("reload"):
            with ctx.memory.use():
                shard = make_lm_head_shard(dims, ctx.tp, ctx.device, run_cfg.seed, update=1)
            drafter.load_weights(shard)
        ctx.manifest("after drafter reload")
    after_free = ctx.after_free("after drafter reload" if run_cfg.reload_drafter else "after set-up")
    with ctx.memory.use():
        oracle = Oracle(
            drafter.masked_embedding,
            all_gather_dim0(drafter.lm_head.weight.detach(), ctx.tp)[: dims.vocab_size].clone(),
        )
    shared = ctx.on_gpu and ctx.tp.active and run_cfg.share_gpu
    ctx.detail(
        after_free=after_free.as_record(),
        guard_mechanism=ctx.guard.mechanism,
        harness_pool_isolated=ctx.memory.isolated,
        vocab_padded=drafter.vocab_padded,
        gathered_lm_head_bytes=drafter.vocab_padded * dims.hidden_size * drafter.dtype.itemsize if ctx.tp.active else 0,
        num_speculative_tokens=k,
        sequences=seqs.last.numel(),
        tp_transport=(SHARED_GPU if shared else ctx.tp.backend),
    )
    if shared:
        ctx.note(SHARED_GPU + ": collectives go through the host; tokens/s is not that of NCCL")
    if not ctx.on_gpu:
        # Only what is true of every CPU trial: the verdict's source depends on the outcome,
        # and the report says it per trial.
        ctx.note("CPU run: no CUDA graph was captured or replayed; the eager path stood in for the centroid graphs")
    loop = Loop(target, seqs, ref, oracle, k, drafter.dtype)
    schedule = [t for t in SCHEDULE if t <= max(dims.batch_sizes)]
    for step in range(run_cfg.steps):
        ctx.begin_step(step)
        b = schedule[step % len(schedule)]
        size = bucket(b, dims.batch_sizes)
        # Deep (rebinding) check once after set-up and reload; liveness before every replay.
        ctx.check_guard(f"before replay, step {step}", graph=graph_label(size), deep=step == 0)
        speculative_step(ctx, loop, proposer.greedy_sample, step, b, size)
    ctx.sync()
    del after_free
