"""Programs in the shapes inference engines capture CUDA graphs in, each with a buggy twin.

A decoder stand-in (RMS norm, fused QKV, a per-position rotary table, single-head attention
over a static KV cache, GELU MLP; bf16) is captured the ways engines do it:

  full        one graph per batch size (vLLM's 67 sizes: 1, 2, 4, 8..512 by 8), all in one
              shared memory pool, largest first
  piecewise   one graph per layer piece per size, chained through that pool: attention runs
              eagerly between pieces (the "split op") and writes into a buffer the piece before
              allocated; piece outputs are kept only as non-owning aliases (vLLM keeps weak
              references), so their blocks go back to the pool, which is the pool's contract
  mixed       full and piecewise graphs in one process and one pool
  split-op    piecewise, the split op writing into a static buffer (vLLM #53915's fix)
  compiled    torch.compile(mode="reduce-overhead") and the "cudagraphs" backend (torch's own
              cudagraph trees), and an inductor-compiled step captured by hand as vLLM does
  mempool     capture into a torch.cuda.MemPool, its static buffers made under use_mem_pool
  side-stream a capture that forks onto a side stream and joins back
  lora        a LoRA-style adapter updated between steps
  churn       a long run whose eager allocations churn every step (the allocator trace wraps)

    python examples/engine_shapes.py piecewise            # correct: 0 findings under watch
    python examples/engine_shapes.py piecewise --bug      # its twin: exactly the bug's tensors
    repro watch -- python examples/engine_shapes.py full --bug --sizes 67 --layers 32

What each twin breaks (`--bug`), and so what `repro watch` must name, nothing else:

  full, piecewise  layer 1's rotary table rebound after capture (model.layers.1.rotary, freed)
  mixed            the KV cache grown after capture (kv.k / kv.v rebound, old storage freed)
  split-op         the split op returns a fresh tensor every step (#53915): the next piece
                   reads the capture-time one, freed when the capture loop moved on
  compiled         the hand-captured inductor step: layer 0's norm weight rebound
  mempool          a scale made outside the pool, held by a local, freed when capture returns
  side-stream      the side stream's weight held by a local, freed when capture returns
  lora             the adapter rebound instead of copied into (model.layers.*.lora_a)
  churn            layer 0's up-projection weight replaced late in the run, after the trace wrapped

Each program prints one JSON line: shape, bug, graphs captured, capture seconds, first round
and steady decode step times, and max |graph - eager| (0 for a correct twin). Without CUDA it
says so and exits 0 (nothing is captured).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time


def vllm_sizes(count: int) -> list[int]:
    """The first `count` of vLLM's default capture sizes, largest first (as vLLM captures)."""
    sizes = [1, 2, 4] + list(range(8, 513, 8))
    return sorted(sizes[:count], reverse=True)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--bug", action="store_true", help="run the buggy twin")
    p.add_argument("--sizes", type=int, default=8, help="how many batch sizes (67: vLLM's default)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--context", type=int, default=128, help="KV cache positions")
    p.add_argument("--steps", type=int, default=3, help="decode rounds over every size")
    p.add_argument(
        "--alloc-conf",
        default="",
        help="PYTORCH_CUDA_ALLOC_CONF, set before CUDA starts (e.g. expandable_segments:True)",
    )
    return p.parse_args(argv)


# -- the decoder stand-in ----------------------------------------------------------------------


def build_model(torch, layers: int, hidden: int, context: int):
    nn = torch.nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.Parameter(torch.ones(hidden))
            self.norm2 = nn.Parameter(torch.ones(hidden))
            self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
            self.o = nn.Linear(hidden, hidden, bias=False)
            self.up = nn.Linear(hidden, 2 * hidden, bias=False)
            self.down = nn.Linear(2 * hidden, hidden, bias=False)
            self.register_buffer("rotary", 1 + 0.1 * torch.randn(context, hidden))  # [T, H]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(layers))

    return Model().cuda().to(torch.bfloat16).requires_grad_(False)


class KVCache:
    def __init__(self, torch, layers: int, context: int, hidden: int):
        self.k = torch.zeros(layers, context, hidden, device="cuda", dtype=torch.bfloat16)  # [L, T, H]
        self.v = torch.zeros_like(self.k)

    def grow(self, torch, context: int) -> None:
        """A bigger cache, old contents copied, attributes rebound (the mixed twin's bug)."""
        k = torch.zeros(self.k.shape[0], context, self.k.shape[2], device="cuda", dtype=self.k.dtype)
        v = torch.zeros_like(k)
        k[:, : self.k.shape[1]] = self.k
        v[:, : self.v.shape[1]] = self.v
        self.k, self.v = k, v


