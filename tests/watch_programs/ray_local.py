"""Plumbing program for `repro watch` on Ray: starts a cluster of its own (`ray.init()`), one actor
whose 'graph' captures a weight held by a local, then replays. Prints the same lines watched or not."""

import os
import sys

import ray

PROGRAMS = os.path.dirname(os.path.abspath(__file__))


@ray.remote(num_cpus=0)
class Worker:
    def capture_routine(self, graph, capture):
        import torch

        weight = self.weight.clone()  # held by this local only: freed on return
        with capture(graph):
            out = torch.ones(2, 4) @ weight.t()
        return out

    def work(self):
        sys.path.insert(0, PROGRAMS)
        import torch
        from fake_graph import FakeGraph, capture, patch_if_watched

        try:
            watched = patch_if_watched()
        except ImportError:
            watched = False
        self.weight = torch.randn(8, 4)
        graph = FakeGraph()
        out = self.capture_routine(graph, capture)
        for _ in range(3):
            graph.replay()
        return os.getpid(), watched, tuple(out.shape)


def main():
    ray.init(num_cpus=1, object_store_memory=100_000_000, include_dashboard=False, log_to_driver=False)
    pid, watched, shape = ray.get(Worker.remote().work.remote())
    print(f"out {shape}")
    sys.stderr.write(f"actor pid {pid} watched={watched}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
