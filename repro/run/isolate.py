"""Run one trial as an isolated group of rank processes and classify how it ended.

The parent never imports torch or touches CUDA: it starts one process per rank (forked by the
run's rank server, which imported torch once and never initialises CUDA, or a fresh
`python -m repro.rank.worker`), watches exit codes and a deadline, kills the whole group as soon
as one rank dies (a peer blocked in a collective after its neighbour's illegal memory access
must never hang the harness), then reads the ranks' JSONL records back.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from repro.run import stacks
from repro.run.footprint import out_of_memory_note
from repro.config import TrialConfig, default_expectation
from repro.run.interrupts import checkpoint
from repro.run.launch import RankServer, ServerUnavailable, StartCancelled, child_env
from repro.outcome import (
    REPRODUCED,
    FirstFailure,
    Outcome,
    RankExit,
    TrialRecord,
    finding_from_dict,
    manifest_from_dict,
    parse_expectation,
    step_from_dict,
    worst,
)
from repro.run.protocol import (
    STACKS_SIGNAL,
    Event,
    RankRecords,
    StepCounter,
    TrialSpec,
    log_path,
    read_records,
    records_path,
    rendezvous_path,
    spec_path,
    stacks_path,
)
from repro.scenarios import trial_measures

POLL_S = 0.05
# After the first rank dies, peers get this long to record their own error before the kill.
GRACE_S = 2.0
# At a deadline, ranks get up to this long to dump their stacks before the kill.
STACKS_WAIT_S = 1.0
# At the deadline a trial whose last record is at most this old (or no older than twice its
# longest pause so far) counts as progressing: DEADLINE, not HANG.
PROGRESS_PAUSE_S = 1.0
TAIL_CHARS = 3000

# torch's allocator error (torch.OutOfMemoryError: "CUDA out of memory. Tried to allocate ..."):
# still a CRASH, but where the scenario is expected to outgrow the GPU the detail says so first.
OUT_OF_MEMORY = re.compile(r"CUDA out of memory|OutOfMemoryError")

# Specific phrases only: PyTorch's illegal-address message itself ends with "Compile with
# TORCH_USE_CUDA_DSA to enable device-side assertions", so "device-side assert" alone is not
# evidence of an assert (measured on torch 2.11 / H200).
ERROR_PATTERNS = [
    (Outcome.STALE_CAPTURE, re.compile(r"StaleCaptureError")),
    (
        Outcome.DEVICE_ASSERT,
        re.compile(r"device-side assert triggered|cudaErrorAssert|CUDA_ERROR_ASSERT|Assertion `.*` failed", re.I),
    ),
    (
        Outcome.ILLEGAL_ADDRESS,
        re.compile(
            r"illegal memory access|cudaErrorIllegalAddress|CUDA_ERROR_ILLEGAL_ADDRESS|"
            r"Invalid __global__ (read|write)",
            re.I,
        ),
    ),
]


# A rank that died of these died because a peer went away first: collateral, not the cause.
PEER_LOSS = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote worker|remote process|"
    r"Broken pipe|NCCL communicator was aborted|ncclRemoteError|Socket Timeout",
    re.I,
)


class Interrupted(Exception):
    """Ctrl-C or SIGTERM during a trial; carries the partial trial record so nothing is lost."""

    def __init__(self, trial: TrialRecord):
        super().__init__("interrupted")
        self.trial = trial


@dataclass
class Rank:
    rank: int
    proc: Any  # subprocess.Popen, or launch.RemoteRank (same interface)
    log: Any  # the log file we opened; None when the rank opened its own
    pgid: int
    exited_at: float | None = None
    killed: bool = False


@dataclass
class Waited:
    spawned_at: float
    ended_at: float
    hung: bool = False  # no progress (stalled) or no record at all by the deadline
    interrupted: bool = False
    first_death: int | None = None
    stacks: dict[int, str] = field(default_factory=dict)  # rank -> its faulthandler dump, when asked
    stalled: bool = False  # the progress watchdog fired (no record for stall_s)
    deadline: bool = False  # the overall deadline came while the trial still progressed
    quiet_s: float | None = None  # seconds since the last record when the wait ended
    longest_pause_s: float = 0.0  # the longest pause between records before that
    stall_limit_s: float | None = None  # the watchdog's limit then: --stall, or twice that pause


@dataclass
class Activity:
    """What tells a slow trial from a stuck one: when the ranks last appended a record to
    their JSONL files, and whether any has recorded a step yet (set-up phases, the model
    build above all, may be long and silent; steps repeat). The pauses between records are
    measured from the first step's start, so a step whose own phases are slow (a real-dims
    reload on CPU: a minute or two without a record) sets how long a pause may be."""

    counters: list[StepCounter]
    seen: int = 0  # bytes of complete records read so far, all ranks
    last_at: float | None = None  # monotonic time a record was last seen; None: none yet
    stepping: bool = False  # some rank has recorded a step
    began: bool = False  # some rank has begun a step
    longest_pause_s: float = 0.0  # the longest pause between records since then

    def poll(self, now: float) -> None:
        steps = [c.poll() for c in self.counters]
        seen = sum(c.offset for c in self.counters)
        if seen != self.seen:
            # A pause counts once a step had begun before it: set-up's silences are not steps'.
            if self.began and self.last_at is not None:
                self.longest_pause_s = max(self.longest_pause_s, now - self.last_at)
            self.seen, self.last_at = seen, now
            self.stepping = self.stepping or any(steps)
            self.began = self.began or self.stepping or any(c.begun for c in self.counters)

    def quiet(self, now: float) -> float | None:
        return None if self.last_at is None else now - self.last_at

    def stall_limit(self, stall_s: float | None) -> float | None:
        """stall_s, or twice the longest pause the steps have shown, whichever is longer."""
        return None if stall_s is None else max(stall_s, 2 * self.longest_pause_s)

    def stalled(self, now: float, stall_s: float | None) -> bool:
        """The watchdog: steps had begun, and no rank wrote a record for the stall limit."""
        quiet, limit = self.quiet(now), self.stall_limit(stall_s)
        return limit is not None and self.stepping and quiet is not None and quiet > limit

    def progressing(self, now: float, stall_s: float | None) -> bool:
        """Still going at the deadline: in the steps, the current pause is no longer than twice
        the longest one since they began (at least PROGRESS_PAUSE_S); in set-up, a record
        came within stall_s."""
        quiet = self.quiet(now)
        if quiet is None:
            return False
        if not self.stepping:
            return stall_s is not None and quiet <= stall_s
        return quiet <= max(2 * self.longest_pause_s, PROGRESS_PAUSE_S)


def spawn_ranks(
    spec: TrialSpec,
    spec_file: Path,
    wrapper: list[str],
    extra_env: dict[str, str] | None = None,
    server: RankServer | None = None,
    stop: threading.Event | None = None,
) -> list[Rank]:
    """One process per rank: forked by the run's rank server where it serves this trial,
    else a fresh `python -m repro.rank.worker` (always under a wrapper program). Once `stop` is
    set (an interrupt) no further rank is started: the ranks so far are returned."""
    ranks: list[Rank] = []
    env = child_env(extra_env)
    use_server = server is not None and server.serves(env, wrapper)
    try:
        for r in range(spec.world_size):
            if stop is not None and stop.is_set():
                break
            # Rank 0 leads a new process group (not in the terminal's foreground, so Ctrl-C
            # reaches only the parent); the others join it so one killpg ends the trial.
            # If rank 0 is already gone, a rank leads its own group.
            joins = bool(ranks) and ranks[0].proc.poll() is None
            pgid = ranks[0].pgid if joins else 0
            log_file = log_path(spec.out_dir, r)
            if use_server:
                try:
                    proc, pgid = server.start_rank(str(spec_file), r, env, str(log_file), pgid, stop)
                    ranks.append(Rank(rank=r, proc=proc, log=None, pgid=pgid))
                    continue
                except StartCancelled:
                    break
                except ServerUnavailable:
                    use_server = False  # this rank and the rest the old way
            log = open(log_file, "wb")
            cmd = [*wrapper, sys.executable, "-m", "repro.rank.worker", str(spec_file), str(r)]
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=os.getcwd(),
                process_group=pgid,
            )
            ranks.append(Rank(rank=r, proc=proc, log=log, pgid=pgid or proc.pid))
    except BaseException:
        kill_group(ranks)
        raise
    return ranks


def kill_group(ranks: list[Rank]) -> None:
    """SIGKILL every process group of the trial (children of ranks included) and reap."""
    for r in ranks:  # decide before the kill: afterwards poll() says -9
        if r.proc.poll() is None:
            r.killed = True
    for pgid in {r.pgid for r in ranks}:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for r in ranks:
        try:
            r.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if r.log is not None:
            r.log.close()


def request_stacks(ranks: list[Rank], out_dir: str) -> list[int]:
    """Ask every live rank for its Python stacks and wait until each answered (STACKS_WAIT_S
    at most). A rank is asked once its start record is out: it answers from then on."""
    asked = []
    for r, recs in zip(ranks, read_records(out_dir, len(ranks))):
        starts = recs.of(Event.START)
        if r.proc.poll() is None and starts:
            try:
                os.kill(starts[0]["pid"], STACKS_SIGNAL)  # the worker's own pid (a wrapper may sit above it)
                asked.append(r.rank)
            except (ProcessLookupError, PermissionError):
                pass
    end = time.monotonic() + STACKS_WAIT_S
    while asked and time.monotonic() < end:
        if all(answered(stacks_path(out_dir, k)) for k in asked):
            time.sleep(POLL_S)  # the dump is a burst of small writes: let it finish
            break
        time.sleep(POLL_S)
    return asked


def answered(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except FileNotFoundError:
        return False


def read_stacks(out_dir: str, ranks: list[int]) -> dict[int, str]:
    dumps = {}
    for k in ranks:
        path = stacks_path(out_dir, k)
        if path.exists() and path.stat().st_size:
            dumps[k] = path.read_text(encoding="utf-8", errors="replace")
    return dumps


def wait_group(
    ranks: list[Rank],
    deadline_s: float,
    spawned_at: float,
    on_tick: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
    out_dir: str | None = None,
    stall_s: float | None = None,
) -> Waited:
    """Poll until every rank exited, one died (plus GRACE_S), the trial stalled, the deadline,
    or an interrupt: Ctrl-C in this thread, or `stop` set by the thread that got it.

    Two clocks (out_dir given): the progress watchdog, no record from any rank for stall_s
    once steps began (HANG); and the overall deadline, which is a HANG only when the trial was
    not progressing then (see Activity.progressing), else DEADLINE: slow, not stuck, and no
    rank is blamed. For a HANG the ranks are asked for
    their stacks before the kill."""
    waited = Waited(spawned_at=spawned_at, ended_at=spawned_at)
    asked: list[int] = []
    first_death_at = None
    activity = Activity([StepCounter(records_path(out_dir, r.rank)) for r in ranks]) if out_dir is not None else None
    try:
        while True:
            now = time.monotonic()
            if stop is not None and stop.is_set():
                waited.interrupted = True  # first: a trial stopped before all its ranks started
                break
            if activity is not None:
                activity.poll(now)
            for r in ranks:
                if r.exited_at is None and r.proc.poll() is not None:
                    r.exited_at = now
                    if r.proc.returncode != 0 and waited.first_death is None:
                        waited.first_death, first_death_at = r.rank, now
            if all(r.exited_at is not None for r in ranks):
                break
            if first_death_at is not None and now - first_death_at > GRACE_S:
                break
            stalled = activity is not None and activity.stalled(now, stall_s)
            if stalled or now - spawned_at > deadline_s:
                waited.quiet_s = activity.quiet(now) if activity is not None else None
                waited.longest_pause_s = activity.longest_pause_s if activity is not None else 0.0
                waited.stall_limit_s = activity.stall_limit(stall_s) if activity is not None else None
                if not stalled and activity is not None and activity.progressing(now, stall_s):
                    waited.deadline = True
                    break
                waited.hung, waited.stalled = True, stalled
                if out_dir is not None:
                    asked = request_stacks(ranks, out_dir)
                break
            if on_tick:
                on_tick()
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        waited.interrupted = True
    finally:
        kill_group(ranks)
        waited.ended_at = time.monotonic()
    if asked:
        waited.stacks = read_stacks(out_dir, asked)
    return waited


def read_tail(path: Path, chars: int = TAIL_CHARS) -> str:
    """The last `chars` bytes of a file as text; '' for a file never written."""
    if not path.exists():
        return ""
    data = path.read_bytes()[-chars:]
    return data.decode("utf-8", errors="replace")


def signal_name(code: int | None) -> str | None:
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def classify_error(text: str) -> Outcome:
    for outcome, pattern in ERROR_PATTERNS:
        if pattern.search(text):
            return outcome
    return Outcome.CRASH


def rank_exit(r: Rank, recs: RankRecords, out_dir: str, dump: str = "") -> RankExit:
    errors = recs.of(Event.ERROR)
    error = f"{errors[-1]['type']}: {errors[-1]['message']}" if errors else None
    code = r.proc.returncode
    starts = recs.of(Event.START)
    last = [e for e in recs.events if e.get("event") in (Event.DONE, Event.ERROR)][-1:]
    return RankExit(
        rank=r.rank,
        pid=starts[0]["pid"] if starts else r.proc.pid,
        exitcode=None if r.killed else code,
        signal=None if r.killed else signal_name(code),
        killed_by_harness=r.killed,
        stderr_tail=read_tail(log_path(out_dir, r.rank)),
        error=error,
        stack=stacks.top_frames(dump),
        peak_reserved_bytes=last[0].get("peak_reserved_bytes") if last else None,
    )


def error_text(ex: RankExit, recs: RankRecords) -> str:
    errors = recs.of(Event.ERROR)
    last = [errors[-1].get("message", ""), errors[-1].get("traceback", "")] if errors else []
    return "\n".join(last) + "\n" + ex.stderr_tail


def collateral(ex: RankExit, recs: RankRecords) -> bool:
    return not ex.signal and bool(PEER_LOSS.search(error_text(ex, recs)))


def interrupt_victim(ex: RankExit) -> bool:
    """A rank the interrupt itself reached (a CI cancel may signal the whole process tree)."""
    return ex.signal in ("SIGINT", "SIGTERM") or (ex.error or "").startswith("KeyboardInterrupt")


def rank_failure(ex: RankExit, recs: RankRecords) -> Outcome | None:
    """How a rank ended on its own: None when it finished cleanly or was killed by us."""
    if ex.killed_by_harness:
        return None
    if ex.exitcode == 0 and recs.of(Event.DONE):
        return None
    # A recorded CUDA error outranks the signal that may follow it (an abort in a destructor).
    return classify_error(error_text(ex, recs))


def current_step(recs: RankRecords) -> int | None:
    """The step a rank was in when it stopped: the last one it began."""
    steps = [e["step"] for e in recs.of(Event.BEGIN)]
    return max(steps) if steps else None


DETAIL_CHARS = 600


def clip(text: str, limit: int = DETAIL_CHARS) -> str:
    """At most `limit` characters, never ending mid-sentence: whole sentences where they fit,
    else whole words and an ellipsis (the record keeps the whole error)."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    end = max(head.rfind(". "), head.rfind("; "))
    if end > limit // 2:
        return head[: end + 1].rstrip(";") + " …"
    return head.rsplit(" ", 1)[0].rstrip(" ,;:(") + " …"


