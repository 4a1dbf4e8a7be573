"""How much memory a trial needs at least, checked against the machine before it starts.

A size that cannot fit (100000 experts, a vocab of billions) would otherwise run for the
whole deadline (swapping, or allocating until the OOM killer comes) and end as HANG or
CRASH. Each bound counts only tensors the scenario holds at the same moment, so it is a
lower bound: a trial refused here could not have run; one admitted may still need more.
Plain arithmetic on the config: no torch (the parent must stay torch-free).
"""
from __future__ import annotations

import os
from pathlib import Path

from repro import gpus
from repro.config import Gemma4Dims, MoeDims, TrialConfig

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
FP32 = 4
INT64 = 8
PAD_TO = 64                     # gemma4_mtp pads the vocab to a multiple of 64 * tp
NVFP4_BYTES = 0.5 + 1 / 16      # packed E2M1 codes + one E4M3 scale per 16 elements


def gemma4_bytes(m: Gemma4Dims, tp: int) -> int:
    """Per rank. Building the lm_head shard holds the padded full head in the model dtype and
    the fp32 random rows; a forward holds the full head and, at the largest batch, the
    gathered candidate rows [B, K*V/C, H] in the model dtype and in fp32."""
    item = ITEMSIZE[m.dtype]
    unit = PAD_TO * tp
    v_pad = (m.vocab_size + unit - 1) // unit * unit
    build = v_pad * m.hidden_size * item + m.vocab_size * m.hidden_size * FP32
    candidates = m.centroid_top_k * (m.vocab_size // m.num_centroids)
    forward = (m.vocab_size * m.hidden_size * item
               + max(m.batch_sizes) * candidates * m.hidden_size * (item + FP32))
    return max(build, forward) + m.vocab_size * INT64          # + token_ordering


def moe_bytes(m: MoeDims) -> int:
    """A reload holds the new BF16 checkpoint, the re-materialised BF16 parameters, the live
    kernel's dequantised workspaces and the NVFP4 experts at once (measured peak on CPU:
    ~16 bytes per expert weight element; this counts 6.6)."""
    elements = m.num_experts * 3 * m.intermediate_size * m.hidden_size    # w13 [E, 2I, D] + w2 [E, D, I]
    return int(elements * (3 * ITEMSIZE[m.dtype] + NVFP4_BYTES))


def needed_bytes(cfg: TrialConfig) -> int:
    """Lower bound of one rank's memory for this trial; 0 when the scenario's is negligible."""
    if isinstance(cfg.model, Gemma4Dims):
        return gemma4_bytes(cfg.model, cfg.run.tp)
    if isinstance(cfg.model, MoeDims):
        return moe_bytes(cfg.model)
    return 0


def host_available() -> int | None:
    """MemAvailable (Linux), else physical memory; None when neither can be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def fit_reason(cfg: TrialConfig, device: str) -> str:
    """'' when the trial may fit; else why not, with the numbers (the trial is UNSUPPORTED here)."""
    per_rank = needed_bytes(cfg)
    if per_rank == 0:
        return ""
    tp = cfg.run.tp
    if device == "cuda":
        totals = gpus.visible_memory()[:tp]
        if cfg.run.share_gpu:             # every rank on the first GPU
            totals, per_rank = totals[:1], per_rank * tp
        if not totals or min(totals) >= per_rank:
            return ""
        return (f"{cfg.scenario} at these model sizes needs at least {gib(per_rank)} of GPU memory per rank "
                f"(lower bound), the smallest of the {tp} GPU(s) it would use has {gib(min(totals))}; "
                "use smaller [model] sizes")
    need = per_rank * tp
    available = host_available()
    if available is None or available >= need:
        return ""
    ranks = f" ({tp} ranks x {gib(per_rank)})" if tp > 1 else ""
    return (f"{cfg.scenario} at these model sizes needs at least {gib(need)} of host memory{ranks} "
            f"(lower bound), this host has {gib(available)} available; use smaller [model] sizes")
