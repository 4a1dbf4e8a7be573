"""In-process side of `repro watch`: hook torch.cuda.CUDAGraph in a program that does not know.

Started by the sitecustomize that `repro watch` puts first on PYTHONPATH (so every Python
process the command starts runs it) or by the vLLM plugin when REPRO_WATCH is set. Importing
this module imports no torch: a meta-path hook waits until the program itself imports
``torch.cuda.graphs`` (torch's own ``import torch`` does) and then wraps four methods of
``torch.cuda.graphs.CUDAGraph`` in place, so ``torch.cuda.graph(...)`` and every subclass go
through them:

  capture_begin  where the census runs, note the time only; elsewhere record what the
                 capture touches (repro.diagnose.guard's dispatch-mode recording)
  capture_end    take the graph census, and make the guard's slots from what it read (the
                 storages owners and the capturing frames' locals hold); or stop recording
  replay         liveness check before every replay; deep check (+ census check) at the first
                 replay after a capture and after any graph's reset
  reset          marks every other graph for a deep check (a reset frees that graph's pool,
                 which another graph may read: vllm-omni #6457)

Findings go, one JSON line each, to ``<run dir>/<host>-<pid>.jsonl`` (written with os.write
on an O_APPEND descriptor: on disk before the replay runs, whatever happens to the process
next) and one line to stderr. The program's stdout is never written to.

One watcher per process is inherent (sys.meta_path and the CUDAGraph class are process-wide),
so ``activate`` keeps it in ``_ACTIVE`` and is idempotent: the sitecustomize and the vLLM
plugin may both call it.
"""
from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.machinery
import json
import os
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from enum import StrEnum
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:       # annotations only: nothing here imports torch until the program does
    import torch

    from repro.diagnose.allocator import PoolMap
    from repro.diagnose.captured import GraphCensus
    from repro.diagnose.census import CensusBook
    from repro.diagnose.guard import CaptureGuard, DropCount
    from repro.outcome import Finding

ENV_ON = "REPRO_WATCH"                  # "1": hooks on (the vLLM plugin's switch too)
ENV_DIR = "REPRO_WATCH_DIR"             # run directory for the per-process records
ENV_ON_FINDING = "REPRO_WATCH_ON_FINDING"   # an OnFinding
ENV_SITE = "REPRO_WATCH_SITE"           # the sitecustomize directory `repro watch` prepended
ENV_RECORD = "REPRO_WATCH_RECORD"       # a Record
ENV_VARS = (ENV_ON, ENV_DIR, ENV_ON_FINDING, ENV_SITE, ENV_RECORD)
ENV_OWNER = "REPRO_WATCH_OWNER"         # set by the pytest plugin: the record file (stem) of the
                                        # test process whose test started this process
DEFAULT_DIR = "repro-watch"


class OnFinding(StrEnum):
    """What a finding does to the replay that would read the dead memory."""
    WARN = "warn"                 # recorded; the replay runs
    RAISE = "raise"               # recorded; the replay raises StaleCaptureError before the launch


class Record(StrEnum):
    """How the hooks learn what a capture holds."""
    # Where the census runs, read from the graph after it (cost per node); elsewhere every op
    # is recorded at the dispatcher.
    GRAPH = "graph"
    # Every op is recorded at the dispatcher as well (cost per op: tensors behind pointer
    # tables in device memory, which no node holds, get names and drop sites too).
    OPS = "ops"


class Origin(StrEnum):
    """What started the hooks in a process."""
    SITECUSTOMIZE = "sitecustomize"   # `repro watch` (every Python process of the command)
    VLLM_PLUGIN = "vllm-plugin"       # vLLM's plugin entry point, with REPRO_WATCH set
    PYTEST = "pytest"                 # the pytest plugin (repro.pytest_watch)
    RAY = "ray"                       # a Ray worker (repro.watch_ray)
    API = "api"                       # the program itself (activate)


TARGET = "torch.cuda.graphs"
RECORD_SCHEMA = "repro.watch.record/1"
HOOKED = ("capture_begin", "capture_end", "replay", "reset")
# cudagraph trees (torch.compile mode="reduce-overhead") reuse their pool's memory for outputs
# whose Python tensors died, by design, and check their own invariants: their graphs are
# counted as managed and not checked, or every dead intermediate would read as a finding.
MANAGED_CALLERS = (os.path.join("_inductor", "cudagraph_trees.py"),)
_OWNER_FRAMES = 8                       # user frames above a capture searched for owners
_MAX_OWNERS = 32                        # owners watched per capture
_RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
             "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")

_ACTIVE: Watcher | None = None
E = TypeVar("E", bound=StrEnum)


@dataclass(frozen=True)
class WatchSettings:
    run_dir: str
    on_finding: OnFinding
    origin: Origin
    record: Record = Record.GRAPH