def crash_detail(ex: RankExit) -> str:
    if ex.error:
        return clip(ex.error.splitlines()[0])
    if ex.signal:
        return f"killed by {ex.signal}"
    lines = [ln.strip() for ln in ex.stderr_tail.splitlines() if ln.strip()]
    telling = [ln for ln in lines if any(p.search(ln) for _, p in ERROR_PATTERNS)]
    return clip((telling or lines or [f"exit code {ex.exitcode}"])[-1])


def classify(
    cfg: TrialConfig, recs: list[RankRecords], exits: list[RankExit], waited: Waited
) -> tuple[Outcome, FirstFailure | None]:
    if any(r.of(Event.UNSUPPORTED) for r in recs):
        reason = next(e["reason"] for r in recs for e in r.of(Event.UNSUPPORTED))
        return Outcome.UNSUPPORTED, FirstFailure(Outcome.UNSUPPORTED, None, None, reason)
    died = [
        (ex, o)
        for ex, rr in zip(exits, recs)
        if (o := rank_failure(ex, rr)) is not None and not (waited.interrupted and interrupt_victim(ex))
    ]
    causes = [(ex, o) for ex, o in died if not collateral(ex, recs[ex.rank])]
    # Peers lost to an interrupted rank are not a crash of their own.
    died = causes or ([] if waited.interrupted else died)
    if died:
        # The failing rank is the first to die of its own accord (not of a lost peer); the
        # outcome is the most severe such death.
        first = next((d for d in died if d[0].rank == waited.first_death), died[0])
        outcome = worst([o for _, o in died])
        ex = first[0]
        detail = crash_detail(ex)
        if outcome == Outcome.CRASH and OUT_OF_MEMORY.search(error_text(ex, recs[ex.rank])):
            note = out_of_memory_note(cfg)  # '' where the scenario was expected to fit
            detail = clip(f"{note}; {detail}") if note else detail
        return outcome, FirstFailure(outcome, ex.rank, current_step(recs[ex.rank]), detail)
    if waited.deadline:
        return Outcome.DEADLINE, deadline_failure(cfg, recs, waited)
    if waited.hung:
        return Outcome.HANG, hang_failure(cfg, recs, exits, waited)
    if waited.interrupted:
        steps = {current_step(r) for r in recs}
        step = steps.pop() if len(steps) == 1 else None
        return Outcome.INTERRUPTED, FirstFailure(
            Outcome.INTERRUPTED, None, step, "interrupted before the trial finished; records up to then kept"
        )
    return classify_steps(recs)


