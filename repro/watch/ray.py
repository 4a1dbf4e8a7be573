"""`repro watch` into Ray: the hooks in every Ray worker process on every node, records to the driver.

A Ray worker is not a child of CMD: on an existing cluster each node's raylet starts it with the
cluster's environment, so the sitecustomize of `repro watch` never reaches it. Ray's own ways in
are used instead:

- `repro watch` sets RAY_RUNTIME_ENV_HOOK (a function Ray calls inside `ray.init()` with the
  runtime_env the program passed, to return the one the job gets). `runtime_env_hook` merges into
  the program's runtime_env, keeping everything it set: the REPRO_WATCH variables (records to a
  node-local folder), this copy of repro (py_modules, for nodes where repro is not installed) and
  a worker_process_setup_hook that starts the hooks in every worker, then the program's own setup
  hook if it had one. A hook the program's environment already named in RAY_RUNTIME_ENV_HOOK runs
  first, and ours merges into its result.
- The workers of each node write their records to a node-local folder of that node
  (`<tmp>/repro-watch-<run>/<node id>/`, also reached by processes those workers start). A
  collector actor on the driver's node sweeps every node's folder each SHIP_S (a tiny task
  pinned to that node returns the bytes it has not sent yet) into `<run dir>/ray-<node>/`; what
  a node had sent before it crashed stays there. The driver creates the collector (no CPU,
  pinned to its own node, the hooks off in it) once `ray.init()` has connected; it dies with
  the job. At the driver's exit one last sweep runs before Ray's own exit handler, so the
  records of workers that ended meanwhile arrive too; a program that calls ray.shutdown() itself
  keeps what was swept until then (the rest stays in the node-local folders).

The report (repro/watch/command.py) reads the run directory and every `ray-<node>` folder, and names
the processes of each node. vLLM's Ray executor starts its workers through the same job
runtime_env; where it sets worker variables itself, add the REPRO_ prefix to
VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY (README; not tested here: no vLLM).
No torch import here; Ray is imported only inside a process that already uses Ray.
"""

from __future__ import annotations

import atexit
import importlib
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from repro.watch.settings import (
    ENV_DIR,
    ENV_ON,
    ENV_ON_FINDING,
    ENV_SITE,
    ENV_STACKS,
    OnFinding,
    Origin,
    WatchSettings,
    choice_from_env,
    flag_from_env,
    settings_from_env,
)

ENV_HOOK = "RAY_RUNTIME_ENV_HOOK"
HOOK = "repro.watch.ray.runtime_env_hook"
ENV_CHAIN = "REPRO_WATCH_RAY_CHAIN"  # the program's own RAY_RUNTIME_ENV_HOOK, run first
ENV_NODE_ROOT = "REPRO_WATCH_RAY_DIR"  # node-local root; each node's workers use <root>/<node id>
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # repro/, shipped whole to the workers
SITE_DIR = Path(__file__).resolve().parent / "_site"
NODE_PREFIX = "ray-"
SHIP_S = 1.0
SWEEP_TIMEOUT_S = 20.0
COLLECTOR_WAIT_S = 60.0
THREAD = "repro-watch-ray"


def ray_env(environ: dict[str, str]) -> dict[str, str]:
    """What `repro watch` adds to CMD's environment for Ray (a hook of its own is chained)."""
    out = {ENV_HOOK: HOOK}
    theirs = environ.get(ENV_HOOK)
    if theirs and theirs != HOOK:
        out[ENV_CHAIN] = theirs
    return out


def load_function(path: str) -> Callable[..., Any]:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def node_root(run_dir: str) -> str:
    """The node-local folder under which each node's workers write: named after the driver's run."""
    return os.path.join(tempfile.gettempdir(), f"repro-watch-{Path(run_dir).name}")


def collector_name(run_dir: str) -> str:
    return f"repro-watch-collector-{Path(run_dir).name}"


