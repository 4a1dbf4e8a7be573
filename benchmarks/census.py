"""Graph census cost at real shapes, and whether it touches the replay.

  gemma4-mtp  the 7 centroid graphs at E2B dims (TP=1, fixed: same kernels as TP=2)
  nvfp4       the MoE layer forward at the Qwen3-30B-A3B shape
Per region: the first allocator snapshot (excluded from the target: it warms the allocator's
snapshot path), the census of all its graphs after that (each census takes its own snapshot
and reads every node; target <= 50 ms in total), one census check of one graph and of all
(target <= 5 ms), and replay time of a graph captured with keep_graph=True + instantiate()
(what the census needs) against a plain CUDAGraph of the same region, interleaved.
Usage: PYTHONPATH=$PWD python3 benchmarks/census.py [--json PATH] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import emit
from repro.diagnose.allocator import take_snapshot
from repro.diagnose.census import CensusBook
from repro.config import load_preset, validate
from repro.rank.dist import TP
from repro.rank.graphs import capture
from repro.diagnose.guard import CaptureGuard
from replay import interleaved


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def first_snapshot_ms() -> float:
    t0 = time.perf_counter()
    take_snapshot()
    return ms(time.perf_counter() - t0)


def check_ms(book: CensusBook, graph: str | None, rounds: int, findings: list) -> float:
    """Median time of one check; findings (none expected in a fixed set-up) are kept."""
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        findings += book.check("bench", graph)
        samples.append(time.perf_counter() - t0)
    return ms(statistics.median(samples))


def region_row(name: str, book: CensusBook, first_ms: float, graph: str, rounds: int) -> dict:
    censuses = list(book.censuses.values())
    findings: list = []
    one, every = check_ms(book, graph, rounds, findings), check_ms(book, None, rounds, findings)
    return {
        "region": name,
        "graphs": len(censuses),
        "first_snapshot_ms": first_ms,
        "census_total_ms": ms(sum(c.seconds for c in censuses)),
        "census_per_graph_ms": [ms(c.seconds) for c in censuses],
        "snapshot_ms_now": first_snapshot_ms(),
        "check_one_graph_ms": one,
        "check_all_graphs_ms": every,
        "findings": [f.message for f in findings],
        "censuses": [c.counts() for c in censuses],
        "unreadable_samples": [u for c in censuses for u in c.unreadable][:5],
        "errors": book.errors,
    }


def bench_gemma(rounds: int) -> dict:
    from repro.scenarios.gemma4_mtp import Gemma4Drafter, Proposer, graph_label

    dims = validate(load_preset("gemma4-e2b")).model
    dev = torch.device("cuda", 0)
    book = CensusBook()
    first = first_snapshot_ms()
    drafter = Gemma4Drafter(dims, TP(0, 1, None), "fixed", dev, seed=0)
    with_census = Proposer(drafter, dims.batch_sizes, CaptureGuard("off"), dev, census=book)
    with_census.setup_centroid_graphs()
    row = region_row("gemma4 centroids (7 graphs, E2B)", book, first, graph_label(16), rounds)
    plain = Proposer(drafter, [16], CaptureGuard("off"), dev)
    plain.setup_centroid_graphs()
    h = torch.randn(16, dims.hidden_size, device=dev, dtype=torch.bfloat16)
    row["replay_us_bs16"] = interleaved(
        {"keep_graph + instantiate": with_census.graphs[16].replay, "plain CUDAGraph": plain.graphs[16].replay},
        rounds,
        50,
    )
    del h
    return row


def bench_moe(rounds: int) -> dict:
    from repro.scenarios import nvfp4_moe as moe

    dims = validate(load_preset("qwen3-30b-a3b-moe")).model
    dev, dtype = torch.device("cuda", 0), torch.bfloat16
    book = CensusBook()
    first = first_snapshot_ms()
    layer = moe.build_layer(dims, moe.MODES["fixed"], moe.make_checkpoint(dims, 0, -1, dtype, dev), dtype, dev)
    x = torch.randn(dims.tokens, dims.hidden_size, device=dev, dtype=dtype)
    with_census = capture(layer, (x,), "moe forward", CaptureGuard("off"), census=book)
    row = region_row("nvfp4 moe forward (Qwen3-30B-A3B)", book, first, "moe forward", rounds)
    plain = capture(layer, (x,), "moe forward plain", CaptureGuard("off"))
    row["replay_us"] = interleaved(
        {"keep_graph + instantiate": with_census.replay, "plain CUDAGraph": plain.replay}, max(3, rounds // 4), 10
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    rows = [bench_gemma(args.rounds), bench_moe(args.rounds)]
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0),
        "rounds": args.rounds,
    }
    emit({"environment": env, "rows": rows, "targets": {"census_total_ms": 50, "check_ms": 5}}, args.json)


if __name__ == "__main__":
    main()
