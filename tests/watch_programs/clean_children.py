"""Plumbing program: no bug. Starts a child that starts a grandchild (subprocess) and a
torch.multiprocessing spawn worker; every process prints one line and 'captures' a tensor
that stays alive. argv: exit code to end with."""

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from fake_graph import FakeGraph, capture, patch_if_watched  # noqa: E402


def graph_work(tag):
    patch_if_watched()
    weight = torch.ones(4, 4)  # stays alive: no finding
    graph = FakeGraph()
    with capture(graph):
        weight.sum()
    graph.replay()
    print(f"{tag} pid-independent line", flush=True)


def spawned(index):
    graph_work(f"spawn worker {index}")


def main(argv):
    role = argv[0] if argv else "top"
    graph_work(role)
    if role == "top":
        subprocess.check_call([sys.executable, __file__, "child"])
        mp.spawn(spawned, nprocs=1)
        return int(argv[1]) if len(argv) > 1 else 0
    if role == "child":
        subprocess.check_call([sys.executable, __file__, "grandchild"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
