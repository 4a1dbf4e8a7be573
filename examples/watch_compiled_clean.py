"""A correct program under torch.compile(mode="reduce-overhead"): `repro watch` must find nothing.

cudagraph trees capture and replay their own graphs and reuse their pool's memory on purpose;
`repro watch` counts those graphs as managed (torch checks its own invariants there) and must
not change the program's results. Prints the max difference to eager; exits 1 if it is wrong.

    python examples/watch_compiled_clean.py
    repro watch -- python examples/watch_compiled_clean.py    # expect: no findings

Without CUDA it says so and exits 0.
"""

import sys

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: reduce-overhead needs CUDA graphs; nothing was run")
        return 0
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU()) for _ in range(6)]
    ).cuda()
    compiled = torch.compile(model, mode="reduce-overhead")
    worst = 0.0
    for step in range(20):
        x = torch.randn(8 if step % 2 else 16, 512, device="cuda")
        worst = max(worst, (compiled(x) - model(x)).abs().max().item())
    print(f"reduce-overhead: 20 steps, max |compiled - eager| = {worst:.3g}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
