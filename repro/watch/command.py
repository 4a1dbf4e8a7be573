"""`repro watch -- CMD`: run a command unchanged with the capture hooks in all its Python processes.

The hooks travel by environment, so every Python process CMD starts gets them (children,
spawned workers, torch.multiprocessing, torchrun's ranks, anything that inherits the
environment). What the command sees added to its environment, and nothing else:

  PYTHONPATH               <repro>/watch/_site prepended (its sitecustomize starts the hooks, runs the
                           sitecustomize it shadows, then removes itself from sys.path)
  REPRO_WATCH=1            the switch (also the vLLM plugin's)
  REPRO_WATCH_DIR          the run directory: one <host>-<pid>.jsonl per process
  REPRO_WATCH_ON_FINDING   warn | raise (repro.watch.settings.OnFinding)
  REPRO_WATCH_SITE         the directory prepended to PYTHONPATH
  REPRO_WATCH_RECORD       graph | ops (repro.watch.settings.Record)
  REPRO_WATCH_STACKS       1 | 0: record each allocation's Python stack (--stacks)
  RAY_RUNTIME_ENV_HOOK     repro.watch.ray.runtime_env_hook: a `ray.init()` in any of them gets the
                           hooks into every Ray worker on every node (repro/watch/ray.py); a hook
                           already set is kept in REPRO_WATCH_RAY_CHAIN and runs first

CMD runs in its own process group with stdin, stdout and stderr passed through untouched (no
pipe: output order and bytes are CMD's own). Ctrl-C (or SIGTERM) is forwarded to that group;
the report follows. No torch import here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from repro.output import Exit
from repro.watch.ray import node_dirs, node_notes, ray_env
from repro.watch.records import WatchReport, load_report, record_files
from repro.watch.settings import ENV_DIR, ENV_ON, ENV_ON_FINDING, ENV_RECORD, ENV_SITE, ENV_STACKS, OnFinding, Record

GRACE_S = 10.0  # after a forwarded Ctrl-C, how long CMD's group gets before SIGKILL


class WatchUsageError(ValueError):
    """Bad arguments: one line, exit 2 (Exit.USAGE)."""


@dataclass
class CommandResult:
    returncode: int  # CMD's exit status, 128+N when a signal N ended it
    interrupted: bool


def site_dir() -> str:
    return str(Path(__file__).resolve().parent / "_site")


def watch_env(
    environ: dict[str, str], run_dir: Path, on_finding: str, record: str | None = None, stacks: bool | None = None
) -> dict[str, str]:
    """on_finding, record, stacks: an OnFinding, a Record and whether allocations record their
    stacks, for every process (None: the environment's, else graph / off)."""
    env = dict(environ)
    site = site_dir()
    old = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = site + (os.pathsep + old if old else "")
    env[ENV_ON] = "1"
    env[ENV_DIR] = str(run_dir.resolve())
    env[ENV_ON_FINDING] = on_finding
    env[ENV_SITE] = site
    if record is not None:
        env[ENV_RECORD] = record
    if stacks is not None:
        env[ENV_STACKS] = "1" if stacks else "0"
    env.update(ray_env(env))  # Ray workers on every node (repro/watch/ray.py)
    return env


def default_run_dir() -> Path:
    """A new folder for this run's records under the user's cache (like every run's files, not
    the current directory), created here, atomically, with a unique name: runs started in the
    same second (a script, CI jobs on one host, pytest-xdist workers) never share one."""
    from repro.run.runs import default_root

    root = default_root(dict(os.environ))
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=time.strftime("watch-%Y%m%d-%H%M%S-", time.localtime()), dir=root))


def check_args(command: list[str], on_finding: str, run_dir: Path | None, record: str = Record.GRAPH) -> None:
    """run_dir: the --run-dir the user gave, or None (a new folder of its own)."""
    if not command:
        raise WatchUsageError("no command given: repro watch [OPTIONS] -- CMD [ARGS...]")
    for flag, value, kind in (("--on-finding", on_finding, OnFinding), ("--record", record, Record)):
        if value not in tuple(kind):
            raise WatchUsageError(f"{flag} {value!r} is not one of {', '.join(kind)}")
    if run_dir is None:
        return
    if run_dir.exists() and not run_dir.is_dir():
        raise WatchUsageError(f"--run-dir {run_dir}: exists and is not a directory")
    if run_dir.is_dir() and record_files([run_dir]):
        raise WatchUsageError(
            f"--run-dir {run_dir} already holds records of an earlier run; "
            "give a new directory or remove its *.jsonl files"
        )


