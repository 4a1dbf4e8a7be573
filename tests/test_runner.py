"""The runner with several trials at once: order, isolation between trials, GPU lanes, Ctrl-C.

Trials are the harness self-test at TP=2 on gloo (every step is a real all-gather), so a
fault in one trial has live peers that must not be disturbed.
"""

import os
import signal
import threading
import time

import pytest

from conftest import alive
from repro import report
from repro.outcome import Outcome
from repro.env.gpus import gpu_lanes
from repro.run.protocol import Event, read_records
from repro.run.runner import lane_env, plan, run_planned, trial_id


def selftest(steps=3, fault=None, deadline=30.0):
    p = plan("selftest", None, {"tp": 2, "steps": steps, "device": "cpu", "deadline_s": deadline}, [], gpus=0)
    p.fault = fault
    return p


def pids_of(report):
    return [r.pid for t in report.trials for r in t.ranks if r.pid]


def test_concurrent_trials_keep_plan_order_and_do_not_disturb_each_other(tmp_path):
    planned = [
        selftest(steps=4),
        selftest(fault={"kind": "segv", "rank": 1, "step": 1}),
        selftest(steps=2),
        selftest(fault={"kind": "exit", "rank": 0, "step": 0}),
    ]
    started = []
    result = run_planned(planned, tmp_path, on_start=lambda tid, p: started.append(tid), jobs=3)
    trials = result.report.trials
    assert [t.id for t in trials] == [trial_id(i, p.cfg) for i, p in enumerate(planned)]
    assert sorted(started) == [t.id for t in trials]
    assert [t.outcome for t in trials] == [Outcome.CLEAN, Outcome.CRASH, Outcome.CLEAN, Outcome.CRASH]
    assert trials[1].first_failure.rank == 1 and trials[1].ranks[1].signal == "SIGSEGV"
    # The clean neighbours ran every step on both ranks although a peer trial crashed beside them.
    assert sorted(s.step for s in trials[0].steps if s.rank == 1) == [0, 1, 2, 3]
    assert sorted(s.step for s in trials[2].steps if s.rank == 0) == [0, 1]
    assert not result.interrupted
    assert not any(alive(pid) for pid in pids_of(result.report))


def test_ctrl_c_stops_every_running_trial_and_keeps_their_records(tmp_path):
    # Three trials hang at step 1 on jobs=2: two run, the third never starts.
    planned = [selftest(steps=3, fault={"kind": "hang", "rank": 0, "step": 1}) for _ in range(3)]

    def interrupt_once_both_stepped():
        end = time.monotonic() + 30
        while time.monotonic() < end:
            dirs = [f.parent for f in tmp_path.rglob("rank1.jsonl")]
            if len(dirs) == 2 and all(read_records(d, 2)[1].of(Event.STEP) for d in dirs):
                break
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does: KeyboardInterrupt in the main thread

    threading.Thread(target=interrupt_once_both_stepped, daemon=True).start()
    result = run_planned(planned, tmp_path, jobs=2)
    assert result.interrupted and result.report.interrupted
    assert result.report.interrupted_by == "SIGINT"
    trials = result.report.trials
    assert len(trials) == 2  # the third was never started
    assert result.report.not_run == 1
    assert report.summary_line(result.report).endswith("interrupted (SIGINT); 1 planned trial never ran")
    for t in trials:
        assert any(s.step == 0 for s in t.steps)  # what each recorded before the interrupt is kept
        assert not t.met
        # Cut short, not crashed: no verdict, and the rank killed by the interrupt is no failure.
        assert t.outcome == Outcome.INTERRUPTED and t.first_failure.kind == Outcome.INTERRUPTED
        assert "interrupted; records up to that point kept" in t.notes
    time.sleep(0.3)
    assert not any(alive(pid) for pid in pids_of(result.report))


@pytest.mark.parametrize(
    "cvd, gpus, lanes",
    [
        (None, 2, ["0", "1"]),
        (None, 0, []),
        ("3,1", 2, ["3", "1"]),
        ("GPU-aaa, GPU-bbb,GPU-ccc", 2, ["GPU-aaa", "GPU-bbb"]),  # NVML saw 2 of them
    ],
)
def test_gpu_lanes_follow_cuda_visible_devices(cvd, gpus, lanes):
    env = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    assert gpu_lanes(gpus, env) == lanes


def test_lane_env_rotates_devices_per_slot():
    lanes = ["0", "1", "2"]
    assert lane_env(0, lanes) is None  # slot 0: the environment unchanged
    assert lane_env(1, lanes) == {"CUDA_VISIBLE_DEVICES": "1,2,0"}
    assert lane_env(2, lanes) == {"CUDA_VISIBLE_DEVICES": "2,0,1"}
    assert lane_env(3, lanes) is None  # wraps around to the identity
    assert lane_env(5, ["0"]) is None  # one GPU: nothing to spread