def settings_from_env(environ: dict[str, str], origin: Origin) -> WatchSettings | None:
    """None unless REPRO_WATCH is set to something other than 0/empty."""
    if environ.get(ENV_ON, "").strip() in ("", "0"):
        return None
    return WatchSettings(run_dir=os.path.abspath(environ.get(ENV_DIR) or DEFAULT_DIR),
                         on_finding=choice_from_env(environ, ENV_ON_FINDING, OnFinding.WARN), origin=origin,
                         record=choice_from_env(environ, ENV_RECORD, Record.GRAPH))


def choice_from_env(environ: dict[str, str], key: str, default: E) -> E:
    """The member of default's enum that environ[key] names; default (said on stderr) for
    any other value, default (silently) when unset or empty."""
    text = environ.get(key, "").strip()
    if not text:
        return default
    kind = type(default)
    try:
        return kind(text)
    except ValueError:
        sys.stderr.write(f"repro watch: {key}={text!r} is not one of {', '.join(kind)}; using {default}\n")
        return default


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


# -- records ------------------------------------------------------------------------------------

class Recorder:
    """Appends JSON lines to this process's record file; each line is on disk when write returns."""

    def __init__(self, run_dir: str):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, f"{socket.gethostname()}-{os.getpid()}.jsonl")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        # ASCII: an argv or message that was not UTF-8 (surrogate escapes) must not lose the record.
        line = json.dumps(record, default=str, ensure_ascii=True) + "\n"
        os.write(self._fd, line.encode("utf-8"))

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass


def process_record(settings: WatchSettings) -> dict[str, Any]:
    argv = list(getattr(sys, "orig_argv", sys.argv))
    return {
        "kind": "process", "schema": RECORD_SCHEMA, "pid": os.getpid(), "ppid": os.getppid(),
        "host": socket.gethostname(), "argv": argv, "executable": sys.executable,
        "python": sys.version.split()[0], "started": time.time(), "origin": settings.origin,
        "on_finding": settings.on_finding, "record": settings.record,
        "env": {k: os.environ[k] for k in (*_RANK_ENV, ENV_OWNER) if k in os.environ},
    }


# -- lazy installation --------------------------------------------------------------------------

class _PatchAfterExec(importlib.abc.Loader):
    """Runs the real loader, then hands the module over; leaves the module's loader as it was."""

    def __init__(self, loader, on_loaded):
        self._loader = loader
        self._on_loaded = on_loaded

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._on_loaded(module)


class GraphsImportHook(importlib.abc.MetaPathFinder):
    """Waits for ``torch.cuda.graphs`` to be imported, then removes itself from sys.meta_path."""

    def __init__(self, on_loaded):
        self._on_loaded = on_loaded

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        self.uninstall()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchAfterExec(spec.loader, self._on_loaded)
        return spec

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


# -- the census, behind its small API -----------------------------------------------------------

def load_census() -> ModuleType | None:
    """repro.census where it exists (the graph census reads what kernels really touch)."""
    try:
        from repro.diagnose import census
    except ImportError:
        return None
    return census


# -- per-graph state ----------------------------------------------------------------------------

@dataclass
class GraphState:
    label: str                    # "#3 decode.py:41 in capture" (unique per capture)
    site: str
    managed: bool = False         # captured by torch.compile's cudagraph trees: counted only
    recording: Any = None         # the guard's recording context while capturing
    since: dict | None = None     # census clock marker at capture_begin: slots come from the census
    census: GraphCensus | None = None   # taken at capture end
    deep_reason: str | None = "first replay after capture"
    replays: int = 0
    live: tuple[int, ...] | None = None   # storage handles the liveness fast path tests
    # The guard's drop count as of which a replay needs nothing from the hooks: the graph is
    # captured, deep-checked, not torch.compile's, and every storage of `live` was seen alive
    # and tells its death (a drop callback). While the count has not moved, no captured
    # storage died since. -1: the next replay takes the checking path (anything that asks for
    # a check sets it back to -1: see `unsettle`).
    fast_at: int = -1

    def unsettle(self, deep_reason: str | None = None) -> None:
        """The next replay is checked (deeply, with a reason)."""
        self.fast_at = -1
        if deep_reason is not None:
            self.deep_reason = deep_reason
    kept: bool | None = None      # cudaGraph_t kept past capture_end (census): True = forced by us
    captured: bool = False
    pool: tuple[int, int] | None = None   # the graph pool it allocates from (graph.pool())


