"""Outcome taxonomy and the records a trial produces.

Everything here is plain data: workers write these records (as JSON lines), the parent
reads them back, classifies, and the report renders them. No torch import: the parent
process must stay free of CUDA state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any, ClassVar, TypeVar

SCHEMA = "repro.report/1"
E = TypeVar("E", bound=Enum)


class Outcome(str, Enum):
    CLEAN = "CLEAN"  # replays ran, finite, equal to the reference
    ILLEGAL_ADDRESS = "ILLEGAL_ADDRESS"  # CUDA error 700 on any rank
    DEVICE_ASSERT = "DEVICE_ASSERT"  # CUDA error 710 / device-side assert
    NONFINITE = "NONFINITE"  # NaN/Inf in outputs
    MISMATCH = "MISMATCH"  # finite but different from the reference
    STALE_CAPTURE = "STALE_CAPTURE"  # guard found a dead/moved captured tensor, no symptom
    HANG = "HANG"  # no progress (no record from any rank) for --stall s, or none by
    # the deadline; the group was killed, the stuck rank blamed
    DEADLINE = "DEADLINE"  # the overall deadline came while the trial still progressed:
    # too slow for its budget, not stuck; no verdict, never a pass
    CRASH = "CRASH"  # any other abnormal exit
    UNSUPPORTED = "UNSUPPORTED"  # the environment cannot run it: never a pass
    INTERRUPTED = "INTERRUPTED"  # cut short by Ctrl-C / SIGTERM: no verdict, never a pass


# What "the bug reproduced" means for an unfixed mode: a symptom, or the guard's latent finding.
REPRODUCED = frozenset(
    {
        Outcome.ILLEGAL_ADDRESS,
        Outcome.DEVICE_ASSERT,
        Outcome.NONFINITE,
        Outcome.MISMATCH,
        Outcome.STALE_CAPTURE,
    }
)

# When ranks disagree, the trial takes the most severe outcome; a hard CUDA error outranks
# the numbers that led up to it.
SEVERITY = [
    Outcome.INTERRUPTED,
    Outcome.DEADLINE,
    Outcome.UNSUPPORTED,
    Outcome.CLEAN,
    Outcome.STALE_CAPTURE,
    Outcome.MISMATCH,
    Outcome.NONFINITE,
    Outcome.HANG,
    Outcome.CRASH,
    Outcome.DEVICE_ASSERT,
    Outcome.ILLEGAL_ADDRESS,
]


def worst(outcomes: list[Outcome]) -> Outcome:
    return max(outcomes, key=SEVERITY.index) if outcomes else Outcome.CLEAN


# An interrupt or a budget too small says nothing about the code under test, so no trial can
# expect one.
EXPECTABLE = [o for o in Outcome if o not in (Outcome.INTERRUPTED, Outcome.DEADLINE)]


def parse_expectation(text: str) -> list[Outcome]:
    """'clean' | 'reproduced' | 'NONFINITE' | 'MISMATCH,NONFINITE' -> allowed outcomes."""
    allowed: set[Outcome] = set()
    for word in (w.strip() for w in text.split(",") if w.strip()):
        if word.lower() == "clean":
            allowed.add(Outcome.CLEAN)
        elif word.lower() == "reproduced":
            allowed |= REPRODUCED
        else:
            outcome = next((o for o in EXPECTABLE if o.value == word.upper()), None)
            if outcome is None:
                names = ", ".join(["clean", "reproduced"] + [o.value for o in EXPECTABLE])
                raise ValueError(f"expectation {word!r} is not one of: {names}")
            allowed.add(outcome)
    if not allowed:
        raise ValueError("expectation is empty; use 'clean', 'reproduced' or outcome names")
    return sorted(allowed, key=SEVERITY.index)


@dataclass
class StepRecord:
    """One step of a scenario (a decode step, a reload and replay, ...) on one rank."""

    step: int
    rank: int
    batch: int  # tokens fed to the captured region
    replayed: bool  # False on CPU: the eager path stood in for the graph
    numel: int = 0  # output elements checked for finiteness
    nonfinite: int = 0
    compared: int = 0  # tokens or elements compared to the oracle
    mismatches: int = 0
    max_abs_err: float | None = None
    rel_err: float | None = None
    tolerance: float | None = None
    seconds: float = 0.0
    label: str = ""  # e.g. "graph bs=16", "reload 3 (changed)"
    extra: dict[str, Any] = field(default_factory=dict)

    def outcome(self) -> Outcome:
        if self.nonfinite:
            return Outcome.NONFINITE
        if self.mismatches or self.rank_disagreements():
            return Outcome.MISMATCH
        return Outcome.CLEAN

    def rank_disagreements(self) -> int:
        """Outputs on which the TP ranks disagree (a scenario records it as an extra): every
        rank must compute the same thing, so any disagreement is wrong output."""
        return int(self.extra.get("rank_disagreements") or 0)


class GuardMode(StrEnum):
    """The stale-capture guard's mode: [run] guard, --guard, CaptureGuard(mode=...). Here, with
    the findings it governs, so the config (parent side) and the guard (rank side) share it."""

    OFF = "off"  # records nothing
    WARN = "warn"  # findings are recorded and the run goes on (the real symptom still shows)
    RAISE = "raise"  # check() raises StaleCaptureError at the first finding


class AfterFreeKnob(StrEnum):
    """[run] after_free, --after-free: what the freed captured blocks hold before the next replay
    (repro/rank/graphs.py writes it). Here, beside GuardMode, so the config and the rank share it."""

    KEEP = "keep"  # left cached and untouched
    RELEASE = "release"  # gc.collect() + empty_cache() return empty segments to the driver
    REUSE = "reuse"  # plausible values written over them, as another tensor would leave
    POISON = "poison"  # 0xFF bytes written over them


class Device(StrEnum):
    """[run] device, --device: where a trial's ranks run. A planned trial's device is CUDA or CPU."""

    AUTO = "auto"  # CUDA where NVML sees a GPU, else CPU
    CUDA = "cuda"
    CPU = "cpu"  # gloo, no graphs: the guard's verdicts


class Status(StrEnum):
    """What became of a captured storage (guard) or block (census): a Finding's status.

    One set for both mechanisms and the reports; a word means the same whoever says it.
    """

    FREED = "freed"  # dead: its memory is free (guard), cached but inactive (census)
    MOVED = "moved"  # guard: the same storage now lives elsewhere (resized / re-pointed)
    REBOUND = "rebound"  # guard: the owner's name points at another tensor, the old one lives
    CONTENTS_CHANGED = (
        "contents-changed"  # guard: same address, new bytes, no torch write (repro/diagnose/fingerprint.py)
    )
    RELEASED = "released"  # census: the block's segment went back to the driver
    REUSED = "reused"  # census: freed, then allocated again
    # The guard's verdict for a storage none of the above happened to; counted in a Manifest,
    # never a finding's status.
    UNCHANGED = "unchanged"


class Mechanism(StrEnum):
    """Which mechanism saw a finding."""

    GUARD = "guard"  # the dispatch-mode guard (repro/diagnose/guard.py)
    CENSUS = "census"  # the graph's own parameters (repro/diagnose/census.py)
    BOTH = "both"
    # Findings taken from torch's own check_input_liveness (torch >= 2.13): the watch hooks
    # turn its error into one.
    TORCH = "torch"


def as_member(kind: type[E], value: str) -> E | str:
    """value as a member of the enum `kind`; a value it does not know (a record written by
    another version) stays the plain string, so reading old or new JSON never fails on it."""
    try:
        return kind(value)
    except ValueError:
        return value


@dataclass
class Finding:
    """A captured storage (guard) or captured block (census) found dead, moved or reused.

    One model for both mechanisms; the fields after `free_stack` are new and default so older
    JSON still loads (and older readers ignore them).
    """

    slot: str  # readable name, e.g. "drafter.<local lm_head_weight>"
    graph: str  # label of the capture that recorded it
    status: Status  # guard: freed, moved, rebound, contents-changed;
    # census: freed, released, reused
    when: str  # e.g. "before replay, step 0"
    rank: int
    shape: list[int]
    dtype: str
    nbytes: int
    old_ptr: int
    new_ptr: int | None = None
    created_at: str | None = None  # "file:line in func" of the op that made the storage
    freed_at: str | None = None  # where the last Python reference was dropped, when known
    message: str = ""
    alloc_stack: list[str] = field(default_factory=list)  # from memory history (CUDA)
    free_stack: list[str] = field(default_factory=list)
    mechanism: Mechanism = Mechanism.GUARD
    census: dict[str, Any] | None = None  # block, kernel, node, param offset, references
    disagreement: str = ""  # what the other mechanism said, when it differs


@dataclass
class Manifest:
    """Counts of captured storages after a reload (vLLM RFC #48312's check)."""

    when: str
    rank: int
    freed: int
    rebound: int
    unchanged: int
    moved: int = 0  # storage resized or re-pointed since the capture


@dataclass
class FirstFailure:
    kind: Outcome
    rank: int | None
    step: int | None
    detail: str


@dataclass
class RankExit:
    rank: int
    pid: int | None
    exitcode: int | None  # None: killed by the harness before it exited
    signal: str | None
    killed_by_harness: bool
    stderr_tail: str
    error: str | None = None  # exception text the worker recorded before dying
    stack: list[str] = field(default_factory=list)  # top frames, most recent first, when asked at a deadline
    # The CUDA caching allocator's peak reserved bytes, as the rank said at its end (done or
    # error); None on CPU, or when it died without a word.
    peak_reserved_bytes: int | None = None


@dataclass
class TrialRecord:
    id: str
    scenario: str
    mode: str
    config: dict[str, Any]
    outcome: Outcome
    expected: list[Outcome]
    met: bool
    graph_replayed: bool  # a CUDA graph replay ran (step records, replay markers)
    first_failure: FirstFailure | None = None
    steps: list[StepRecord] = field(default_factory=list)
    guard_findings: list[Finding] = field(default_factory=list)
    manifests: list[Manifest] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    ranks: list[RankExit] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    artifacts: dict[str, str] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)  # after-free result, guard mechanism, ...
    device: str = ""  # "cpu" | "cuda" where the ranks ran; "" not run
    injected_fault: dict[str, Any] | None = None  # test hook {"kind", "rank", "step", "fired"}: never a reproduction
    runtime: dict[str, Any] = field(default_factory=dict)  # torch/CUDA/NCCL facts rank 0 reported
    # The scenarios' own trial fields (ScenarioSpec.record_fields, e.g. acceptance_rate): keys of
    # the trial itself in its JSON, here rather than in their own fields so that this module
    # names no scenario. None: not measured, or another scenario's field.
    measures: dict[str, Any] = field(default_factory=dict)
    # The cluster node that ran it (`repro matrix --ray`, or the shard's host after `repro merge`);
    # None on a local run, whose JSON then has no such key.
    node: str | None = None
    # Keys carried only where they apply (absent, not null, elsewhere): a local run's JSON is
    # what it always was.
    OPTIONAL: ClassVar[tuple[str, ...]] = ("node",)
    # Dicts whose keys are written as the record's own, in the field's place.
    FLAT: ClassVar[tuple[str, ...]] = ("measures",)


