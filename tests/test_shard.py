"""`repro matrix --shard K/N` / `--balance` and `repro merge`: a stable split, and a merge that is one run.

The end-to-end tests run a tiny matrix of harness self-tests on CPU (gloo, seconds each) through
the real command line: the full run, each shard, the merge, and what a missing or doubled shard does.
"""

import json
import os
import random
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from conftest import REPO, TINY_MATRIX
from repro.config import ConfigError
from repro.run.shard import Shard, assign, parse_shard, split_by_durations, split_by_id


ids_strategy = st.lists(st.text("abcdefgh0123456789-", min_size=1, max_size=12), min_size=0, max_size=40, unique=True)


@settings(max_examples=200, deadline=None)
@given(ids=ids_strategy, count=st.integers(1, 9), seed=st.integers(0, 2**32))
def test_shards_cover_the_plan_once_whatever_the_order(ids, count, seed):
    shards = [assign(ids, Shard(k, count)).trials for k in range(1, count + 1)]
    assert sorted(t for s in shards for t in s) == sorted(ids)  # union == plan, disjoint
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    shuffled = list(ids)
    random.Random(seed).shuffle(shuffled)
    assert [assign(shuffled, Shard(k, count)).trials for k in range(1, count + 1)] == shards


@settings(max_examples=200, deadline=None)
@given(ids=ids_strategy, count=st.integers(1, 6), seed=st.integers(0, 2**32))
def test_balanced_shards_cover_the_plan_once_and_stay_stable(ids, count, seed):
    rng = random.Random(seed)
    seconds = {t: rng.choice([0.5, 1.0, 7.0, 30.0]) for t in ids}
    shards = split_by_durations(ids, count, seconds)
    assert sorted(t for s in shards for t in s) == sorted(ids)
    shuffled = list(ids)
    rng.shuffle(shuffled)
    assert split_by_durations(shuffled, count, seconds) == shards
    if ids:  # greedy longest-first: no shard exceeds the lightest by more than the longest trial
        loads = [sum(seconds[t] for t in s) for s in shards]
        assert max(loads) - min(loads) <= max(seconds.values())


def test_balance_reads_a_previous_report_and_spreads_the_long_trials(tmp_path):
    ids = [f"{i:02d}-t" for i in range(6)]
    previous = {
        "schema": "repro.report/1",
        "trials": [
            {"id": "00-t", "timings": {"total": 60.0}},
            {"id": "01-t", "timings": {"total": 50.0}},
            {"id": "02-t", "timings": {"total": 1.0}},
            {"id": "03-t", "timings": {"total": 1.0}},
            {"id": "04-t", "timings": {"total": 2.0}},
        ],
    }  # 05-t never timed: the median
    path = tmp_path / "previous.json"
    path.write_text(json.dumps(previous))
    one, two = (assign(ids, Shard(k, 2), path) for k in (1, 2))
    # Longest first onto the lighter shard: 00 (60 s) alone, everything else (56 s) on the other.
    assert one.trials == ["00-t"] and two.trials == ["01-t", "02-t", "03-t", "04-t", "05-t"]
    assert one.by == "durations from previous.json" and one.durations["00-t"] == 60.0
    assert {**one.durations, **two.durations}["05-t"] == 2.0  # median of 60, 50, 1, 1, 2
    # By id alone the split ignores the durations: 62 s against 53 s.
    assert split_by_id(ids, 2) == [["00-t", "02-t", "04-t"], ["01-t", "03-t", "05-t"]]


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"BUILDKITE_PARALLEL_JOB": "0", "BUILDKITE_PARALLEL_JOB_COUNT": "4"}, Shard(1, 4)),
        ({"BUILDKITE_PARALLEL_JOB": "3", "BUILDKITE_PARALLEL_JOB_COUNT": "4"}, Shard(4, 4)),
        ({"REPRO_SHARD": "2/3"}, Shard(2, 3)),
    ],
)
def test_shard_auto_reads_the_ci_variables(env, expected):
    assert parse_shard("auto", env) == expected


@pytest.mark.parametrize(
    "text, env, words",
    [
        ("0/3", {}, "shard 0 of 3 does not exist"),
        ("4/3", {}, "shard 4 of 3 does not exist"),
        ("2", {}, "expected K/N"),
        ("a/b", {}, "expected K/N"),
        ("auto", {}, "neither BUILDKITE_PARALLEL_JOB"),
        ("auto", {"BUILDKITE_PARALLEL_JOB": "4", "BUILDKITE_PARALLEL_JOB_COUNT": "4"}, "shard 5 of 4 does not exist"),
        ("auto", {"BUILDKITE_PARALLEL_JOB": "x", "BUILDKITE_PARALLEL_JOB_COUNT": "4"}, "must be integers"),
    ],
)
def test_bad_shard_values_name_the_value(text, env, words):
    with pytest.raises(ConfigError, match=words):
        parse_shard(text, env)


def repro(*args, cwd, env=None):
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "repro", *args], cwd=cwd, capture_output=True, text=True, env=full_env, timeout=240
    )


def normalized(doc: dict) -> dict:
    """A report without what differs between two runs of the same trials: times, hosts, pids,
    run folders, the command line, the environment, the shard bookkeeping."""
    out = {k: v for k, v in doc.items() if k not in ("created", "command", "environment", "shard")}
    trials = []
    for t in doc["trials"]:
        t = {k: v for k, v in t.items() if k not in ("timings", "node", "runtime")}
        t["steps"] = [{k: v for k, v in s.items() if k != "seconds"} for s in t["steps"]]
        t["ranks"] = [{k: v for k, v in r.items() if k != "pid"} for r in t["ranks"]]
        t["artifacts"] = {k: Path(v).name for k, v in t["artifacts"].items()}
        trials.append(t)
    out["trials"] = trials
    return out