def runtime_env_hook(runtime_env: Any) -> Any:
    """RAY_RUNTIME_ENV_HOOK: the program's runtime_env plus the hooks (in the driver, in ray.init)."""
    chained = os.environ.get(ENV_CHAIN)
    if chained:
        runtime_env = load_function(chained)(runtime_env)
    settings = settings_from_env(dict(os.environ), "ray")
    if settings is None:
        return runtime_env
    env = dict(runtime_env or {})
    name = collector_name(settings.run_dir)
    # REPRO_WATCH=0: a worker that inherited the sitecustomize (a cluster ray.init() started
    # here) leaves the hooks to setup_worker, which knows the worker's node.
    env["env_vars"] = {
        **(env.get("env_vars") or {}),
        ENV_ON: "0",
        ENV_NODE_ROOT: node_root(settings.run_dir),
        ENV_ON_FINDING: settings.on_finding,
        ENV_STACKS: "1" if settings.stacks else "0",
    }
    modules = list(env.get("py_modules") or [])
    if str(PACKAGE_DIR) not in map(str, modules):
        modules.append(str(PACKAGE_DIR))
    env["py_modules"] = modules
    env["worker_process_setup_hook"] = chained_setup(env.get("worker_process_setup_hook"))
    start_collector_thread(settings.run_dir, name)
    return env


def chained_setup(theirs: Any) -> Callable[[], None]:
    """Our worker setup, then the program's (a function or a 'module.function' string)."""
    if theirs is None:
        return setup_worker

    def repro_watch_setup() -> None:
        setup_worker()
        (load_function(theirs) if isinstance(theirs, str) else theirs)()

    return repro_watch_setup


# -- in every Ray worker ------------------------------------------------------------------------


def setup_worker() -> None:
    """worker_process_setup_hook: start the hooks here, writing to this node's folder; processes
    this worker starts inherit them (as CMD's children do under `repro watch`)."""
    root = os.environ.get(ENV_NODE_ROOT)
    if not root:
        return  # the collector and its sweeps: not watched
    import ray
    from repro.watch.hooks import activate  # the worker's own: `repro watch` reads the settings only

    run_dir = os.path.join(root, ray.get_runtime_context().get_node_id())
    site = str(SITE_DIR)
    old = os.environ.get("PYTHONPATH", "")
    os.environ.update(
        {ENV_ON: "1", ENV_DIR: run_dir, ENV_SITE: site, "PYTHONPATH": site + (os.pathsep + old if old else "")}
    )
    activate(
        WatchSettings(
            run_dir=run_dir,
            on_finding=choice_from_env(os.environ, ENV_ON_FINDING, OnFinding.WARN),
            origin=Origin.RAY,
            stacks=flag_from_env(os.environ, ENV_STACKS),
        )
    )


def read_new(folder: Path, offsets: dict[str, int]) -> dict[str, tuple[int, bytes]]:
    """The bytes of each file in folder past the offset already taken (new files whole, empty
    ones too): what a sweep or a trial snapshot sends."""
    out = {}
    try:
        files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    except OSError:
        return out
    for path in files:
        start = offsets.get(path.name, 0)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
        except OSError:
            continue
        if data or path.name not in offsets:
            out[path.name] = (start, data)
    return out


