"""The rank server: one process per run that imports torch once and forks every rank from it.

`python -m repro.rank.server REQUEST_FD REPLY_FD`, started by the parent (repro/run/launch.py).
Starting a rank from a cold interpreter costs the torch import again (about 2 s with
bytecode, 1.5 s on a 2-core CPU box); a fork of a process that already imported it costs
milliseconds. The guarantees of a fresh interpreter are kept:

  * the server never initialises CUDA (it refuses to fork once torch says CUDA is initialised),
    so every rank creates its own CUDA context, and a CUDA error still only ever kills the
    rank that made it;
  * each forked child becomes exactly one rank of one trial (`repro.rank.worker.main`) and then
    exits; nothing is reused between trials;
  * a child leads or joins its trial's process group, as a spawned rank does, so the parent's
    killpg, deadlines and Ctrl-C/SIGTERM handling are unchanged;
  * no process outlives the harness: the server dies with the parent (PR_SET_PDEATHSIG) and
    every rank with the server; on the parent's EOF the server kills its ranks' groups.

Wire format: one JSON object per line. Parent -> server:
  {"id", "spec", "rank", "env", "log", "pgid", "cwd"}      start one rank (pgid 0: lead a group)
Server -> parent (ServerOp in repro/run/protocol.py names each op and its fields):
  {"op": "ready", "pid", "preload_s", "threads"} | {"op": "unavailable", "reason"}   once, after the preload
  {"op": "started", "id", "pid", "pgid"} | {"op": "failed", "id", "reason"}
  {"op": "exit", "pid", "code"}             a rank was reaped (code as Popen.returncode)
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import sys
import time
import warnings
from typing import Any

from repro.noise import silence_known_warnings
from repro.rank.worker import die_with_parent
from repro.run.protocol import ServerOp

REAP_EVERY_S = 0.01
CUDA_ERROR_NOT_INITIALIZED = 3


def preload() -> None:
    """Import everything a rank imports, touching no device."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    from repro.diagnose import census, forensics, guard  # noqa: F401
    from repro.rank import dist, graphs, worker  # noqa: F401
    from repro.env import runtime  # noqa: F401
    from repro.scenarios import SCENARIOS, load_scenario

    for name in SCENARIOS:
        load_scenario(name)


def cuda_initialized() -> bool:
    """Whether torch, or anything else behind its back, initialised CUDA in this process."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized()) or driver_initialized()


def driver_initialized() -> bool:
    """Whether cuInit ran here (a module that asked the driver directly, or through
    torch.cuda.is_available()): children of a fork then get a CUDA they cannot use.
    cuDeviceGetCount answers CUDA_ERROR_NOT_INITIALIZED (3) before cuInit and initialises
    nothing; a libcuda nobody loaded cannot have been initialised."""
    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return False
    count = ctypes.c_int()
    return lib.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def thread_count() -> int:
    """Threads of this process (Linux); a fork copies only the calling one."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def unfit_reason() -> str | None:
    """Why this process must not fork ranks, if it must not.

    Threads are not a reason: importing torch imports NumPy, whose OpenBLAS starts its thread
    pool at load (nproc - 1 threads) and shuts it down around fork itself (pthread_atfork);
    nothing here runs a torch op, so no OpenMP pool exists yet. The count is reported.
    """
    if cuda_initialized():
        return "CUDA was initialised in the rank server (a fork would give ranks an unusable CUDA)"
    return None