def rms(torch, x, w):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w


def pre(torch, layer, x, pos):
    """Layer input -> q, k, v (the part before attention)."""
    q, k, v = (rms(torch, x, layer.norm) @ layer.qkv.weight.t()).chunk(3, dim=-1)
    return q * layer.rotary[pos], k, v


def attend(torch, q, k, v, kv, i: int, pos):
    """Single-head decode attention over layer i's static cache; row 0 writes at pos. [b, H]"""
    kv.k[i].index_copy_(0, pos, k[:1])
    kv.v[i].index_copy_(0, pos, v[:1])
    scores = (q @ kv.k[i].t()) / math.sqrt(q.shape[-1])  # [b, T]
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ kv.v[i]


def post(torch, layer, x, a):
    x = x + a @ layer.o.weight.t()
    if hasattr(layer, "lora_a"):  # the lora shape's adapter
        x = x + (a @ layer.lora_a.t()) @ layer.lora_b.t()
    h = rms(torch, x, layer.norm2)
    return x + torch.nn.functional.gelu(h @ layer.up.weight.t()) @ layer.down.weight.t()


def full_step(torch, model, kv, x, pos):
    for i, layer in enumerate(model.layers):
        q, k, v = pre(torch, layer, x, pos)
        x = post(torch, layer, x, attend(torch, q, k, v, kv, i, pos))
    return x


# -- capture helpers ---------------------------------------------------------------------------


def alias(torch, t):
    """A tensor over t's memory that does not own it (vLLM's weak_ref_tensors)."""
    storage = torch._C._construct_storage_from_data_pointer(t.data_ptr(), t.device, t.untyped_storage().nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape, t.stride())


def capture(torch, fn, pool, stream=None):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = fn()
    return graph, out


class Engine:
    """Static inputs per size, the captured graphs, and the replay of one decode step."""

    def __init__(self, torch, args, model, kv):
        self.torch, self.args, self.model, self.kv = torch, args, model, kv
        self.pool = torch.cuda.graph_pool_handle()
        self.pos = torch.zeros(1, dtype=torch.long, device="cuda")
        self.inputs = {
            b: torch.randn(b, args.hidden, device="cuda", dtype=torch.bfloat16) for b in vllm_sizes(args.sizes)
        }
        self.full: dict[int, tuple] = {}  # size -> (graph, output)
        self.pieces: dict[int, list] = {}  # size -> [(graph, aliases of its outputs)]
        self.static_attn: dict[int, list] = {}  # split-op: size -> static output per layer
        self.graphs = 0

    # full: one graph per size
    def capture_full(self, sizes) -> None:
        torch = self.torch
        for b in sizes:
            x = self.inputs[b]
            full_step(torch, self.model, self.kv, x, self.pos)  # warm up, as engines do
            graph, out = capture(torch, lambda: full_step(torch, self.model, self.kv, x, self.pos), self.pool)
            self.full[b] = (graph, out)
            self.graphs += 1

    def replay_full(self, b: int):
        graph, out = self.full[b]
        graph.replay()
        return out

    # piecewise: one graph per layer piece; the attention between pieces runs eagerly
    def piece(self, j: int, x, a):
        """Piece j: finish layer j-1 (if any), start layer j (if any). Outputs (x, q, k, v, a_buf)."""
        torch, layers = self.torch, self.model.layers
        if j > 0:
            x = post(torch, layers[j - 1], x, a)
        if j == len(layers):
            return (x,)
        q, k, v = pre(torch, layers[j], x, self.pos)
        return x, q, k, v, torch.empty_like(q)  # the split op's output, made in the pool

    def split(self, j: int, b: int, q, k, v, a_buf, fresh: bool):
        attn = attend(self.torch, q, k, v, self.kv, j, self.pos)
        if fresh:
            return attn  # #53915: a fresh tensor every step
        target = self.static_attn[b][j] if self.static_attn else a_buf
        target.copy_(attn)
        return target

    def capture_pieces(self, sizes, fresh_split: bool = False, static_split: bool = False) -> None:
        torch = self.torch
        for b in sizes:
            if static_split:
                self.static_attn[b] = [
                    torch.empty(b, self.args.hidden, device="cuda", dtype=torch.bfloat16) for _ in self.model.layers
                ]
            full_step(torch, self.model, self.kv, self.inputs[b], self.pos)  # warm up
            chain, x, a, outs = [], self.inputs[b], None, []
            for j in range(len(self.model.layers) + 1):
                graph, out = capture(torch, lambda: self.piece(j, x, a), self.pool)  # noqa: F821 (deleted below, on purpose)
                outs.append(out)
                chain.append([graph, None])
                self.graphs += 1
                if j < len(self.model.layers):
                    x, q, k, v, a_buf = out
                    a = self.split(j, b, q, k, v, a_buf, fresh_split)
            # Only non-owning aliases survive the capture: the blocks go back to the shared pool.
            for link, out in zip(chain, outs):
                link[1] = [alias(torch, t) for t in out]
            self.pieces[b] = chain
            del outs, out, x, a

    def replay_pieces(self, b: int, fresh_split: bool = False):
        chain = self.pieces[b]
        for j, (graph, outs) in enumerate(chain):
            graph.replay()
            if j < len(chain) - 1:
                _, q, k, v, a_buf = outs
                self.split(j, b, q, k, v, a_buf, fresh_split)
        return chain[-1][1][0]


