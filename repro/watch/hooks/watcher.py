"""The watcher: one process's hooks put together, and the one watcher a process has.

A Watcher owns the parts (the record file, the per-graph states, the guard and census, the
capture and replay hooks), starts them (a record file, then torch's CUDAGraph patched now or
once the program imports it), carries them over a fork, and writes the exit record.

One watcher per process is inherent (sys.meta_path and the CUDAGraph class are process-wide),
so ``activate`` keeps it in ``_ACTIVE`` and is idempotent: the sitecustomize and the vLLM
plugin may both call it.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Callable

from repro.watch.hooks.capture import Captures
from repro.watch.hooks.checks import Checks
from repro.watch.hooks.graphs import GraphStates
from repro.watch.hooks.install import CUDA_MODULE, TARGET, ImportHook
from repro.watch.hooks.patch import patch_graph_class, patch_keep_graph
from repro.watch.hooks.records import Log
from repro.watch.hooks.tools import Tools
from repro.watch.settings import Origin, WatchSettings, settings_from_env

_ACTIVE: Watcher | None = None


def active() -> Watcher | None:
    return _ACTIVE


def activate(settings: WatchSettings) -> Watcher:
    """Start watching this process (idempotent: a second call returns the running watcher)."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.note_origin(settings.origin)
        return _ACTIVE
    watcher = Watcher(settings)
    _ACTIVE = watcher
    watcher.start()
    return watcher


def activate_from_env(origin: Origin) -> Watcher | None:
    settings = settings_from_env(os.environ, origin)
    return activate(settings) if settings is not None else None


class Watcher:
    """Hooks of one process. Every hook swallows its own errors (recorded as 'internal'): the
    program must see torch's behaviour, except a StaleCaptureError in raise mode."""

    def __init__(self, settings: WatchSettings):
        self.settings = settings
        self.origins = [settings.origin]
        self.log = Log()
        self.tools = Tools(settings, self.log)
        self.graphs = GraphStates(self.tools.drops)
        self.captures = Captures(settings, self.log, self.graphs, self.tools)
        self.checks = Checks(settings, self.log, self.graphs, self.tools)
        self.patched: list[type] = []
        self.replay_wrappers: dict[type, Callable] = {}  # class -> its replay wrapper (on or off it)
        self._hook = ImportHook(self.on_graphs_module)
        self._t0 = time.perf_counter()

    def start(self) -> None:
        self.log.open(self.settings)
        module = sys.modules.get(TARGET)
        if module is not None and hasattr(module, "CUDAGraph"):
            self.on_graphs_module(module)  # torch already imported (vLLM plugin, late start)
        else:
            self._hook.install()
        if self.settings.stacks:
            self.wait_for_cuda()
        atexit.register(self.on_exit)
        os.register_at_fork(after_in_child=self.on_fork_child)

    def wait_for_cuda(self) -> None:
        """--stacks: the allocation stacks start at CUDA's initialisation, which torch.cuda's
        _lazy_call queues for (or runs now, where CUDA is up already: a late start)."""
        module = sys.modules.get(CUDA_MODULE)
        if module is None:
            ImportHook(self.on_cuda_module, CUDA_MODULE).install()
        elif hasattr(module, "_lazy_call"):
            self.on_cuda_module(module)
        else:  # torch.cuda half imported: this start came from inside torch's own import
            self.log.write({"kind": "stacks", "state": "not started: torch.cuda was being imported"})

    def on_cuda_module(self, module) -> None:
        try:
            module._lazy_call(self.tools.start_stacks)
        except Exception as e:
            self.log.internal("queueing the allocation stacks for CUDA's initialisation", e)

    def note_origin(self, origin: Origin) -> None:
        if origin not in self.origins:
            self.origins.append(origin)
            self.log.write({"kind": "origin", "origin": origin})

    def on_fork_child(self) -> None:
        # A forked child is a new process with its own record file; its graphs (if any) are new.
        try:
            self.log.open(self.settings, forked=True)
            self.captures.cross_pool = 0
            if self.patched:
                self.log.write({"kind": "hooked", "classes": self.patched_names(), "inherited": True})
        except Exception:
            pass

    def on_graphs_module(self, module) -> None:
        try:
            t0 = time.perf_counter()
            self.patch(module.CUDAGraph)
            patch_s = time.perf_counter() - t0
            torch = sys.modules.get("torch")
            self.log.write(
                {
                    "kind": "hooked",
                    "classes": self.patched_names(),
                    "patch_s": patch_s,
                    "torch": getattr(getattr(torch, "version", None), "__version__", None)
                    or getattr(torch, "__version__", None),
                    "since_activation_s": time.perf_counter() - self._t0,
                }
            )
        except Exception as e:
            self.log.internal("patching torch.cuda.graphs.CUDAGraph", e)

    def patch(self, cls: type) -> None:
        """Wrap capture_begin / capture_end / replay / reset (and __init__) of ``cls`` in place."""
        if cls in self.patched:
            return
        self.replay_wrappers[cls] = patch_graph_class(cls, self.captures, self.checks)
        self.patched.append(cls)
        patch_keep_graph(cls, self.captures)

    def patched_names(self) -> list[str]:
        return [c.__qualname__ for c in self.patched]

    def on_exit(self) -> None:
        census = self.tools.census.exit_line()
        self.log.say_repeats()
        guard = self.tools.guard
        self.log.write(
            {
                "kind": "exit",
                "counters": vars(self.log.counters),
                # while the wrappers stood aside, replays were torch's own and went uncounted
                "stood_aside": self.graphs.gate.asides,
                "census": census,
                "census_reads": self.tools.census.reads(),
                "pool_managed": guard.pool_managed() if guard is not None else 0,
                "cross_pool": self.captures.cross_pool,
                "rank": self.log.rank,
                "seconds": {k: round(v, 6) for k, v in vars(self.log.seconds).items()},
            }
        )
