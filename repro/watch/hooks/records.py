"""What a watched process tells: its record file ``<run dir>/<host>-<pid>.jsonl`` (one JSON line
a record, schema repro.watch.record/1), the counts its exit record gives, and its findings on
stderr (the first of each group).

Each record is appended with os.write on an O_APPEND descriptor, so a finding is on disk before
the replay it is about runs, whatever happens to the process next. The program's stdout is
never written to.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from repro.watch.settings import ENV_OWNER, WatchSettings

if TYPE_CHECKING:  # annotations only: nothing here imports torch until the program does
    from repro.outcome import Finding

RECORD_SCHEMA = "repro.watch.record/1"
_RANK_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
)


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
        "kind": "process",
        "schema": RECORD_SCHEMA,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "host": socket.gethostname(),
        "argv": argv,
        "executable": sys.executable,
        "python": sys.version.split()[0],
        "started": time.time(),
        "origin": settings.origin,
        "on_finding": settings.on_finding,
        "record": settings.record,
        "stacks": settings.stacks,
        "env": {k: os.environ[k] for k in (*_RANK_ENV, ENV_OWNER) if k in os.environ},
    }


@dataclass
class HookSeconds:
    """Where the hooks' own time goes (seconds, summed over the process); the per-replay fast
    path is left untimed (timing it would cost more than it does)."""

    capture_begin: float = 0.0  # naming owners, starting the recording
    capture_end: float = 0.0  # stopping the recording, records
    census: float = 0.0  # reading the graph and matching its words
    census_read: float = 0.0  # of census: reading the graph's nodes (driver, parameter bytes, segment map)
    census_sort: float = 0.0  # of census: sorting those words by pool
    census_names: float = 0.0  # of census: naming the captured storages (the guard's adoption)
    checks: float = 0.0  # deep checks and liveness checks that found something dead


@dataclass
class Counters:
    captures: int = 0
    managed: int = 0
    replays: int = 0
    checks_deep: int = 0
    findings: int = 0
    resets: int = 0
    internal_errors: int = 0


class Log:
    """This process's records: the file, what the hooks counted and timed, its rank once
    torch.distributed has one, and which finding groups stderr has been told of."""

    def __init__(self):
        self.recorder: Recorder | None = None
        self.counters = Counters()
        self.seconds = HookSeconds()
        self.rank: int | None = None
        self.groups_said: dict[tuple, int] = {}  # finding group -> findings of it so far

    def open(self, settings: WatchSettings, forked: bool = False) -> None:
        """Start this process's record file with its process record, counting from zero (a
        forked child is a new process: a record file and counts of its own)."""
        self.recorder = Recorder(settings.run_dir)
        record = process_record(settings)
        if forked:
            record["forked"] = True
        self.recorder.write(record)
        self.counters, self.seconds, self.groups_said = Counters(), HookSeconds(), {}

    def write(self, record: dict[str, Any]) -> None:
        if self.recorder is None:
            return
        try:
            self.recorder.write({**record, "pid": os.getpid(), "t": time.time()})
        except OSError:
            pass  # a full disk must not break the program

    def internal(self, where: str, error: BaseException) -> None:
        self.counters.internal_errors += 1
        self.write({"kind": "internal", "where": where, "error": f"{type(error).__name__}: {error}"})

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
            self.write({"kind": "finding", "mechanism": mechanism, "rank": rank, "finding": finding_dict(f)})
            key = group_key(f)
            self.groups_said[key] = self.groups_said.get(key, 0) + 1
            if self.groups_said[key] == 1:
                sys.stderr.write(f"{self.prefix()}: {f.message}\n")
        sys.stderr.flush()

    def say_repeats(self) -> None:
        """At exit, one stderr line for the findings report() kept off it."""
        repeated = sum(n - 1 for n in self.groups_said.values())
        if repeated:
            try:
                sys.stderr.write(
                    f"{self.prefix()}: {repeated} more findings like those above "
                    f"({len(self.groups_said)} groups; the report lists them all)\n"
                )
            except Exception:
                pass

    def prefix(self) -> str:
        return f"repro watch [pid {os.getpid()}{'' if self.rank is None else f' rank {self.rank}'}]"


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
    finding = Finding(
        slot="<tensor named by torch check_input_liveness>",
        graph=graph,
        status=Status.FREED,
        when="replay (torch's own check)",
        rank=rank or 0,
        shape=[],
        dtype="",
        nbytes=0,
        old_ptr=ptr,
        message=text.splitlines()[0],
        mechanism=Mechanism.TORCH,
    )
    return finding
