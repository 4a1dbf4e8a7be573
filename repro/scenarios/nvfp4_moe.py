"""nvfp4-reload: an online-NVFP4 MoE layer reloaded with new BF16 weights under a captured graph.

The bug (vLLM PR #50074, follow-up #57954; docs/BACKGROUND.md section 3). RL trainers push new BF16
weights into a running engine many times. vLLM's layerwise reload re-materialises the layer's
parameters, loads the new weights, runs process_weights_after_loading (PWAL), then copies
every new parameter back into the ORIGINAL storage, so the addresses a CUDA graph baked in
stay valid. Only registered parameters get that protection. The online NVFP4 method's PWAL
quantizes the experts and then `_setup_kernel` builds a MoE kernel object and a quant config;
the kernel owns device tensors the forward reads (workspace, routing table, derived scales).

  unfixed       `_setup_kernel` builds a NEW kernel and config on every reload. The captured
                graph still points at the first kernel's tensors, which are now freed: the
                replay reads whatever lands there (NaN, garbage indices, unmapped memory).
  kernel-reuse  #50074: build them only `if self.moe_kernel is None`. The graph stays valid,
                but the reused config's alphas are references to the ORIGINAL scale_2
                storages, which still hold the previous weights' scales while PWAL runs (the
                copy-back comes after), so the kernel derives its scales from stale values:
                wrong output whenever the new weights have new scales, eager or graphed.
  fixed         #50074 + #57954: also copy the new scale_2 values into the config's alphas
                before the kernel's PWAL.

The whole difference is in `Nvfp4OnlineMoEMethod._setup_kernel`: the lines marked
`# fix (#50074)` and `# fix (#57954)`. Everything else is identical across modes.

Hopper (H100/H200) has no FP4 tensor cores, so, like vLLM's Marlin path there, the kernel
here is weight-only W4A16: FP4 weights dequantised into a kernel-owned BF16 workspace, BF16
activations. The forward is dense over all experts (gates are zero for unrouted ones): static
shapes, no host syncs, capturable.

The check each step is vLLM RFC #48312's warm-B vs cold-B: the warm layer (built on weights A,
captured, reloaded to B_k) against a cold layer built directly on B_k.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from repro.scenarios import nvfp4
from repro.scenarios.compare import Comparison, compare
from repro.rank.graphs import AfterFree, Captured, capture
from repro.outcome import StepRecord
from repro.scenarios.nvfp4_moe_spec import SPEC

if TYPE_CHECKING:
    from repro.diagnose.guard import CaptureGuard
    from repro.rank.worker import WorkerContext

# Mismatch tolerance, per element: |y - y_ref| > TOLERANCE * (|y_ref| + rms(y_ref)); the rms
# term keeps near-zero outputs from counting on rounding alone. Why 0.05:
#  * Correct scales: warm-B and cold-B quantize the same BF16 weights with the same
#    deterministic code, so their NVFP4 codes, block scales and scale_2 are bit-identical and
#    only BF16 rounding / accumulation order can differ. Graph replay vs eager runs the same
#    kernels (expected: bit-identical). A hard ceiling for any such noise is the gap between
#    this BF16 forward and an fp64 forward of the same dequantised weights with the same
#    routing: measured on CPU up to 0.022 per element (norm-relative ~5e-3), at moe-tiny and at
#    32 experts x 512 hidden x top-8 (tests/test_nvfp4_moe.py checks it stays below).
#  * Stale scales: a stale global scale multiplies every dequantised weight of an expert by
#    scale_2_old / scale_2_new. make_checkpoint moves each expert's scale by 2**0.5 or 2**-1 per
#    reload (|ratio - 1| >= 0.29, plus the data's own amax change); the smallest NVFP4
#    disagreement of any other kind, one E2M1 code step, is >= 33% of the value.
# 0.05 sits 2x above that noise ceiling and ~6x below the smallest real signal. Measured:
# fixed rel_err 0.0 (bit-identical) at every step, on CPU and on an H200 (graph replay vs cold
# eager, real preset); kernel-reuse rel_err 0.77-0.87 on CPU at moe-tiny, 0.65-0.73 at 32
# experts x 512 hidden x top-8, 0.66-0.73 on the H200 at the real preset; ~90% of the
# elements beyond 0.05 (max scaled error 1.6-4.3).
TOLERANCE = 0.05

HOPPER_NOTE = (
    "Hopper: NVFP4 MoE runs as weight-only W4A16 (FP4 weights dequantised, BF16 "
    "activations) — the Blackwell tensor-core path is not exercised"
)
CPU_NOTE = (
    "CPU: no CUDA graph was replayed; each step ran the eager forward through the layer's "
    "current kernel, and the guard's findings name what a replay would have read"
)


class ReloadError(RuntimeError):
    """Layerwise reload produced parameters that cannot be copied into the originals."""


@dataclass(frozen=True)
class Fixes:
    reuse_kernel: bool  # #50074: build kernel + config once, reuse across reloads
    refresh_alphas: bool  # #57954: copy the new scale_2 into the reused config's alphas


# The fix flags of each mode are the spec's (ModeSpec.fixes); Fixes names and documents them.
MODES = {m.name: Fixes(**m.fixes) for m in SPEC.modes}


# ------------------------------------------------------------------------ quant config + kernel


@dataclass
class FusedMoEQuantConfig:
    """What the kernel reads its weight global scales from (vLLM: FusedMoEQuantConfig)."""

    g1_alphas: Tensor  # [E] fp32: a REFERENCE to layer.w13_weight_scale_2, not a copy
    g2_alphas: Tensor  # [E] fp32: a REFERENCE to layer.w2_weight_scale_2


def make_quant_config(layer: "NvFp4MoE") -> FusedMoEQuantConfig:
    return FusedMoEQuantConfig(g1_alphas=layer.w13_weight_scale_2, g2_alphas=layer.w2_weight_scale_2)


class WeightOnlyNvfp4Experts:
    """Hopper's NVFP4 MoE path (Marlin-like W4A16): kernel-owned device state the forward reads.

    None of these tensors is a registered parameter, so a layerwise reload does not protect
    them: replacing this object frees them under a captured graph.
    """

    def __init__(
        self, quant_config: FusedMoEQuantConfig, expert_map: Tensor, dims: Any, dtype: torch.dtype, device: torch.device
    ):
        e, d, i = dims.num_experts, dims.hidden_size, dims.intermediate_size
        self.quant_config = quant_config
        self.expert_map = expert_map  # [E] int64, global -> local id
        self.workspace13 = torch.empty(e, 2 * i, d, dtype=dtype, device=device)  # dequantised w13
        self.workspace2 = torch.empty(e, d, i, dtype=dtype, device=device)  # dequantised w2
        self.w13_alpha = torch.empty(e, dtype=torch.float32, device=device)  # derived scales
        self.w2_alpha = torch.empty(e, dtype=torch.float32, device=device)

    def process_weights_after_loading(self, layer: "NvFp4MoE") -> None:
        """Derive the kernel's per-expert scales from the CONFIG's alphas, in place.

        Marlin folds the global scale into its own scale tensor here; our dequantiser takes the
        true scale_2, so the derivation is the identity. What matters is the source: the config.
        """
        self.w13_alpha.copy_(self.quant_config.g1_alphas)
        self.w2_alpha.copy_(self.quant_config.g2_alphas)

    def apply(self, layer: "NvFp4MoE", x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        """x [T, D], topk_weights [T, k] fp32, topk_ids [T, k] int64 -> [T, D]."""
        t, e = x.shape[0], self.expert_map.shape[0]
        local = self.expert_map[topk_ids]  # [T, k]; garbage here -> device assert
        on_rank = local >= 0  # -1 marks an expert of another EP rank
        gates = torch.zeros(t, e, dtype=torch.float32, device=x.device)
        gates.scatter_add_(1, local.clamp(min=0), topk_weights * on_rank)  # [T, E], 0 if unrouted
        nvfp4.dequantize_into(self.workspace13, layer.w13_weight, layer.w13_weight_scale, self.w13_alpha)
        nvfp4.dequantize_into(self.workspace2, layer.w2_weight, layer.w2_weight_scale, self.w2_alpha)
        h = torch.matmul(x, self.workspace13.transpose(1, 2))  # [E, T, 2I]
        a = silu_and_mul(h)  # [E, T, I]
        y = torch.bmm(a, self.workspace2.transpose(1, 2))  # [E, T, D]
        # Weighted sum in fp32. Dense on purpose: 0 * NaN is NaN, so poisoned state shows.
        return torch.einsum("te,etd->td", gates, y.float()).to(x.dtype)


def silu_and_mul(h: Tensor) -> Tensor:
    """[..., 2I] (gate | up) -> [..., I]."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def make_moe_kernel(quant_config: FusedMoEQuantConfig, layer: "NvFp4MoE") -> WeightOnlyNvfp4Experts:
    return WeightOnlyNvfp4Experts(quant_config, layer.expert_routing_table(), layer.dims, layer.dtype, layer.device)


