"""The trial runner under injected faults: classification, deadline, no process left behind.

Each trial is the harness self-test at TP=2 on gloo: every step all-gathers across ranks, so a
dead rank leaves its peer blocked in a real collective. The fault tests run twice: ranks
spawned as fresh interpreters, and ranks forked by a rank server (the CLI's default); the
guarantees are the same.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, alive, group_alive
from repro.run.isolate import GRACE_S, run_trial
from repro.run.launch import RankServer, child_env
from repro.outcome import Outcome
from repro.run.runner import plan

DEADLINE = 20.0


@pytest.fixture(params=["fresh", "forked"])
def launcher(request):
    return request.param


def selftest(tmp_path, fault=None, steps=3, deadline=DEADLINE, server="fresh", stall=None):
    """server "forked": the ranks come from a rank server started in the test itself (its
    environment must be the test's own: pytest changes PYTEST_CURRENT_TEST per phase)."""
    p = plan(
        "selftest",
        None,
        {"tp": 2, "steps": steps, "device": "cpu", "deadline_s": deadline, "stall_s": stall},
        [],
        gpus=0,
    )
    start = time.monotonic()
    if server == "fresh":
        trial = run_trial(p.cfg, "cpu", tmp_path, "t", fault=fault)
    else:
        with RankServer.start(child_env()) as rank_server:
            trial = run_trial(p.cfg, "cpu", tmp_path, "t", fault=fault, server=rank_server)
        assert {r.pid for r in trial.ranks} <= set(rank_server.started), "the server forked every rank"
    return trial, time.monotonic() - start


def assert_nothing_left(trial):
    pids = [r.pid for r in trial.ranks if r.pid]
    assert pids, "every rank recorded its pid"
    assert not any(alive(pid) for pid in pids)
    assert not group_alive(pids[0])


def steps_of(trial, rank):
    return sorted(s.step for s in trial.steps if s.rank == rank)


def test_clean_run(tmp_path, launcher):
    trial, _ = selftest(tmp_path, server=launcher)
    assert trial.outcome == Outcome.CLEAN and trial.met
    assert steps_of(trial, 0) == [0, 1, 2] and steps_of(trial, 1) == [0, 1, 2]
    assert all(r.exitcode == 0 and not r.killed_by_harness for r in trial.ranks)
    assert trial.timings["total"] > 0 and "init" in trial.timings
    assert_nothing_left(trial)


def test_segfault_is_crash_with_signal(tmp_path, launcher):
    trial, elapsed = selftest(tmp_path, {"kind": "segv", "rank": 0, "step": 1}, server=launcher)
    assert trial.outcome == Outcome.CRASH
    assert trial.first_failure.rank == 0 and trial.first_failure.step == 1
    assert trial.ranks[0].signal == "SIGSEGV"
    # The peer was waiting in the all-gather: gloo either reports the lost peer or we kill it.
    assert trial.ranks[1].killed_by_harness or trial.ranks[1].exitcode != 0
    assert steps_of(trial, 0) == [0]
    assert elapsed < DEADLINE
    assert_nothing_left(trial)


def test_hang_is_killed_at_deadline_and_blames_the_rank_outside_the_collective(tmp_path, launcher):
    deadline = 10.0
    trial, elapsed = selftest(tmp_path, {"kind": "hang", "rank": 1, "step": 1}, server=launcher, deadline=deadline)
    assert trial.outcome == Outcome.HANG
    # Rank 0 waits in the step's all-gather, rank 1 never gets there: rank 1 is to blame.
    assert trial.first_failure.rank == 1 and trial.first_failure.step == 1
    assert "rank 1 was not in a collective" in trial.first_failure.detail
    assert deadline <= elapsed
    assert all(r.killed_by_harness for r in trial.ranks)
    # The stacks the ranks dumped before the kill: top frames in the record, whole dumps kept.
    assert "in inject_fault" in trial.ranks[1].stack[0]
    assert any("/torch/distributed/" in f for f in trial.ranks[0].stack)
    for k in (0, 1):
        assert "most recent call first" in open(trial.artifacts[f"rank {k} stacks"]).read()
    from repro.report.view import trial_facts

    facts = {f.label: f.value for f in trial_facts(trial)}
    assert facts["rank 1 stack"].startswith("inject_fault (worker.py:")
    assert_nothing_left(trial)


def test_stall_watchdog_blames_the_stuck_rank_long_before_the_deadline(tmp_path, launcher):
    trial, _ = selftest(tmp_path, {"kind": "hang", "rank": 1, "step": 1}, server=launcher, deadline=120, stall=3)
    assert trial.outcome == Outcome.HANG and trial.met is False
    assert trial.first_failure.rank == 1 and trial.first_failure.step == 1
    assert "stall limit 3 s, --stall" in trial.first_failure.detail
    assert "rank 1 was not in a collective" in trial.first_failure.detail
    assert_nothing_left(trial)


def test_slow_but_progressing_trial_reaches_its_deadline_not_a_hang(tmp_path):
    """Many quick steps, a budget too small for them: the ranks never stop writing records,
    so the deadline is DEADLINE (no verdict, never a pass), with no rank blamed."""
    trial, _ = selftest(tmp_path, steps=10_000_000, server="forked", deadline=10)
    assert trial.outcome == Outcome.DEADLINE and trial.met is False
    first = trial.first_failure
    assert first.rank is None and "blame" not in first.detail and "collective" not in first.detail
    # Counted from 0 as the steps table counts them, and the same step the verdict names.
    assert f"deadline 10 s reached in step {first.step} (" in first.detail
    assert " of 10000000 steps done) while progressing" in first.detail
    assert "not a hang: raise --deadline" in first.detail
    assert not trial.artifacts.get("rank 0 stacks")  # nobody was asked where it was stuck
    assert_nothing_left(trial)
    from repro.report.view import verdict_words

    assert verdict_words(trial).text == "✗ deadline reached: no verdict (not a pass)"


def activity_of(tmp_path):
    """A watchdog over one rank's record file, and a writer of its records at given times."""
    from repro.run.isolate import Activity
    from repro.run.protocol import StepCounter

    path = tmp_path / "rank0.jsonl"
    act = Activity([StepCounter(path)])

    def write(event, at):
        with open(path, "a") as f:
            f.write(json.dumps({"event": event, "rank": 0, "t": 0, "step": 0}) + "\n")
        act.poll(at)

    return act, write


def test_activity_tells_slow_from_stuck(tmp_path):
    """The watchdog's logic on a clock of its own: set-up may be long and silent, steps repeat."""
    act, write = activity_of(tmp_path)
    act.poll(0.0)
    assert act.quiet(5.0) is None and not act.progressing(5.0, 60) and not act.stalled(5.0, 3)
    write("start", 1.0)
    act.poll(39.9)  # a 39 s silent build: set-up, no watchdog yet
    assert not act.stalled(39.9, 3) and act.progressing(39.9, 60) and not act.progressing(39.9, 30)
    write("phase", 40.0)
    write("step", 41.0)
    for k in range(10):  # steps every 0.5 s
        write("step", 41.5 + 0.5 * k)
    last = 41.5 + 0.5 * 9
    assert act.longest_pause_s == 0.5  # pauses count from the first step on
    assert act.progressing(last + 0.9, 60) and not act.progressing(last + 1.1, 60)
    assert not act.stalled(last + 2.9, 3) and act.stalled(last + 3.1, 3)
    write("step", last + 2.5)  # one slow step: twice it is still "progressing"
    assert act.longest_pause_s == 2.5 and act.progressing(last + 2.5 + 4.9, 60)


def test_a_step_with_slow_phases_sets_how_long_a_pause_may_be(tmp_path):
    """nvfp4-reload at real dims on CPU: one reload is a minute or two without a record. The
    first step's own pauses (56 s, 121 s) make the next step's 70 s silence normal, not a HANG
    at the 60 s --stall; a silence past twice the longest pause still is one."""
    act, write = activity_of(tmp_path)
    write("start", 0.0)
    write("phase", 74.0)  # build + capture: set-up, not counted
    write("begin", 74.0)
    write("phase", 130.0)  # reload 56 s
    write("phase", 180.0)  # replays 50 s
    write("phase", 301.0)  # oracle 121 s
    write("step", 302.0)
    write("begin", 302.0)
    assert act.longest_pause_s == 121.0 and act.stall_limit(60) == 242.0
    assert not act.stalled(302.0 + 70, 60) and act.stalled(302.0 + 243, 60)


def test_deadline_outcome_is_never_expectable_and_never_met():
    from repro.outcome import EXPECTABLE, REPRODUCED, parse_expectation

    assert Outcome.DEADLINE not in EXPECTABLE and Outcome.DEADLINE not in REPRODUCED
    with pytest.raises(ValueError):
        parse_expectation("DEADLINE")


def test_injected_fault_is_recorded_and_never_counts_as_reproduced(tmp_path):
    p = plan(
        "selftest",
        None,
        {"tp": 2, "steps": 2, "device": "cpu", "deadline_s": DEADLINE, "expect": "reproduced"},
        [],
        gpus=0,
    )
    trial = run_trial(p.cfg, "cpu", tmp_path, "t", fault={"kind": "ima-message", "rank": 0, "step": 1})
    assert trial.outcome == Outcome.ILLEGAL_ADDRESS and Outcome.ILLEGAL_ADDRESS in trial.expected
    assert trial.met is False
    assert trial.injected_fault == {"kind": "ima-message", "rank": 0, "step": 1, "fired": True}
    from repro.report.view import trial_facts

    assert any(
        f.label == "injected fault" and f.value.startswith("ima-message on rank 0 at step 1 (fired")
        for f in trial_facts(trial)
    )
    assert_nothing_left(trial)


def test_cuda_700_message_is_illegal_address(tmp_path, launcher):
    trial, elapsed = selftest(tmp_path, {"kind": "ima-message", "rank": 0, "step": 0}, server=launcher)
    assert trial.outcome == Outcome.ILLEGAL_ADDRESS
    assert trial.first_failure.rank == 0 and trial.first_failure.step == 0
    assert "illegal memory access" in trial.ranks[0].stderr_tail
    assert elapsed < DEADLINE
    assert_nothing_left(trial)


def test_rank_dies_while_peer_waits_in_gloo_all_gather(tmp_path, launcher):
    trial, elapsed = selftest(tmp_path, {"kind": "exit", "rank": 1, "step": 1}, server=launcher)
    assert trial.outcome == Outcome.CRASH
    assert trial.first_failure.rank == 1 and trial.first_failure.step == 1
    assert trial.ranks[1].exitcode == 3
    assert trial.ranks[0].killed_by_harness or trial.ranks[0].exitcode != 0
    # Killed right after the grace period, long before the deadline.
    assert elapsed < GRACE_S + 10
    assert_nothing_left(trial)


def test_sigkill_keeps_earlier_records(tmp_path, launcher):
    trial, _ = selftest(tmp_path, {"kind": "sigkill", "rank": 0, "step": 2}, server=launcher)
    assert trial.outcome == Outcome.CRASH
    assert trial.ranks[0].signal == "SIGKILL"
    assert steps_of(trial, 0) == [0, 1]  # written before the kill, still there
    assert_nothing_left(trial)


def test_exception_is_recorded(tmp_path, launcher):
    trial, _ = selftest(tmp_path, {"kind": "raise", "rank": 0, "step": 0}, server=launcher)
    assert trial.outcome == Outcome.CRASH
    assert trial.ranks[0].error == "RuntimeError: injected fault"
    assert_nothing_left(trial)


def cli(*args, **kw):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "repro", *args],
        cwd=kw.get("cwd"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_pids(root, n, timeout=30, event="start"):
    """Pids of the n ranks, once each has written an event of the given kind."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pids, seen = [], 0
        for f in root.rglob("rank*.jsonl"):
            lines = [json.loads(l) for l in f.read_text().splitlines() if l.endswith("}")]
            pids += [e["pid"] for e in lines if e["event"] == "start"]
            seen += any(e["event"] == event for e in lines)
        if len(pids) >= n and seen >= n:
            return pids
        time.sleep(0.1)
    raise AssertionError(f"workers did not reach {event!r}")


def start_hanging_selftest(tmp_path):
    """A TP 2 selftest whose rank 1 hangs at step 1, once both ranks have recorded a step:
    (the process, its JSON report's path, the ranks' pids)."""
    out = tmp_path / "r.json"
    args = "selftest --tp 2 --steps 3 --device cpu --deadline 60 --inject-fault hang@1:1".split()
    proc = cli(*args, "--artifacts", str(tmp_path / "a"), "--json", str(out))
    return proc, out, wait_for_pids(tmp_path / "a", 2, event="step")


def test_sigterm_is_handled_like_ctrl_c_and_exits_143(tmp_path):
    proc, out, pids = start_hanging_selftest(tmp_path)
    proc.send_signal(signal.SIGTERM)  # what a CI cancel sends
    text, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    report = json.loads(out.read_text())
    assert report["interrupted"] is True and report["interrupted_by"] == "SIGTERM"
    trial = report["trials"][0]
    assert trial["outcome"] == "INTERRUPTED" and trial["met"] is False
    assert any(s["step"] == 0 for s in trial["steps"])  # records kept
    assert "interrupted (SIGTERM)" in text and "did NOT meet" not in text
    time.sleep(0.5)
    assert not any(alive(p) for p in pids)


def test_ctrl_c_exits_130_keeps_records_no_orphans(tmp_path):
    proc, out, pids = start_hanging_selftest(tmp_path)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    report = json.loads(out.read_text())
    assert report["interrupted"] is True
    assert any(s["step"] == 0 for s in report["trials"][0]["steps"])  # records kept
    time.sleep(0.5)
    assert not any(alive(p) for p in pids)


def parent_of(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def test_harness_killed_takes_workers_and_rank_server_with_it(tmp_path):
    proc = cli(
        "selftest",
        "--tp",
        "2",
        "--device",
        "cpu",
        "--deadline",
        "60",
        "--inject-fault",
        "hang@0:0",
        "--artifacts",
        str(tmp_path / "a"),
    )
    pids = wait_for_pids(tmp_path / "a", 2)
    servers = {parent_of(p) for p in pids}
    assert len(servers) == 1 and proc.pid not in servers, "the CLI forks its ranks from one rank server"
    server = servers.pop()
    assert parent_of(server) == proc.pid
    proc.kill()  # SIGKILL: no cleanup code of ours runs
    proc.wait(timeout=10)
    everyone = pids + [server]
    end = time.monotonic() + 10
    while time.monotonic() < end and any(alive(p) for p in everyone):
        time.sleep(0.1)
    assert not any(alive(p) for p in everyone)


# Verbatim from torch 2.11 on an H200 (matrix gpu-2): the IMA text mentions "device-side
# assertions" in its last line; the assert text says "device-side assert triggered".
IMA_2_11 = """torch.AcceleratorError: CUDA error: an illegal memory access was encountered
Search for `cudaErrorIllegalAddress' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.
For debugging consider passing CUDA_LAUNCH_BLOCKING=1
Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."""
ASSERT_2_11 = """torch.AcceleratorError: CUDA error: device-side assert triggered
Search for `cudaErrorAssert' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.
Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."""


def test_real_cuda_messages_classify():
    from repro.run.isolate import classify_error

    assert classify_error(IMA_2_11) == Outcome.ILLEGAL_ADDRESS
    assert classify_error(ASSERT_2_11) == Outcome.DEVICE_ASSERT
    assert classify_error("RuntimeError: shapes do not match") == Outcome.CRASH
    assert classify_error("repro.diagnose.guard.StaleCaptureError: graph ...") == Outcome.STALE_CAPTURE


def test_bytecode_cache_only_where_torch_has_none(tmp_path):
    from repro.run.launch import with_bytecode_cache

    src = tmp_path / "torch" / "__init__.py"
    src.parent.mkdir()
    src.write_text("")
    env = {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONDONTWRITEBYTECODE": "1"}
    # No compiled torch: workers get our own cache, and may write to it.
    got = with_bytecode_cache(env, str(src))
    assert got["PYTHONPYCACHEPREFIX"] == str(tmp_path / "cache" / "repro" / "pycache")
    assert "PYTHONDONTWRITEBYTECODE" not in got and env["PYTHONDONTWRITEBYTECODE"] == "1"
    # A prefix the user chose is theirs; no torch at all: nothing to do.
    assert with_bytecode_cache({**env, "PYTHONPYCACHEPREFIX": "/mine"}, str(src))["PYTHONPYCACHEPREFIX"] == "/mine"
    assert with_bytecode_cache(env, None) == env
    # The install's own bytecode exists: the environment is left as it is.
    import py_compile

    py_compile.compile(str(src))
    assert with_bytecode_cache(env, str(src)) == env


def test_workers_write_their_bytecode_cache_where_told(tmp_path, monkeypatch):
    """End to end: with an uncompiled torch, a worker writes bytecode under our cache, even
    where the user's environment forbids writing bytecode next to the sources."""
    import repro.run.launch

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    monkeypatch.setattr(repro.run.launch, "torch_origin", lambda: str(tmp_path / "torch" / "__init__.py"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    env = repro.run.launch.child_env()
    subprocess.run([sys.executable, "-c", "import repro.config"], env=env, check=True)
    assert list((tmp_path / "cache" / "repro" / "pycache").rglob("config*.pyc"))


def test_graph_replayed_comes_from_replays_not_the_device():
    from repro.run.isolate import replayed_graphs
    from repro.run.protocol import RankRecords
    from repro.outcome import StepRecord

    began = RankRecords([{"event": "begin", "step": 0}])
    # Steps that began, even on CUDA, are no replay (selftest has no graph at all).
    assert not replayed_graphs([StepRecord(step=0, rank=0, batch=4, replayed=False)], [began])
    assert replayed_graphs([StepRecord(step=0, rank=0, batch=4, replayed=True)], [began])
    # The replay that crashed has no step record; its marker was written before it started.
    assert replayed_graphs([], [RankRecords([*began.events, {"event": "replay", "graph": "g"}])])


def test_captured_marks_each_real_replay_before_it_starts():
    from repro.rank.graphs import Captured

    order = []

    class Graph:
        def replay(self):
            order.append("replay")

    Captured("g", Graph(), (), "out", on_replay=lambda label: order.append(f"marked {label}")).replay()
    assert order == ["marked g", "replay"]
    # On CPU there is no graph: no replay, so no marker.
    assert Captured("g", None, (), None, on_replay=order.append).replay() is None and len(order) == 2


def test_cpu_trial_records_no_replay(tmp_path):
    p = plan("gemma4-mtp", None, {"tp": 1, "steps": 1, "device": "cpu", "mode": "fixed"}, [], gpus=0)
    trial = run_trial(p.cfg, "cpu", tmp_path, "t")
    assert trial.outcome == Outcome.CLEAN and trial.device == "cpu"
    assert not trial.graph_replayed
    events = [json.loads(line)["event"] for line in (tmp_path / "t" / "rank0.jsonl").read_text().splitlines()]
    assert "replay" not in events and "step" in events


def test_step_counter_reads_records_incrementally(tmp_path):
    from repro.run.protocol import Event, RecordSink, StepCounter

    path = tmp_path / "rank0.jsonl"
    counter = StepCounter(path)
    assert counter.poll() == 0  # no file yet
    sink = RecordSink(path, 0)
    sink.emit(Event.BEGIN, step=0)
    sink.emit(Event.STEP, step=0, note='"event": "step"')  # the text inside a field is no step
    assert counter.poll() == 1
    with open(path, "a") as f:
        f.write('{"event": "step", "rank": 0')  # a line still being written
    assert counter.poll() == 1
    with open(path, "a") as f:
        f.write(', "t": 0}\n')
    assert counter.poll() == 2


def dump(*threads):
    """A faulthandler dump: one (current, [(path, line, func), ...]) per thread."""
    out = []
    for current, frames in threads:
        out.append(f"{'Current thread' if current else 'Thread'} 0x00007f0000000000 (most recent call first):")
        out += [f'  File "{p}", line {n} in {fn}' for p, n, fn in frames]
        out.append("")
    return "\n".join(out)


WORKER = ("/x/repro/rank/worker.py", 200, "run_rank")
GATHER = [
    ("/x/torch/distributed/distributed_c10d.py", 4394, "all_gather_single"),
    ("/x/repro/rank/dist.py", 40, "all_gather_dim0"),
    ("/x/repro/scenarios/selftest.py", 20, "run"),
    WORKER,
]
STUCK = [("/x/repro/scenarios/gemma4_mtp.py", 99, "greedy_sample"), WORKER]


def test_stack_blame_names_the_rank_outside_a_collective():
    from repro.run import stacks

    frames = {
        0: stacks.main_frames(dump((True, GATHER))),
        1: stacks.main_frames(dump((False, [("/t.py", 1, "f")]), (True, STUCK))),
        2: stacks.main_frames(dump((True, GATHER))),
    }
    rank, why = stacks.blame(frames)
    assert rank == 1 and "gemma4_mtp.py:99 in greedy_sample" in why and "ranks 0, 2 waited" in why
    # Everyone in a collective, or nobody: the stacks do not single out a rank.
    assert stacks.blame({0: frames[0], 1: frames[2]})[0] is None
    assert stacks.blame({0: frames[1], 1: frames[1]})[0] is None
    assert stacks.blame({0: [], 1: []}) == (None, "no rank dumped its stack")
    assert stacks.top_frames(dump((True, STUCK)), n=1) == ["/x/repro/scenarios/gemma4_mtp.py:99 in greedy_sample"]


def test_rank_disagreement_is_a_mismatch():
    from repro.run.isolate import classify_steps
    from repro.run.protocol import RankRecords

    def step(rank, disagree):
        return {
            "event": "step",
            "rank": rank,
            "t": 0,
            "step": 2,
            "batch": 4,
            "replayed": False,
            "numel": 4,
            "compared": 4,
            "mismatches": 0,
            "label": "graph bs=4",
            "extra": {"rank_disagreements": disagree},
        }

    agree = [RankRecords([step(0, 0)]), RankRecords([step(1, 0)])]
    assert classify_steps(agree)[0] == Outcome.CLEAN
    outcome, first = classify_steps([RankRecords([step(0, 3)]), RankRecords([step(1, 3)])])
    assert outcome == Outcome.MISMATCH
    assert (first.rank, first.step) == (0, 2) and "the ranks disagree on 3/4 outputs" in first.detail
