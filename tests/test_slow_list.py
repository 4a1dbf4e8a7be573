"""tests/slow.txt, the cost class behind `-m "not slow"`: read from --durations reports."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO, slow_tests

LOG = """\
============================= slowest durations ==============================
14.35s setup    tests/test_ray.py::test_refused[device = "cuda"\\ntp = 4-needs 4 GPUs]
0.40s call     tests/test_a.py::test_split
0.20s teardown tests/test_a.py::test_split
0.30s call     tests/test_a.py::test_quick
(2512 durations < 0.3s hidden.)
"""


def test_phases_add_up_ids_keep_their_spaces_and_the_largest_run_counts(tmp_path):
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    first.write_text(LOG)
    second.write_text("0.90s call     tests/test_a.py::test_quick\n")
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "slow_from_durations.py"), str(first), str(second)],
        capture_output=True,
        text=True,
        check=True,
    )
    listed = [line for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert listed == [
        "tests/test_a.py::test_quick",
        "tests/test_a.py::test_split",
        'tests/test_ray.py::test_refused[device = "cuda"\\ntp = 4-needs 4 GPUs]',
    ]
    assert (
        subprocess.run(
            [sys.executable, str(REPO / "tests" / "slow_from_durations.py"), str(first), "--seconds", "1"],
            capture_output=True,
            text=True,
        ).stdout.count("\ntests/")
        == 1
    )


def test_conftest_marks_exactly_the_listed_tests_slow():
    """-m slow collects, of one file, the tests slow.txt lists (and none it does not)."""
    listed = {n for n in slow_tests() if n.startswith("tests/test_isolate.py::")}
    assert listed
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "slow",
            "tests/test_isolate.py",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    collected = {line for line in proc.stdout.splitlines() if line.startswith("tests/test_isolate.py::")}
    assert collected == listed, proc.stdout[-2000:]
