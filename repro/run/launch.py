"""How the parent starts rank processes: their environment, and the rank server.

The parent stays torch-free and CUDA-free. Ranks are forked by the run's rank server
(repro/rank/server.py: one process that imported torch once); the parent only writes requests
and reads replies. A rank so started is a RemoteRank, which answers poll()/wait() like the
subprocess.Popen of a spawned rank (the server reports each rank's exit status), so
repro/run/isolate.py watches, kills and classifies both alike.

The server is an optimisation, never a requirement: whenever it is unavailable (its preload
failed, it died, a request needs an interpreter of its own) the parent spawns the rank as
`python -m repro.rank.worker`, as it always did.

`prestart(argv)` starts the server before the CLI imports its own modules, for the commands
that run trials: the server's torch import then overlaps the parent's start-up and planning.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from repro.run.protocol import ServerOp
from repro.run.runs import cache_root

REPO_ROOT = Path(__file__).resolve().parent.parent.parent  # holds repro/ (repro/run/launch.py)

# Children inherit these; NVLink multicast must stay off on shared hosts. This module is the
# parent's and must not import torch (seconds of start-up before the first rank is spawned).
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


# Variables a rank reads only when it initialises CUDA, never at import: a forked rank may
# differ from the server in these (the runner's GPU lanes set CUDA_VISIBLE_DEVICES per trial).
RUNTIME_ONLY_ENV = frozenset({"CUDA_VISIBLE_DEVICES"})
# How long a rank request waits for the server's preload (the torch import) before the
# parent gives up on it and spawns the rank itself.
READY_TIMEOUT_S = 120.0
REPLY_TIMEOUT_S = 30.0
CLOSE_WAIT_S = 10.0
# Exit status given to the ranks of a server that died: they died with it (PR_SET_PDEATHSIG).
LOST = -signal.SIGKILL


def with_bytecode_cache(env: dict[str, str], torch_origin: str | None) -> dict[str, str]:
    """Let workers reuse compiled bytecode where torch's install has none.

    An install made without .pyc files in a place Python cannot (or is told not to) write
    makes every worker compile ~1600 torch/sympy modules from source: 5-6 s of each trial
    (profiled on the GPU image: builtins.compile, 1600 calls per worker). Then the workers
    get a bytecode cache of our own (PYTHONPYCACHEPREFIX), written once and read by every
    later worker; the install itself is never written to. A prefix the user chose is kept.
    """
    if "PYTHONPYCACHEPREFIX" in env or torch_origin is None:
        return env
    if Path(importlib.util.cache_from_source(torch_origin)).exists():
        return env  # the install's own bytecode is there: use it
    out = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}  # writes go to our cache
    out["PYTHONPYCACHEPREFIX"] = str(cache_root(env) / "pycache")
    return out


def torch_origin() -> str | None:
    """torch/__init__.py, located without importing torch."""
    spec = importlib.util.find_spec("torch")
    return spec.origin if spec else None


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = with_bytecode_cache({**os.environ, **(extra or {})}, torch_origin())
    for key, value in MULTICAST_OFF.items():
        env.setdefault(key, value)
    env["PYTHONUNBUFFERED"] = "1"
    # The worker must import this very checkout, also when run as `python cli.py`.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


class ServerUnavailable(RuntimeError):
    pass


class StartCancelled(Exception):
    """The run was interrupted while a rank waited for the server's preload: start nothing."""


