"""Tokens per second of the gemma4-mtp speculative loop (propose, verify, accept), per variant.

One set of TP ranks (spawned here), one target stand-in, the variants interleaved round by round
so drift hits them alike:
  fixed graphs     drafter #43909-fixed, centroid graphs replayed (what an engine runs)
  fixed eager      the same drafter without graphs (get_top_tokens eagerly at every position)
  unfixed reuse    drafter before #43909, graphs replayed after the freed gathered lm_head was
                   reused by other tensors (`--after-free reuse`): no error, garbage drafts
                   (TP > 1 only: at TP = 1 there is no bug)
Each variant decodes its own sequences from the same start; tokens/s = emitted tokens / seconds
of propose + verify + accept (synchronized), the scenario's step schedule (every captured size).
Usage: PYTHONPATH=$PWD python3 benchmarks/specdec.py [--tp 2] [--share-gpu] [--config gemma4-e2b]
           [--rounds 5] [--steps 14] [--json PATH]     (--device cpu: a smoke run, no graphs)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from common import emit
from repro.config import load_preset, validate
from repro.rank.dist import init_tp, shutdown
from repro.rank.graphs import apply_after_free
from repro.diagnose.guard import CaptureGuard
from repro.scenarios import gemma4_mtp as g
from repro.scenarios.gemma4_target import TargetStandIn
from repro.scenarios.specdec import SpecStats


def build_variants(dims, tp, dev, seed: int) -> dict:
    """name -> (sample function, keep-alive objects). Unfixed is built last and its freed
    gathered weight re-filled at once, so nothing else takes the block first."""
    variants, keep = {}, []
    fixed = g.Proposer(g.Gemma4Drafter(dims, tp, "fixed", dev, seed), dims.batch_sizes, CaptureGuard("warn"), dev)
    fixed.setup_centroid_graphs()
    variants["fixed graphs"] = fixed.greedy_sample
    variants["fixed eager"] = fixed.eager_sample
    if tp.active:
        guard = CaptureGuard("warn")
        unfixed = g.Proposer(g.Gemma4Drafter(dims, tp, "unfixed", dev, seed), dims.batch_sizes, guard, dev)
        unfixed.setup_centroid_graphs()
        keep.append(apply_after_free("reuse", [(ptr, n) for ptr, n, _ in guard.freed_blocks()], dev, seed))
        variants["unfixed reuse graphs"] = unfixed.greedy_sample
    return variants, keep


def time_block(target, sample, seqs, schedule, k, dtype, tp, dev) -> tuple[float, SpecStats]:
    stats = SpecStats()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for b in schedule:
        _, _, accepted = g.decode_step(target, sample, seqs, b, k, dtype, tp)
        stats.add(accepted, k)
    sync()
    return time.perf_counter() - t0, stats


def rank_main(rank: int, args, rendezvous: str, queue) -> None:
    torch.set_grad_enabled(False)
    dims = validate(load_preset(args.config)).model
    dev = torch.device("cuda", 0 if args.share_gpu else rank) if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    tp = init_tp(rank, args.tp, Path(rendezvous), dev, timeout_s=600, share_gpu=args.share_gpu)
    try:
        target = TargetStandIn(dims, tp, dev, args.seed, g.full_lm_head(dims, args.seed, dev))
        variants, keep = build_variants(dims, tp, dev, args.seed)
        start = target.initial(max(dims.batch_sizes), args.seed)
        seqs = {name: g.Sequences(start[0].clone(), start[1].clone()) for name in variants}
        sizes = [b for b in g.SCHEDULE if b <= max(dims.batch_sizes)]
        schedule = [sizes[i % len(sizes)] for i in range(args.steps)]
        dtype = getattr(torch, dims.dtype)
        for name, sample in variants.items():  # warm-up: lazy loading, allocator
            time_block(
                target,
                sample,
                g.Sequences(*target.initial(max(dims.batch_sizes), args.seed + 1)),
                schedule[:3],
                args.k,
                dtype,
                tp,
                dev,
            )
        got = {name: {"seconds": [], "stats": SpecStats()} for name in variants}
        for _ in range(args.rounds):
            for name, sample in variants.items():
                seconds, stats = time_block(target, sample, seqs[name], schedule, args.k, dtype, tp, dev)
                got[name]["seconds"].append(seconds)
                total = got[name]["stats"]
                total.passes += stats.passes
                total.proposed += stats.proposed
                total.accepted += stats.accepted
                total.emitted += stats.emitted
                got[name].setdefault("tokens_per_s", []).append(stats.emitted / seconds)
        rows = [
            {
                "variant": name,
                "tokens_per_s_median": statistics.median(r["tokens_per_s"]),
                "tokens_per_s_rounds": r["tokens_per_s"],
                "acceptance_rate": r["stats"].acceptance_rate,
                "mean_accepted_length": r["stats"].mean_accepted_length,
                "emitted": r["stats"].emitted,
                "seconds": sum(r["seconds"]),
            }
            for name, r in got.items()
        ]
        if rank == 0:
            queue.put(rows)
        del keep
    finally:
        shutdown(tp)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--share-gpu", action="store_true", help="ranks share GPU 0 over gloo (not NCCL)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--config", default="gemma4-e2b")
    ap.add_argument("-k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=14, help="decode steps per timed block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "store_port")
        procs = [ctx.Process(target=rank_main, args=(r, args, rendezvous, queue)) for r in range(args.tp)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=1800)
        for p in procs:
            p.join(timeout=120)
    by_name = {r["variant"]: r for r in rows}
    ratios = {
        "graphs_over_eager": by_name["fixed graphs"]["tokens_per_s_median"]
        / by_name["fixed eager"]["tokens_per_s_median"]
    }
    if "unfixed reuse graphs" in by_name:
        ratios["unfixed_reuse_over_fixed"] = (
            by_name["unfixed reuse graphs"]["tokens_per_s_median"] / by_name["fixed graphs"]["tokens_per_s_median"]
        )
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "transport": (
            "gloo, ranks share one GPU (not NCCL)"
            if args.share_gpu and args.tp > 1
            else "nccl"
            if args.device == "cuda" and args.tp > 1
            else "gloo"
            if args.tp > 1
            else "none"
        ),
        **{k: v for k, v in vars(args).items() if k != "json"},
    }
    emit({"environment": env, "rows": rows, "ratios": ratios}, args.json)


if __name__ == "__main__":
    main()
