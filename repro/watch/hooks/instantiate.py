"""A kept graph's instantiation, alongside the census's host work at capture end.

Where the census runs, graphs are captured with keep_graph=True and the watch instantiates them
at the end of capture_end, where torch would have (patch.patch_keep_graph). torch's
CUDAGraph.instantiate releases the GIL around cudaGraphInstantiateWithFlags, and once the census
has read a graph's nodes it no longer touches the graph: sorting the words it read, naming their
storages and placing them in pools is host work on what was read. So a large graph's
instantiation runs on a thread of its own meanwhile, and capture_end waits for it before it
returns: the program gets its graph instantiated, or the same exception, at the same point.

CUDA graph objects are not internally synchronized: nothing else may use the graph while it is
instantiated, which is why the thread starts only after the census's last driver call on it.
"""

from __future__ import annotations

import threading
from typing import Any

# Graphs of fewer parameter words instantiate inline: a piece of a piecewise engine (~25
# kernels) leaves little to overlap, and starting and joining a thread costs ~0.1 ms (2-core
# CPU machine), times 2,000 pieces; a full decoder graph (~1,000 kernels, ~70,000 words) takes
# milliseconds both to instantiate and to sort. The census sorts graphs of up to as many words
# one by one (words.SMALL_GRAPH_WORDS) for the same reason: they are small.
THREAD_WORDS = 8192


class Instantiation:
    """graph.instantiate(), started on a thread by start() or run inline by finish()."""

    def __init__(self, graph: Any):
        self.graph = graph
        self.device: int | None = None  # the capturing thread's current device, for the thread
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, census: Any = None) -> None:
        """After the census's last read of the graph (take_census's after_read): a large graph
        starts instantiating on a thread; a small one (or no census) is left to finish()."""
        if census is None or census.words < THREAD_WORDS or self.thread is not None:
            return
        try:
            import torch  # the program's: it captured the graph

            self.device = torch.cuda.current_device() if torch.cuda.is_available() else None
            thread = threading.Thread(target=self.run, name="repro-watch-instantiate", daemon=True)
            thread.start()
        except Exception:  # no device or no thread to be had: finish() instantiates inline
            return
        self.thread = thread

    def run(self) -> None:
        try:
            if self.device is not None:
                import torch

                torch.cuda.set_device(self.device)  # per thread: a new thread starts on device 0
            self.graph.instantiate()
        except BaseException as e:  # raised in the capturing thread by finish()
            self.error = e

    def finish(self) -> None:
        """The graph instantiated when this returns; its instantiation's exception raised here."""
        if self.thread is None:
            self.graph.instantiate()
            return
        self.thread.join()
        error, self.error = self.error, None
        if error is not None:
            raise error