def append_chunks(folder: Path, chunks: dict[str, tuple[int, bytes]], offsets: dict[str, int]) -> None:
    """Write each chunk at its offset into folder/<name>; offsets advance to what is held."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (start, data) in chunks.items():
        path = folder / Path(name).name
        with open(path, "r+b" if path.exists() else "wb") as f:
            f.seek(start)
            f.write(data)
            f.truncate()
        offsets[name] = start + len(data)


# -- on the driver ------------------------------------------------------------------------------


def start_collector_thread(run_dir: str, name: str) -> None:
    """Once ray.init() has connected, start the collector (a thread: ray.init is still running)."""
    if any(t.name == THREAD for t in threading.enumerate()):
        return
    threading.Thread(target=start_collector, args=(run_dir, name), name=THREAD, daemon=True).start()


def start_collector(run_dir: str, name: str) -> None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    end = time.monotonic() + COLLECTOR_WAIT_S
    while not ray.is_initialized():
        if time.monotonic() > end:
            return
        time.sleep(0.05)
    try:
        here = ray.get_runtime_context().get_node_id()
        collector = (
            ray.remote(Collector)
            .options(
                name=name,
                get_if_exists=True,
                num_cpus=0,
                max_concurrency=4,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
                runtime_env={"env_vars": {ENV_NODE_ROOT: ""}},
            )
            .remote(run_dir, node_root(run_dir))
        )
        collector.start.remote()
    except Exception:  # the program shut Ray down meanwhile: nothing to collect
        return
    # Runs before Ray's own exit handler (registered at its import; atexit is last in, first
    # out): the last sweep happens while the job is still up.
    atexit.register(final_sweep, collector)


def final_sweep(collector: Any) -> None:
    import ray

    if not ray.is_initialized():
        return  # the program shut Ray down itself
    try:
        ray.get(collector.sweep.remote(), timeout=SWEEP_TIMEOUT_S + 5)
    except Exception:
        pass


def sweep_node(folder: str, offsets: dict[str, int]) -> dict[str, tuple[int, bytes]]:
    """On one node: the new bytes of its workers' record files."""
    return read_new(Path(folder), offsets)


class Collector:
    """On the driver's node: sweeps every node's record folder into <run dir>/ray-<node>/."""

    def __init__(self, run_dir: str, root: str):
        self.run_dir = Path(run_dir)
        self.root = root
        self.offsets: dict[str, dict[str, int]] = {}
        self.labels: dict[str, str] = {}
        self.lock = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self.loop, name=THREAD, daemon=True).start()

    def loop(self) -> None:
        while True:
            self.sweep()
            time.sleep(SHIP_S)

    def sweep(self) -> int:
        """One round over the live nodes; returns how many files changed."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        with self.lock:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            self.label_nodes(nodes)
            task = ray.remote(sweep_node)
            refs = {
                n["NodeID"]: task.options(
                    num_cpus=0,
                    runtime_env={"env_vars": {ENV_NODE_ROOT: ""}},
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False),
                ).remote(os.path.join(self.root, n["NodeID"]), dict(self.offsets.get(n["NodeID"], {})))
                for n in nodes
            }
            changed = 0
            for node_id, ref in refs.items():
                try:
                    chunks = ray.get(ref, timeout=SWEEP_TIMEOUT_S)
                except Exception:  # the node went away: what it sent so far stays
                    continue
                if chunks:
                    append_chunks(
                        self.run_dir / f"{NODE_PREFIX}{self.labels[node_id]}",
                        chunks,
                        self.offsets.setdefault(node_id, {}),
                    )
                    changed += len(chunks)
            return changed

    def label_nodes(self, nodes: list[dict[str, Any]]) -> None:
        names = [n.get("NodeName") or n.get("NodeManagerAddress") or "node" for n in nodes]
        for n, name in zip(nodes, names):
            self.labels.setdefault(n["NodeID"], name if names.count(name) == 1 else f"{name}-{n['NodeID'][:8]}")


def node_dirs(run_dir: Path) -> list[Path]:
    """The run directory's per-node folders of swept records."""
    return sorted(p for p in run_dir.glob(f"{NODE_PREFIX}*") if p.is_dir())


def node_notes(run_dir: Path, pids_by_file: dict[str, int]) -> list[str]:
    """One line per Ray node: the watched processes whose records came from it."""
    notes = []
    for folder in node_dirs(run_dir):
        pids = sorted(pid for path, pid in pids_by_file.items() if Path(path).parent == folder)
        if pids:
            notes.append(
                f"Ray node {folder.name[len(NODE_PREFIX) :]}: {len(pids)} watched process"
                f"{'es' if len(pids) > 1 else ''} (pid {', '.join(map(str, pids))}), records in {folder}"
            )
    return notes