class GraphStates:
    """GraphState per graph object, keyed by id and dropped when the graph dies (a weak
    reference; a graph class without them is held for the process's life)."""

    def __init__(self):
        self.by_id: dict[int, tuple[Any, GraphState]] = {}

    def get(self, graph: torch.cuda.CUDAGraph) -> GraphState | None:
        entry = self.by_id.get(id(graph))
        return entry[1] if entry is not None and entry[0]() is graph else None

    def __getitem__(self, graph: torch.cuda.CUDAGraph) -> GraphState:
        state = self.get(graph)
        if state is None:
            raise KeyError(graph)
        return state

    def __setitem__(self, graph: torch.cuda.CUDAGraph, state: GraphState) -> None:
        key = id(graph)
        try:
            ref = weakref.ref(graph, lambda _, key=key, by_id=self.by_id: by_id.pop(key, None))
        except TypeError:
            ref = (lambda g: lambda: g)(graph)
        self.by_id[key] = (ref, state)

    def values(self) -> list[GraphState]:
        return [state for _, state in list(self.by_id.values())]


@dataclass
class HookSeconds:
    """Where the hooks' own time goes (seconds, summed over the process); the per-replay fast
    path is left untimed (timing it would cost more than it does)."""
    capture_begin: float = 0.0    # naming owners, starting the recording
    capture_end: float = 0.0      # stopping the recording, records
    census: float = 0.0           # reading the graph and matching its words
    checks: float = 0.0           # deep checks and liveness checks that found something dead


@dataclass
class Counters:
    captures: int = 0
    managed: int = 0
    replays: int = 0
    checks_deep: int = 0
    findings: int = 0
    resets: int = 0
    internal_errors: int = 0


