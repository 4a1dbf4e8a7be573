"""Patching torch: the wrappers put in place of four CUDAGraph methods (and its __init__).

  capture_begin  where the census runs, note the time only; elsewhere record what the
                 capture touches (repro.diagnose.guard's dispatch-mode recording)
  capture_end    take the graph census, and make the guard's slots from what it read (the
                 storages owners and the capturing frames' locals hold); or stop recording
  replay         deep check (+ census check) at the first replay after a capture and after any
                 graph's reset; then nothing until a captured storage dies (graphs.Gate), and
                 the liveness check of the graph's storages at its next replay once one did.
                 While every graph is settled and nothing died since, the class's replay is
                 torch's own again (the wrappers stand aside): a bound `graph.replay` the program
                 saved in that time replays unwatched, and those replays are not counted (the
                 exit record says how often the wrappers stood aside)
  reset          marks every other graph for a deep check

The wrappers replace the methods on the class in place, so ``torch.cuda.graph(...)`` and every
subclass go through them; each hands over to capture.py or checks.py, except the replay of a
settled graph, which the replay wrapper lets through itself. They are on the stack whenever
the program captures or replays: this file is among the guard's plumbing (tools.plumbing_files).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from repro.watch.hooks.graphs import Mode

if TYPE_CHECKING:
    from repro.watch.hooks.capture import Captures
    from repro.watch.hooks.checks import Checks

HOOKED = ("capture_begin", "capture_end", "replay", "reset")


def patch_graph_class(cls: type, captures: Captures, checks: Checks) -> Callable:
    """Wrap capture_begin / capture_end / replay / reset of ``cls`` in place; returns the replay
    wrapper (off the class while the wrappers stand aside)."""
    originals = {name: getattr(cls, name) for name in HOOKED}

    @functools.wraps(originals["capture_begin"])
    def capture_begin(graph, *args, **kwargs):
        captures.prepare()  # imports happen before the capture, not inside it
        originals["capture_begin"](graph, *args, **kwargs)
        captures.begin(graph, sys._getframe(1), kwargs.get("pool", args[0] if args else None))

    @functools.wraps(originals["capture_end"])
    def capture_end(graph, *args, **kwargs):
        captures.stop_recording(graph)
        out = originals["capture_end"](graph, *args, **kwargs)
        captures.end(graph, sys._getframe(1))
        return out

    original_replay, states, counters = originals["replay"], checks.graphs.by_id, checks.log.counters
    gate = checks.graphs.gate
    held, drops = gate.held, gate.drops

    # The per-replay path, inline, by the gate's Mode (graphs.Gate), kept in this closure and
    # compared as a plain int: 0, standing aside (nothing held, no captured storage died since
    # every graph settled): one test and a count; 1, only held graphs are checked: one set
    # lookup more; 2, a storage died since: a settled graph (GraphState.fast_at) costs one dict
    # lookup until the checks open the gate again. Anything else goes through before_replay.
    # torch's replay takes only `self`: a wrapper of that very signature saves packing
    # *args/**kwargs.
    if takes_only_self(original_replay):
        mode = int(gate.mode)

        @functools.wraps(original_replay)
        def replay(graph):
            if not mode:
                counters.replays += 1
            elif mode == 1 and id(graph) not in held:
                counters.replays += 1
            else:
                entry = states.get(id(graph))
                if entry is not None and entry[1].fast_at == drops.n and entry[0]() is graph:
                    counters.replays += 1
                else:
                    checks.before_replay(graph)
                if gate.at != drops.n:
                    checks.on_stale_gate()
            try:
                return original_replay(graph)
            except RuntimeError as e:
                checks.on_replay_error(graph, e)
                raise

        def set_mode(now: int) -> None:
            """Standing aside, the class's replay is torch's own: nothing of ours is on the
            replay path (any Python layer there cost a host-bound piecewise step up to 2.5% on
            an H200 host, by where its code fell more than by what it did: docs/PERFORMANCE.md). Any other
            mode puts the wrapper back before the next replay: a death tells the gate inside
            the deallocation. A bound `graph.replay` the program saves while the wrappers stand
            aside is torch's and stays unwatched (module docstring)."""
            nonlocal mode
            mode = now
            setattr(cls, "replay", original_replay if now == Mode.ASIDE else replay)

        gate.armers.append(set_mode)
    else:

        @functools.wraps(original_replay)
        def replay(graph, *args, **kwargs):
            checks.before_replay(graph)
            try:
                return original_replay(graph, *args, **kwargs)
            except RuntimeError as e:
                checks.on_replay_error(graph, e)
                raise

    @functools.wraps(originals["reset"])
    def reset(graph, *args, **kwargs):
        out = originals["reset"](graph, *args, **kwargs)
        checks.on_reset(graph)
        return out

    for name, wrapper in (
        ("capture_begin", capture_begin),
        ("capture_end", capture_end),
        ("replay", original_replay if gate.mode == Mode.ASIDE else replay),
        ("reset", reset),
    ):
        setattr(cls, name, wrapper)
    return replay


def patch_keep_graph(cls: type, captures: Captures) -> None:
    """Where the census runs, graphs must keep their cudaGraph_t past capture_end; we then
    instantiate at the end of capture_end ourselves, exactly where torch would have.
    keep_graph reaches the C++ graph through __init__ (pybind's constructor; torch's
    Python __new__ passes it on but pybind's __new__ ignores it), so __init__ is wrapped."""
    original_init = cls.__init__
    tools, kept = captures.tools, captures.kept

    def __init__(graph, *args, **kwargs):
        if not tools.census_ready():
            return original_init(graph, *args, **kwargs)  # exactly the program's call
        asked = bool(args[0]) if args else bool(kwargs.pop("keep_graph", False))
        original_init(graph, True, *args[1:], **kwargs)
        kept[graph] = not asked

    cls.__init__ = functools.wraps(original_init)(__init__)


def takes_only_self(fn) -> bool:
    """Whether a Python function's signature is exactly `(self)` (torch's CUDAGraph.replay)."""
    code = getattr(fn, "__code__", None)
    varargs = 0x04 | 0x08  # CO_VARARGS | CO_VARKEYWORDS
    return code is not None and code.co_argcount == 1 and not code.co_kwonlyargcount and not code.co_flags & varargs
