"""A stand-in for torch.cuda.CUDAGraph on CPU, for plumbing tests of the watch hooks only.

No graph exists: capture_begin/capture_end/replay/reset do nothing, so what these tests show is
that the hooks are installed, record what the code between capture_begin and capture_end
touches, and check before replay. Real capture is covered by the GPU runs.
"""


class FakeGraph:
    def capture_begin(self, *args, **kwargs):
        pass

    def capture_end(self):
        pass

    def replay(self):
        pass

    def reset(self):
        pass


class KeptGraph(FakeGraph):
    """torch.cuda.CUDAGraph's shape where the census runs: CUDAGraph(keep_graph=...) (through
    __new__ and __init__, as pybind's constructor takes it) and instantiate()."""

    def __new__(cls, keep_graph=False):
        return super().__new__(cls)

    def __init__(self, keep_graph=False):
        self.keep_graph = keep_graph

    def instantiate(self):
        pass


class StandInBook:
    """A census book that reads nothing (the real one needs a GPU): subclasses say what add()
    finds in a graph (words with addr and describe())."""

    def __init__(self, rank, trace):
        self.censuses = {}

    def hand_over(self, census, left):
        census.pending = left

    def resume_trace(self):
        pass

    def pause_trace(self):
        return False

    def check(self, when, graph):
        return []

    def check_graphs(self, when, labels):
        return []

    def census_line(self):
        return "graph census: stand-in"


class capture:
    """torch.cuda.graph's shape: capture_begin on enter, capture_end on exit."""

    def __init__(self, graph):
        self.graph = graph

    def __enter__(self):
        self.graph.capture_begin()

    def __exit__(self, *exc):
        self.graph.capture_end()


def patch_if_watched():
    """Route FakeGraph through the watch hooks when this process is watched."""
    from repro.watch import hooks as watch_hooks

    watcher = watch_hooks.active()
    if watcher is not None:
        watcher.patch(FakeGraph)
    return watcher is not None