def hang_failure(cfg: TrialConfig, recs: list[RankRecords], exits: list[RankExit], waited: Waited) -> FirstFailure:
    """Blame the rank that was not waiting in a collective while its peers were (from the stacks
    the ranks dumped at the deadline); a lone stuck rank is blamed as it is."""
    stuck = [ex.rank for ex in exits if ex.killed_by_harness]
    if waited.quiet_s is None:
        detail = f"no record from any rank within the {cfg.run.deadline_s:g} s deadline; group killed"
    elif waited.stalled:
        limit = waited.stall_limit_s or cfg.run.stall_s
        why = (
            f"{cfg.run.stall_s:g} s, --stall"
            if limit <= cfg.run.stall_s
            else f"{limit:.0f} s, twice the longest pause between the steps' records so far; --stall {cfg.run.stall_s:g}"
        )
        detail = f"no record from any rank for {waited.quiet_s:.0f} s (stall limit {why}); group killed"
    else:
        detail = (
            f"no record from any rank for the last {waited.quiet_s:.1f} s before the "
            f"{cfg.run.deadline_s:g} s deadline (longest pause before: {waited.longest_pause_s:.1f} s); "
            "group killed"
        )
    rank, why = stacks.blame({k: stacks.main_frames(waited.stacks.get(k, "")) for k in stuck})
    if rank is None and len(stuck) == 1:
        rank = stuck[0]
    elif len(stuck) > 1:
        detail += f"; {why}"
    steps = {current_step(recs[k]) for k in stuck}
    step = current_step(recs[rank]) if rank is not None else (steps.pop() if len(steps) == 1 else None)
    return FirstFailure(Outcome.HANG, rank, step, detail)