@dataclass
class Report:
    environment: dict[str, Any]
    trials: list[TrialRecord]
    command: str = ""
    created: str = ""
    interrupted: bool = False
    schema: str = SCHEMA
    interrupted_by: str | None = None  # "SIGINT" | "SIGTERM"
    not_run: int = 0  # planned trials that never started (an interrupt came first)
    # `repro matrix --shard K/N` / `repro merge` (repro/run/shard.py, repro/run/merge.py): which part of
    # which plan this report covers; None on an unsharded run, whose JSON then has no such key.
    shard: dict[str, Any] | None = None
    OPTIONAL: ClassVar[tuple[str, ...]] = ("shard",)

    def all_met(self) -> bool:
        return (
            bool(self.trials) and all(t.met for t in self.trials) and not self.interrupted and not self.shard_problems()
        )

    def shard_problems(self) -> list[str]:
        """A merge's missing or duplicated shards (repro/run/merge.py): each one fails the run."""
        return list((self.shard or {}).get("problems") or [])


def to_jsonable(obj: Any) -> Any:
    """Dataclasses and enums -> plain JSON types."""
    if isinstance(obj, Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.name in getattr(obj, "FLAT", ()):
                out.update(to_jsonable(value))
            elif not (f.name in getattr(obj, "OPTIONAL", ()) and value is None):
                out[f.name] = to_jsonable(value)
        return out
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj


def _build(cls: type, data: dict[str, Any]) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in known})


