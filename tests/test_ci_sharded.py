"""docs/ci/github-sharded.yml and docs/ci/buildkite-sharded.yml: valid YAML, N parallel GPU jobs
and a merge job, and every repro command in them accepted by this repro as written."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO

DOCS = REPO / "docs" / "ci"


def load(name: str) -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((DOCS / name).read_text())


def repro_lines(script: str, subs: dict | None = None) -> list[list[str]]:
    script = script.replace("\\\n", " ")
    for old, new in (subs or {}).items():
        script = script.replace(old, new)
    return [shlex.split(line.split("||")[0]) for line in script.splitlines() if line.strip().startswith("repro ")]


def trial_lines(listing: str) -> list[str]:
    """The listing's trial rows ("NN-scenario-..."), not its notes on why trials cannot run here."""
    return [line for line in listing.splitlines() if re.match(r"\d+-", line)]


def without_outputs(argv: list[str]) -> list[str]:
    """The command's plan only: --list refuses output options it would ignore."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--json", "--junit", "--html", "--artifacts"):
            skip = True
        else:
            out.append(a)
    return out


def plan(argv: list[str], env: dict, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "repro", *without_outputs(argv)[1:], "--list"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )


def test_github_workflow_runs_n_shards_then_merges_them(tmp_path):
    jobs = load("github-sharded.yml")["jobs"]
    shards = jobs["shard"]["strategy"]["matrix"]["shard"]
    assert jobs["shard"]["strategy"]["fail-fast"] is False and jobs["merge"]["needs"] == "shard"
    assert jobs["merge"]["if"] == "always()"
    (merge_cmd,) = [c for s in jobs["merge"]["steps"] for c in repro_lines(s.get("run", ""))]
    listed = []
    for k in shards:
        (argv,) = [
            c for s in jobs["shard"]["steps"] for c in repro_lines(s.get("run", ""), {"${{ matrix.shard }}": str(k)})
        ]
        assert f"{k}/{len(shards)}" in argv
        done = plan(argv, {}, tmp_path)
        assert done.returncode == 0, done.stderr
        listed += trial_lines(done.stdout)
    assert (
        len(listed)
        == len(set(listed))
        == len(trial_lines(plan(["repro", "matrix", "--config", "gpu-2"], {}, tmp_path).stdout))
    )
    assert merge_cmd[:2] == ["repro", "merge"] and {"--json", "--junit", "--html"} <= set(merge_cmd)


def test_buildkite_pipeline_uses_parallelism_and_shard_auto(tmp_path):
    steps = load("buildkite-sharded.yml")["steps"]
    gpu, merge = steps
    assert gpu["parallelism"] == 4 and merge["depends_on"] == gpu["key"] and merge["allow_dependency_failure"]
    (shard_cmd,) = repro_lines(gpu["command"])
    assert "--shard" in shard_cmd and shard_cmd[shard_cmd.index("--shard") + 1] == "auto"
    listed = []
    for job in range(gpu["parallelism"]):
        argv = [a.replace("$${BUILDKITE_PARALLEL_JOB}", str(job)) for a in shard_cmd]
        done = plan(argv, {"BUILDKITE_PARALLEL_JOB": str(job), "BUILDKITE_PARALLEL_JOB_COUNT": "4"}, tmp_path)
        assert done.returncode == 0, done.stderr
        listed += trial_lines(done.stdout)
    assert (
        len(listed)
        == len(set(listed))
        == len(trial_lines(plan(["repro", "matrix", "--config", "gpu-2"], {}, tmp_path).stdout))
    )
    (merge_cmd,) = repro_lines(merge["command"])
    assert merge_cmd[:2] == ["repro", "merge"] and {"--json", "--junit", "--html"} <= set(merge_cmd)
