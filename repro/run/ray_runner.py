"""`repro matrix --ray ADDRESS`: every trial as Ray work, placed on a cluster node by its needs.

Each trial gets a placement group of one bundle ({"CPU": ranks, "GPU": its GPU count}; a
`--share-gpu` trial needs one GPU, a CPU trial none), so all ranks of a trial land on one node.
On that node a small actor runs the trial exactly as a local run does (repro/run/isolate.py: one
process per rank in its own process group, deadlines, kill on first death, classification),
in a node-local folder; while it runs the driver copies the trial's new record and log bytes
into its own run directory, and at the end the actor returns the trial record and every file
of the trial folder. The report is a local run's plus each trial's `node`.

A node (or the actor's worker) lost mid-trial: that trial is CRASH naming the node, or run
again elsewhere with `--retries N`. Ctrl-C / SIGTERM: every actor is asked to stop its trial
(its ranks are killed, the partial record comes back as INTERRUPTED); an actor that does not
answer in time is killed, and its ranks die with it (PR_SET_PDEATHSIG in repro/rank/worker.py).

The code runs on the nodes from the driver's own copy of the package (runtime_env py_modules),
so a node needs Python, torch and repro's dependencies, not repro itself. Ray is imported only
here and only when --ray is given; without Ray the command exits 3 with one line. The driver
never imports torch.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, Callable

from repro.config import TrialConfig, default_expectation
from repro.run.isolate import Interrupted, run_trial, unsupported_record
from repro.run.launch import MULTICAST_OFF
from repro.outcome import (
    Device,
    FirstFailure,
    Outcome,
    TrialRecord,
    parse_expectation,
    step_from_dict,
    to_jsonable,
    trial_from_dict,
)
from repro.run.protocol import Event, StepCounter, read_records, records_path
from repro.run.runner import Hooks, Planned, RunResult, environment, run_all, trial_id, with_runtime
from repro.scenarios import trial_measures
from repro.watch.ray import append_chunks, read_new

RAY_MISSING = "--ray needs Ray, which is not installed here: pip install 'repro[ray]' (or pip install ray)"
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # repro/, shipped whole to the nodes
POLL_S = 0.5
# After Ctrl-C an actor gets this long to stop its trial and hand back the partial record.
STOP_WAIT_S = 15.0
SNAPSHOT_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 5.0


class RayUnavailable(Exception):
    """No Ray installed, or no cluster reached: the environment cannot run it (exit 3)."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayUnavailable(RAY_MISSING) from None
    return ray


@dataclass
class Node:
    id: str
    name: str
    cpus: float
    gpus: float
    label: str = ""

    def describe(self) -> dict[str, Any]:
        return {"node": self.label, "id": self.id, "CPU": self.cpus, "GPU": self.gpus}


def runtime_env() -> dict[str, Any]:
    """What every actor of the run gets: this copy of repro, and the children's must-have variables."""
    return {"py_modules": [str(PACKAGE_DIR)], "excludes": ["__pycache__", "*.pyc"], "env_vars": dict(MULTICAST_OFF)}


def label_nodes(nodes: list[Node]) -> list[Node]:
    """A node's name (its IP unless `ray start --node-name` named it), with its id where names repeat."""
    names = [n.name for n in nodes]
    for n in nodes:
        n.label = n.name if names.count(n.name) == 1 else f"{n.name} (node {n.id[:8]})"
    return nodes


def alive_nodes(ray: Any) -> list[Node]:
    return label_nodes(
        [
            Node(
                id=n["NodeID"],
                name=n.get("NodeName") or n.get("NodeManagerAddress") or "?",
                cpus=float(n["Resources"].get("CPU", 0)),
                gpus=float(n["Resources"].get("GPU", 0)),
            )
            for n in ray.nodes()
            if n.get("Alive")
        ]
    )


def needs(p: Planned) -> tuple[int, int]:
    """(CPUs, GPUs) of a trial's bundle: a CPU per rank; a GPU per rank on CUDA, one when shared."""
    r = p.cfg.run
    if p.device != Device.CUDA:
        return r.tp, 0
    return r.tp, 1 if r.share_gpu else r.tp


