"""Sleep and wake under the speculative loop's draft graphs (vLLM #53197, #53508, #52487).

vLLM's sleep mode hands the GPU back without ending the engine. Every allocation made inside a
tagged pool scope (`weights` around model loading, `kv_cache` around initialize_kv_cache) is
unmapped at sleep and mapped again at wake at the SAME virtual address. Level 1 copies the
`weights` pool to host memory and back; level 2 keeps nothing of it, and the caller reloads the
weights (`wake_up(tags=["weights"])`, `collective_rpc("reload_weights")`,
`wake_up(tags=["kv_cache"])`). The `kv_cache` pool's contents are discarded at every level. A
captured graph keeps its addresses across all of this, so it reads whatever the wake left there:

- #53508 (merged): Model Runner V2 entered the `kv_cache` scope around the whole of
  initialize_kv_cache, so persistent metadata made there (the block-table layout tensors the
  fused MTP draft graph reads) lost its contents in a level-1 sleep and kept its address. The
  guard's pointer checks cannot see this: the storage is alive, its pointer and its version
  counter unchanged; only its bytes are gone. The fix narrows the scope to the cache's backing.
- #53197: MRV2's post_kv_cache_wake_up() repaired the lost layout by REBUILDING it: Python got
  new, correct tensors, the graph kept reading the old ones, freed; under memory pressure the
  first request after the wake hit an illegal memory access. #53197 allocates them once and
  refreshes their values in place (copy_) at wake.
- #52487 (issue #52479): after a level-2 wake, reload_weights loaded the target model's
  parameters only (the worker restores the drafter's buffers, not its parameters), so the draft
  weights read back as 0.0: acceptance fell to nothing (EAGLE3: mean acceptance length 1.685 ->
  1.000, 0 of 4560 drafts accepted), with the same text and no error. The fix reloads the
  drafter's weights too. SGLang #33124 is the same family (graph buffers allocated outside the
  pool came back as garbage after a pause).

Modes (the lines marked `# fix (#...)` are the upstream diffs):
  unfixed  post_kv_cache_wake_up leaves the layout as the wake mapped it; reload_weights loads
           the target only. Level 1: the draft graph reads a zeroed layout (wrong KV rows,
           acceptance collapses); level 2: the draft weights are zeros as well.
  rebuild  post_kv_cache_wake_up rebuilds the layout as new tensors (the MRV2 code #53197
           fixed); the draft weights are reloaded. The graphs read the old layout, discarded at
           sleep and freed at wake: the after-free knob decides what they find there.
  fixed    the layout refreshed in place (#53197), the draft weights reloaded (#52487).

Why rebuild is a mode of its own and not the unfixed mode of level 1: it is another bug, with
another detector and another fate. Unfixed loses contents at a live address (what #53508's
"poisoned remap" reproducer and the RFC #53343 inventory are about, and what only a check of
contents can find); the layout is the same tensor for the graph and for Python, so the symptom
shows even on CPU, where the eager path stands in for the graph. Rebuild moves Python to new
tensors and frees the captured ones: the guard's pointer checks find it, the after-free knob
applies, and on CPU the eager path reads the rebuilt (right) layout, so only the guard tells.
Folding one into the other would hide one of the two shapes. The fixed mode takes #53197's refresh
rather than #53508's narrowed scope: both leave the graph reading the right values at the
captured address; the refresh keeps the discard happening (the program's own write puts back
what the remap took, which a check of contents must tell from a loss), and its diff sits in the
wake's hook beside the rebuild it replaces.

The loop is gemma4-mtp's (its drafter, target stand-in, propose/verify/accept and acceptance
bookkeeping, imported): the first half of the steps before the sleep, the rest after the wake.
The draft graph of each batch size reads its input rows from a paged KV-cache stand-in through
the block table and its layout, then runs the drafter's centroid-masked argmax on them:

  entry = row * layout.strides[0] + block_index           # into block_table.view(-1)
  slot  = block_table.view(-1)[entry] * layout.block_sizes[0] + block_offset
  draft = drafter.get_top_tokens(kv[slot], lm_head)       # tokens, scores

A zeroed layout sends every row to block 0's first slots (another sequence's rows: wrong drafts,
finite; MISMATCH, acceptance near 0); garbage (`reuse`) gives out-of-range indices, and torch's
indexing kernels assert (DEVICE_ASSERT: where the engine's Triton kernels dereference a garbage
pointer, the illegal memory access #53197 reported). Upstream's layout also holds raw pointers
(block_table_ptrs) that torch ops cannot dereference; the strides and block sizes stand for it.

Upstream names: Worker.sleep / wake_up / reload_weights (vllm/v1/worker/gpu_worker.py),
GPUModelRunner.post_kv_cache_wake_up and BlockTables.init_block_table_layout_tensors (Model
Runner V2). Our code is written from their description.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from repro.rank.dist import all_gather_dim0
from repro.rank.graphs import AfterFree, Captured, capture
from repro.scenarios.gemma4_mtp import (
    SCHEDULE,
    SHARED_GPU,
    Gemma4Drafter,
    Loop,
    MaskedEmbedding,
    Oracle,
    Sequences,
    bucket,
    full_lm_head,
    speculative_step,
)
from repro.scenarios.gemma4_target import TargetStandIn
from repro.scenarios.sleep_wake_spec import NUM_SPECULATIVE_TOKENS, SPEC

if TYPE_CHECKING:
    from repro.rank.worker import WorkerContext

# vLLM's default KV-cache block size on CUDA; max_model_len of #53508's reproduction (16 blocks).
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
MAX_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE
# What a discarded page holds after the wake maps fresh memory at its address: zeros, as fresh
# physical memory is commonly observed to be (RFC #53343) and as #52487's draft weights read back.
DISCARDED_BYTE = 0
# gemma4-mtp's own bug (#43909) fixed and its cache refreshed on reload: only sleep/wake shows here.
DRAFTER_MODE = "reload-safe"


@dataclass(frozen=True)
class Fixes:
    restore_layout: bool  # post_kv_cache_wake_up puts the layout's values back (MRV2's hook)
    layout_in_place: bool  # #53197: into the storage the graphs captured (copy_), not new tensors
    reload_draft_weights: bool  # #52487: reload_weights loads the drafter's parameters too


# The fix flags of each mode are the spec's (ModeSpec.fixes); Fixes names and documents them.
MODES = {m.name: Fixes(**m.fixes) for m in SPEC.modes}


def discard(t: torch.Tensor) -> None:
    """What a sleep does to a tensor of a discarded pool, as the driver's unmap and remap do it:
    the storage's bytes replaced by DISCARDED_BYTE at the same address, written around torch (no
    aten op, so no version-counter bump: nothing in the program wrote it). The whole storage goes,
    as an allocation is what the pool discards."""
    storage = t.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    if nbytes == 0:
        return
    if t.device.type != "cuda":
        ctypes.memset(ptr, DISCARDED_BYTE, nbytes)
        return
    from repro.diagnose.cuda_driver import load_driver  # libcuda through ctypes, as the census reads graphs

    memset = load_driver().lib.cuMemsetD8_v2
    memset.argtypes, memset.restype = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t], ctypes.c_int
    torch.cuda.synchronize(t.device)  # the program's work on it first, then the remap
    code = memset(ptr, DISCARDED_BYTE, nbytes)
    if code:
        raise RuntimeError(f"cuMemsetD8_v2 of {nbytes} bytes at {ptr:#x} failed: CUresult {code}")
    torch.cuda.synchronize(t.device)


class BlockTableLayout:
    """The block-table layout the fused draft graph reads (MRV2's layout tensors: per KV-cache
    group the table's row stride and the block size; one group here). Constants: nothing
    rewrites them per step, so a value the sleep discards stays lost."""

    def __init__(self, table: torch.Tensor, block_size: int):
        self.strides = torch.tensor([table.stride(0)], dtype=torch.int64, device=table.device)  # [G]
        self.block_sizes = torch.tensor([block_size], dtype=torch.int32, device=table.device)  # [G]

    def tensors(self) -> list[torch.Tensor]:
        return [self.strides, self.block_sizes]

    def refresh_(self, table: torch.Tensor, block_size: int) -> None:
        """The same values written into the same storage (#53197's refresh)."""
        self.strides.fill_(table.stride(0))
        self.block_sizes.fill_(block_size)


@dataclass
class Checkpoint:
    """The weights as loaded at start-up, in host memory: what reload_weights reads again after a
    level-2 wake (vLLM reads the checkpoint files)."""

    target: dict[str, torch.Tensor]
    drafter: dict[str, torch.Tensor]  # parameters only: the worker saves buffers at sleep

    @staticmethod
    def of(drafter: Gemma4Drafter, target: TargetStandIn) -> "Checkpoint":
        return Checkpoint(
            {n: t.to("cpu", copy=True) for n, t in target_tensors(target).items()},
            {n: p.to("cpu", copy=True) for n, p in drafter.named_parameters()},
        )


def target_tensors(target: TargetStandIn) -> dict[str, torch.Tensor]:
    """The target stand-in's weights (its head and its index tables), by attribute name."""
    return {name: t for name, t in vars(target).items() if isinstance(t, torch.Tensor)}


def load_drafter(drafter: Gemma4Drafter, params: dict[str, torch.Tensor]) -> None:
    """Every drafter parameter copied in place; the lm_head through its own loader, which also
    refreshes the gathered copy the graphs read at TP > 1 (gemma4-mtp's reload-safe mode)."""
    for name, p in drafter.named_parameters():
        if name != "lm_head.weight":
            p.copy_(params[name])
    drafter.load_weights(params["lm_head.weight"])


class Engine:
    """One rank's slice of vLLM's Worker and Model Runner V2 the bugs live in: the drafter's draft
    graphs, the block table and its layout, the paged KV-cache stand-in, sleep and wake."""

    def __init__(
        self,
        drafter: Gemma4Drafter,
        target: TargetStandIn,
        batch_sizes: list[int],
        mode: str,
        seed: int,
        guard,
        on_replay=None,
        census=None,
    ):
        self.drafter, self.target, self.batch_sizes, self.fixes = drafter, target, batch_sizes, MODES[mode]
        self.guard, self.on_replay, self.census = guard, on_replay, census
        device, sequences = drafter.lm_head.weight.device, max(batch_sizes)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed * 7919 + 43)
        # Each sequence's pages, scattered over the cache as an allocator hands them out.
        blocks = torch.randperm(sequences * MAX_BLOCKS, generator=gen, device=device)
        self.table = blocks.view(sequences, MAX_BLOCKS).to(torch.int32)  # [S, MAX_BLOCKS]
        # initialize_kv_cache's `kv_cache` scope: the backing (the drafter's input rows, standing
        # for the KV its layers read) and, before #53508 narrowed the scope, the layout.
        self.kv = torch.zeros(
            sequences * MAX_BLOCKS * BLOCK_SIZE,
            drafter.masked_embedding.hidden_size,
            dtype=drafter.dtype,
            device=device,
        )  # [slots, H]
        self.layout = BlockTableLayout(self.table, BLOCK_SIZE)
        self.lengths = torch.zeros(sequences, dtype=torch.int64, device=device)  # tokens emitted, mod MAX_MODEL_LEN
        self.graphs: dict[int, Captured] = {}

    # -- the draft graphs --------------------------------------------------------------------

    def draft(
        self, block_index: torch.Tensor, block_offset: torch.Tensor, lm_head_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] block index and offset of each row's position -> (tokens [T], scores [T]): its
        input row read from the KV cache through the table and the layout, then drafted."""
        rows = torch.arange(block_index.shape[0], device=block_index.device)
        entry = rows * self.layout.strides[0] + block_index  # [T]
        slots = self.table.view(-1)[entry].long() * self.layout.block_sizes[0] + block_offset  # [T]
        return self.drafter.masked_embedding.get_top_tokens(self.kv[slots], lm_head_weight)

    def capture_draft_graphs(self) -> None:
        lm_head_weight = self.drafter.full_lm_head_weight()  # a live parameter view, or the cached gather
        for size in self.batch_sizes:
            inputs = tuple(torch.zeros(size, dtype=torch.int64, device=self.kv.device) for _ in range(2))
            self.graphs[size] = capture(
                lambda index, offset: self.draft(index, offset, lm_head_weight),
                inputs,
                label=f"draft bs={size}",
                guard=self.guard,
                warmup=3,
                on_replay=self.on_replay,
                census=self.census,
            )

    def sampler(self):
        """greedy_sample for one decode step: its j-th call drafts position j past each sequence's
        emitted tokens (the loop feeds each draft back)."""
        positions = itertools.count()
        return lambda hidden: self.sample(hidden, next(positions))

    def sample(self, hidden: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """hidden [t, H] of draft position j: written into the KV cache at each sequence's slot
        (the engine's own slot mapping), then read back by the draft graph of the bucket size."""
        t = hidden.shape[0]
        pos = (self.lengths[:t] + j) % MAX_MODEL_LEN  # [t]
        index, offset = pos // BLOCK_SIZE, pos % BLOCK_SIZE
        rows = torch.arange(t, device=hidden.device)
        self.kv[self.table[rows, index].long() * BLOCK_SIZE + offset] = hidden
        g = self.graphs[bucket(t, self.batch_sizes)]
        for static, value in zip(g.inputs, (index, offset)):
            static.zero_()  # padding rows read a valid slot of their own rows
            static[:t].copy_(value)
        out = g.replay()
        if out is None:  # CPU: no graph; the eager path on the tensors Python holds now stands in
            out = self.draft(*g.inputs, self.drafter.full_lm_head_weight())
        return out[0][:t].clone(), out[1][:t].clone(), g.graph is not None

    def advance(self, b: int, accepted: torch.Tensor) -> None:
        """Sequences [0, b) emitted their accepted drafts and the bonus token."""
        self.lengths[:b] = (self.lengths[:b] + accepted + 1) % MAX_MODEL_LEN

    # -- sleep and wake ----------------------------------------------------------------------

    def kv_cache_pool(self) -> list[torch.Tensor]:
        """What initialize_kv_cache made inside the `kv_cache` scope: the backing and the layout."""
        return [self.kv, *self.layout.tensors()]

    def weights_pool(self) -> list[torch.Tensor]:
        """What model loading made inside the `weights` scope: both models' weights and buffers (the
        gathered lm_head of TP > 1 is made at capture, outside every pool: a sleep leaves it)."""
        return [*self.drafter.parameters(), *self.drafter.buffers(), *target_tensors(self.target).values()]

    def sleep(self, level: int) -> dict[str, torch.Tensor]:
        """Worker.sleep(level); returns the drafter's buffers, which the worker saves at level 2.
        Level 1 copies the weights to host and back to the same addresses: their contents stay,
        so they are left in place here."""
        saved = {}
        if level == 2:
            saved = {name: b.to("cpu", copy=True) for name, b in self.drafter.named_buffers()}
            for t in self.weights_pool():
                discard(t)
        for t in self.kv_cache_pool():
            discard(t)
        return saved

    def wake_up(self, level: int, checkpoint: Checkpoint, saved: dict[str, torch.Tensor]) -> None:
        """The staged wake: the weights (level 2: buffers restored, then reload_weights), then the
        KV-cache pool and its hook."""
        if level == 2:
            for name, b in self.drafter.named_buffers():
                b.copy_(saved[name])
            self.reload_weights(checkpoint)
        self.post_kv_cache_wake_up()

    def reload_weights(self, checkpoint: Checkpoint) -> None:
        """Worker.reload_weights: the checkpoint loaded into the weights in place."""
        for name, t in target_tensors(self.target).items():
            t.copy_(checkpoint.target[name])
        if self.fixes.reload_draft_weights:  # fix (#52487): the drafter's weights
            load_drafter(self.drafter, checkpoint.drafter)  # fix (#52487): are weights too

    def post_kv_cache_wake_up(self) -> None:
        """MRV2's hook once the KV-cache pool is mapped again (same addresses, fresh memory)."""
        if not self.fixes.restore_layout:
            return  # the layout stays as the wake left it
        if self.fixes.layout_in_place:  # fix (#53197): the values back into
            self.layout.refresh_(self.table, BLOCK_SIZE)  # fix (#53197): the captured storage
        else:
            self.layout = BlockTableLayout(self.table, BLOCK_SIZE)  # NEW tensors; the graphs keep the old


def pool_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def sleep_and_wake(
    ctx: WorkerContext, engine: Engine, checkpoint: Checkpoint, level: int, before_step: int
) -> AfterFree:
    """Sleep, wake, then the deep check (before any replay reads what the wake left) and the
    after-free knob on what the wake freed. Returns the knob's record (it holds its fills)."""
    # Sizes only: a list of the pools' tensors held here would keep a rebuilt layout's old tensors alive.
    sizes = {"kv_cache": pool_bytes(engine.kv_cache_pool())}
    if level == 2:
        sizes["weights"] = pool_bytes(engine.weights_pool())
    with ctx.phase("sleep"):
        saved = engine.sleep(level)
    with ctx.phase("wake"):
        engine.wake_up(level, checkpoint, saved)
    fixes = engine.fixes
    ctx.note(
        f"sleep level {level} before step {before_step}: "
        + ", ".join(f"the {name} pool ({mib(n)})" for name, n in sizes.items())
        + " discarded at the same addresses (zeros); at wake the layout was "
        + (
            "refreshed in place"
            if fixes.layout_in_place
            else "rebuilt as new tensors"
            if fixes.restore_layout
            else "left as the wake mapped it"
        )
        + (
            ""
            if level == 1
            else ", the target reloaded, the drafter " + ("reloaded" if fixes.reload_draft_weights else "not")
        )
    )
    ctx.detail(sleep_level=level, sleep_before_step=before_step, discarded_bytes=sizes)
    ctx.check_guard("after wake")
    ctx.manifest("after wake")
    return ctx.after_free("after wake")


def run(ctx: WorkerContext) -> None:
    dims = ctx.cfg.model
    run_cfg = ctx.cfg.run
    level, k = run_cfg.sleep_level, NUM_SPECULATIVE_TOKENS
    with ctx.phase("build"):
        drafter = Gemma4Drafter(dims, ctx.tp, DRAFTER_MODE, ctx.device, run_cfg.seed, scratch=ctx.memory.use)
        with ctx.memory.use():  # the stand-in target never lands in, or frees, the engine's blocks
            target = TargetStandIn(dims, ctx.tp, ctx.device, run_cfg.seed, full_lm_head(dims, run_cfg.seed, ctx.device))
            seqs = Sequences(*target.initial(max(dims.batch_sizes), run_cfg.seed))
        engine = Engine(
            drafter,
            target,
            dims.batch_sizes,
            run_cfg.mode,
            run_cfg.seed,
            ctx.guard,
            on_replay=ctx.replaying,
            census=ctx.census,
        )
        checkpoint = Checkpoint.of(drafter, target)
    ctx.guard.watch("engine", engine)
    ctx.guard.watch("drafter", drafter)
    with ctx.phase("capture"), ctx.guard.tracking():
        engine.capture_draft_graphs()
    with ctx.memory.use():
        # The drafts a healthy drafter makes: its own copies of the weights, untouched by any sleep.
        masked = drafter.masked_embedding
        healthy = MaskedEmbedding(dims, drafter.dtype, ctx.device, masked.centroids.weight, masked.token_ordering)
        oracle = Oracle(healthy, all_gather_dim0(drafter.lm_head.weight.detach(), ctx.tp)[: dims.vocab_size].clone())
        loop = Loop(target, seqs, seqs.clone(), oracle, k, drafter.dtype)
    shared = ctx.on_gpu and ctx.tp.active and run_cfg.share_gpu
    ctx.detail(
        guard_mechanism=ctx.guard.mechanism,
        harness_pool_isolated=ctx.memory.isolated,
        num_speculative_tokens=k,
        sequences=seqs.last.numel(),
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        tp_transport=(SHARED_GPU if shared else ctx.tp.backend),
    )
    if shared:
        ctx.note(SHARED_GPU + ": collectives go through the host; tokens/s is not that of NCCL")
    if not ctx.on_gpu:
        ctx.note(
            "CPU run: no CUDA graph was captured or replayed; the eager path on the tensors Python holds "
            "stood in for the draft graphs (a layout rebuilt at wake reads right there)"
        )
    schedule = [t for t in SCHEDULE if t <= max(dims.batch_sizes)]
    sleep_at, after_free = run_cfg.steps // 2, None
    for step in range(run_cfg.steps):
        if step == sleep_at:
            after_free = sleep_and_wake(ctx, engine, checkpoint, level, step)
            ctx.detail(after_free=after_free.as_record())
        ctx.begin_step(step)
        b = schedule[step % len(schedule)]
        size = bucket(b, dims.batch_sizes)
        # Deep checks before the first replay and at the wake; liveness before every replay.
        ctx.check_guard(f"before replay, step {step}", graph=f"draft bs={size}", deep=step == 0)
        woke = step >= sleep_at
        accepted = speculative_step(
            ctx,
            loop,
            engine.sampler(),
            step,
            b,
            size,
            label="after wake: " if woke else "before sleep: ",
            extra={"after_wake": woke},
        )
        with ctx.memory.use():
            engine.advance(b, accepted)
    ctx.sync()
    del after_free