def deadline_failure(cfg: TrialConfig, recs: list[RankRecords], waited: Waited) -> FirstFailure:
    """The deadline came while the ranks still wrote records: too slow for the budget, not a
    hang. Where it had got to, and no blame: every rank was progressing."""
    steps = [s for s in (current_step(r) for r in recs) if s is not None]
    done = min(len({e["step"] for e in r.of(Event.STEP)}) for r in recs) if recs else 0
    # Steps counted from 0, as the steps table and the verdict's "on step N" count them.
    where = (
        f"in step {max(steps)} ({done} of {cfg.run.steps} steps done)"
        if steps
        else f"before the first step (0 of {cfg.run.steps} steps done)"
    )
    detail = (
        f"deadline {cfg.run.deadline_s:g} s reached {where} while progressing (last record "
        f"{waited.quiet_s or 0:.1f} s before); not a hang: raise --deadline, or lower --steps"
    )
    return FirstFailure(Outcome.DEADLINE, None, max(steps) if steps else None, detail)


def classify_steps(recs: list[RankRecords]) -> tuple[Outcome, FirstFailure | None]:
    steps = [step_from_dict(e) for r in recs for e in r.of(Event.STEP)]
    for kind in (Outcome.NONFINITE, Outcome.MISMATCH):
        bad = sorted((s for s in steps if s.outcome() == kind), key=lambda s: (s.step, s.rank))
        if bad:
            s = bad[0]
            what = (
                f"{s.nonfinite}/{s.numel} non-finite"
                if kind == Outcome.NONFINITE
                else f"{s.mismatches}/{s.compared} differ from the reference"
                if s.mismatches
                else f"the ranks disagree on {s.rank_disagreements()}/{s.compared} outputs"
            )
            return kind, FirstFailure(kind, s.rank, s.step, f"{s.label}: {what}")
    findings = [e for r in recs for e in r.of(Event.FINDING)]
    if findings:
        f = findings[0]
        return Outcome.STALE_CAPTURE, FirstFailure(
            Outcome.STALE_CAPTURE, f["rank"], None, f"{f['slot']} {f['status']} ({f['when']})"
        )
    return Outcome.CLEAN, None