def test_shards_merged_equal_one_run(tmp_path):
    (tmp_path / "m.toml").write_text(TINY_MATRIX)
    full = repro("matrix", "--config", "m.toml", "--json", "full.json", "--artifacts", "runs", cwd=tmp_path)
    assert full.returncode == 1, full.stderr  # the CRASH expectation is not met
    codes = []
    for k in (1, 2):
        shard = repro(
            "matrix",
            "--config",
            "m.toml",
            "--shard",
            f"{k}/2",
            "--json",
            f"s{k}.json",
            "--artifacts",
            "runs",
            cwd=tmp_path,
        )
        codes.append(shard.returncode)
    assert sorted(codes) == [0, 1]  # the failing trial is in one shard only
    merged = repro(
        "merge",
        "s2.json",
        "s1.json",
        "--json",
        "merged.json",
        "--junit",
        "merged.xml",
        "--html",
        "merged.html",
        cwd=tmp_path,
    )
    assert merged.returncode == full.returncode, merged.stderr
    one, joined = (json.loads((tmp_path / n).read_text()) for n in ("full.json", "merged.json"))
    assert normalized(joined) == normalized(one)
    assert "shard" not in one and all("node" not in t for t in one["trials"])  # a plain run's JSON as before
    s1 = json.loads((tmp_path / "s1.json").read_text())["shard"]
    assert s1["index"] == 1 and s1["count"] == 2 and s1["plan"] == [t["id"] for t in one["trials"]]
    assert joined["shard"]["problems"] == [] and [s["index"] for s in joined["shard"]["merged"]] == [1, 2]
    assert all(t["node"] for t in joined["trials"])  # the host each shard ran on
    assert "2 of 2 shards merged" in " ".join(merged.stdout.split())
    cases = ET.parse(tmp_path / "merged.xml").getroot().iter("testcase")
    assert sorted(c.find("properties/property[@name='trial_id']").get("value") for c in cases) == sorted(
        t["id"] for t in one["trials"]
    )
    assert "2/3 trials met their expectation" in (tmp_path / "merged.html").read_text()


def shard_reports(tmp_path, count=2):
    (tmp_path / "m.toml").write_text(TINY_MATRIX)
    for k in range(1, count + 1):
        repro(
            "matrix",
            "--config",
            "m.toml",
            "--shard",
            f"{k}/{count}",
            "--json",
            f"s{k}.json",
            "--artifacts",
            "runs",
            cwd=tmp_path,
        )


def test_a_missing_or_doubled_shard_fails_the_merge_naming_it(tmp_path):
    shard_reports(tmp_path)
    s2 = json.loads((tmp_path / "s2.json").read_text())
    assert all(t["met"] for t in s2["trials"])  # alone, shard 2 is green
    missing = repro("merge", "s2.json", "--json", "m.json", "--junit", "m.xml", cwd=tmp_path)
    assert missing.returncode == 1
    assert "FAILED: shard 1/2 missing" in " ".join(missing.stdout.split())
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["shard"]["problems"] == ["shard 1/2 missing: no report given for it"]
    assert doc["not_run"] == len(json.loads((tmp_path / "s1.json").read_text())["shard"]["trials"])
    failures = [c for c in ET.parse(tmp_path / "m.xml").getroot().iter("testcase") if c.find("failure") is not None]
    assert [c.get("name") for c in failures] == ["shard 1/2 missing"]
    doubled = repro("merge", "s2.json", "s2.json", "s1.json", "--json", "d.json", cwd=tmp_path)
    assert doubled.returncode == 1
    assert json.loads((tmp_path / "d.json").read_text())["shard"]["problems"] == [
        "shard 2/2 given 2 times (s2.json, s2.json)"
    ]


def test_merge_refuses_reports_of_another_split_in_one_line(tmp_path):
    shard_reports(tmp_path)
    (tmp_path / "other").mkdir()
    shard_reports(tmp_path / "other", count=3)
    mixed = repro("merge", "s1.json", "other/s2.json", cwd=tmp_path)
    assert mixed.returncode == 2 and mixed.stderr.count("\n") == 1
    assert "merge the reports of one split" in mixed.stderr
    plain = repro(
        "matrix", "--config", "m.toml", "--only", "01-", "--json", "plain.json", "--artifacts", "runs", cwd=tmp_path
    )
    assert plain.returncode == 0
    refused = repro("merge", "plain.json", cwd=tmp_path)
    assert refused.returncode == 2 and "not the report of one shard" in refused.stderr
    assert "Traceback" not in refused.stderr + mixed.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["--shard", "3/2"], "shard 3 of 2 does not exist"),
        (["--balance", "x.json"], "add --shard"),
        (["--shard", "1/2", "--balance", "nope.json"], "cannot read it"),
        (["--retries", "1"], "add --ray"),
    ],
)
def test_bad_matrix_options_are_one_line_exit_2(tmp_path, args, words):
    done = repro("matrix", "--list", *args, cwd=tmp_path)
    assert done.returncode == 2 and words in done.stderr and done.stderr.count("\n") == 1