class Watcher:
    """Hooks of one process. Every hook swallows its own errors (recorded as 'internal'): the
    program must see torch's behaviour, except a StaleCaptureError in raise mode."""

    def __init__(self, settings: WatchSettings):
        self.settings = settings
        self.recorder: Recorder | None = None
        self.guard: CaptureGuard | None = None
        self.graphs = GraphStates()
        self.patched: list[type] = []
        self.counters = Counters()
        self.seconds = HookSeconds()
        self.census_mod: ModuleType | None = None   # repro.census, once asked for (load_census)
        self.book: CensusBook | None = None   # where the census runs
        self.census_state = "not checked yet (no capture)"
        self.rank: int | None = None
        self.origins = [settings.origin]
        self._watched: dict[str, Any] = {}   # owner name -> its object, held as the guard holds it
        # graphs whose cudaGraph_t outlives capture_end (for the census): True where we forced it
        self.kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.expired = None           # torch.UntypedStorage._expired once torch is in use
        self.drops: DropCount | None = None   # the guard's, once the guard exists
        self.pools: PoolMap | None = None     # which graph pool an address is in
        # Graphs captured since the census last checked: checked together, against one
        # allocator snapshot, at the first replay after them (not one snapshot per graph).
        self.census_due: list[str] = []
        self.cross_pool = 0           # captured storages in another graph's pool (checked)
        self.groups_said: dict[tuple, int] = {}   # finding group -> findings of it so far
        self._hook = GraphsImportHook(self.on_graphs_module)
        self._t0 = time.perf_counter()
        self._loaded = False          # load_modules ran

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        self.recorder = Recorder(self.settings.run_dir)
        self.recorder.write(process_record(self.settings))
        module = sys.modules.get(TARGET)
        if module is not None and hasattr(module, "CUDAGraph"):
            self.on_graphs_module(module)     # torch already imported (vLLM plugin, late start)
        else:
            self._hook.install()
        atexit.register(self.on_exit)
        os.register_at_fork(after_in_child=self.on_fork_child)

    def note_origin(self, origin: Origin) -> None:
        if origin not in self.origins:
            self.origins.append(origin)
            self.write({"kind": "origin", "origin": origin})

    def on_fork_child(self) -> None:
        # A forked child is a new process with its own record file; its graphs (if any) are new.
        try:
            self.recorder = Recorder(self.settings.run_dir)
            record = process_record(self.settings)
            record["forked"] = True
            self.recorder.write(record)
            self.counters = Counters()
            self.seconds = HookSeconds()
            self.groups_said = {}
            self.cross_pool = 0
            if self.patched:
                self.write({"kind": "hooked", "classes": [c.__qualname__ for c in self.patched],
                            "inherited": True})
        except Exception:
            pass

    def on_graphs_module(self, module) -> None:
        try:
            t0 = time.perf_counter()
            self.patch(module.CUDAGraph)
            patch_s = time.perf_counter() - t0
            torch = sys.modules.get("torch")
            self.write({"kind": "hooked", "classes": [c.__qualname__ for c in self.patched],
                        "patch_s": patch_s,
                        "torch": getattr(getattr(torch, "version", None), "__version__", None)
                        or getattr(torch, "__version__", None),
                        "since_activation_s": time.perf_counter() - self._t0})
        except Exception as e:
            self.internal("patching torch.cuda.graphs.CUDAGraph", e)

    def patch(self, cls: type) -> None:
        """Wrap capture_begin / capture_end / replay / reset of ``cls`` in place."""
        if cls in self.patched:
            return
        originals = {name: getattr(cls, name) for name in HOOKED}
        watcher = self

        @functools.wraps(originals["capture_begin"])
        def capture_begin(graph, *args, **kwargs):
            watcher.prepare()                 # imports happen before the capture, not inside it
            originals["capture_begin"](graph, *args, **kwargs)
            watcher.on_capture_begin(graph, sys._getframe(1), kwargs.get("pool", args[0] if args else None))

        @functools.wraps(originals["capture_end"])
        def capture_end(graph, *args, **kwargs):
            watcher.on_capture_stop(graph)
            out = originals["capture_end"](graph, *args, **kwargs)
            watcher.on_capture_end(graph, sys._getframe(1))
            return out

        original_replay, states = originals["replay"], self.graphs.by_id

        # The per-replay path, inline: a settled graph (GraphState.fast_at) costs one dict
        # lookup and one compare while no captured storage died; anything else goes through
        # before_replay. `watcher.drops` is set wherever a state exists (states are made after
        # the guard). torch's replay takes only `self`: a wrapper of that very signature saves
        # packing *args/**kwargs (~0.1 us of the ~0.2 us the fast path costs on a 2-core host).
        if takes_only_self(original_replay):
            @functools.wraps(original_replay)
            def replay(graph):
                entry = states.get(id(graph))
                if entry is not None and entry[1].fast_at == watcher.drops.n and entry[0]() is graph:
                    entry[1].replays += 1
                    watcher.counters.replays += 1
                else:
                    watcher.before_replay(graph)
                try:
                    return original_replay(graph)
                except RuntimeError as e:
                    watcher.on_replay_error(graph, e)
                    raise
        else:
            @functools.wraps(original_replay)
            def replay(graph, *args, **kwargs):
                watcher.before_replay(graph)
                try:
                    return original_replay(graph, *args, **kwargs)
                except RuntimeError as e:
                    watcher.on_replay_error(graph, e)
                    raise

        @functools.wraps(originals["reset"])
        def reset(graph, *args, **kwargs):
            out = originals["reset"](graph, *args, **kwargs)
            watcher.on_reset(graph)
            return out

        for name, wrapper in (("capture_begin", capture_begin), ("capture_end", capture_end),
                              ("replay", replay), ("reset", reset)):
            setattr(cls, name, wrapper)
        self.patched.append(cls)
        self.patch_keep_graph(cls)

    def patch_keep_graph(self, cls: type) -> None:
        """Where the census runs, graphs must keep their cudaGraph_t past capture_end; we then
        instantiate at the end of capture_end ourselves, exactly where torch would have.
        keep_graph reaches the C++ graph through __init__ (pybind's constructor; torch's
        Python __new__ passes it on but pybind's __new__ ignores it), so __init__ is wrapped."""
        original_init = cls.__init__
        watcher = self

        def __init__(graph, *args, **kwargs):
            if not watcher.census_ready():
                return original_init(graph, *args, **kwargs)      # exactly the program's call
            asked = bool(args[0]) if args else bool(kwargs.pop("keep_graph", False))
            original_init(graph, True, *args[1:], **kwargs)
            watcher.kept[graph] = not asked

        cls.__init__ = functools.wraps(original_init)(__init__)

    # -- capture -------------------------------------------------------------------------------

    def prepare(self) -> None:
        try:
            self.ensure_guard()
            if self.book is not None:
                self.book.resume_trace()          # a capture phase: the census needs the trace
        except Exception as e:
            self.internal("loading the guard", e)

    def state_of(self, graph: torch.cuda.CUDAGraph) -> GraphState | None:
        return self.graphs.get(graph)

    def set_state(self, graph: torch.cuda.CUDAGraph, state: GraphState) -> None:
        self.graphs[graph] = state

    def on_capture_begin(self, graph: torch.cuda.CUDAGraph, frame: FrameType | None, pool: Any = None) -> None:
        """pool: what the program passed to capture_begin (a shared pool's id); None means a
        fresh private pool, which holds nothing made before this capture."""
        t0 = time.perf_counter()
        try:
            guard = self.ensure_guard()
            self.counters.captures += 1
            site, managed = capture_site(frame, guard.plumbing)
            state = GraphState(label=f"#{self.counters.captures} {site}", site=site, managed=managed)
            state.kept = self.kept.get(graph)
            state.pool = pool_id(pool)           # torch answers graph.pool() only after the capture
            self.set_state(graph, state)
            if managed:
                self.counters.managed += 1
                return
            self.watch_owners(frame)
            if self.by_census(state):
                state.since = self.census_mod.clock_marker()
            else:
                state.recording = guard.recording(
                    state.label, state.pool, self.pools.graph_pool_of if self.pools is not None else None)
                state.recording.__enter__()
        except Exception as e:
            self.internal("capture_begin", e)
        self.seconds.capture_begin += time.perf_counter() - t0

    def on_capture_stop(self, graph: torch.cuda.CUDAGraph) -> None:
        state = self.state_of(graph)
        if state is None or state.recording is None:
            return
        recording, state.recording = state.recording, None
        try:
            recording.__exit__(None, None, None)
        except Exception as e:
            self.internal("capture_end (recording)", e)

    def by_census(self, state: GraphState) -> bool:
        """Whether this capture's slots come from its census (no per-op recording)."""
        return state.kept is not None and self.book is not None and self.settings.record == Record.GRAPH

    def on_capture_end(self, graph: torch.cuda.CUDAGraph, frame: FrameType | None = None) -> None:
        """frame: the frame that ended the capture (its locals name what the graph holds)."""
        state = self.state_of(graph)
        if state is None:
            return
        state.captured = True
        state.pool = graph_pool(graph) or state.pool
        t0 = time.perf_counter()
        try:
            if state.kept is not None and not state.managed and self.book is not None:
                state.census = self.book.add(graph, state.label, state.pool, since=state.since)   # None: unreadable (noted)
                if state.census is not None:
                    self.census_due.append(state.label)
                    if state.since is not None:
                        census = state.census
                        left = self.guard.adopt(state.label, [*census.pending, *census.references], frame)
                        self.book.hand_over(census, left)
        except Exception as e:
            self.internal("census at capture end", e)
        t1 = time.perf_counter()
        self.seconds.census += t1 - t0
        self.assign_pools(state, checked=state.census is not None)
        if state.kept:
            graph.instantiate()   # where torch instantiates a graph without keep_graph
        try:
            rank = self.current_rank()
            self.write({"kind": "capture", "graph": state.label, "managed": state.managed,
                        "rank": rank, "pool": list(state.pool) if state.pool else None, "census": state.census is not None,
                        "slots": len(self.guard.slots_of(state.label))})
        except Exception as e:
            self.internal("capture_end", e)
        self.seconds.capture_end += time.perf_counter() - t1

    # -- replay --------------------------------------------------------------------------------

    def before_replay(self, graph: torch.cuda.CUDAGraph) -> None:
        state = self.state_of(graph)
        if state is None or state.managed or not state.captured:
            return
        self.counters.replays += 1
        state.replays += 1
        # The per-replay path: nothing while no captured storage died, else one C call per
        # captured storage of the graph.
        if state.deep_reason is None and state.live is not None and self.all_alive(state):
            return
        state.fast_at = -1
        t0 = time.perf_counter()
        try:
            if state.deep_reason is None:
                findings = self.guard.check("before replay", graph=state.label, deep=False)
            else:
                findings = self.deep_check(state)
            state.live = self.live_handles(state.label)
        except Exception as e:
            self.internal("replay check", e)
            return
        finally:
            self.seconds.checks += time.perf_counter() - t0
        if findings:
            self.report(findings)
            if self.settings.on_finding == OnFinding.RAISE:
                from repro.diagnose.guard import StaleCaptureError
                raise StaleCaptureError(findings[0].message, findings)

    def deep_check(self, state: GraphState) -> list:
        when, state.deep_reason = f"{state.deep_reason} (replay {state.replays})", None
        self.counters.checks_deep += 1
        findings = self.guard.check(when, graph=state.label, deep=True)
        if self.book is not None and self.census_due:
            # Every graph captured (or reset) since the last census check, in one snapshot.
            live = {s.label for s in self.live_states() if s.census is not None}
            due, self.census_due = [label for label in self.census_due if label in live], []
            census_findings = self.book.check_graphs(when, due)
            self.adopt_late(due)
            findings = self.census_mod.merge_findings(findings, census_findings, self.guard.slots,
                                                      True, self.book)
            self.pause_trace()
        return findings

    def adopt_late(self, labels: list[str]) -> None:
        """After a census check matched the words no owner or local held at capture: those in
        memory still allocated then may be in tensors an owner gained since its index was
        built. Build it again, once for the whole check (not per capture), and hand over
        what it names."""
        censuses = [self.book.censuses[label] for label in labels
                    if label in self.book.censuses and self.book.censuses[label].references]
        if not censuses or self.settings.record != Record.GRAPH:
            return
        self.guard.refresh_index()
        for census in censuses:
            self.book.hand_over(census, self.guard.adopt(census.label, census.references, None))

    def pause_trace(self) -> None:
        """Every graph matched: the trace can rest until the next capture (its own errors
        never cost the findings of the check that led here)."""
        try:
            if self.book.pause_trace():
                self.write({"kind": "trace", "state": "paused until the next capture"})
        except Exception as e:
            self.internal("pausing the allocator trace", e)

    def live_states(self) -> list[GraphState]:
        return [s for s in self.graphs.values() if s.captured]

    def assign_pools(self, state: GraphState, checked: bool = False) -> None:
        """Which captured storages live in a graph pool: in the graph's own pool they are the
        pool's business (not checked); in another graph's pool, a cross-pool dependency.
        checked: the census just brought the segment map up to date (nothing allocated since)."""
        if state.managed or state.pool is None:
            return
        try:
            if self.pools is None:
                from repro.diagnose.allocator import PoolMap
                self.pools = self.book.pools if self.book is not None else PoolMap()
            if not checked:
                self.pools.check()
            cross = self.guard.assign_pools(state.label, state.pool, self.pools.graph_pool_of)
            self.cross_pool += len(cross)
            if cross:
                self.write({"kind": "cross_pool", "graph": state.label,
                            "storages": [{"slot": s.name, "pool": list(s.pool)} for s in cross[:8]],
                            "count": len(cross)})
        except Exception as e:
            self.internal("assigning graph pools", e)

    def on_replay_error(self, graph: torch.cuda.CUDAGraph, error: RuntimeError) -> None:
        """torch's own check_input_liveness (where the program turned it on) raises here."""
        text = str(error)
        if not text.startswith("CUDA graph replay detected"):
            return
        state = self.state_of(graph)
        try:
            self.report([torch_finding(state.label if state else "?", text, self.current_rank())])
        except Exception as e:
            self.internal("recording torch's liveness error", e)

    def on_reset(self, graph: torch.cuda.CUDAGraph) -> None:
        try:
            self.counters.resets += 1
            state = self.state_of(graph)
            if state is not None:
                state.captured = False    # nothing to check until it is captured again
                state.unsettle()
                if state.census is not None and self.book is not None:
                    self.book.censuses.pop(state.label, None)
                    state.census = None
            for other in self.live_states():
                if other is not state and not other.managed:
                    other.unsettle(f"first replay after a reset of {state.label if state else 'a graph'}")
                    if other.census is not None and other.label not in self.census_due:
                        self.census_due.append(other.label)
            self.write({"kind": "reset", "graph": state.label if state else None})
        except Exception as e:
            self.internal("reset", e)

    # -- helpers -------------------------------------------------------------------------------

    def all_alive(self, state: GraphState) -> bool:
        """Whether every storage in state.live lives; where each of them tells its death, the
        graph is settled as of the guard's drop count (the replay wrapper's fast path)."""
        drops = self.drops.n
        if state.fast_at == drops:
            return True
        if any(map(self.expired, state.live)):
            return False
        if self.listened(state.label):
            state.fast_at = drops
        return True

    def listened(self, label: str) -> bool:
        """Whether every storage of the graph's slots tells its death (a drop callback)."""
        return all(slot.drop_ref is not None for slot in self.guard.slots_of(label))

    def live_handles(self, label: str) -> tuple[int, ...] | None:
        """Handles of the graph's storages not yet reported freed; None: use the guard's path."""
        if self.expired is None:
            return None
        from repro.outcome import Status      # loaded with the guard already
        handles = []
        for slot in self.guard.slots_of(label):
            if Status.FREED not in slot.reported and slot.checked_in(label):
                if slot.ref is None:
                    return None
                handles.append(slot.ref.cdata)
        return tuple(handles)

    def load_modules(self) -> None:
        """Import, once, what the hooks use, on a thread of its own, before the first use.

        The hooks first run inside the program's own calls (its ``CUDAGraph()``, its capture),
        so an import made in place runs with the program's frames below it on the stack. Module
        code that leaves a frame in a reference cycle (torch.fx keeps ``inspect.currentframe()``
        in a local of its import-time ``wrap()``) then pins, on CPython 3.11/3.12, every frame
        below that one through ``f_back``, each with all its locals: the program's capturing
        function outlives its return until the cyclic GC happens to run, and the buffer it
        frees on return is not freed while watched (the very bug watch exists to show would
        not happen). A thread's stack holds its own frames only. The recording mode's first
        dispatch is made there too (torch imports torch._dynamo at it). Only a message is kept
        of an error, never the exception (its traceback would hold frames).
        """
        if self._loaded:
            return
        self._loaded = True
        failed: list[str] = []

        def load() -> None:
            try:
                census = load_census()
                import repro.diagnose.guard
                # Only the dispatch-mode recording needs the warm-up (its first dispatch imports
                # torch._dynamo: seconds on an image without bytecode); where the census makes
                # the slots, no capture records at the dispatcher.
                if self.settings.record == Record.OPS or census is None or not census.census_supported()[0]:
                    repro.diagnose.guard.warm_up()
            except Exception as e:
                failed.append(f"{type(e).__name__}: {e}")

        try:
            thread = threading.Thread(target=load, name="repro-watch-import", daemon=True)
            thread.start()
            thread.join()
        except RuntimeError as e:     # no thread can be started: the hooks import in place
            failed.append(f"no import thread ({e})")
        if failed:
            self.counters.internal_errors += 1
            self.write({"kind": "internal", "where": "importing the hooks' modules",
                        "error": failed[0]})

    def ensure_guard(self) -> CaptureGuard:
        if self.guard is None:
            self.load_modules()
            import torch
            from repro.diagnose.guard import CaptureGuard
            from repro.outcome import GuardMode
            # StorageWeakRef.expired() goes through two Python calls; the C function is ~20x faster.
            self.expired = getattr(torch.UntypedStorage, "_expired", None)
            # raise mode: we raise ourselves, after writing the record. This file's frames
            # (the CUDAGraph wrappers) are plumbing, never the user's site.
            self.guard = CaptureGuard(mode=GuardMode.WARN, plumbing=[__file__])
            self.drops = self.guard.drops
            if self.census_ready():
                # Starts the allocator's alloc/free trace (no stacks), so reuse at the same
                # address is seen; before the first capture, never inside one.
                try:
                    self.book = self.census_mod.CensusBook(rank=0, trace=self.census_mod.Tracing.START)
                except Exception as e:
                    self.census_state = f"unavailable: {type(e).__name__}: {e}"
            self.write({"kind": "census", "state": self.census_state})
        return self.guard

    def census_ready(self) -> bool:
        """Whether the census runs in this process (decided once, on first use)."""
        if self.census_mod is None and self.census_state.startswith("not checked"):
            self.load_modules()
            census = load_census()
            if census is None:
                self.census_state = "unavailable: repro.diagnose.census is not in this install"
                self.census_mod = False
            else:
                ok, why = census.census_supported()
                self.census_state = "active" if ok else f"unavailable: {why}"
                self.census_mod = census if ok else False
        return bool(self.census_mod)

    def watch_owners(self, frame) -> None:
        """Name what the capturing code holds: modules, tensors and `self` in its frames."""
        from repro.diagnose.sites import frame_locals, user_frame
        import torch
        plumbing = self.guard.plumbing
        frame = user_frame(frame, plumbing)
        added = 0
        for _ in range(_OWNER_FRAMES):
            if frame is None or added >= _MAX_OWNERS:
                break
            for var, value in frame_locals(frame):
                name = owner_name(var, value, torch)
                if name is None or not self.watch_once(name, value):
                    continue
                added += 1
                if var == "self" and not isinstance(value, torch.nn.Module):
                    added += self.watch_module_attrs(name, value, torch)
            frame = user_frame(frame.f_back, plumbing)

    def watch_module_attrs(self, name: str, obj: Any, torch) -> int:
        return sum(self.watch_once(f"{name}.{attr}", value)
                   for attr, value in list(getattr(obj, "__dict__", {}).items())[:_MAX_OWNERS]
                   if isinstance(value, torch.nn.Module))

    def watch_once(self, name: str, value: Any) -> bool:
        """Watch value as name unless that very owner is watched already. Keyed by name: one
        object reached under two names (a runner's `self.model` and the caller's `model`)
        keeps both, instead of each capture re-watching the one the last capture replaced,
        which threw the owner index away at every capture (2,211 rebuilds, piecewise)."""
        from repro.diagnose.owners import hold
        held = self._watched.get(name)
        if held is not None and held() is value:
            return False
        self.guard.watch(name, value)
        self._watched[name] = hold(value)
        return True

    def current_rank(self) -> int | None:
        if self.rank is None:
            dist = sys.modules.get("torch.distributed")
            try:
                if dist is not None and dist.is_available() and dist.is_initialized():
                    self.rank = dist.get_rank()
                    self.write({"kind": "rank", "rank": self.rank})
            except Exception:
                pass
        return self.rank

    def report(self, findings: list[Finding]) -> None:
        """Each finding to the record file; to stderr the first of each group only (one dead
        tensor in 2,000 graphs is one line; the exit line counts the repeats)."""
        from repro.report.groups import group_key
        rank = self.current_rank()
        for f in findings:
            self.counters.findings += 1
            if rank is not None:
                f.rank = rank
            mechanism = f.mechanism
            self.write({"kind": "finding", "mechanism": mechanism, "rank": rank,
                        "finding": finding_dict(f)})
            key = group_key(f)
            self.groups_said[key] = self.groups_said.get(key, 0) + 1
            if self.groups_said[key] == 1:
                sys.stderr.write(f"{self.prefix()}: {f.message}\n")
        sys.stderr.flush()

    def prefix(self) -> str:
        return f"repro watch [pid {os.getpid()}{'' if self.rank is None else f' rank {self.rank}'}]"

    def write(self, record: dict[str, Any]) -> None:
        if self.recorder is None:
            return
        try:
            self.recorder.write({**record, "pid": os.getpid(), "t": time.time()})
        except OSError:
            pass   # a full disk must not break the program

    def internal(self, where: str, error: BaseException) -> None:
        self.counters.internal_errors += 1
        self.write({"kind": "internal", "where": where,
                    "error": f"{type(error).__name__}: {error}"})

    def on_exit(self) -> None:
        census = self.census_state
        if self.book is not None:
            try:
                census = f"active; {self.book.census_line()}"
            except Exception:
                pass
        repeated = sum(n - 1 for n in self.groups_said.values())
        if repeated:
            try:
                sys.stderr.write(f"{self.prefix()}: {repeated} more findings like those above "
                                 f"({len(self.groups_said)} groups; the report lists them all)\n")
            except Exception:
                pass
        self.write({"kind": "exit", "counters": vars(self.counters), "census": census,
                    "pool_managed": self.guard.pool_managed() if self.guard is not None else 0,
                    "cross_pool": self.cross_pool,
                    "rank": self.rank, "seconds": {k: round(v, 6) for k, v in vars(self.seconds).items()}})


