"""GPU program: a tensor this file allocates, held only by the capturing function's local, is
captured into a CUDA graph and freed when that function returns; the graph is replayed after.

    repro watch --stacks -- python tests/watch_programs/freed_after_capture.py

The finding names the local, the line that dropped it and, with --stacks, the line marked
`# ALLOCATED` as where it was created (tests/test_watch_stacks_gpu.py). Without CUDA it says so
and exits 0.
"""

import sys

import torch


def capture(graph: torch.cuda.CUDAGraph, x: torch.Tensor) -> torch.Tensor:
    weight = torch.randn(256, 256, device="cuda")  # ALLOCATED: held by this local only
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x @ weight  # warm up (cuBLAS picks its kernel and workspace) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = x @ weight
    return out  # `weight` dies here; the graph keeps its address


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to capture")
        return 0
    x = torch.randn(16, 256, device="cuda")
    graph = torch.cuda.CUDAGraph()
    capture(graph, x)
    graph.replay()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