@dataclass
class RemoteRank:
    """A rank forked by the server, seen through Popen's interface (pid, poll, wait, returncode)."""

    pid: int
    returncode: int | None = None
    lost: bool = False  # the server died before reporting this rank's exit
    exited: threading.Event = field(default_factory=threading.Event)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Until the server reaped the rank; a lost rank (its server died) until it is gone:
        nobody of ours can reap it, and its SIGKILL takes a moment to end it."""
        end = None if timeout is None else time.monotonic() + timeout
        if not self.exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
        while self.lost and not gone(self.pid):
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def set_exit(self, code: int, lost: bool = False) -> None:
        if self.returncode is None:
            self.returncode, self.lost = code, lost
            self.exited.set()


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


class RankServer:
    """One rank server per run. Start it early (its preload overlaps the parent's own start-up):
    `with RankServer.start(env) as server: ...`; closing it kills any rank still alive."""

    def __init__(self, proc: subprocess.Popen, requests: Any, replies: Any, env: dict[str, str]):
        self.proc = proc
        self.env = env
        self._requests = requests
        self._replies = replies
        self._lock = threading.Lock()
        self._state = threading.Condition()
        self._next_id = 0
        self._answers: dict[int, dict[str, Any]] = {}
        self._ranks: dict[int, RemoteRank] = {}  # live ranks by pid (the server reports
        # a rank's start before its exit)
        self.started: list[int] = []  # pids of every rank it forked
        self.ready: bool | None = None  # None until the server said ready/unavailable
        self.reason = ""
        self.preload_s: float | None = None
        self._reader = threading.Thread(target=self._read, name="rank-server-replies", daemon=True)
        self._reader.start()

    @staticmethod
    def start(env: dict[str, str]) -> "RankServer":
        """Call from the thread that outlives the run (the main thread): the server's
        PR_SET_PDEATHSIG fires when the thread that started it exits."""
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "repro.rank.server", str(req_r), str(rep_w)],
                pass_fds=(req_r, rep_w),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
                cwd=os.getcwd(),
                process_group=0,
            )
        finally:
            os.close(req_r)
            os.close(rep_w)
        return RankServer(proc, os.fdopen(req_w, "w", buffering=1), os.fdopen(rep_r, "r"), env)

    # -- the parent's API -------------------------------------------------------------------

    def serves(self, env: dict[str, str], wrapper: list[str] | None) -> bool:
        """Whether a rank with this environment may be forked from the server: no wrapper
        program (it must exec the rank itself) and no difference an import could see."""
        if wrapper:
            return False
        keys = set(env) | set(self.env)
        return all(env.get(k) == self.env.get(k) for k in keys - RUNTIME_ONLY_ENV)

    def start_rank(
        self, spec_file: str, rank: int, env: dict[str, str], log: str, pgid: int, stop: threading.Event | None = None
    ) -> tuple[RemoteRank, int]:
        """Fork one rank; returns it and its process group. Raises ServerUnavailable, or
        StartCancelled once `stop` is set while the server still imports."""
        if not self.wait_ready(READY_TIMEOUT_S, stop):
            raise ServerUnavailable(self.reason or "the rank server is not ready")
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            req = {"id": rid, "spec": spec_file, "rank": rank, "env": env, "log": log, "pgid": pgid, "cwd": os.getcwd()}
            try:
                self._requests.write(json.dumps(req) + "\n")
                self._requests.flush()
            except (BrokenPipeError, ValueError, OSError) as e:
                raise ServerUnavailable(f"the rank server is gone ({e})") from None
        answer = self._await(rid)
        if answer is None:
            # A server that does not answer could still fork the rank later, beside the one the
            # parent is about to spawn instead: end it first (its ranks die with it).
            self.proc.kill()
            raise ServerUnavailable(f"the rank server did not answer within {REPLY_TIMEOUT_S:g} s")
        if answer.get("op") != ServerOp.STARTED:
            raise ServerUnavailable(answer.get("reason", "the rank server did not start the rank"))
        return answer["rank"], answer["pgid"]

    def wait_ready(self, timeout: float, stop: threading.Event | None = None) -> bool:
        """Until the preload ended (True: ready); a Ctrl-C/SIGTERM of the run (`stop`) must
        not wait for a torch import that takes seconds."""
        end = time.monotonic() + timeout
        with self._state:
            while self.ready is None:
                if stop is not None and stop.is_set():
                    raise StartCancelled()
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._state.wait(min(left, 0.05))
            return bool(self.ready)

    def close(self) -> None:
        """EOF to the server: it kills what is left of its ranks' groups and exits. A server
        still importing (the run ended before it was needed) is killed outright: it has no
        ranks yet, and the run must not wait for its import."""
        try:
            self._requests.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=CLOSE_WAIT_S if self.ready else 0)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # its ranks die with it (PR_SET_PDEATHSIG)
            self.proc.wait()
        self._reader.join(timeout=5)

    def __enter__(self) -> "RankServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the reply reader (a thread) ----------------------------------------------------------

    def _await(self, rid: int) -> dict[str, Any] | None:
        """The server's answer to request rid; a "failed" one if the server is gone; None if
        it is alive but said nothing in REPLY_TIMEOUT_S."""
        end = time.monotonic() + REPLY_TIMEOUT_S
        with self._state:
            while rid not in self._answers:
                if self.ready is False:
                    return {"op": ServerOp.FAILED, "reason": self.reason}
                if not self._state.wait(max(0.0, end - time.monotonic())):
                    return self._answers.pop(rid, None)
            return self._answers.pop(rid)

    def _read(self) -> None:
        for line in self._replies:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self._state:
                self._handle(msg)
                self._state.notify_all()
        with self._state:  # EOF: the server exited or died
            self._lose_all()
            self._state.notify_all()

    def _handle(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == ServerOp.READY:
            self.ready, self.preload_s = True, msg.get("preload_s")
        elif op == ServerOp.UNAVAILABLE:
            self.ready, self.reason = False, msg.get("reason", "")
        elif op == ServerOp.STARTED:
            rank = self._ranks[msg["pid"]] = RemoteRank(pid=msg["pid"])
            self.started.append(msg["pid"])
            self._answers[msg["id"]] = {**msg, "rank": rank}
        elif op == ServerOp.FAILED:
            self._answers[msg["id"]] = msg
        elif op == ServerOp.EXIT:
            rank = self._ranks.pop(msg["pid"], None)
            if rank is not None:
                rank.set_exit(msg["code"])

    def _lose_all(self) -> None:
        code = self.proc.poll()
        self.reason = self.reason or f"the rank server exited (status {code})"
        self.ready = False
        for rank in self._ranks.values():
            rank.set_exit(LOST, lost=True)
        self._ranks.clear()


# Flags after which a command runs no trial; prestart() leaves the server off for them.
NO_TRIAL_FLAGS = frozenset(
    {"--help", "-h", "--print-config", "--list", "--install-completion", "--show-completion", "--version"}
)


def runs_trials(argv: list[str], commands: frozenset[str]) -> bool:
    """Whether this command line will run trials: a trial command, and no flag that only prints."""
    return bool(argv) and argv[0] in commands and not NO_TRIAL_FLAGS.intersection(argv)


def prestart(argv: list[str], commands: frozenset[str]) -> RankServer | None:
    """The rank server for this command line, started now (from the main thread), or None.
    A command that turns out to run nothing (bad input) closes it at once, unwaited."""
    if not runs_trials(argv, commands):
        return None
    try:
        return RankServer.start(child_env())
    except OSError:
        return None  # the run starts ranks the old way
