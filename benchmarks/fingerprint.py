"""What the contents fingerprint (repro/diagnose/fingerprint.py) costs, against the number and size of
the inputs a capture takes from outside its pool.

    PYTHONPATH=. python3 benchmarks/fingerprint.py [--device cpu|cuda] [--counts 16 256 1024]
        [--sizes 4096 262144 4194304 67108864] [--max-bytes N] [--repeats 5] [--json OUT]

Per (count, size): `count` float32 tensors of `size` bytes each, all read by one capture (a real
CUDA graph on cuda, the dry-run recording on cpu). Reported, in seconds:
  capture_end    guard.fingerprint(label): every input fingerprinted, one sync (the first call)
  deep_check     guard.check(deep=True) with the fingerprints compared (median of --repeats)
  deep_pointers  the same check with no fingerprint to compare: what a deep check cost before
  liveness       guard.check(deep=False): the per-replay path, which never fingerprints
  first_replay   (cuda) the first replay under guard.replaying(label) minus a plain replay:
                 the two fingerprints around it
Regions up to FULL_BYTES are summed whole, larger ones at SAMPLES fixed words, so above 1 MiB
the cost stops growing with the size. Tests never assert these times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402

import torch  # noqa: E402

from repro.diagnose import fingerprint  # noqa: E402
from repro.rank.graphs import HarnessMemory  # noqa: E402
from repro.diagnose.guard import CaptureGuard  # noqa: E402

LABEL = "inputs"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def median(fn, device: torch.device, repeats: int) -> float:
    return statistics.median(timed(fn, device) for _ in range(repeats))


def read_all(inputs: list[torch.Tensor]) -> torch.Tensor:
    """One element of every input: the capture reads (and records) each storage."""
    acc = torch.zeros(1, device=inputs[0].device)
    for t in inputs:
        acc += t[:1]
    return acc


def record(guard: CaptureGuard, inputs: list[torch.Tensor]):
    """The capture, without its fingerprints; returns the graph (None on cpu)."""
    device = inputs[0].device
    if device.type != "cuda":
        with guard.recording(LABEL):
            read_all(inputs)
        for slot in guard.slots:  # recording() fingerprints at its end: timed separately here
            slot.contents = None
        return None
    read_all(inputs)  # warm-up, as a capture asks
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with guard.capture(graph, LABEL, fingerprint=False):
        read_all(inputs)
    return graph


def row(count: int, size: int, device: torch.device, repeats: int) -> dict:
    inputs = [torch.randn(size // 4, device=device) for _ in range(count)]
    memory = HarnessMemory(device)
    guard = CaptureGuard("warn", compiles=False, scratch=memory.use)
    graph = record(guard, inputs)
    deep_pointers = median(lambda: guard.check("deep", deep=True), device, repeats)
    capture_end = timed(lambda: guard.fingerprint(LABEL), device)
    printed = sum(s.contents is not None for s in guard.slots)
    deep_check = median(lambda: guard.check("deep", deep=True), device, repeats)
    liveness = median(lambda: guard.check("replay", deep=False), device, repeats)
    out = {
        "count": count,
        "size_bytes": size,
        "sampled": size > fingerprint.FULL_BYTES,
        "fingerprinted": printed,
        "capture_end_s": capture_end,
        "deep_check_s": deep_check,
        "deep_pointers_s": deep_pointers,
        "liveness_s": liveness,
        "capture_end_us_per_input": capture_end / count * 1e6,
        "deep_extra_us_per_input": (deep_check - deep_pointers) / count * 1e6,
    }
    if graph is not None:

        def first() -> None:
            with guard.replaying(LABEL):
                graph.replay()

        out["first_replay_extra_s"] = timed(first, device) - median(graph.replay, device, repeats)
    return out


def warm_up(device: torch.device) -> None:
    """The first fingerprint pays kernel loading; no row should."""
    row(2, 1 << 21, device, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--counts", type=int, nargs="+", default=[16, 256, 1024])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 1 << 18, 1 << 22, 1 << 26])
    p.add_argument(
        "--max-bytes",
        type=int,
        default=None,
        help="skip rows above this many input bytes (default 2 GiB on cpu, 32 GiB on cuda)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.stderr.write("benchmarks/fingerprint.py: --device cuda, but torch sees no CUDA GPU\n")
        return 2
    limit = args.max_bytes or (32 << 30 if device.type == "cuda" else 2 << 30)
    with torch.no_grad():
        warm_up(device)
        rows = [row(c, s, device, args.repeats) for c in args.counts for s in args.sizes if c * s <= limit]
    emit(
        {
            "device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
            "torch": torch.__version__,
            "full_bytes": fingerprint.FULL_BYTES,
            "samples": fingerprint.SAMPLES,
            "skipped_above_bytes": limit,
            "rows": rows,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