# ------------------------------------------------------------------------ online quant method


@dataclass
class QuantStats:
    bytes_in: int  # BF16 bytes quantized
    seconds: float

    @property
    def gbps(self) -> float | None:
        return self.bytes_in / self.seconds / 1e9 if self.seconds > 0 else None


@dataclass
class Nvfp4Experts:
    w13: nvfp4.NVFP4Weight  # packed [E, 2I, D/2], block_scale [E, 2I, D/16], scale_2 [E]
    w2: nvfp4.NVFP4Weight  # packed [E, D, I/2],  block_scale [E, D, I/16],  scale_2 [E]
    stats: QuantStats


def convert_to_nvfp4_moe(layer: "NvFp4MoE") -> Nvfp4Experts:
    """Quantize the layer's BF16 experts to NVFP4, one global scale per expert."""
    sync(layer.device)
    start = time.perf_counter()
    w13 = nvfp4.quantize(layer.w13_weight.detach())
    w2 = nvfp4.quantize(layer.w2_weight.detach())
    sync(layer.device)
    nbytes = layer.w13_weight.nbytes + layer.w2_weight.nbytes
    return Nvfp4Experts(w13=w13, w2=w2, stats=QuantStats(nbytes, time.perf_counter() - start))


def replace_parameter(layer: nn.Module, name: str, data: Tensor) -> None:
    """Register `data` as parameter `name`, rebinding it to NEW storage (added if absent).

    Quantization changes dtype and size (bf16 -> uint8 / e4m3 / fp32), so the parameter cannot
    be updated in place: it is rebound. That is why the reload's copy-back exists.
    """
    layer.register_parameter(name, nn.Parameter(data, requires_grad=False))


