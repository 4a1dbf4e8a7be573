"""In-process side of `repro watch`: hook torch.cuda.CUDAGraph in a program that does not know.

Started by the sitecustomize that `repro watch` puts first on PYTHONPATH (so every Python
process the command starts runs it), by the vLLM plugin when REPRO_WATCH is set, by the pytest
plugin, in Ray workers, or by the program itself (``activate``). Importing the hooks imports no
torch: they wait until the program imports ``torch.cuda.graphs``, then wrap four methods of
``torch.cuda.graphs.CUDAGraph`` in place. One concern a module:

  watcher   the Watcher of a process (its parts put together) and activate / active
  install   the meta-path hook that waits for the program's own torch import
  patch     the wrappers put in place of CUDAGraph's methods (the replay fast path)
  capture   capture recording: the guard's recording or the census clock, graph pools
  owners    what the capturing code holds, named for the guard
  checks    checking at replay (liveness, deep and census checks) and at reset
  part      what capture and checks are handed (settings, records, graph states, tools)
  graphs    GraphState, what the hooks know of each graph
  tools     the guard and the census, loaded at the first graph on a thread of their own
  records   the process's record file, its counters, findings on stderr

Every file of this package is the guard's plumbing (tools.plumbing_files): a frame of the hooks
is never named as the program's site. What a process is told to do (the REPRO_WATCH_* variables)
is repro/watch/settings.py.
"""

from repro.watch.hooks.records import Recorder
from repro.watch.hooks.watcher import Watcher, activate, activate_from_env, active
from repro.watch.settings import OnFinding, Origin, Record, WatchSettings

__all__ = [
    "OnFinding",
    "Origin",
    "Record",
    "Recorder",
    "WatchSettings",
    "Watcher",
    "activate",
    "activate_from_env",
    "active",
]