def connect(address: str) -> "Cluster":
    """Join the cluster at `address` ('auto': the running one; 'local': start one here)."""
    ray = import_ray()
    local = address == "local"
    refused = unreachable(address)
    if refused:
        raise RayUnavailable(
            f"--ray {address}: cannot reach a Ray cluster ({refused}); start one with "
            "`ray start --head` and pass its address, or use --ray local"
        )
    # Ray's core worker installs its own fatal-signal handler for SIGTERM (it aborts the
    # process); the CLI's must stay, so a CI cancel still stops every remote trial cleanly.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        ray.init(
            address=None if local else address,
            runtime_env=runtime_env(),
            logging_level=logging.ERROR,
            log_to_driver=False,
            **({"include_dashboard": False} if local else {}),
        )
    except Exception as e:  # ConnectionError, ValueError, RuntimeError: all mean "not reached"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RayUnavailable(
            f"--ray {address}: cannot reach a Ray cluster ({first}); start one with "
            "`ray start --head` and pass its address, or use --ray local"
        ) from None
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
    return Cluster(address=address, nodes=alive_nodes(ray))


def current_cluster(environ: dict[str, str]) -> str:
    """Where `auto` leads: $RAY_ADDRESS, else the address `ray start` left in Ray's temp folder."""
    if environ.get("RAY_ADDRESS"):
        return environ["RAY_ADDRESS"]
    try:
        return (Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster").read_text().strip()
    except OSError:
        return ""


def unreachable(address: str) -> str:
    """Why a host:port address cannot be a cluster ('' when it answers, or is not host:port):
    Ray itself retries a dead address for minutes before giving up."""
    if address == "auto":
        address = current_cluster(dict(os.environ))
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return ""
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
            return ""
    except OSError as e:
        return f"nothing answers at {host}:{port}: {e.strerror or type(e).__name__}"


@dataclass
class Cluster:
    address: str
    nodes: list[Node] = field(default_factory=list)

    def largest_gpus(self) -> int:
        return int(max((n.gpus for n in self.nodes), default=0))

    def largest_cpus(self) -> int:
        return int(max((n.cpus for n in self.nodes), default=0))

    def refusal(self, planned: list[Planned]) -> str:
        """'' when every trial fits some node; else one line naming the first that fits none."""
        for p in planned:
            tid = trial_id(p.index or 0, p.cfg)
            if (
                p.device is None
                and p.cfg.run.device != Device.CPU
                and not p.cfg.run.share_gpu
                and p.cfg.run.tp > self.largest_gpus()
            ):
                return f"trial {tid} needs a node with {p.cfg.run.tp} GPUs; largest has {self.largest_gpus()}"
            if p.device is None:
                continue
            cpus, gpus = needs(p)
            if gpus > self.largest_gpus():
                return f"trial {tid} needs a node with {gpus} GPUs; largest has {self.largest_gpus()}"
            if cpus > self.largest_cpus():
                return f"trial {tid} needs a node with {cpus} CPUs (one per rank); largest has {self.largest_cpus()}"
        return ""

    def label(self, node_id: str) -> str:
        known = {n.id: n.label for n in self.nodes}
        return known.get(node_id) or f"node {node_id[:8]}"

    def runner(self, retries: int) -> Callable[..., RunResult]:
        return partial(run_on_ray, self, retries)


# --------------------------------------------------------------------------------------------
# On the node


class TrialHost:
    """The Ray actor that runs one trial on its node, as a local run would."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.dir: Path | None = None

    def run(self, cfg: TrialConfig, device: str, tid: str, fault: dict[str, Any] | None) -> dict[str, Any]:
        root = Path(tempfile.mkdtemp(prefix="repro-trial-"))
        self.dir = root / tid
        try:
            try:
                trial, interrupted = run_trial(cfg, device, root, tid, fault=fault, stop=self.stop), False
            except Interrupted as e:
                trial, interrupted = e.trial, True
            if device == Device.CUDA:
                import ray

                trial.notes.append(f"Ray gave this trial GPU(s) {', '.join(map(str, ray.get_gpu_ids()))} of its node")
            return {
                "trial": to_jsonable(trial),
                "interrupted": interrupted,
                "dir": str(self.dir),
                "files": read_new(self.dir, {}),
            }
        finally:
            self.dir = None
            shutil.rmtree(root, ignore_errors=True)

    def snapshot(self, offsets: dict[str, int]) -> dict[str, tuple[int, bytes]]:
        """The bytes of each trial file past the offsets the driver already has."""
        d = self.dir
        return read_new(d, offsets) if d is not None else {}

    def halt(self) -> None:
        self.stop.set()


@lru_cache(maxsize=1)
def actor_class(ray: Any) -> Any:
    """TrialHost as a Ray actor class, made once per driver (each ray.remote exports the class)."""
    return ray.remote(TrialHost)


# --------------------------------------------------------------------------------------------
# On the driver


class Mirror:
    """The driver's copy of one trial folder, grown from the actor's snapshots."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.offsets: dict[str, int] = {}
        folder.mkdir(parents=True, exist_ok=True)
        self.steps = StepCounter(records_path(folder, 0))

    def apply(self, chunks: dict[str, tuple[int, bytes]]) -> None:
        append_chunks(self.folder, chunks, self.offsets)


def failed_record(
    tid: str, cfg: TrialConfig, device: str, outcome: Outcome, detail: str, notes: list[str], node: str, folder: Path
) -> TrialRecord:
    """A trial whose node-side record never came back (node lost, actor killed): its outcome,
    and the steps of the records copied to the driver before that."""
    expected = parse_expectation(default_expectation(cfg))
    recs = read_records(folder, cfg.run.tp)
    steps = sorted((step_from_dict(e) for r in recs for e in r.of(Event.STEP)), key=lambda s: (s.step, s.rank))
    return TrialRecord(
        steps=steps,
        id=tid,
        scenario=cfg.scenario,
        mode=cfg.run.mode,
        config=cfg.to_dict(),
        outcome=outcome,
        expected=expected,
        met=False,
        graph_replayed=False,
        device=device,
        first_failure=FirstFailure(outcome, None, None, detail),
        notes=notes,
        node=node,
        measures=trial_measures(cfg.scenario, []),
    )  # measured on the node, which never reported


def relocate(trial: TrialRecord, node_dir: str, local_dir: Path) -> None:
    """Artifact paths as the driver has them (the node's folder is gone)."""
    trial.artifacts = {
        k: str(local_dir / Path(v).relative_to(node_dir)) if v.startswith(node_dir) else v
        for k, v in trial.artifacts.items()
    }


def node_alive(ray: Any, node_id: str) -> bool:
    return any(n.id == node_id for n in alive_nodes(ray))


@dataclass
class Attempt:
    trial: TrialRecord | None  # None: never placed (an interrupt came first)
    lost: bool = False  # the node or the actor's worker went away mid-trial
    interrupted: bool = False


def attempt(
    cluster: Cluster,
    p: Planned,
    tid: str,
    folder: Path,
    stop: threading.Event,
    on_tick: Callable[[str, int], None] | None,
) -> Attempt:
    ray = import_ray()
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cpus, gpus = needs(p)
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    pg = placement_group([bundle], strategy="STRICT_PACK")
    host = None
    try:
        while not ray.wait([pg.ready()], timeout=POLL_S)[0]:
            if stop.is_set():
                return Attempt(None)
        node_id = placement_group_table(pg)["bundles_to_node_id"][0]
        node = cluster.label(node_id)
        host = (
            actor_class(ray)
            .options(
                num_cpus=cpus,
                num_gpus=gpus,
                max_concurrency=4,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            )
            .remote()
        )
        ref = host.run.remote(p.cfg, p.device, tid, p.fault)
        mirror = Mirror(folder)
        halted_at = None
        while not ray.wait([ref], timeout=POLL_S)[0]:
            try:
                mirror.apply(ray.get(host.snapshot.remote(dict(mirror.offsets)), timeout=SNAPSHOT_TIMEOUT_S))
            except Exception:  # the actor is gone or stuck: the run's own result says which
                pass
            if on_tick:
                on_tick(tid, mirror.steps.poll())
            if stop.is_set() and halted_at is None:
                host.halt.remote()
                halted_at = time.monotonic()
            if halted_at is not None and time.monotonic() - halted_at > STOP_WAIT_S:
                ray.kill(host)  # its ranks die with its process (PR_SET_PDEATHSIG)
                break
        try:
            out = ray.get(ref)
        except Exception as e:
            if halted_at is not None:
                return Attempt(
                    failed_record(
                        tid,
                        p.cfg,
                        p.device,
                        Outcome.INTERRUPTED,
                        f"interrupted; the actor on {node} did not stop in time and was killed",
                        [f"records received before the kill are in {folder}"],
                        node,
                        folder,
                    ),
                    interrupted=True,
                )
            gone = not node_alive(ray, node_id)
            what = (
                f"node {node} was lost during the trial"
                if gone
                else f"the Ray worker running the trial on {node} died ({type(e).__name__})"
            )
            notes = [f"records received before that are in {folder}"]
            return Attempt(failed_record(tid, p.cfg, p.device, Outcome.CRASH, what, notes, node, folder), lost=True)
        mirror.apply(out["files"])
        trial = trial_from_dict(out["trial"])
        relocate(trial, out["dir"], folder)
        trial.node = node
        return Attempt(trial, interrupted=out["interrupted"])
    finally:
        if host is not None:
            ray.kill(host)
        remove_placement_group(pg)


def run_remote(
    cluster: Cluster,
    retries: int,
    i: int,
    p: Planned,
    run_dir: Path,
    hooks: Hooks,
    wrapper: list[str] | None,
    slots: Any,
    lanes: list[str],
    stop: threading.Event,
    server: Any = None,
) -> TrialRecord | None:
    """One trial on the cluster (run_all's per-trial step, like runner.run_one)."""
    if stop.is_set():
        return None
    tid = trial_id(i if p.index is None else p.index, p.cfg)
    if hooks.on_start:
        hooks.on_start(tid, p)
    if p.device is None:
        result = Attempt(unsupported_record(tid, p.cfg, p.reason))
    else:
        lost_on: list[str] = []
        while True:
            result = attempt(cluster, p, tid, run_dir / tid, stop, hooks.on_tick)
            if not result.lost or len(lost_on) >= retries or stop.is_set():
                break
            lost_on.append(result.trial.first_failure.detail)
        if result.trial is not None and lost_on:
            result.trial.notes += [f"run again (--retries {retries}) after: {what}" for what in lost_on]
    if result.trial is None:
        return None
    if hooks.on_done:
        hooks.on_done(result.trial)
    if result.interrupted:
        raise Interrupted(result.trial)
    return result.trial


def run_on_ray(
    cluster: Cluster,
    retries: int,
    planned: list[Planned],
    out_root: Path,
    on_start: Callable[[str, Planned], None] | None = None,
    on_tick: Callable[[str, int], None] | None = None,
    on_done: Callable[[TrialRecord], None] | None = None,
    jobs: int = 1,
    server: Any = None,
    interrupts: Any = None,
) -> RunResult:
    """run_planned's contract on a Ray cluster (interrupts: the CLI's signal flag, polled). Every trial is submitted at once: Ray's
    placement decides how many run together (a node holds as many bundles as it has room for)."""
    stamp = dt.datetime.now(dt.timezone.utc)
    run_dir = out_root / stamp.strftime("%Y%m%d-%H%M%S-%f")
    one = partial(run_remote, cluster, retries)
    result = run_all(
        planned,
        run_dir,
        Hooks(on_start, on_tick, on_done),
        None,
        max(1, len(planned)),
        [],
        None,
        one=one,
        interrupts=interrupts,
    )
    env = environment()
    env["ray"] = {"address": cluster.address, "nodes": [n.describe() for n in cluster.nodes]}
    result.report.environment = with_runtime(env, result.report.trials)
    result.report.command = shlex.join(sys.argv)
    result.report.created = stamp.isoformat(timespec="seconds")
    result.run_dir = run_dir
    return result
