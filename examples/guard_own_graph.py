"""Guard your own CUDA graph: capture around a weight held only by a local, then ask the guard.

Runs on a GPU (a real torch.cuda.CUDAGraph) or, without one, as a CPU dry run of the same code.
    PYTHONPATH=. python examples/guard_own_graph.py
"""

import torch

from repro.diagnose.guard import CaptureGuard


def main() -> list[str]:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.set_grad_enabled(False)
    guard = CaptureGuard(mode="warn")  # "raise": check() raises StaleCaptureError
    head = torch.nn.Linear(256, 4096, bias=False, device=device)
    guard.watch("head", head)  # readable names: "head.weight"
    static_in = torch.zeros(16, 256, device=device)
    graph = torch.cuda.CUDAGraph() if cuda else None

    def capture_routine():
        weight = head.weight.clone()  # made outside the capture, held by a local
        static_in @ weight.t()  # warm up before capturing, as usual
        if cuda:
            torch.cuda.synchronize()
            with guard.capture(graph, "head bs=16"):
                return static_in @ weight.t()
        with guard.recording("head bs=16"):  # CPU: same recording, no graph
            return static_in @ weight.t()
        # `weight` dies on return; a graph keeps its address

    with guard.tracking():  # optional: where storages were made
        capture_routine()
    findings = guard.check("before replay")  # microseconds; nothing is replayed
    for f in findings:
        print(f.message)
    return [f.slot for f in findings]


if __name__ == "__main__":
    main()