# -- pure helpers -------------------------------------------------------------------------------

def capture_site(frame, plumbing: frozenset[str] = frozenset()) -> tuple[str, bool]:
    """'file:line in func' of the code that asked for the capture, and whether that code is
    torch.compile's cudagraph trees (the first frame above torch/cuda/graphs.py)."""
    graphs_file = os.path.join("torch", "cuda", "graphs.py")
    while frame is not None and frame.f_code.co_filename.endswith(graphs_file):
        frame = frame.f_back
    if frame is None:
        return "<unknown>", False
    managed = frame.f_code.co_filename.endswith(MANAGED_CALLERS)
    from repro.diagnose.sites import frame_site, user_frame
    return frame_site(user_frame(frame, plumbing) or frame), managed


def takes_only_self(fn) -> bool:
    """Whether a Python function's signature is exactly `(self)` (torch's CUDAGraph.replay)."""
    code = getattr(fn, "__code__", None)
    varargs = 0x04 | 0x08                                  # CO_VARARGS | CO_VARKEYWORDS
    return code is not None and code.co_argcount == 1 and not code.co_kwonlyargcount \
        and not code.co_flags & varargs


def graph_pool(graph: torch.cuda.CUDAGraph) -> tuple[int, int] | None:
    """The id of the pool a captured graph allocates from (torch answers once the capture ended)."""
    try:
        return pool_id(graph.pool())
    except Exception:
        return None


