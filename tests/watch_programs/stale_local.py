"""Plumbing program: a 'graph' captures a weight held only by a local, then replays.

Prints the same lines watched or not; exits 0 unless a replay raised. argv: [spawn N] [fork]
"""

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from fake_graph import FakeGraph, capture, patch_if_watched  # noqa: E402


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)


def capture_routine(graph, head, x):
    weight = head.weight.clone()  # held by this local only: freed on return
    with capture(graph):
        out = x @ weight.t()
    return out


def main(argv):
    watched = patch_if_watched()
    head, x = Head(), torch.ones(2, 4)
    graph = FakeGraph()
    out = capture_routine(graph, head, x)
    for _ in range(3):
        graph.replay()
    print(f"out {tuple(out.shape)} replays 3")
    sys.stderr.write(f"watched={watched}\n")
    if argv[:1] == ["spawn"]:
        depth = int(argv[1])
        if depth > 0:
            rc = subprocess.call([sys.executable, __file__, "spawn", str(depth - 1)])
            print(f"child exited {rc}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
