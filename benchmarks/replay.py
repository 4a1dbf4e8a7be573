"""Graph replay vs eager for every captured region, and the guard's cost on replay.

One process, one GPU, one set of captured graphs; the variants are interleaved round by round
so drift (clocks, other tenants) hits them alike, and every ratio comes from the same run:
  gemma4-mtp  each centroid graph (E2B dims, TP=1, one per batch size): eager get_top_tokens
              vs replay; at batch 1 and 64 also replay preceded by the guard's check, deep
              (liveness + rebinding) and liveness-only (what runs before every replay)
  nvfp4       the MoE layer forward at the Qwen3-30B-A3B shape: eager vs replay; one reload
Two timings per variant:
  synced      host-timed, synchronized before and after every call: the latency of one call
              when the caller waits for its result (the guard's host work adds in full)
  pipelined   a block of back-to-back calls, one synchronize at the end: the cost per call
              when the host runs ahead of the GPU (host work hides behind the GPU's)
Usage: PYTHONPATH=$PWD python3 benchmarks/replay.py [--json PATH] [--rounds 30] [--block 50]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from common import emit
from repro.config import load_preset, validate
from repro.rank.dist import TP
from repro.diagnose.guard import CaptureGuard
from repro.scenarios.gemma4_mtp import Gemma4Drafter, Proposer, graph_label

GUARD_BATCHES = (1, 64)
DEVICE = "cuda"  # a module constant so a CPU smoke run can swap it


def synced_us(fn: Callable[[], object], block: int) -> float:
    """Median over the block of host-timed, synchronized single calls."""
    samples = []
    for _ in range(block):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def pipelined_us(fn: Callable[[], object], block: int) -> float:
    """Mean per call over `block` back-to-back calls, synchronized once at the end."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(block):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / block


def interleaved(variants: dict[str, Callable[[], object]], rounds: int, block: int) -> dict[str, dict]:
    """Each round times every variant once with each timer; the result is the median of rounds."""
    for fn in variants.values():  # warm-up: lazy kernel loading, allocator
        for _ in range(10):
            fn()
    got = {name: {"synced": [], "pipelined": []} for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            got[name]["synced"].append(synced_us(fn, block))
            got[name]["pipelined"].append(pipelined_us(fn, block))
    return {name: {k: statistics.median(v) for k, v in t.items()} for name, t in got.items()}


def bench_gemma(rounds: int, block: int) -> list[dict]:
    dims = validate(load_preset("gemma4-e2b")).model
    dev = torch.device(DEVICE, 0) if DEVICE == "cuda" else torch.device(DEVICE)
    guard = CaptureGuard(mode="warn")
    drafter = Gemma4Drafter(dims, TP(0, 1, None), "fixed", dev, seed=0)
    proposer = Proposer(drafter, dims.batch_sizes, guard, dev)
    guard.watch("drafter", drafter)
    proposer.setup_centroid_graphs()
    weight = drafter.full_lm_head_weight()
    rows = []
    for batch in dims.batch_sizes:
        h = torch.randn(batch, dims.hidden_size, device=dev, dtype=torch.bfloat16)
        label = graph_label(batch)
        variants = {
            "eager": lambda: drafter.masked_embedding.get_top_tokens(h, weight),
            "replay": lambda: proposer.greedy_sample(h),
        }
        if batch in GUARD_BATCHES:
            variants["replay + check (deep)"] = lambda: (
                guard.check("bench", graph=label, deep=True),
                proposer.greedy_sample(h),
            )
            variants["replay + check (liveness)"] = lambda: (
                guard.check("bench", graph=label, deep=False),
                proposer.greedy_sample(h),
            )
        times = interleaved(variants, rounds, block)
        row = {
            "region": "gemma4 centroids",
            "batch": batch,
            "slots_checked": sum(label in s.graphs for s in guard.slots),
            "us": times,
        }
        for timer in ("synced", "pipelined"):
            replay = times["replay"][timer]
            row[f"speedup_{timer}"] = times["eager"][timer] / replay
            for check in ("deep", "liveness"):
                name = f"replay + check ({check})"
                if name in times:
                    row[f"overhead_{timer}_{check}"] = times[name][timer] / replay - 1
        rows.append(row)
    assert not guard.check("after bench"), "the fixed drafter must leave nothing stale"
    return rows


def bench_moe(rounds: int) -> list[dict]:
    """The MoE forward at the real shape: eager vs replay; and one reload (quantize + copy-back)."""
    from repro.rank.graphs import capture
    from repro.scenarios import nvfp4_moe as moe

    dims = validate(load_preset("qwen3-30b-a3b-moe")).model
    dev, dtype = torch.device("cuda", 0), torch.bfloat16
    layer = moe.build_layer(dims, moe.MODES["fixed"], moe.make_checkpoint(dims, 0, -1, dtype, dev), dtype, dev)
    x = torch.randn(dims.tokens, dims.hidden_size, device=dev, dtype=dtype)
    captured = capture(layer, (x,), "moe forward", CaptureGuard(mode="off"))
    times = interleaved({"eager": lambda: layer(x), "replay": captured.replay}, max(3, rounds // 6), 5)
    row = {
        "region": "nvfp4 moe forward",
        "batch": dims.tokens,
        "us": times,
        "speedup_synced": times["eager"]["synced"] / times["replay"]["synced"],
        "speedup_pipelined": times["eager"]["pipelined"] / times["replay"]["pipelined"],
    }
    ckpt = moe.make_checkpoint(dims, 0, 0, dtype, dev)
    bf16_bytes = sum(t.numel() * t.element_size() for t in ckpt.values())
    moe.reload_weights(layer, ckpt)
    reload_us = synced_us(lambda: moe.reload_weights(layer, ckpt), 5)
    row.update(reload_us=reload_us, reload_bf16_bytes=bf16_bytes, reload_gb_per_s=bf16_bytes / (reload_us * 1e-6) / 1e9)
    return [row]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--block", type=int, default=50)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    rows = bench_gemma(args.rounds, args.block) + bench_moe(args.rounds)
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0),
        "rounds": args.rounds,
        "block": args.block,
    }
    emit({"environment": env, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