def step_from_dict(d: dict[str, Any]) -> StepRecord:
    return _build(StepRecord, d)


def finding_from_dict(d: dict[str, Any]) -> Finding:
    finding = _build(Finding, d)
    finding.status = as_member(Status, finding.status)
    finding.mechanism = as_member(Mechanism, finding.mechanism)
    return finding


def manifest_from_dict(d: dict[str, Any]) -> Manifest:
    return _build(Manifest, d)


def trial_from_dict(d: dict[str, Any]) -> TrialRecord:
    d = dict(d)
    d["outcome"] = Outcome(d["outcome"])
    d["expected"] = [Outcome(e) for e in d.get("expected", [])]
    ff = d.get("first_failure")
    d["first_failure"] = (
        None
        if ff is None
        else FirstFailure(
            kind=Outcome(ff["kind"]), rank=ff.get("rank"), step=ff.get("step"), detail=ff.get("detail", "")
        )
    )
    d["steps"] = [step_from_dict(s) for s in d.get("steps", [])]
    d["guard_findings"] = [finding_from_dict(f) for f in d.get("guard_findings", [])]
    d["manifests"] = [manifest_from_dict(m) for m in d.get("manifests", [])]
    d["ranks"] = [_build(RankExit, r) for r in d.get("ranks", [])]
    # The keys that are no field of the record are the scenarios' (TrialRecord.measures).
    known = {f.name for f in dataclasses.fields(TrialRecord)}
    d["measures"] = {k: d.pop(k) for k in list(d) if k not in known}
    return _build(TrialRecord, d)


def report_from_dict(d: dict[str, Any]) -> Report:
    if d.get("schema") != SCHEMA:
        raise ValueError(f"report schema is {d.get('schema')!r}, this repro reads {SCHEMA!r}")
    return Report(
        environment=d.get("environment", {}),
        trials=[trial_from_dict(t) for t in d.get("trials", [])],
        command=d.get("command", ""),
        created=d.get("created", ""),
        interrupted=d.get("interrupted", False),
        interrupted_by=d.get("interrupted_by"),
        not_run=d.get("not_run", 0),
        shard=d.get("shard"),
    )
