"""Graph replay vs eager, and the guard's cost on replay, for both captured regions.

One process, one GPU, everything measured in the same run so the ratios are fair:
  gemma4-mtp  greedy_sample at batch 1 and 64 (E2B dims, TP=1): eager get_top_tokens vs
              graph replay, and replay with guard=warn (a check() before every replay) vs off
  nvfp4       the MoE layer forward at the real shape: eager vs replay
Usage: PYTHONPATH=$PWD python3 benchmarks/replay.py [--json PATH]
"""
from __future__ import annotations

import argparse
import time

import torch

from common import emit
from repro.config import load_preset, validate
from repro.dist import TP
from repro.guard import CaptureGuard
from repro.scenarios.gemma4_mtp import Gemma4Drafter, Proposer

REPEATS = 200


def wall(fn, repeats=REPEATS) -> float:
    """Median host-side microseconds per call (the guard's check() is host work)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6)
    samples.sort()
    return samples[len(samples) // 2]


def bench_gemma_mode(guard_mode: str, dims, dev: torch.device) -> list[dict]:
    """One guard setting: off, warn (deep check before each replay), warn-liveness."""
    guard = CaptureGuard(mode=guard_mode.split("-")[0])
    deep = guard_mode != "warn-liveness"
    drafter = Gemma4Drafter(dims, TP(0, 1, None), "fixed", dev, seed=0)
    proposer = Proposer(drafter, dims.batch_sizes, guard, dev)
    guard.watch("drafter", drafter)
    proposer.setup_centroid_graphs()
    rows = []
    for batch in (1, 64):
        h = torch.randn(batch, dims.hidden_size, device=dev, dtype=torch.bfloat16)
        label = f"centroids bs={batch}"   # the graph greedy_sample picks for this batch

        def replay():
            guard.check("bench", graph=label, deep=deep)
            return proposer.greedy_sample(h)
        row = {"region": "gemma4 greedy_sample", "batch": batch, "guard": guard_mode,
               "replay_us": wall(replay), "slots_checked": sum(label in sl.graphs for sl in guard.slots)}
        if guard_mode == "off":
            w = drafter.full_lm_head_weight()
            row["eager_us"] = wall(lambda: drafter.masked_embedding.get_top_tokens(h, w))
        rows.append(row)
    return rows


def bench_gemma() -> list[dict]:
    dims = validate(load_preset("gemma4-e2b")).model
    dev = torch.device("cuda", 0)
    rows = []
    for guard_mode in ("off", "warn", "warn-liveness"):
        rows += bench_gemma_mode(guard_mode, dims, dev)
        torch.cuda.empty_cache()
    return rows


def bench_moe() -> list[dict]:
    """The MoE forward at the real shape: eager vs replay; and one reload (quantize + copy-back)."""
    from repro.graphs import capture
    from repro.scenarios import nvfp4_moe as moe
    dims = validate(load_preset("qwen3-30b-a3b-moe")).model
    dev, dtype = torch.device("cuda", 0), torch.bfloat16
    layer = moe.build_layer(dims, moe.MODES["fixed"], moe.make_checkpoint(dims, 0, -1, dtype, dev), dtype, dev)
    x = torch.randn(dims.tokens, dims.hidden_size, device=dev, dtype=dtype)
    captured = capture(layer, (x,), "moe forward", CaptureGuard(mode="off"))
    row = {"region": "nvfp4 moe forward", "batch": dims.tokens, "guard": "off",
           "replay_us": wall(captured.replay, 50), "eager_us": wall(lambda: layer(x), 50)}
    ckpt = moe.make_checkpoint(dims, 0, 0, dtype, dev)
    bf16_bytes = sum(t.numel() * t.element_size() for t in ckpt.values())
    reload_us = wall(lambda: moe.reload_weights(layer, ckpt), 5)
    row.update(reload_us=reload_us, reload_bf16_bytes=bf16_bytes,
               reload_gb_per_s=bf16_bytes / (reload_us * 1e-6) / 1e9)
    return [row]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    rows = bench_gemma() + bench_moe()
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0)}
    doc = {"environment": env, "rows": rows}
    # Ratios inside one run: guard overhead and graph speedup.
    by = {(r["region"], r["batch"], r.get("guard")): r for r in rows}
    for r in rows:
        if r.get("guard", "").startswith("warn"):
            off = by[(r["region"], r["batch"], "off")]
            r["guard_overhead"] = r["replay_us"] / off["replay_us"] - 1
        if "eager_us" in r:
            r["graph_speedup"] = r["eager_us"] / r["replay_us"]
    emit(doc, args.json)


if __name__ == "__main__":
    main()