def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def run_command(command: list[str], env: dict[str, str]) -> CommandResult:
    """Run CMD in its own process group; forward SIGINT/SIGTERM to that group."""
    try:
        proc = subprocess.Popen(command, env=env, start_new_session=True)
    except FileNotFoundError:
        raise WatchUsageError(f"command not found: {command[0]}") from None
    except PermissionError:
        raise WatchUsageError(f"command not executable: {command[0]}") from None
    interrupted = False

    def forward(signum, _frame) -> None:
        nonlocal interrupted
        interrupted = interrupted or signum == signal.SIGINT
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        returncode = wait_for(proc, lambda: interrupted)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return CommandResult(exit_status(returncode), interrupted)


def wait_for(proc: subprocess.Popen, interrupted) -> int:
    deadline = None
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if interrupted() and deadline is None:
            deadline = time.monotonic() + GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def finish(rep: WatchReport, command: list[str], result: CommandResult, on_finding: str) -> WatchReport:
    rep.command = command
    rep.command_exit = result.returncode
    rep.interrupted = result.interrupted
    rep.on_finding = OnFinding(on_finding)
    if not rep.processes:
        rep.notes.append(
            "No Python process started the hooks (CMD started no Python, or its "
            "environment was replaced before Python started)."
        )
    from repro.env.gpus import gpu_count

    rep.notes += sight_notes(rep, gpu_count())
    rep.exit = Exit.INTERRUPTED if result.interrupted else Exit.FINDINGS if rep.findings else result.returncode
    return rep


def sight_notes(rep: WatchReport, gpu_count: int | None = None) -> list[str]:
    """What watch could see in this run, said where "no findings" would otherwise suggest more
    than was checked: watch looks at CUDA graph captures and their replays, nothing else.
    gpu_count: GPUs of the machine the run was on; None when that is not known (records
    merged from elsewhere), so nothing is said of it."""
    if not rep.processes or any(p.graphs for p in rep.processes):
        return []
    hooked = sum(p.torch_hooked for p in rep.processes)
    what = (
        f"no CUDA graph was captured in the {len(rep.processes)} watched process(es) "
        f"({hooked} imported torch); watch looks at CUDA graph captures and their replays only, "
        'so "no findings" says nothing else about the program'
    )
    if gpu_count == 0:
        what += (
            "; this machine has no GPU (NVML sees none), and without one no program captures a "
            "CUDA graph: run it on a GPU machine"
        )
    notes = ["Nothing checked: " + what + "."]
    if hooked:
        notes.append(
            "What the program prints itself (its own CaptureGuard, e.g. a CPU dry run with "
            "guard.recording) is its own output, not a finding of watch."
        )
    return notes


def watch(
    command: list[str], run_dir: Path | None, on_finding: str, record: str = Record.GRAPH, stacks: bool = False
) -> WatchReport:
    """run_dir None: a new folder of its own under the cache (default_run_dir)."""
    check_args(command, on_finding, run_dir, record)
    if run_dir is None:
        run_dir = default_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    result = run_command(command, watch_env(dict(os.environ), run_dir, on_finding, record, stacks))
    return finish(with_ray_nodes(run_dir, load_report([run_dir, *node_dirs(run_dir)])), command, result, on_finding)


def with_ray_nodes(run_dir: Path, rep: WatchReport) -> WatchReport:
    """The report's processes of each Ray node, named in its notes."""
    rep.notes += node_notes(run_dir, {p.record_file: p.pid for p in rep.processes})
    return rep


def merge(run_dirs: list[Path]) -> WatchReport:
    """One report over run directories written separately (one per node)."""
    for d in run_dirs:
        check_watch_run(d)
    rep = load_report([p for d in run_dirs for p in (d, *node_dirs(d))])
    for d in run_dirs:
        with_ray_nodes(d, rep)
    rep.notes += sight_notes(rep)  # the records may come from another machine: no GPU claim
    rep.exit = Exit.FINDINGS if rep.findings else Exit.OK
    return rep


def check_watch_run(d: Path) -> None:
    """A folder that `repro watch` wrote: refused with what it is otherwise (a trial run's
    folder has records too, of another kind, and reads as "0 processes watched")."""
    if not d.exists():
        raise WatchUsageError(f"{d}: does not exist; give the folder `repro watch` printed after 'records:'")
    if not d.is_dir():
        raise WatchUsageError(f"{d}: not a directory; give the folder `repro watch` printed after 'records:'")
    if load_report([d]).processes:
        return
    if (d / "spec.json").exists() or any(d.glob("*/spec.json")) or any(d.glob("rank*.jsonl")):
        raise WatchUsageError(
            f"{d}: a trial run's folder (records of `repro gemma4-mtp`, `matrix`, ...), "
            "not a repro watch run; watch-report reads the folders `repro watch` writes"
        )
    raise WatchUsageError(
        f"{d}: holds no repro watch records (<host>-<pid>.jsonl with a process record); "
        "give the folder `repro watch` printed after 'records:'"
    )
