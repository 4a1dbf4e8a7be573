"""Plumbing program for torchrun: each rank joins a gloo group, 'captures' a stale local, replays."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fake_graph import FakeGraph, capture, patch_if_watched  # noqa: E402


def capture_routine(graph, x):
    weight = torch.full((4, 4), float(dist.get_rank() + 1))
    with capture(graph):
        out = x @ weight
    return out


def main():
    patch_if_watched()
    dist.init_process_group("gloo")
    x = torch.ones(1, 4)
    graph = FakeGraph()
    capture_routine(graph, x)
    graph.replay()
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {int(total)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