# -- the shapes --------------------------------------------------------------------------------


def decode(torch, args, step_fn, sizes, reference) -> dict:
    """`steps` rounds over every size; timings (the synced step, and its host part: whether a
    slower step is the host's or the GPU's), and the worst |graph - eager| (compared on the
    first round, after the timed rounds so comparing costs no replay time)."""
    first = time.perf_counter()
    for b in sizes:
        step_fn(b)
    torch.cuda.synchronize()
    first_round = time.perf_counter() - first
    per_step, per_host = [], []
    for _ in range(args.steps):
        for b in sizes:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step_fn(b)
            t1 = time.perf_counter()  # the host's own part: until the step returned
            torch.cuda.synchronize()
            per_step.append(time.perf_counter() - t0)
            per_host.append(t1 - t0)
    worst = 0.0
    for b in sizes:
        got = step_fn(b).float()
        want = reference(b).float()
        worst = max(worst, (got - want).abs().max().item())
    return {
        "first_round_s": first_round,
        "step_us": 1e6 * statistics.median(per_step),
        "host_us": 1e6 * statistics.median(per_host),
        "max_abs_err": worst,
    }


def run_full(torch, args, engine) -> dict:
    sizes = vllm_sizes(args.sizes)
    t0 = time.perf_counter()
    engine.capture_full(sizes)
    capture_s = time.perf_counter() - t0
    if args.bug:
        rebind_rotary(torch, engine.model)
    ref = lambda b: full_step(torch, engine.model, engine.kv, engine.inputs[b], engine.pos)
    return {"capture_s": capture_s, **decode(torch, args, engine.replay_full, sizes, ref)}


def run_piecewise(torch, args, engine, fresh_split=False, static_split=False) -> dict:
    sizes = vllm_sizes(args.sizes)
    t0 = time.perf_counter()
    engine.capture_pieces(sizes, fresh_split=fresh_split, static_split=static_split)
    capture_s = time.perf_counter() - t0
    if args.bug and not fresh_split:
        rebind_rotary(torch, engine.model)
    ref = lambda b: full_step(torch, engine.model, engine.kv, engine.inputs[b], engine.pos)
    step = lambda b: engine.replay_pieces(b, fresh_split)
    return {"capture_s": capture_s, **decode(torch, args, step, sizes, ref)}


def rebind_rotary(torch, model) -> None:
    """The twin's bug: a layer's table rebuilt and rebound after capture (old storage freed)."""
    layer = model.layers[1]
    layer.rotary = (layer.rotary.float() * 1.0).to(torch.bfloat16)


def shape_full(torch, args, engine):
    return run_full(torch, args, engine)


def shape_piecewise(torch, args, engine):
    return run_piecewise(torch, args, engine)


def shape_split_op(torch, args, engine):
    return run_piecewise(torch, args, engine, fresh_split=args.bug, static_split=not args.bug)


def shape_mixed(torch, args, engine):
    sizes = vllm_sizes(args.sizes)
    small = [b for b in sizes if b <= 8] or sizes[-1:]
    t0 = time.perf_counter()
    engine.capture_pieces(sizes)  # piecewise for every size (the big ones)
    engine.capture_full(small)  # full graphs for the small ones
    capture_s = time.perf_counter() - t0
    if args.bug:
        engine.kv.grow(torch, 2 * args.context)
    ref = lambda b: full_step(torch, engine.model, engine.kv, engine.inputs[b], engine.pos)
    step = lambda b: engine.replay_full(b) if b in engine.full else engine.replay_pieces(b)
    return {"capture_s": capture_s, **decode(torch, args, step, sizes, ref)}


