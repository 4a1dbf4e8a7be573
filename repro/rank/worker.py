"""One rank of one trial, in its own process: `python -m repro.rank.worker SPEC.json RANK`.

The worker appends every record to rank<R>.jsonl as soon as it has it (line-buffered,
flushed), so a crash, a sticky CUDA error or a SIGKILL loses nothing already produced. It
never renders a report; the parent reads the records back and classifies.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import faulthandler
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from repro.config import TrialConfig
from repro.noise import silence_known_warnings
from repro.outcome import Device, Finding, GuardMode, StepRecord
from repro.run.protocol import STACKS_SIGNAL, Event, RecordSink, TrialSpec, records_path, rendezvous_path, stacks_path

if TYPE_CHECKING:  # annotations only: torch is imported in run_rank, where its import is timed
    import torch

    from repro.diagnose.census import CensusBook
    from repro.rank.dist import TP
    from repro.diagnose.forensics import MemoryHistory
    from repro.rank.graphs import AfterFree, HarnessMemory
    from repro.diagnose.guard import CaptureGuard


def inject_fault(kind: str) -> None:
    """Test hook: make this rank fail the way real failures look from the outside."""
    if kind == "segv":
        faulthandler.disable()  # a bare segfault, as a crashing kernel launch would give
        ctypes.string_at(0)
    elif kind == "hang":
        while True:
            time.sleep(3600)
    elif kind == "ima-message":
        sys.stderr.write(
            "RuntimeError: CUDA error: an illegal memory access was encountered\n"
            "CUDA kernel errors might be asynchronously reported at some other API call\n"
        )
        sys.stderr.flush()
        os._exit(1)
    elif kind == "exit":
        os._exit(3)  # dies silently; peers are left waiting in a collective
    elif kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "raise":
        raise RuntimeError("injected fault")


@dataclass
class WorkerContext:
    """Everything a scenario needs on one rank; scenarios talk to the harness only through it."""

    spec: TrialSpec
    cfg: TrialConfig
    rank: int
    device: torch.device
    tp: TP
    sink: RecordSink
    guard: CaptureGuard
    history: MemoryHistory
    memory: HarnessMemory
    census: CensusBook | None = None  # None: CPU, or no census here
    timings: dict[str, float] = field(default_factory=dict)
    replayed: set[str] = field(default_factory=set)  # graphs whose first replay is recorded

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase (build, capture, reload, replays); CUDA work is synchronized first."""
        start = time.perf_counter()
        yield
        self.sync()
        seconds = time.perf_counter() - start
        self.timings[name] = self.timings.get(name, 0.0) + seconds
        self.sink.emit(Event.PHASE, name=name, seconds=seconds)

    def sync(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize(self.device)

    def begin_step(self, step: int) -> None:
        """Mark the step as started, so a death inside it is attributed to it."""
        self.sink.emit(Event.BEGIN, step=step)
        f = self.spec.fault
        if f and f.get("rank", 0) == self.rank and f.get("step", 0) == step:
            self.sink.emit(Event.FAULT, kind=f["kind"], step=step)  # on disk before it fires
            inject_fault(f["kind"])

    def step(self, record: StepRecord) -> None:
        self.sink.emit(Event.STEP, **dataclasses.asdict(record))

    def replaying(self, graph: str) -> None:
        """A captured graph is about to replay: the record says replays ran even when this one
        crashes before its step is recorded. Once per graph keeps the records small."""
        if graph not in self.replayed:
            self.replayed.add(graph)
            self.sink.emit(Event.REPLAY, graph=graph)

    def check_guard(self, when: str, graph: str | None = None, deep: bool = True) -> list[Finding]:
        """Guard check before a replay, plus the census check at the deep points (deep, or the
        first check of a graph); findings are written before the replay can crash."""
        guard_findings = self.guard.check(when, graph, deep)
        census_findings = []
        if self.census is not None and (deep or graph not in self.census.checked):
            census_findings = self.census.check(when, graph)
        return self.emit_findings(guard_findings, census_findings)

    def emit_findings(self, guard_findings: list[Finding], census_findings: list[Finding]) -> list[Finding]:
        from repro.diagnose.merge import merge_findings

        findings = merge_findings(
            guard_findings,
            census_findings,
            self.guard.slots if census_findings else [],
            self.guard.mode != GuardMode.OFF,
            self.census,
        )
        if findings:
            self.history.annotate(findings)
            for f in findings:
                self.sink.emit(Event.FINDING, **dataclasses.asdict(f))
        return findings

    def after_free(self, when: str) -> AfterFree:
        """Deep check at `when`, then the after-free knob on the freed captured blocks the
        census found (never the guard's: the knob must act the same with the guard off)."""
        from repro.rank.graphs import apply_after_free

        guard_findings = self.guard.check(when, None, True)
        findings, regions, note = [], [], ""
        if self.census is not None:
            findings, regions = self.census.dead_blocks(when)
            self.detail(census=self.census.graph_counts(), census_errors=self.census.errors)
            self.note(self.census.census_line())
        elif self.on_gpu:
            note = "no graph census here, so no freed captured block to target"
        self.emit_findings(guard_findings, findings)
        r = self.cfg.run
        return apply_after_free(r.after_free, regions, self.device, r.seed, note)

    def manifest(self, when: str) -> None:
        self.sink.emit(Event.MANIFEST, **dataclasses.asdict(self.guard.manifest(when)))

    def note(self, text: str) -> None:
        self.sink.emit(Event.NOTE, text=text)

    def detail(self, **fields: Any) -> None:
        """Trial facts worth keeping (after-free result, mechanism, ...)."""
        self.sink.emit(Event.DETAIL, **fields)


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent (the harness, or the rank server) dies, so
    no rank outlives it. parent_pid: the parent as it was before this call."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # parent already gone before prctl took effect
        os._exit(1)


def pick_device(spec: TrialSpec, rank: int) -> torch.device:
    """One GPU per rank; every rank on GPU 0 when the ranks share it (run.share_gpu)."""
    import torch

    if spec.device == Device.CUDA:
        index = 0 if spec.config["run"].get("share_gpu") else rank
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def build_context(spec: TrialSpec, rank: int, sink: RecordSink) -> WorkerContext:
    import torch
    from repro.diagnose import forensics, guard
    from repro.rank import dist, graphs

    cfg = TrialConfig.from_dict(spec.config)
    torch.manual_seed(cfg.run.seed)
    start = time.perf_counter()
    device = pick_device(spec, rank)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the CUDA context now, so "cuda" times its creation
        sink.emit(Event.PHASE, name="cuda", seconds=time.perf_counter() - start)
    # The harness's capture and collective helpers are plumbing: sites and stacks name the
    # scenario line that asked for a tensor, not the helper that allocated it.
    # No scenario compiles: the recording need not hide from torch.compile (which costs the
    # torch._dynamo import, seconds of every trial). The guard's fingerprints allocate in the
    # harness's pool: never in freed captured blocks, whose bytes decide how a bug shows.
    memory = graphs.HarnessMemory(device)
    stale_guard = guard.CaptureGuard(
        mode=cfg.run.guard, rank=rank, plumbing=(dist.__file__, graphs.__file__), compiles=False, scratch=memory.use
    )
    history = forensics.MemoryHistory(
        enabled=cfg.run.forensics and device.type == "cuda", plumbing=stale_guard.plumbing
    )
    history.start()
    start = time.perf_counter()
    # Collectives must outlast the trial deadline: a hang is the harness's verdict, not a
    # collective timeout that looks like a crash.
    tp = dist.init_tp(
        rank,
        spec.world_size,
        rendezvous_path(spec.out_dir),
        device,
        timeout_s=cfg.run.deadline_s + 600,
        share_gpu=cfg.run.share_gpu,
    )
    sink.emit(Event.PHASE, name="init", seconds=time.perf_counter() - start)
    ctx = WorkerContext(
        spec=spec,
        cfg=cfg,
        rank=rank,
        device=device,
        tp=tp,
        sink=sink,
        guard=stale_guard,
        history=history,
        memory=memory,
        census=open_census(device, rank, history, sink),
    )
    ctx.timings["init"] = time.perf_counter() - start
    return ctx


def open_census(device: torch.device, rank: int, history: MemoryHistory, sink: RecordSink) -> CensusBook | None:
    """The graph census on CUDA where the driver and torch allow it; its reason when not.

    With --forensics the memory history (with stacks) already records the allocator trace the
    census needs; otherwise the census records one without stacks.
    """
    if device.type != "cuda":
        return None
    from repro.diagnose import census

    ok, reason = census.census_supported()
    if not ok:
        sink.emit(Event.NOTE, text=f"graph census unavailable: {reason}")
        return None
    return census.CensusBook(rank=rank, trace=census.Tracing.EXTERNAL if history.active else census.Tracing.START)


def dump_forensics(ctx: WorkerContext) -> None:
    if not ctx.history.available:
        return
    name = ctx.history.snapshot_name(ctx.cfg.scenario, ctx.rank, os.getpid())
    path = Path(ctx.spec.out_dir) / name
    if ctx.history.dump(path):
        ctx.sink.emit(Event.ARTIFACT, name=f"memory snapshot rank {ctx.rank}", path=str(path))


def peak_reserved(ctx: WorkerContext | None) -> int | None:
    """The caching allocator's peak reserved bytes on this rank's GPU (what a trial really
    reached, to check the scenario's peak estimate against: repro/run/ledger.py); None off CUDA or
    before CUDA started. Never raises: it runs on the way out of a failing rank too."""
    try:
        import torch

        if ctx is None or ctx.device.type != "cuda" or not torch.cuda.is_initialized():
            return None
        return int(torch.cuda.max_memory_reserved(ctx.device))
    except Exception:
        return None


def run_rank(spec: TrialSpec, rank: int) -> int:
    from repro.scenarios import load_scenario

    sink = RecordSink(records_path(spec.out_dir, rank), rank)
    sink.emit(
        Event.START,
        pid=os.getpid(),
        device=spec.device,
        world_size=spec.world_size,
        visible_gpus=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    ctx = None
    try:
        start = time.perf_counter()
        import torch  # noqa: F401  (timed: a large share of a trial's start-up)

        sink.emit(Event.PHASE, name="import", seconds=time.perf_counter() - start)
        if rank == 0:
            # The report's torch/CUDA/NCCL facts come from here, so the parent never imports torch.
            from repro.env.runtime import describe_torch

            sink.emit(Event.RUNTIME, **describe_torch())
        ctx = build_context(spec, rank, sink)
        with torch.no_grad():  # inference engines never build autograd graphs
            load_scenario(ctx.cfg.scenario).run(ctx)
        dump_forensics(ctx)
        sink.emit(Event.DONE, timings=ctx.timings, peak_reserved_bytes=peak_reserved(ctx))
        from repro.rank import dist

        dist.shutdown(ctx.tp)
        return 0
    except BaseException as e:  # noqa: BLE001 - every failure must be recorded before exit
        sink.emit(
            Event.ERROR,
            type=type(e).__name__,
            message=str(e)[:4000],
            traceback=traceback.format_exc()[-6000:],
            peak_reserved_bytes=peak_reserved(ctx),
        )
        if ctx is not None:
            with contextlib.suppress(BaseException):
                dump_forensics(ctx)
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        # Exit before the context is torn down: after a sticky CUDA error, destructors of
        # CUDA objects (memory pools, communicators) abort the process and would hide the
        # error we just recorded behind a SIGABRT.
        os._exit(1)


def answer_stack_requests(spec: TrialSpec, rank: int) -> None:
    """On STACKS_SIGNAL, write every thread's Python stack to rank<R>.stacks.

    faulthandler writes from its C signal handler, so a rank blocked inside a collective (in
    C++, maybe holding the GIL) still answers. The file stays open for the process's life.
    """
    stacks = open(stacks_path(spec.out_dir, rank), "w")
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True)


def main(argv: list[str], parent_pid: int | None = None) -> None:
    """parent_pid: the rank server's pid when forked from it (repro/rank/server.py)."""
    die_with_parent(os.getppid() if parent_pid is None else parent_pid)
    silence_known_warnings()  # before torch is imported: it warns once, at import
    faulthandler.enable()  # a segfault still prints the Python stack to the log
    spec = TrialSpec.load(Path(argv[0]))
    rank = int(argv[1])
    answer_stack_requests(spec, rank)  # before the start record: a started rank can answer
    code = run_rank(spec, rank)
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: after a sticky CUDA error or with a dead peer, normal interpreter teardown
    # (NCCL communicator destructors) can hang; everything worth keeping is already on disk.
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
