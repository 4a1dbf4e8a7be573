"""A raw Triton kernel captured in a CUDA graph reads a buffer that is freed after the capture.

Triton launches never pass through the PyTorch dispatcher, so the stale-capture guard (like
torch's own check_input_liveness) cannot see this buffer; only the graph census, which reads
the kernel parameters out of the captured graph, can. Under `repro watch` this example has a
finding only where the census is available (the report's "census:" line says whether it ran);
the guard alone reports nothing here, and that is the expected blind spot, not a pass.

    python examples/watch_triton_freed.py
    repro watch -- python examples/watch_triton_freed.py

Without CUDA or Triton it says so and exits 0.
"""

import sys

import torch


def build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def scale(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask) * 2.0, mask=mask)

    def launch(src: torch.Tensor, dst: torch.Tensor) -> None:
        n = src.numel()
        scale[(triton.cdiv(n, 1024),)](src, dst, n, BLOCK=1024)

    return launch


def capture(launch, dst, n):
    src = torch.arange(n, device="cuda", dtype=torch.float32)  # held by this local only
    launch(src, dst)  # compile + warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(src, dst)
    return graph  # src is freed here


def run(n: int = 1 << 16) -> float:
    launch = build_kernel()
    dst = torch.zeros(n, device="cuda")
    graph = capture(launch, dst, n)
    reuse = torch.full((n,), -1.0, device="cuda")  # takes src's freed block
    graph.replay()
    torch.cuda.synchronize()
    expected = torch.arange(n, device="cuda", dtype=torch.float32) * 2
    del reuse
    return (dst - expected).abs().max().item()


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this example needs a GPU and Triton; nothing was run")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("Triton is not installed: nothing was run")
        return 0
    err = run()
    print(f"max |graph - expected| = {err:.3g} (nonzero: the graph read the freed buffer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