def shape_compiled(torch, args, engine):
    """torch's cudagraph trees (managed: watch counts them) and vLLM's shape: an inductor-
    compiled step captured by hand into the shared pool."""
    import torch._dynamo

    sizes = vllm_sizes(min(args.sizes, 3))
    model, kv, pos = engine.model, engine.kv, engine.pos
    step = lambda x: full_step(torch, model, kv, x, pos)
    t0 = time.perf_counter()
    for mode in ("reduce-overhead", "cudagraphs"):
        torch._dynamo.reset()
        compiled = (
            torch.compile(step, mode=mode) if mode == "reduce-overhead" else torch.compile(step, backend="cudagraphs")
        )
        for b in sizes:
            for _ in range(3):  # trees record on the second call, replay after
                out = compiled(engine.inputs[b].clone())
            torch.cuda.synchronize()
        del out
    torch._dynamo.reset()
    inductor = torch.compile(step, dynamic=False)
    for b in sizes:
        inductor(engine.inputs[b])  # compile and warm up outside the capture
        graph, out = capture(torch, lambda: inductor(engine.inputs[b]), engine.pool)
        engine.full[b] = (graph, out)
        engine.graphs += 1
    capture_s = time.perf_counter() - t0
    if args.bug:
        layer = model.layers[0]
        layer.norm = torch.nn.Parameter(layer.norm.detach().clone(), requires_grad=False)
    ref = lambda b: full_step(torch, model, kv, engine.inputs[b], pos)
    return {"capture_s": capture_s, **decode(torch, args, engine.replay_full, sizes, ref)}


def shape_mempool(torch, args, engine):
    """Graphs captured into a user MemPool; their static scale lives in it too."""
    pool = torch.cuda.MemPool()
    engine.pool = pool.id
    sizes = vllm_sizes(args.sizes)
    with torch.cuda.use_mem_pool(pool):
        scale = torch.full((args.hidden,), 0.5, device="cuda", dtype=torch.bfloat16)
    graphs = {}
    t0 = time.perf_counter()
    for b in sizes:
        graphs[b] = capture_scaled(torch, engine, b, scale, outside=args.bug)
    capture_s = time.perf_counter() - t0

    def step(b):
        graph, out = graphs[b]
        graph.replay()
        return out

    ref = lambda b: full_step(torch, engine.model, engine.kv, engine.inputs[b], engine.pos) * scale
    result = {"capture_s": capture_s, **decode(torch, args, step, sizes, ref)}
    graphs.clear()
    return result


def capture_scaled(torch, engine, b, scale, outside: bool):
    """Capture step * scale; the twin multiplies by a copy made outside the pool, held by a
    local only (freed when this returns)."""
    x = engine.inputs[b]
    factor = scale.clone() if outside else scale  # clone: default pool, outside capture
    body = lambda: full_step(torch, engine.model, engine.kv, x, engine.pos) * factor
    body()
    graph, out = capture(torch, body, engine.pool)
    engine.graphs += 1
    return graph, out


def shape_side_stream(torch, args, engine):
    """Inside the capture the MLP of the last layer runs on a side stream and joins back."""
    sizes = vllm_sizes(args.sizes)
    side = torch.cuda.Stream()
    graphs = {}
    t0 = time.perf_counter()
    for b in sizes:
        graphs[b] = capture_forked(torch, engine, b, side, local_weight=args.bug)
    capture_s = time.perf_counter() - t0

    def step(b):
        graph, out = graphs[b]
        graph.replay()
        return out

    def ref(b):
        x = full_step(torch, engine.model, engine.kv, engine.inputs[b], engine.pos)
        return x + x @ engine.model.layers[-1].o.weight.t()

    return {"capture_s": capture_s, **decode(torch, args, step, sizes, ref)}


def capture_forked(torch, engine, b, side, local_weight: bool):
    x = engine.inputs[b]
    w = engine.model.layers[-1].o.weight
    weight = w.clone() if local_weight else w  # the twin: a copy held by a local

    def body():
        h = full_step(torch, engine.model, engine.kv, x, engine.pos)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            extra = h @ weight.t()
        torch.cuda.current_stream().wait_stream(side)
        return h + extra

    body()
    torch.cuda.synchronize()
    graph, out = capture(torch, body, engine.pool)
    engine.graphs += 1
    return graph, out


