"""The rank server: ranks forked from one process that imported torch once (repro/rank/server.py).

What must hold is what a fresh interpreter per rank guaranteed: the server never initialises
CUDA, each child is one rank of one trial, the runner's GPU lane reaches the rank, nothing
outlives the server, a dead server fails its trials quickly and says so, and where the server
cannot serve a rank the rank is spawned the old way.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import alive
from repro.run.isolate import run_trial
from repro.run.launch import RankServer, ServerUnavailable, child_env, runs_trials
from repro.outcome import Outcome
from repro.run.protocol import ServerOp, records_path
from repro.run.runner import plan


def selftest_cfg(steps=3, deadline=20.0):
    return plan("selftest", None, {"tp": 2, "steps": steps, "device": "cpu", "deadline_s": deadline}, [], gpus=0).cfg


def start_record(trial_dir, rank):
    return next(
        json.loads(line)
        for line in records_path(trial_dir, rank).read_text().splitlines()
        if json.loads(line)["event"] == "start"
    )


def test_the_server_ops_are_their_plain_strings_on_the_wire():
    assert [op.value for op in ServerOp] == ["ready", "unavailable", "started", "failed", "exit"]
    assert json.dumps({"op": ServerOp.EXIT, "pid": 7}) == '{"op": "exit", "pid": 7}'
    assert json.loads('{"op": "started"}')["op"] == ServerOp.STARTED


def test_preload_imports_what_a_rank_needs_and_never_initialises_cuda():
    code = (
        "import sys, torch; from repro.rank import server as rankserver; rankserver.preload(); "
        "print(rankserver.unfit_reason(), torch.cuda.is_initialized(), "
        "all(m in sys.modules for m in ('repro.rank.worker', 'repro.scenarios.gemma4_mtp', "
        "'repro.scenarios.nvfp4_moe', 'torch.distributed')))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "False", "True"]


def test_lane_env_reaches_a_forked_rank_and_other_differences_spawn_fresh(tmp_path):
    with RankServer.start(child_env()) as server:
        trial = run_trial(selftest_cfg(), "cpu", tmp_path, "t", env={"CUDA_VISIBLE_DEVICES": "3,2"}, server=server)
        assert trial.outcome == Outcome.CLEAN
        assert {r.pid for r in trial.ranks} <= set(server.started)
        assert start_record(tmp_path / "t", 1)["visible_gpus"] == "3,2"
        # An import-time variable the server was not started with: the ranks need their own interpreter.
        assert not server.serves(child_env({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}), None)
        assert not server.serves(child_env(), ["compute-sanitizer"])  # a wrapper must exec the rank
        assert server.serves(child_env({"CUDA_VISIBLE_DEVICES": "1"}), None)
        fresh = run_trial(selftest_cfg(), "cpu", tmp_path, "u", env={"REPRO_TEST_IMPORT_TIME": "1"}, server=server)
        assert fresh.outcome == Outcome.CLEAN
        assert not {r.pid for r in fresh.ranks} & set(server.started)


def test_each_rank_is_its_own_process_once(tmp_path):
    with RankServer.start(child_env()) as server:
        a = run_trial(selftest_cfg(), "cpu", tmp_path, "a", server=server)
        b = run_trial(selftest_cfg(), "cpu", tmp_path, "b", server=server)
    pids = [r.pid for t in (a, b) for r in t.ranks]
    assert len(set(pids)) == 4 and set(pids) <= set(server.started) and os.getpid() not in pids
    assert not any(alive(p) for p in pids + [server.proc.pid])


def test_server_killed_mid_trial_fails_it_at_once_and_says_so(tmp_path):
    """A hang that would run to the deadline: the server's death ends it (its ranks die with it)."""
    with RankServer.start(child_env()) as server:

        def kill_once_both_ranks_run():
            # Not a fixed delay: on a loaded machine the server's torch import alone takes seconds.
            end = time.monotonic() + 60
            while len(server.started) < 2 and time.monotonic() < end:
                time.sleep(0.05)
            time.sleep(1.0)
            os.kill(server.proc.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_both_ranks_run)
        killer.start()
        start = time.monotonic()
        trial = run_trial(
            selftest_cfg(deadline=120.0),
            "cpu",
            tmp_path,
            "t",
            fault={"kind": "hang", "rank": 1, "step": 1},
            server=server,
        )
        killer.join()
        assert time.monotonic() - start < 60, "ended by the server's death, not by the 120 s deadline"
    assert trial.outcome == Outcome.CRASH
    assert any("rank server died" in n for n in trial.notes)
    assert all(r.signal == "SIGKILL" for r in trial.ranks)
    assert not any(alive(r.pid) for r in trial.ranks)


