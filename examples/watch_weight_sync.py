"""RL-style weight sync into a policy whose forward pass was captured as a CUDA graph.

After each training step the trainer sends new weights. Loading them with
``load_state_dict(new, assign=True)`` rebinds every parameter to the trainer's tensors: the
graph keeps the old parameters' addresses, whose memory is freed and reused, so rollouts run
on garbage with no error (vLLM #40390's pattern). Copying in place (``param.copy_(new)``)
keeps the captured addresses and is correct.

    python examples/watch_weight_sync.py                 # assign=True: graph != eager
    python examples/watch_weight_sync.py --in-place      # copy_: clean
    repro watch -- python examples/watch_weight_sync.py  # names policy.layers.N.weight, freed

Without CUDA it runs the syncs and eager forwards only and says so.
"""

import argparse
import sys

import torch


def make_policy(layers: int, hidden: int, device: str) -> torch.nn.Sequential:
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*mods).to(device)


def trainer_weights(policy: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """New tensors, as a trainer (or a broadcast from it) would deliver them."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return {name: (torch.randn(p.shape, generator=gen) * 0.05).to(p.device) for name, p in policy.state_dict().items()}


def sync_weights(policy: torch.nn.Module, new: dict[str, torch.Tensor], in_place: bool) -> None:
    if in_place:
        with torch.no_grad():
            for name, p in policy.state_dict().items():
                p.copy_(new[name])  # captured addresses stay valid
    else:
        policy.load_state_dict(new, assign=True)  # rebinds: the graph keeps the old ones


def capture(policy, static_in):
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        policy(static_in)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        static_out = policy(static_in)
    return graph, static_out


def run(in_place: bool, syncs: int = 3, layers: int = 8, hidden: int = 512, batch: int = 16) -> float:
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    policy = make_policy(layers, hidden, "cuda")
    static_in = torch.randn(batch, hidden, device="cuda")
    graph, static_out = capture(policy, static_in)
    graph.replay()
    worst = 0.0
    for sync in range(syncs):
        sync_weights(policy, trainer_weights(policy, seed=sync + 1), in_place)
        scratch = [torch.randn(hidden, hidden, device="cuda") for _ in range(2 * layers)]  # reuse
        static_in.copy_(torch.randn(batch, hidden, device="cuda"))
        graph.replay()
        worst = max(worst, (static_out - policy(static_in)).abs().max().item())
        del scratch
    return worst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-place", action="store_true", help="copy_ into the captured parameters")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        torch.set_grad_enabled(False)
        policy = make_policy(2, 32, "cpu")
        sync_weights(policy, trainer_weights(policy, seed=1), args.in_place)
        policy(torch.randn(4, 32))
        print(
            "no CUDA device: synced weights and ran the policy eagerly; no CUDA graph was "
            "captured, so there is nothing stale to find"
        )
        return 0
    err = run(args.in_place)
    print(f"{'in-place' if args.in_place else 'assign=True'}: max |graph - eager| after syncs = {err:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
