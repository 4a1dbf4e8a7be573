"""Ctrl-C and SIGTERM at any moment of a run: exit 130/143 and the JSON, marked interrupted.

Two loops. The first signals the CLI at every named point of its life (REPRO_SIGNAL_AT, the
test hook of repro/run/interrupts.py: the process signals itself there), so each window (start-up,
rank server start, planning, a trial being spawned or collected, the report) is reached
deterministically. The second sends SIGTERM from outside after a random delay, counted from
the moment the CLI's handler is in place (read from /proc), into a run that cannot end by
itself (an injected hang): every one must end with 143 and the JSON. Both are bounded
(about 40 s together on 2 cores).
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, alive

POINTS = ["start", "server", "parsed", "planned", "run", "spawning", "spawned", "ended", "collected", "report"]
RANDOM_RUNS = 6


def cli_env(**extra):
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def selftest_args(tmp_path, *extra):
    return [
        sys.executable,
        "-m",
        "repro",
        "selftest",
        "--tp",
        "2",
        "--steps",
        "3",
        "--device",
        "cpu",
        "--deadline",
        "60",
        "--artifacts",
        str(tmp_path / "a"),
        "--json",
        str(tmp_path / "r.json"),
        *extra,
    ]


def matrix_args(tmp_path):
    """`repro matrix` over the smoke preset's first trial, its report in tmp_path/r.json."""
    return [
        sys.executable,
        "-m",
        "repro",
        "matrix",
        "--only",
        "01-",
        "--artifacts",
        str(tmp_path / "a"),
        "--json",
        str(tmp_path / "r.json"),
    ]


def ranks_left(tmp_path):
    pids = []
    for f in (tmp_path / "a").rglob("rank*.jsonl"):
        pids += [
            json.loads(l)["pid"]
            for l in f.read_text().splitlines()
            if l.endswith("}") and json.loads(l)["event"] == "start"
        ]
    time.sleep(0.3)
    return [p for p in pids if alive(p)]


def check_interrupted(proc_rc, stderr, tmp_path, name):
    code = {"SIGTERM": 143, "SIGINT": 130}[name]
    assert proc_rc == code, stderr
    assert "Traceback" not in stderr, stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["interrupted"] is True and report["interrupted_by"] == name
    assert all(not t["met"] for t in report["trials"] if t["outcome"] == "INTERRUPTED")
    assert len(report["trials"]) + report["not_run"] == 1
    assert not ranks_left(tmp_path)
    return report


@pytest.mark.parametrize(
    "name,point", [("SIGTERM", p) for p in POINTS] + [("SIGINT", p) for p in ("start", "spawned", "collected")]
)
def test_signal_at_every_point_gives_its_exit_code_and_the_json(tmp_path, name, point):
    proc = subprocess.run(
        selftest_args(tmp_path),
        env=cli_env(REPRO_SIGNAL_AT=f"{name}@{point}"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = check_interrupted(proc.returncode, proc.stderr, tmp_path, name)
    if point in ("start", "server", "parsed", "planned", "run"):
        assert report["trials"] == [] and report["not_run"] == 1  # nothing had started
    else:
        assert len(report["trials"]) == 1


def test_signal_after_the_report_is_written_changes_nothing(tmp_path):
    proc = subprocess.run(
        selftest_args(tmp_path),
        env=cli_env(REPRO_SIGNAL_AT="SIGTERM@written"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["interrupted"] is False and report["trials"][0]["outcome"] == "CLEAN"


def test_matrix_signalled_while_its_first_trial_is_collected(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        matrix_args(tmp_path),
        env=cli_env(REPRO_SIGNAL_AT="SIGTERM@ended"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 143, proc.stderr
    report = json.loads(out.read_text())
    assert report["interrupted"] is True and report["interrupted_by"] == "SIGTERM"
    assert len(report["trials"]) == 1


MATRIX_POINTS = ["start", "server", "parsed", "planned", "spawned", "collected", "report"]


@pytest.mark.parametrize("point", MATRIX_POINTS)
def test_matrix_signalled_at_every_point_gives_143_and_the_json(tmp_path, point):
    """`repro matrix --json PATH` as a CI job runs it (its own session): its planning is its own
    code path, the trial's points are the same as a scenario command's."""
    out = tmp_path / "r.json"
    proc = subprocess.run(
        matrix_args(tmp_path),
        env=cli_env(REPRO_SIGNAL_AT=f"SIGTERM@{point}"),
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr
    report = json.loads(out.read_text())
    assert report["interrupted"] is True and report["interrupted_by"] == "SIGTERM"
    assert len(report["trials"]) + report["not_run"] == 1
    assert len(report["trials"]) == (0 if point in ("start", "server", "parsed", "planned") else 1)
    assert not ranks_left(tmp_path)


def handler_installed(pid):
    """Whether the process catches SIGTERM (its SigCgt mask in /proc): the CLI's first act."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    except OSError:
        pass
    return False


def test_sigterm_at_random_moments_always_gives_143_and_the_json(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    for i in range(RANDOM_RUNS):
        run = tmp_path / str(i)
        run.mkdir()
        delay = rng.uniform(0.0, 3.0)
        proc = subprocess.Popen(
            selftest_args(run, "--inject-fault", "hang@1:1"),
            env=cli_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        while not handler_installed(proc.pid) and proc.poll() is None:
            time.sleep(0.002)
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        try:
            check_interrupted(proc.returncode, err, run, "SIGTERM")
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, run {i}, SIGTERM {delay:.3f} s after the handler: {e}") from None