def phase_timings(recs: list[RankRecords], waited: Waited) -> dict[str, float]:
    """Per phase, the slowest rank (phases run in lock-step across ranks)."""
    timings: dict[str, float] = {}
    starts = [e["t"] for r in recs for e in r.of(Event.START)]
    wall_spawn = time.time() - (time.monotonic() - waited.spawned_at)
    if starts:
        timings["start"] = max(0.0, min(starts) - wall_spawn)
    for r in recs:
        per_rank: dict[str, float] = {}
        for e in r.of(Event.PHASE):
            per_rank[e["name"]] = per_rank.get(e["name"], 0.0) + e["seconds"]
        for name, sec in per_rank.items():
            timings[name] = max(timings.get(name, 0.0), sec)
    timings["total"] = waited.ended_at - waited.spawned_at
    return timings


def replayed_graphs(steps: list, recs: list[RankRecords]) -> bool:
    """A replay ran: a step says its output came from one, or a rank marked one it started
    (the replay that crashes never gets its step record). Never inferred from the device."""
    return any(s.replayed for s in steps) or any(r.of(Event.REPLAY) for r in recs)


def injected(fault: dict[str, Any] | None, recs: list[RankRecords]) -> dict[str, Any] | None:
    """The test hook's fault as asked, and whether the rank reached it ("fired")."""
    if not fault:
        return None
    rank = fault.get("rank", 0)
    fired = rank < len(recs) and bool(recs[rank].of(Event.FAULT))
    return {"kind": fault["kind"], "rank": rank, "step": fault.get("step", 0), "fired": fired}