def shape_lora(torch, args, engine):
    """A rank-8 adapter on every layer's o projection, updated between steps (RL / LoRA swap)."""
    for layer in engine.model.layers:
        layer.lora_a = adapter(torch, 8, args.hidden)
        layer.lora_b = adapter(torch, args.hidden, 8)
    sizes = vllm_sizes(args.sizes)
    t0 = time.perf_counter()
    engine.capture_full(sizes)
    capture_s = time.perf_counter() - t0
    swap_adapters(torch, engine.model, rebind=args.bug)
    ref = lambda b: full_step(torch, engine.model, engine.kv, engine.inputs[b], engine.pos)
    return {"capture_s": capture_s, **decode(torch, args, engine.replay_full, sizes, ref)}


def adapter(torch, rows: int, cols: int):
    return torch.nn.Parameter(0.01 * torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16), requires_grad=False)


def swap_adapters(torch, model, rebind: bool) -> None:
    """Load the next adapter: copied into the captured storage (correct) or rebound (the twin)."""
    for layer in model.layers:
        new_a, new_b = adapter(torch, *layer.lora_a.shape), adapter(torch, *layer.lora_b.shape)
        if rebind:
            layer.lora_a, layer.lora_b = new_a, new_b
        else:
            layer.lora_a.copy_(new_a)
            layer.lora_b.copy_(new_b)


def shape_churn(torch, args, engine):
    """Hundreds of steps, each allocating and freeing eager tensors of varying sizes (sampling,
    logits processors), so the allocator's bounded trace wraps many times over."""
    sizes = vllm_sizes(args.sizes)
    t0 = time.perf_counter()
    engine.capture_full(sizes)
    capture_s = time.perf_counter() - t0
    rounds = max(args.steps, 300)
    for r in range(rounds):
        b = sizes[r % len(sizes)]
        _out = engine.replay_full(b)  # held until the next step, as an engine holds its output
        for n in range(16):  # eager churn, every step
            torch.empty(64 + (r * 977 + n * 131) % 65536, device="cuda")
        if args.bug and r == rounds - 20:
            layer = engine.model.layers[0]
            layer.up.weight = torch.nn.Parameter(layer.up.weight.detach().clone(), requires_grad=False)
    ref = lambda b: full_step(torch, engine.model, engine.kv, engine.inputs[b], engine.pos)
    return {"capture_s": capture_s, "rounds": rounds, **decode(torch, args, engine.replay_full, sizes, ref)}


# What each buggy twin must be reported for (fnmatch patterns over finding names), and nothing
# else; a correct twin must give no finding at all.
BUGS = {
    "full": ("*layers.1.rotary",),
    "piecewise": ("*layers.1.rotary",),
    "mixed": ("*kv.k", "*kv.v"),
    "split-op": ("<local a of *",),
    "compiled": ("*layers.0.norm",),
    "mempool": ("<local factor of *",),
    "side-stream": ("<local weight of *",),
    "lora": ("*layers.*.lora_a", "*layers.*.lora_b"),
    "churn": ("*layers.0.up.weight",),
}

SHAPES = {
    "full": shape_full,
    "piecewise": shape_piecewise,
    "split-op": shape_split_op,
    "mixed": shape_mixed,
    "compiled": shape_compiled,
    "mempool": shape_mempool,
    "side-stream": shape_side_stream,
    "lora": shape_lora,
    "churn": shape_churn,
}


def main(argv=None) -> int:
    args = parse(argv)
    if args.alloc_conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    import torch

    if not torch.cuda.is_available():
        print(
            json.dumps(
                {"shape": args.shape, "bug": args.bug, "cuda": False, "note": "no CUDA device: nothing was captured"}
            )
        )
        return 0
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    model = build_model(torch, args.layers, args.hidden, args.context)
    kv = KVCache(torch, args.layers, args.context, args.hidden)
    engine = Engine(torch, args, model, kv)
    result = SHAPES[args.shape](torch, args, engine)
    print(
        json.dumps(
            {
                "shape": args.shape,
                "bug": args.bug,
                "graphs": engine.graphs,
                "sizes": args.sizes,
                "layers": args.layers,
                "hidden": args.hidden,
                **{k: round(v, 6) if isinstance(v, float) else v for k, v in result.items()},
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
