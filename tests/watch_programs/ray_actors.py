"""Plumbing program for `repro watch` on Ray: joins the cluster at argv[1] with a runtime_env of
its own, starts one actor on each worker node (every node but the head); on the first node the
actor's 'graph' captures a weight held by a local (a finding under watch), on the others the
weight stays alive (clean). Prints the same lines watched or not."""

import os
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

PROGRAMS = os.path.dirname(os.path.abspath(__file__))


@ray.remote(num_cpus=0)
class Worker:
    def capture_routine(self, graph, capture, stale):
        import torch

        weight = self.weight.clone() if stale else self.weight  # stale: held by this local only
        with capture(graph):
            out = torch.ones(2, 4) @ weight.t()
        return out

    def work(self, stale: bool):
        sys.path.insert(0, PROGRAMS)  # one machine: the plumbing module is right here
        import torch
        from fake_graph import FakeGraph, capture, patch_if_watched

        try:
            watched = patch_if_watched()
        except ImportError:  # not watched: repro is not on this node's path
            watched = False
        self.weight = torch.randn(8, 4)
        graph = FakeGraph()
        out = self.capture_routine(graph, capture, stale)
        for _ in range(3):
            graph.replay()
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "watched": watched,
            "program_var": os.environ.get("PROGRAM_VAR"),
            "shape": tuple(out.shape),
        }


def main(address):
    ray.init(address=address, runtime_env={"env_vars": {"PROGRAM_VAR": "mine"}}, log_to_driver=False)
    head = ray.get_runtime_context().get_node_id()
    nodes = sorted((n["NodeName"], n["NodeID"]) for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
    actors = [
        Worker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nid, soft=False)).remote()
        for _, nid in nodes
    ]
    results = ray.get([a.work.remote(i == 0) for i, a in enumerate(actors)])
    for (name, _), r in zip(nodes, results):
        print(f"{name} program_var {r['program_var']} out {r['shape']}")
        sys.stderr.write(f"{name} pid {r['pid']} watched={r['watched']}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