def runtime_facts(recs: list[RankRecords]) -> dict[str, Any]:
    reported = recs[0].of(Event.RUNTIME) if recs else []
    return {k: v for k, v in reported[0].items() if k not in ("event", "rank", "t")} if reported else {}


def build_record(
    trial_id: str,
    cfg: TrialConfig,
    device: str,
    recs: list[RankRecords],
    exits: list[RankExit],
    waited: Waited,
    out_dir: str,
    fault: dict[str, Any] | None = None,
) -> TrialRecord:
    outcome, first = classify(cfg, recs, exits, waited)
    fault = injected(fault, recs)
    expected = parse_expectation(default_expectation(cfg))
    steps = sorted((step_from_dict(e) for r in recs for e in r.of(Event.STEP)), key=lambda s: (s.step, s.rank))
    details: dict[str, Any] = {}
    for r in recs:
        for e in r.of(Event.DETAIL):
            details.update({k: v for k, v in e.items() if k not in ("event", "rank", "t")})
    artifacts = {e["name"]: e["path"] for r in recs for e in r.of(Event.ARTIFACT)}
    artifacts.update({f"rank {i} records": str(records_path(out_dir, i)) for i in range(len(recs))})
    artifacts.update({f"rank {k} stacks": str(stacks_path(out_dir, k)) for k in sorted(waited.stacks)})
    notes = list(dict.fromkeys(e["text"] for r in recs for e in r.of(Event.NOTE)))  # each once, in order
    # A symptom the harness injected is not the bug's: it can never meet a "reproduced" expectation.
    met = outcome in expected and not waited.interrupted and not (fault and outcome in REPRODUCED)
    return TrialRecord(
        id=trial_id,
        scenario=cfg.scenario,
        mode=cfg.run.mode,
        config=cfg.to_dict(),
        outcome=outcome,
        expected=expected,
        met=met,
        graph_replayed=replayed_graphs(steps, recs),
        first_failure=first,
        steps=steps,
        guard_findings=[finding_from_dict(e) for r in recs for e in r.of(Event.FINDING)],
        manifests=[manifest_from_dict(e) for r in recs for e in r.of(Event.MANIFEST)],
        timings=phase_timings(recs, waited),
        ranks=exits,
        notes=notes,
        artifacts=artifacts,
        details=details,
        device=device,
        injected_fault=fault,
        runtime=runtime_facts(recs),
        measures=trial_measures(cfg.scenario, steps),
    )