def test_closing_the_server_kills_ranks_still_running(tmp_path):
    server = RankServer.start(child_env())
    assert server.wait_ready(120)
    spec = tmp_path / "spec.json"
    from repro.run.protocol import TrialSpec

    TrialSpec(
        trial_id="t",
        config=selftest_cfg().to_dict(),
        device="cpu",
        world_size=1,
        out_dir=str(tmp_path),
        fault={"kind": "hang", "rank": 0, "step": 0},
    ).save(spec)
    rank, pgid = server.start_rank(str(spec), 0, child_env(), str(tmp_path / "rank0.log"), 0)
    assert pgid == rank.pid  # rank 0 leads its trial's group
    end = time.monotonic() + 60
    while not (tmp_path / "rank0.jsonl").exists() or "fault" not in (tmp_path / "rank0.jsonl").read_text():
        assert time.monotonic() < end
        time.sleep(0.05)
    server.close()
    assert rank.wait(10) == -signal.SIGKILL and not alive(rank.pid)


def test_a_server_still_importing_is_killed_on_close_not_waited_for():
    server = RankServer.start(child_env())
    importing = server.ready is None
    server.close()
    assert server.proc.returncode is not None
    if importing:
        assert server.proc.returncode == -signal.SIGKILL


class Unavailable:
    """A server that cannot serve (its preload failed): ranks must be spawned the old way."""

    started: list = []

    def serves(self, env, wrapper):
        return True

    def start_rank(self, *args):
        raise ServerUnavailable("preload failed: ImportError: test")


def test_an_unavailable_server_falls_back_to_fresh_ranks(tmp_path):
    trial = run_trial(selftest_cfg(), "cpu", tmp_path, "t", server=Unavailable())
    assert trial.outcome == Outcome.CLEAN and trial.met
    assert all(r.exitcode == 0 for r in trial.ranks)


@pytest.mark.parametrize(
    "argv, runs",
    [
        (["gemma4-mtp", "--tp", "2"], True),
        (["matrix", "--jobs", "8"], True),
        (["selftest"], True),
        (["gemma4-mtp", "--print-config"], False),
        (["matrix", "--list"], False),
        (["nvfp4-reload", "--help"], False),
        (["doctor"], False),
        (["--version"], False),
        ([], False),
        (["watch", "--", "python", "x.py"], False),
    ],
)
def test_only_commands_that_run_trials_prestart_a_server(argv, runs):
    assert runs_trials(argv, frozenset({"gemma4-mtp", "nvfp4-reload", "selftest", "matrix"})) is runs


def test_a_server_where_cuda_was_initialised_refuses_to_fork(monkeypatch):
    """torch's own flag, or the driver's (cuInit by anything else, e.g. is_available()): either
    makes a fork hand the ranks a CUDA they cannot use. On a GPU the driver check is measured
    by benchmarks/startup.py (False after the preload, True after torch.cuda.init())."""
    from repro.rank import server as rankserver

    assert rankserver.unfit_reason() is None and rankserver.driver_initialized() is False  # no GPU here
    monkeypatch.setattr(rankserver, "driver_initialized", lambda: True)
    assert "CUDA was initialised in the rank server" in rankserver.unfit_reason()


def test_forked_ranks_get_sigint_as_a_fresh_interpreter_would(tmp_path):
    """Started with SIGINT ignored (a script's background job), a spawned worker inherits the
    ignore; a forked rank must too, while the server always ignores it itself."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        server = RankServer.start(child_env())
    finally:
        signal.signal(signal.SIGINT, previous)

    def interrupt_ranks():
        for rank in (0, 1):
            os.kill(start_record(tmp_path / "t", rank)["pid"], signal.SIGINT)

    with server:
        assert server.wait_ready(120)
        timer = threading.Timer(4.0, interrupt_ranks)
        timer.start()
        trial = run_trial(
            selftest_cfg(deadline=8.0),
            "cpu",
            tmp_path,
            "t",
            fault={"kind": "hang", "rank": 1, "step": 1},
            server=server,
        )
        timer.join()
    assert trial.outcome == Outcome.HANG, "SIGINT stayed ignored: the ranks ran on to the deadline"
    assert all(r.killed_by_harness for r in trial.ranks)
