"""A decode loop whose static KV cache is reallocated after the decode step was captured.

The engine captures one decode step into a CUDA graph, then (as a cache resize or a
sleep/wake cycle does) allocates a bigger cache, copies the old contents over and rebinds
`cache.k` / `cache.v`. The graph still writes and reads the old cache: its memory is freed
and handed to the next allocation, so later steps silently compute on garbage.

    python examples/watch_kv_cache.py            # bug: graph output differs from eager
    python examples/watch_kv_cache.py --fixed    # re-captures after the resize: clean
    repro watch -- python examples/watch_kv_cache.py                    # names cache.k / cache.v
    repro watch --on-finding raise -- python examples/watch_kv_cache.py # StaleCaptureError instead

Without CUDA it runs the same decode loop eagerly (no graph, nothing to find) and says so.
"""

import argparse
import sys

import torch


class Layer(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.q = torch.nn.Linear(hidden, hidden, bias=False)
        self.k = torch.nn.Linear(hidden, hidden, bias=False)
        self.v = torch.nn.Linear(hidden, hidden, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)


class Model(torch.nn.Module):
    def __init__(self, layers: int, hidden: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(hidden) for _ in range(layers))


class KVCache:
    def __init__(self, layers: int, max_len: int, hidden: int, device: str):
        self.k = torch.zeros(layers, max_len, hidden, device=device)  # [L, T, H]
        self.v = torch.zeros(layers, max_len, hidden, device=device)

    def grow(self, max_len: int) -> None:
        """Bigger cache, old contents copied over, attributes rebound (the bug's trigger)."""
        k = torch.zeros(self.k.shape[0], max_len, self.k.shape[2], device=self.k.device)
        v = torch.zeros_like(k)
        k[:, : self.k.shape[1]] = self.k
        v[:, : self.v.shape[1]] = self.v
        self.k, self.v = k, v


def decode_step(model: Model, cache: KVCache, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x [1, H], pos long[1]: writes this token's k/v at pos, attends over the whole cache."""
    h = x
    for i, layer in enumerate(model.layers):
        cache.k[i].index_copy_(0, pos, layer.k(h))
        cache.v[i].index_copy_(0, pos, layer.v(h))
        scores = (layer.q(h) @ cache.k[i].t()) / h.shape[-1] ** 0.5  # [1, T]
        h = h + layer.o(torch.softmax(scores, dim=-1) @ cache.v[i])
    return h


def capture(model, cache, x, pos):
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_step(model, cache, x, pos)  # warm up on a side stream, as usual
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = decode_step(model, cache, x, pos)
    return graph, out


def run(fixed: bool, steps: int = 16, layers: int = 4, hidden: int = 256, max_len: int = 64) -> float:
    """Max |graph - eager| over the steps after the resize (0.0 when the graph is right)."""
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    model = Model(layers, hidden).cuda()
    cache = KVCache(layers, max_len, hidden, "cuda")
    ref_cache = KVCache(layers, max_len, hidden, "cuda")
    x = torch.randn(1, hidden, device="cuda")
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    graph, out = capture(model, cache, x, pos)
    worst = 0.0
    for step in range(steps):
        if step == steps // 2:
            cache.grow(2 * max_len)
            ref_cache.grow(2 * max_len)
            # the next allocations of that size take the freed blocks (best fit in the cache)
            filler = [torch.full((layers, max_len, hidden), 1e4, device="cuda") for _ in range(2)]
            if fixed:
                graph, out = capture(model, cache, x, pos)  # the fix: re-capture after it
        x.copy_(torch.randn(1, hidden, device="cuda"))
        pos.fill_(step)
        graph.replay()
        expected = decode_step(model, ref_cache, x, pos)
        if step >= steps // 2:
            worst = max(worst, (out - expected).abs().max().item())
    del filler
    return worst


def run_cpu(steps: int = 4, layers: int = 2, hidden: int = 32, max_len: int = 16) -> None:
    torch.set_grad_enabled(False)
    model = Model(layers, hidden)
    cache = KVCache(layers, max_len, hidden, "cpu")
    for step in range(steps):
        decode_step(model, cache, torch.randn(1, hidden), torch.tensor([step]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="re-capture after the resize")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        run_cpu()
        print(
            "no CUDA device: ran the decode loop eagerly; no CUDA graph was captured, so there is nothing stale to find"
        )
        return 0
    err = run(args.fixed)
    print(f"{'fixed' if args.fixed else 'unfixed'}: max |graph - eager| after the resize = {err:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