def unsupported_record(trial_id: str, cfg: TrialConfig, reason: str) -> TrialRecord:
    expected = parse_expectation(default_expectation(cfg))
    return TrialRecord(
        id=trial_id,
        scenario=cfg.scenario,
        mode=cfg.run.mode,
        config=cfg.to_dict(),
        outcome=Outcome.UNSUPPORTED,
        expected=expected,
        met=Outcome.UNSUPPORTED in expected,
        graph_replayed=False,
        first_failure=FirstFailure(Outcome.UNSUPPORTED, None, None, reason),
        notes=[f"not run: {reason}"],
        measures=trial_measures(cfg.scenario, []),
    )


def run_trial(
    cfg: TrialConfig,
    device: str,
    out_root: Path,
    trial_id: str,
    fault: dict[str, Any] | None = None,
    wrapper: list[str] | None = None,
    on_tick: Callable[[str, int], None] | None = None,
    env: dict[str, str] | None = None,
    stop: threading.Event | None = None,
    server: RankServer | None = None,
) -> TrialRecord:
    """Spawn, watch, kill, classify. Raises Interrupted (with the partial record) on Ctrl-C
    or once `stop` is set. env: extra variables for the ranks (the runner's GPU lanes).
    server: the run's rank server, which forks the ranks where it can (repro/rank/server.py)."""
    out_dir = out_root / trial_id
    out_dir.mkdir(parents=True, exist_ok=True)
    world = cfg.run.tp
    spec = TrialSpec(
        trial_id=trial_id, config=cfg.to_dict(), device=device, world_size=world, out_dir=str(out_dir), fault=fault
    )
    spec.save(spec_path(out_dir))
    # A reused directory's old store port and stack dumps belong to another run.
    rendezvous_path(out_dir).unlink(missing_ok=True)
    for k in range(world):
        stacks_path(out_dir, k).unlink(missing_ok=True)
    spawned_at = time.monotonic()
    checkpoint("spawning")
    ranks = spawn_ranks(spec, spec_path(out_dir), wrapper or [], env, server, stop)
    checkpoint("spawned")
    rank0_steps = StepCounter(records_path(out_dir, 0))

    def tick() -> None:
        if on_tick:
            on_tick(trial_id, rank0_steps.poll())

    waited = wait_group(ranks, cfg.run.deadline_s, spawned_at, tick, stop, str(out_dir), cfg.run.stall_s)
    checkpoint("ended")
    tick()  # the polls can miss the last steps of a quick trial; the final count is always said
    recs = read_records(out_dir, world)
    exits = [rank_exit(r, rr, str(out_dir), waited.stacks.get(r.rank, "")) for r, rr in zip(ranks, recs)]
    trial = build_record(trial_id, cfg, device, recs, exits, waited, str(out_dir), fault)
    if any(getattr(r.proc, "lost", False) for r in ranks):
        trial.notes.append("the rank server died during the trial; its ranks died with it (SIGKILL)")
    if waited.interrupted:
        trial.notes.append("interrupted; records up to that point kept")
        raise Interrupted(trial)
    return trial
