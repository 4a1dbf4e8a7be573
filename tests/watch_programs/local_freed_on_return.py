"""Plumbing program: does a capturing function's local die when the function returns, watched?

The watch hooks first run inside the program's own calls (its graph constructor, its capture),
which is where their modules get imported. Anything those imports leave in a reference cycle
with a frame pins, through f_back, every frame below it, the capturing function's included:
its locals then outlive its return until the cyclic GC happens to run. The GC is off here, so
"happens to run" cannot hide it. A graph stand-in (no CUDA on CPU) goes through the hooks;
argv[1] == "census" routes it through the census path with a stand-in census (graphs forced to
keep_graph, a census added at capture end). Prints one line: `alive=<bool> frames=<n> kept=<bool> slots=<names> internal=<n>`.
"""

import gc
import sys
import tempfile
import types
import weakref

import torch

gc.disable()  # before anything of the hooks is imported

from repro.watch import hooks as watch_hooks  # noqa: E402  (imports no torch, nothing of the guard yet)
from repro.watch.hooks import tools as hooks_tools  # noqa: E402
from fake_graph import KeptGraph, StandInBook  # noqa: E402  (beside this file)


class Graph(KeptGraph):
    """torch.cuda.CUDAGraph's shape, as far as the hooks use it."""


class Book(StandInBook):
    """A census that reads nothing (the real one needs a GPU)."""

    def add(self, graph, label, pool=None, since=None, after_read=None):
        # The kernel's two words, into the capturing function's locals: the guard makes their
        # slots from them (adopt), and that must not keep the local alive either.
        words = [
            types.SimpleNamespace(addr=refs[name]().data_ptr(), describe=lambda: f"node 0 kernel add param {i} +0")
            for i, name in enumerate(("dst", "src"))
        ]
        return types.SimpleNamespace(pending=words, references=[], seconds=0.0, sort_seconds=0.0)


def stand_in_census():
    from repro.diagnose.census import Tracing

    fake = type(sys)("stand_in_census")
    fake.Tracing = Tracing
    fake.census_supported = lambda: (True, "")
    fake.clock_marker = lambda: {"time_us": 0}
    fake.CensusBook = Book
    fake.merge_findings = lambda guard, census, slots, guard_on, book: guard + census
    return fake


refs = {}


def capture(dst):
    src = torch.arange(4.0)  # held by this local only: freed on return
    refs["src"], refs["dst"] = weakref.ref(src), weakref.ref(dst)
    graph = Graph()
    graph.capture_begin()
    dst.add_(src)
    graph.capture_end()
    return graph


def main(argv):
    if argv[:1] == ["census"]:
        hooks_tools.load_census = stand_in_census
    watcher = watch_hooks.activate(watch_hooks.WatchSettings(tempfile.mkdtemp(), "warn", "api"))
    watcher.patch(Graph)
    graph = capture(torch.zeros(4))
    frames = sum(1 for o in gc.get_objects() if type(o).__name__ == "frame" and o.f_code is capture.__code__)
    slots = [s.name for s in watcher.tools.guard.slots]
    print(
        f"alive={refs['src']() is not None} frames={frames} kept={getattr(graph, 'keep_graph')} "
        f"slots={','.join(slots).replace(' ', '_')} internal={watcher.log.counters.internal_errors}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
