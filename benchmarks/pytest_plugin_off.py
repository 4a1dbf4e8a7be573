"""What the pytest plugin costs a session when it is installed but off: nothing measurable.

    PYTHONPATH=. python3 benchmarks/pytest_plugin_off.py [--runs 15] [--tests 200] [--json OUT]

A generated suite of N trivial tests (no torch), run as `python -m pytest -q` in a fresh
process, in three variants, interleaved run by run (the order rotated each round) so
machine load hits all alike:

  no_plugin   -p no:repro            the plugin never imported
  off         (plugin auto-loaded)   installed through its pytest11 entry point, not enabled
  on          --repro-watch          for scale only: the hooks on, markers per phase

The entry point is declared by a dist-info written to a temporary directory on PYTHONPATH
(the same for all variants), as `pip install` would write it. Reported: the median wall time
(wall) and CPU time (user + sys of the session process: less disturbed by other load) of each
variant, the ratios off / no_plugin and on / no_plugin of both, the least CPU time of each
variant, and the import time of repro.pytest alone (`python -X importtime`).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {"no_plugin": ["-p", "no:repro"], "off": [], "on": ["--repro-watch"]}


def write_suite(root: Path, tests: int) -> None:
    lines = [f"def test_{i}():\n    assert {i} + 1 > {i}\n" for i in range(tests)]
    (root / "test_many.py").write_text("\n".join(lines))
    info = root / "_site" / "repro_entry_point-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: repro-entry-point\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[pytest11]\nrepro = repro.pytest\n")


def session_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPRO_WATCH")}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "_site"), str(REPO)])
    env["REPRO_WATCH_DIR"] = str(root / "records")
    return env


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(root: Path, env: dict[str, str], extra: list[str]) -> tuple[float, float]:
    """(wall s, CPU s of the session process): CPU time is what other load on the machine
    disturbs least."""
    start, cpu = time.perf_counter(), children_cpu_s()
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, "test_many.py"],
        cwd=root,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - start, children_cpu_s() - cpu


def import_time_us(env: dict[str, str]) -> int:
    """Cumulative import time of repro.pytest, pytest already imported (as in a session)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import pytest, repro.pytest"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    for line in proc.stderr.splitlines():
        parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
        if len(parts) == 3 and parts[2] == "repro.pytest":
            return int(parts[1])
    return -1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--tests", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="repro-bench-pytest-") as tmp:
        root = Path(tmp)
        write_suite(root, args.tests)
        env = session_env(root)
        for extra in VARIANTS.values():  # warm the file cache and bytecode once each
            run_once(root, env, extra)
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
        names = list(VARIANTS)
        for r in range(args.runs):
            # Rotate the order each round: no variant always runs right after another.
            for name in names[r % len(names) :] + names[: r % len(names)]:
                wall, used = run_once(root, env, VARIANTS[name])
                times[name].append(wall)
                cpu[name].append(used)
        imported_us = import_time_us(env)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    cpu_medians = {name: statistics.median(ts) for name, ts in cpu.items()}
    base = medians["no_plugin"]
    doc = {
        "benchmark": "pytest_plugin_off",
        "runs": args.runs,
        "tests": args.tests,
        "python": sys.version.split()[0],
        "median_s": {k: round(v, 4) for k, v in medians.items()},
        "ratio_off_vs_no_plugin": round(medians["off"] / base, 4),
        "ratio_on_vs_no_plugin": round(medians["on"] / base, 4),
        "spread_no_plugin_s": round(max(times["no_plugin"]) - min(times["no_plugin"]), 4),
        "median_cpu_s": {k: round(v, 4) for k, v in cpu_medians.items()},
        "cpu_ratio_off_vs_no_plugin": round(cpu_medians["off"] / cpu_medians["no_plugin"], 4),
        "cpu_ratio_on_vs_no_plugin": round(cpu_medians["on"] / cpu_medians["no_plugin"], 4),
        # The least disturbed run of each: on a shared machine load only ever adds time.
        "min_cpu_s": {k: round(min(ts), 4) for k, ts in cpu.items()},
        "import_repro_pytest_us": imported_us,
    }
    emit(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