def pool_id(pool) -> tuple[int, int] | None:
    try:
        a, b = pool
        return int(a), int(b)
    except (TypeError, ValueError):
        return None


def owner_name(var: str, value: Any, torch) -> str | None:
    """The watch name of a local worth watching, or None."""
    # Tensors held by locals are left to the guard, which names them "<local w of f, created
    # by ...>"; owners are what gives paths to tensors: modules and the capturing object.
    if var.startswith("__") or isinstance(value, torch.Tensor):
        return None
    if isinstance(value, torch.nn.Module):
        return type(value).__name__ if var == "self" else var
    module = type(value).__module__ or ""
    if module == "builtins" or module.startswith(("torch", "repro")) or not hasattr(value, "__dict__"):
        return None
    if var == "self":
        return type(value).__name__
    # A plain object (a KV cache, a runner) is worth watching when it holds tensors or modules itself.
    attrs = list(vars(value).values())[:_MAX_OWNERS]
    return var if any(isinstance(a, (torch.Tensor, torch.nn.Module)) for a in attrs) else None


def finding_dict(finding: Finding) -> dict[str, Any]:
    from repro.outcome import to_jsonable
    return to_jsonable(finding)


def torch_finding(graph: str, text: str, rank: int | None) -> Finding:
    from repro.outcome import Finding, Mechanism, Status
    ptr = 0
    for word in text.replace("(", " ").replace(")", " ").replace(":", " ").split():
        if word.startswith("data_ptr=0x"):
            ptr = int(word.removeprefix("data_ptr="), 16)
            break
    finding = Finding(slot="<tensor named by torch check_input_liveness>", graph=graph,
                      status=Status.FREED, when="replay (torch's own check)", rank=rank or 0,
                      shape=[], dtype="", nbytes=0, old_ptr=ptr, message=text.splitlines()[0],
                      mechanism=Mechanism.TORCH)
    return finding