class Server:
    def __init__(self, req_fd: int, rep_fd: int, rank_sigint: Any):
        self.req_fd = req_fd
        self.rank_sigint = rank_sigint  # what a fresh interpreter started here would have
        self.rep = os.fdopen(rep_fd, "w", buffering=1)
        self.buf = b""
        self.pgids: dict[int, int] = {}  # live rank pid -> its process group

    def reply(self, **msg: Any) -> None:
        self.rep.write(json.dumps(msg) + "\n")
        self.rep.flush()

    def serve(self) -> None:
        while True:
            ready, _, _ = select.select([self.req_fd], [], [], REAP_EVERY_S)
            self.reap()
            if not ready:
                continue
            chunk = os.read(self.req_fd, 65536)
            if not chunk:
                return  # the parent closed the pipe (or died)
            self.buf += chunk
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                self.start(json.loads(line))

    def start(self, req: dict[str, Any]) -> None:
        reason = unfit_reason()
        if reason:
            self.reply(op=ServerOp.FAILED, id=req["id"], reason=reason)
            return
        server_pid = os.getpid()
        with warnings.catch_warnings():
            # Python >= 3.12 warns on fork with other threads; here they are OpenBLAS's pool,
            # which stops itself around fork (see unfit_reason).
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            become_rank(req, server_pid, (self.req_fd, self.rep.fileno()), self.rank_sigint)
        pgid = join_group(pid, req["pgid"])
        self.pgids[pid] = pgid
        self.reply(op=ServerOp.STARTED, id=req["id"], pid=pid, pgid=pgid)

    def reap(self) -> None:
        while self.pgids:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.pgids.pop(pid, None)
            self.reply(op=ServerOp.EXIT, pid=pid, code=os.waitstatus_to_exitcode(status))

    def kill_all(self) -> None:
        """The parent is gone or done: no rank may outlive it."""
        for pgid in set(self.pgids.values()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        for pid in list(self.pgids):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.pgids.clear()


def join_group(pid: int, pgid: int) -> int:
    """Put a rank in its trial's group (pgid 0: a new one it leads). Called by the server and by
    the child itself, whichever runs first (as shells do), so the group exists before the
    server answers. A group whose leader already exited cannot be joined: lead a new one."""
    try:
        os.setpgid(pid, pgid)
        return pgid or pid
    except (PermissionError, ProcessLookupError, OSError):
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)
        return pid


def become_rank(req: dict[str, Any], server_pid: int, server_fds: tuple[int, int], sigint: Any) -> None:
    """In the forked child: look like a fresh `python -m repro.rank.worker SPEC RANK`, then run it.
    sigint: the SIGINT handling such an interpreter would get (Python's, or ignored where the
    harness itself was started with SIGINT ignored, as a background job of a script is).
    Never returns into the server's loop."""
    code = 70
    try:
        for fd in server_fds:
            os.close(fd)
        join_group(0, req["pgid"])
        signal.signal(signal.SIGINT, sigint)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.argv = [sys.executable, "-m", "repro.rank.worker", req["spec"], str(req["rank"])]
        from repro.rank import worker

        worker.main([req["spec"], str(req["rank"])], parent_pid=server_pid)  # exits itself
    except BaseException:  # noqa: BLE001 - the child must never fall back into the server
        import traceback

        with contextlib.suppress(BaseException):
            sys.stderr.write(traceback.format_exc())
            sys.stderr.flush()
    finally:
        os._exit(code)


def main(argv: list[str]) -> None:
    parent = os.getppid()
    die_with_parent(parent)
    # The ranks get SIGINT as this interpreter got it from the harness; the server itself
    # ignores it (the parent handles Ctrl-C for the run).
    rank_sigint = signal.getsignal(signal.SIGINT) or signal.default_int_handler  # None: set outside Python
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server = Server(int(argv[0]), int(argv[1]), rank_sigint)
    silence_known_warnings()  # its stderr is the user's terminal; torch's import would warn there
    start = time.perf_counter()
    try:
        preload()
        reason = unfit_reason()
    except Exception as e:  # noqa: BLE001 - the parent then starts ranks the old way
        reason = f"preload failed: {type(e).__name__}: {e}"
    if reason:
        server.reply(op=ServerOp.UNAVAILABLE, reason=reason)
        return
    server.reply(op=ServerOp.READY, pid=os.getpid(), preload_s=time.perf_counter() - start, threads=thread_count())
    try:
        server.serve()
    finally:
        server.kill_all()


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)