class Nvfp4OnlineMoEMethod:
    """Online NVFP4 for MoE experts (vLLM: Nvfp4OnlineMoEMethod): BF16 checkpoint in, NVFP4 out."""

    def __init__(self, fixes: Fixes):
        self.fixes = fixes
        self.moe_kernel: WeightOnlyNvfp4Experts | None = None
        self.moe_quant_config: FusedMoEQuantConfig | None = None
        self.last_quant: QuantStats | None = None

    def process_weights_after_loading(self, layer: "NvFp4MoE") -> None:
        """Runs after the initial load and after every reload."""
        converted = convert_to_nvfp4_moe(layer)
        self.last_quant = converted.stats
        self._setup_kernel(layer, converted)

    def _setup_kernel(self, layer: "NvFp4MoE", converted: Nvfp4Experts) -> None:
        replace_parameter(layer, "w13_weight", converted.w13.packed)
        replace_parameter(layer, "w13_weight_scale", converted.w13.block_scale)
        replace_parameter(layer, "w13_weight_scale_2", converted.w13.scale_2)
        replace_parameter(layer, "w2_weight", converted.w2.packed)
        replace_parameter(layer, "w2_weight_scale", converted.w2.block_scale)
        replace_parameter(layer, "w2_weight_scale_2", converted.w2.scale_2)

        # Unfixed: a new config and kernel on every call, so a reload frees the kernel's tensors
        # that the captured graph reads.
        if self.moe_kernel is None or not self.fixes.reuse_kernel:  # fix (#50074)
            self.moe_quant_config = make_quant_config(layer)
            self.moe_kernel = make_moe_kernel(self.moe_quant_config, layer)
        elif self.fixes.refresh_alphas:  # fix (#57954)
            # The reused config's alphas are the ORIGINAL scale_2 storages; during a reload
            # they hold the previous weights' scales until the copy-back. Refresh them first.
            self.moe_quant_config.g1_alphas.copy_(layer.w13_weight_scale_2)  # fix (#57954)
            self.moe_quant_config.g2_alphas.copy_(layer.w2_weight_scale_2)  # fix (#57954)

        self.moe_kernel.process_weights_after_loading(layer)

    def apply(self, layer: "NvFp4MoE", x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        return self.moe_kernel.apply(layer, x, topk_weights, topk_ids)


# ------------------------------------------------------------------------ the layer


class NvFp4MoE(nn.Module):
    """Router [E, D] + experts w13 [E, 2I, D] (gate | up), w2 [E, D, I]; top-k routing.

    Before PWAL its parameters are in load format (BF16); after, the experts are NVFP4:
    w13_weight uint8 [E, 2I, D/2], w13_weight_scale e4m3 [E, 2I, D/16], w13_weight_scale_2
    fp32 [E], and the same for w2.
    """

    def __init__(self, dims: Any, quant_method: Nvfp4OnlineMoEMethod, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.dims = dims
        self.dtype = dtype
        self.device = device
        self.quant_method = quant_method
        e, d, i = dims.num_experts, dims.hidden_size, dims.intermediate_size
        self.load_format = {"router_weight": (e, d), "w13_weight": (e, 2 * i, d), "w2_weight": (e, d, i)}
        materialize_load_format(self)

    def expert_routing_table(self) -> Tensor:
        """[E] int64 global -> local expert id; one rank holds every expert (no EP)."""
        return torch.arange(self.dims.num_experts, dtype=torch.int64, device=self.device)

    def forward(self, x: Tensor) -> Tensor:
        """x [T, D] -> [T, D]. Capturable: static shapes, no host syncs."""
        logits = F.linear(x, self.router_weight)  # [T, E]
        probs = logits.float().softmax(dim=-1)
        topk_weights, topk_ids = probs.topk(self.dims.top_k, dim=-1)  # [T, k]
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)  # renormalise
        return self.quant_method.apply(self, x, topk_weights, topk_ids)


def materialize_load_format(layer: NvFp4MoE) -> None:
    """Fresh, empty BF16 parameters in the checkpoint's format, ready for load_weights."""
    for name, shape in layer.load_format.items():
        data = torch.empty(shape, dtype=layer.dtype, device=layer.device)
        layer.register_parameter(name, nn.Parameter(data, requires_grad=False))


@torch.no_grad()
def load_weights(layer: NvFp4MoE, checkpoint: dict[str, Tensor]) -> None:
    for name, tensor in checkpoint.items():
        getattr(layer, name).copy_(tensor)


@torch.no_grad()
def build_layer(
    dims: Any, fixes: Fixes, checkpoint: dict[str, Tensor], dtype: torch.dtype, device: torch.device
) -> NvFp4MoE:
    """Initial load: load-format params, load, PWAL (quantize + kernel setup)."""
    layer = NvFp4MoE(dims, Nvfp4OnlineMoEMethod(fixes), dtype, device)
    load_weights(layer, checkpoint)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


# ------------------------------------------------------------------------ layerwise reload


@torch.no_grad()
def reload_weights(layer: NvFp4MoE, checkpoint: dict[str, Tensor]) -> None:
    """vLLM's layerwise reload: re-materialise, load, PWAL, copy back into the originals.

    The originals are the storages a captured graph points at. Only they are protected:
    whatever PWAL does to kernel or config objects is not undone.
    """
    originals = dict(layer.named_parameters(recurse=False))
    for name in originals:
        delattr(layer, name)  # vLLM keeps only meta-device records of them
    materialize_load_format(layer)
    load_weights(layer, checkpoint)
    layer.quant_method.process_weights_after_loading(layer)
    restore_originals(layer, originals)


@torch.no_grad()
def restore_originals(layer: nn.Module, originals: dict[str, nn.Parameter]) -> None:
    """Copy each new parameter into its original storage and re-point the layer at it."""
    current = dict(layer.named_parameters(recurse=False))
    if set(current) != set(originals):
        raise ReloadError(
            f"reload changed the parameter set: new {sorted(set(current) - set(originals))}, "
            f"missing {sorted(set(originals) - set(current))}; the captured originals cannot be kept"
        )
    for name, original in originals.items():
        new = current[name]
        if new.shape != original.shape or new.dtype != original.dtype:
            raise ReloadError(
                f"reload of {name}: PWAL produced {new.dtype} {list(new.shape)} but the captured "
                f"original is {original.dtype} {list(original.shape)}; copy-back needs equal shape "
                "and dtype (did the model dims change between loads?)"
            )
        original.copy_(new)
        layer.register_parameter(name, original)


# ------------------------------------------------------------------------ weights and inputs


def expert_factors(num_experts: int, step: int, phase: int) -> Tensor:
    """[E] per-expert weight scale 2**(0.5 * ((step + e + phase) % 3 - 1)).

    Consecutive steps move every expert's factor by 2**0.5 or 2**-1, so each scale_2 changes
    by >= 29% per reload (the tolerance comment relies on it). Step -1 is weights A.
    """
    pos = (torch.arange(num_experts) + step + phase) % 3 - 1
    return torch.exp2(0.5 * pos.to(torch.float32))


def make_checkpoint(dims: Any, seed: int, step: int, dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
    """BF16 weights for reload `step` (-1: the initial weights A); values and amax differ per step."""
    e, d, i = dims.num_experts, dims.hidden_size, dims.intermediate_size
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + step + 1)
    f13 = expert_factors(e, step, 0).to(device)[:, None, None]
    f2 = expert_factors(e, step, 1).to(device)[:, None, None]

    def normal(*shape: int) -> Tensor:
        return torch.randn(shape, generator=gen, dtype=dtype, device=device)

    return {
        "router_weight": normal(e, d).mul_(d**-0.5),
        "w13_weight": normal(e, 2 * i, d).mul_(f13 * d**-0.5),
        "w2_weight": normal(e, d, i).mul_(f2 * i**-0.5),
    }


def make_tokens(dims: Any, seed: int, step: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[T, D] seeded activations for replay `step`."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + 500_000 + step)
    return torch.randn(dims.tokens, dims.hidden_size, generator=gen, dtype=dtype, device=device)


def weights_step(step: int, identity: bool) -> int:
    return -1 if identity else step


@torch.no_grad()
def scale_change(before: Tensor, after: Tensor) -> float:
    """max over experts of |after / before - 1| for two scale_2 [E]."""
    return float((after.double() / before.double() - 1).abs().max())


@torch.no_grad()
def live_alpha_staleness(layer: NvFp4MoE) -> float:
    """How far the LIVE kernel's derived scales are from the layer's scale_2 (0 when current)."""
    k = layer.quant_method.moe_kernel
    return max(scale_change(layer.w13_weight_scale_2, k.w13_alpha), scale_change(layer.w2_weight_scale_2, k.w2_alpha))


# ------------------------------------------------------------------------ the trial


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def watch_layer(guard: CaptureGuard, layer: NvFp4MoE) -> None:
    """Readable names for everything the capture reads: params and the kernel/config tensors."""
    method = layer.quant_method
    guard.watch("moe", layer)
    guard.watch("moe.quant_method", method)
    guard.watch("moe.quant_method.moe_kernel", method.moe_kernel)
    guard.watch("moe.quant_method.moe_quant_config", method.moe_quant_config)


def quant_stats(layer: NvFp4MoE) -> dict[str, Any]:
    q = layer.quant_method.last_quant
    return {"bytes": q.bytes_in, "seconds": q.seconds, "gbps": q.gbps}


def dims_detail(dims: Any) -> dict[str, Any]:
    e, d, i = dims.num_experts, dims.hidden_size, dims.intermediate_size
    return {
        **dataclasses.asdict(dims),
        "bf16_expert_bytes": 2 * (e * 2 * i * d + e * d * i),
        "forward_gflop": 2 * dims.tokens * e * (2 * i * d + d * i) / 1e9,
    }


@dataclass
class Trial:
    """What lives across the steps of one trial."""

    layer: NvFp4MoE
    captured: Captured  # the graph (None on CPU) + static I/O
    static_x: Tensor  # [T, D], allocated before capture; tokens written per step
    after_free: AfterFree | None = None  # its holders keep the fills alive
    reloads: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclass
class Reloaded:
    weights: dict[str, Tensor] | None  # B_k, kept for the cold oracle
    kernel_rebuilt: bool
    scale_change: tuple[float, float]  # w13, w2: max |new / old - 1| over experts
    live_staleness: float
    seconds: float


@torch.no_grad()
def run(ctx: WorkerContext) -> None:
    r = ctx.cfg.run
    ctx.note(HOPPER_NOTE if ctx.on_gpu else CPU_NOTE)
    trial = build_and_capture(ctx)
    for k in range(r.steps):
        ctx.begin_step(k)
        step_start = time.perf_counter()
        reloaded = reload_step(ctx, trial, k)
        apply_after_free_once(ctx, trial)
        ctx.check_guard(f"before replay, step {k}")  # on disk before a replay can crash
        out, replayed, replay_s = replay(ctx, trial, k)
        cmp, oracle_s = compare_with_cold(ctx, trial, reloaded.weights, out)
        reloaded.weights = None
        ctx.step(
            step_record(
                ctx,
                k,
                reloaded,
                cmp,
                replayed,
                time.perf_counter() - step_start,
                {"replay_s": replay_s, "oracle_s": oracle_s},
            )
        )


def build_and_capture(ctx: WorkerContext) -> Trial:
    dims, r = ctx.cfg.model, ctx.cfg.run
    dtype, device = getattr(torch, dims.dtype), ctx.device
    with ctx.phase("build"):
        with ctx.memory.use():  # the trainer's buffer, not engine memory
            weights_a = make_checkpoint(dims, r.seed, -1, dtype, device)
        layer = build_layer(dims, MODES[r.mode], weights_a, dtype, device)
        del weights_a
    watch_layer(ctx.guard, layer)
    ctx.detail(
        dims=dims_detail(dims),
        mode_fixes=dataclasses.asdict(MODES[r.mode]),
        tolerance=TOLERANCE,
        tolerance_rule="elementwise |y - y_ref| > tolerance * (|y_ref| + rms(y_ref)); mismatches counts such elements",
        kernel_path="weight-only W4A16 (NVFP4 weights dequantised into a kernel workspace)",
        quant_build=quant_stats(layer),
    )
    static_x = torch.zeros(dims.tokens, dims.hidden_size, dtype=dtype, device=device)  # [T, D]
    with ctx.phase("capture"):
        captured = capture(layer, (static_x,), "moe forward", ctx.guard, on_replay=ctx.replaying, census=ctx.census)
    return Trial(layer=layer, captured=captured, static_x=static_x)


def reload_step(ctx: WorkerContext, trial: Trial, k: int) -> Reloaded:
    """Reload to B_k (or A again under identity_reload) and take the storage manifest."""
    dims, r, layer = ctx.cfg.model, ctx.cfg.run, trial.layer
    with ctx.memory.use():
        weights = make_checkpoint(dims, r.seed, weights_step(k, r.identity_reload), layer.dtype, layer.device)
        old = (layer.w13_weight_scale_2.clone(), layer.w2_weight_scale_2.clone())
    kernel_before = weakref.ref(layer.quant_method.moe_kernel)  # weak: must not keep it alive
    start = time.perf_counter()
    with ctx.phase("reload"):
        reload_weights(layer, weights)
    seconds = time.perf_counter() - start
    trial.reloads.append({"step": k, **quant_stats(layer)})
    ctx.detail(quant_reloads=trial.reloads)
    ctx.manifest(f"after reload {k}")
    with ctx.memory.use():
        change = (scale_change(old[0], layer.w13_weight_scale_2), scale_change(old[1], layer.w2_weight_scale_2))
        staleness = live_alpha_staleness(layer)
    return Reloaded(
        weights=weights,
        kernel_rebuilt=kernel_before() is not layer.quant_method.moe_kernel,
        scale_change=change,
        live_staleness=staleness,
        seconds=seconds,
    )


def apply_after_free_once(ctx: WorkerContext, trial: Trial) -> None:
    """Decide what the dead captured blocks hold before the first replay.

    They die at the first reload (unfixed) and none revives, so the knob acts once and its
    holders stay alive for the trial. Under `keep` nothing holds them, so the next unfixed
    rebuild may land on them and a later replay then reads the NEW kernel by accident: on an
    H200, keep gave mismatches at steps 0, 2, 4 and exact output at steps 1, 3.
    """
    if trial.after_free is not None:
        return
    trial.after_free = ctx.after_free(f"after reload {len(trial.reloads) - 1}")
    ctx.detail(after_free=trial.after_free.as_record())


def replay(ctx: WorkerContext, trial: Trial, k: int) -> tuple[Tensor, bool, float]:
    """Seeded tokens into the static input, replay; on CPU the live kernel runs eagerly instead."""
    dims, r = ctx.cfg.model, ctx.cfg.run
    with ctx.memory.use():
        trial.static_x.copy_(make_tokens(dims, r.seed, k, trial.layer.dtype, trial.layer.device))
    start = time.perf_counter()
    with ctx.phase("replays"):
        out = trial.captured.replay()
        replayed = out is not None
        if not replayed:
            out = trial.layer(trial.static_x)
    return out, replayed, time.perf_counter() - start


def compare_with_cold(
    ctx: WorkerContext, trial: Trial, weights: dict[str, Tensor], out: Tensor
) -> tuple[Comparison, float]:
    """RFC #48312's oracle: a cold layer built directly on the same weights, run eagerly."""
    dims, layer = ctx.cfg.model, trial.layer
    start = time.perf_counter()
    with ctx.phase("oracle"), ctx.memory.use():  # never in the blocks the knob decided on
        cold = build_layer(dims, MODES[ctx.cfg.run.mode], weights, layer.dtype, layer.device)
        cmp = compare(out, cold(trial.static_x), TOLERANCE)
        del cold
    return cmp, time.perf_counter() - start


def step_record(
    ctx: WorkerContext,
    k: int,
    reloaded: Reloaded,
    cmp: Comparison,
    replayed: bool,
    seconds: float,
    timings: dict[str, float],
) -> StepRecord:
    kind = "identity" if ctx.cfg.run.identity_reload else "changed"
    return StepRecord(
        step=k,
        rank=ctx.rank,
        batch=ctx.cfg.model.tokens,
        replayed=replayed,
        **cmp.step_fields(),
        tolerance=TOLERANCE,
        seconds=seconds,
        label=f"reload {k} ({kind})",
        extra={
            "weights": kind,
            "kernel_rebuilt": reloaded.kernel_rebuilt,
            "max_scaled_err": cmp.max_scaled_err,
            "scale_change_w13": reloaded.scale_change[0],
            "scale_change_w2": reloaded.scale_change[1],
            "live_kernel_alpha_staleness": reloaded.live_staleness,
            "reload_s": reloaded.seconds,
            **timings,
        },
    )
