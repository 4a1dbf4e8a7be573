"""The CLI through Typer's CliRunner: usage errors are one line + exit 2, env errors exit 3."""

import json
import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import repro.env.gpus
from conftest import REPO
from repro.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, list(args))


def one_line_error(result, code=2):
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("repro: error:")
    assert "Traceback" not in result.stderr
    return lines[0]


def test_help_lists_commands_and_exit_codes():
    result = invoke("--help")
    assert result.exit_code == 0
    for word in ("gemma4-mtp", "nvfp4-reload", "matrix", "doctor", "vllm-audit", "Exit codes", "130"):
        assert word in result.stdout


def test_scenario_help_lists_exit_codes():
    result = invoke("gemma4-mtp", "--help")
    assert result.exit_code == 0 and "--after-free" in result.stdout and "Exit codes" in result.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (["gemma4-mtp", "--bogus"], "No such option"),
        (["gemma4-mtp", "--tp", "two"], "Invalid value for '--tp'"),
        (["gemma4-mtp", "--mode", "halfway"], "'--mode': 'halfway' is not one of 'unfixed', 'fixed', 'reload-safe'"),
        (["nvfp4-reload", "--mode", "reload-safe"], "is not one of 'unfixed', 'kernel-reuse', 'fixed'"),
        (["gemma4-mtp", "--after-free", "shred"], "'--after-free': 'shred' is not one of 'keep', 'release'"),
        (["gemma4-mtp", "--guard", "loud"], "'--guard': 'loud' is not one of 'off', 'warn', 'raise'"),
        (["gemma4-mtp", "--set", "run.mode=halfway", "--device", "cpu"], "mode = 'halfway' is not one of"),
        (["gemma4-mtp", "--config", "/nope.toml"], "does not exist"),
        (["gemma4-mtp", "--steps", "-2", "--device", "cpu"], "steps = -2 must be >= 1"),
        (["gemma4-mtp", "--tp", "0", "--device", "cpu"], "tp = 0 must be >= 1"),
        (["gemma4-mtp", "--set", "model.vocab_size=4001", "--device", "cpu"], "not divisible"),
        (["gemma4-mtp", "--set", "oops"], "expected SECTION.KEY=VALUE"),
        (
            ["gemma4-mtp", "--identity-reload", "--device", "cpu"],
            "gemma4-mtp has no --identity-reload option; --identity-reload belongs to nvfp4-reload",
        ),
        (["nvfp4-reload", "--config", "gemma4-tiny"], "preset is for scenario 'gemma4-mtp'"),
        (["gemma4-mtp", "--expect", "works", "--device", "cpu"], "expectation 'works'"),
        (["matrix", "--config", "/nope.toml"], "does not exist"),
        (["matrix", "--jobs", "0"], "--jobs 0: must be >= 1"),
        (["matrix", "--jobs", "many"], "Invalid value for '--jobs'"),
        (["selftest", "--inject-fault", "melt@0:0", "--device", "cpu"], "kind 'melt'"),
        (["vllm-audit", "--path", "/nonexistent-dir"], "/nonexistent-dir"),
        (
            ["gemma4-mtp", "--num-speculative-tokens", "-1", "--device", "cpu"],
            "num_speculative_tokens = -1 must be between 1 and 16",
        ),
        (
            ["gemma4-mtp", "--num-speculative-tokens", "17", "--device", "cpu"],
            "num_speculative_tokens = 17 must be between 1 and 16",
        ),
        (["gemma4-mtp", "--share-gpu", "--device", "cpu"], "share_gpu = true with device = cpu"),
        (
            ["nvfp4-reload", "--set", "run.num_speculative_tokens=2", "--device", "cpu"],
            "num_speculative_tokens does not apply to nvfp4-reload",
        ),
    ],
)
def test_bad_input_one_line_exit_2(args, needle):
    assert needle in one_line_error(invoke(*args))


def test_tp_larger_than_gpus_is_environment_exit_3(monkeypatch, tmp_path):
    monkeypatch.setattr(repro.env.gpus, "gpu_count", lambda *a, **k: 1)
    result = invoke("gemma4-mtp", "--tp", "2", "--device", "cuda", "--artifacts", str(tmp_path), "--json", "-")
    assert result.exit_code == 3
    doc = json.loads(result.stdout)
    assert doc["trials"][0]["outcome"] == "UNSUPPORTED" and doc["trials"][0]["met"] is False
    assert "needs 2 GPUs, 1 visible" in doc["trials"][0]["first_failure"]["detail"]


def test_tp_larger_than_gpus_says_how_to_share_one(monkeypatch, tmp_path):
    monkeypatch.setattr(repro.env.gpus, "gpu_count", lambda *a, **k: 1)
    result = invoke("gemma4-mtp", "--tp", "2", "--device", "cuda", "--artifacts", str(tmp_path), "--json", "-")
    assert "--share-gpu" in json.loads(result.stdout)["trials"][0]["first_failure"]["detail"]


@pytest.mark.parametrize(
    "gpus,extra,device",
    [
        (1, ["--share-gpu"], "cuda"),  # two ranks on one GPU, over gloo
        (1, [], "UNSUPPORTED"),  # without the opt-in: still not runnable here
        (2, [], "cuda"),  # enough GPUs: NCCL, the flag not needed
        (0, ["--share-gpu"], "cpu"),  # auto on a CPU-only machine: gloo on the host
    ],
)
def test_share_gpu_planning(monkeypatch, gpus, extra, device):
    monkeypatch.setattr(repro.env.gpus, "gpu_count", lambda *a, **k: gpus)
    monkeypatch.setattr(repro.env.gpus, "visible_memory", lambda *a, **k: [140 << 30] * gpus)
    cfg = json.loads(invoke("gemma4-mtp", "--tp", "2", "--config", "gemma4-e2b", *extra, "--print-config").stdout)
    assert cfg["device"].split(":")[0] == device
    assert cfg["run"]["share_gpu"] is bool(extra) and cfg["run"]["num_speculative_tokens"] == 3


def test_shared_gpu_must_hold_every_rank(monkeypatch):
    from repro.config import apply_overrides, load_preset, validate
    from repro.run.footprint import fit_reason, needed_bytes

    cfg = validate(apply_overrides(load_preset("gemma4-e2b"), {"tp": 2, "share_gpu": True}, []))
    per_rank = needed_bytes(cfg)
    monkeypatch.setattr(repro.env.gpus, "visible_memory", lambda *a, **k: [int(per_rank * 1.5)])
    assert "needs at least" in fit_reason(cfg, "cuda")  # two ranks do not fit on the one GPU
    monkeypatch.setattr(repro.env.gpus, "visible_memory", lambda *a, **k: [per_rank * 2])
    assert fit_reason(cfg, "cuda") == ""


def test_share_gpu_ranks_use_gloo_on_gpu_0(monkeypatch):
    import torch
    from repro.rank.dist import backend_for
    from repro.rank.worker import TrialSpec, pick_device

    assert backend_for(torch.device("cuda", 0), share_gpu=True) == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl"
    assert backend_for(torch.device("cpu")) == "gloo"
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for share in (True, False):
        spec = TrialSpec(trial_id="t", config={"run": {"share_gpu": share}}, device="cuda", world_size=2, out_dir=".")
        assert pick_device(spec, rank=1) == torch.device("cuda", 0 if share else 1)
    assert chosen == [0, 1]


def test_print_config_resolves_cpu_preset(no_gpu):
    result = invoke("gemma4-mtp", "--print-config", "--mode", "fixed")
    assert result.exit_code == 0
    cfg = json.loads(result.stdout)
    assert cfg["preset"] == "gemma4-tiny" and cfg["device"] == "cpu" and cfg["run"]["mode"] == "fixed"
    assert cfg["run"]["after_free"] == "release"


def test_print_config_real_preset_when_named(no_gpu):
    cfg = json.loads(invoke("nvfp4-reload", "--config", "qwen3-30b-a3b-moe", "--print-config").stdout)
    assert cfg["model"]["num_experts"] == 128 and cfg["run"]["after_free"] == "poison"


def test_doctor_without_gpu_exits_0(monkeypatch):
    result = invoke("doctor", "--json", "-")
    assert result.exit_code == 0
    env = json.loads(result.stdout)
    assert "torch" in env and "gpus" in env


def test_doctor_json_goes_through_the_strict_writer(monkeypatch):
    """What NVML or the host says may hold what plain json.dumps would write as bare NaN or as a
    lone surrogate; the doctor's JSON is strict like every report's."""
    import repro.env.inventory

    monkeypatch.setattr(
        repro.env.inventory, "collect", lambda **k: {"host": {"hostname": "h\udcff"}, "x": float("nan")}
    )
    monkeypatch.setattr("repro.env.doctor.render", lambda env, console: None)
    result = invoke("doctor", "--json", "-")
    assert result.exit_code == 0, result.stderr

    def reject(token):
        raise AssertionError(f"non-standard JSON token {token}")

    assert json.loads(result.stdout, parse_constant=reject) == {"host": {"hostname": "h\ufffd"}, "x": "NaN"}


def test_selftest_json_stdout_is_only_json(tmp_path, no_gpu):
    result = invoke("selftest", "--tp", "2", "--steps", "2", "--artifacts", str(tmp_path), "--json", "-")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)  # nothing but JSON on stdout
    assert doc["schema"] == "repro.report/1"
    assert doc["trials"][0]["outcome"] == "CLEAN"


def test_vllm_audit_cli_states_and_require(tmp_path):
    from fixtures_audit import make_wheel, source_files, write_tree

    # 0.28-like: #43909 and #50074 present, #57954 absent.
    tree = write_tree(tmp_path / "src", source_files(refresh="none"), version="0.28.0")
    result = invoke("vllm-audit", "--path", str(tree), "--json", "-")
    assert result.exit_code == 0, result.stderr
    states = {c["fix_id"]: c["state"] for c in json.loads(result.stdout)["checks"]}
    assert states == {
        "43909": "present",
        "50074": "present",
        "57954": "absent",
        "55341": "not-applicable",
        "53508": "not-applicable",
    }
    wheel = make_wheel(tmp_path / "vllm-0.28.0-py3-none-any.whl", source_files(refresh="none"), "0.28.0")
    assert invoke("vllm-audit", "--wheel", str(wheel), "--require", "50074").exit_code == 0
    failed = invoke("vllm-audit", "--wheel", str(wheel), "--require", "57954")
    assert failed.exit_code == 1 and "57954" in failed.stderr
    assert "99999" in one_line_error(invoke("vllm-audit", "--wheel", str(wheel), "--require", "99999"))


def test_vllm_audit_cli_unknown_fails_a_requirement(tmp_path):
    from fixtures_audit import source_files, write_tree

    # The wake-up hook calls code the rule cannot read: #53508 is unknown, and a gate on it fails.
    tree = write_tree(tmp_path / "src", source_files(v2={"capture": "locked", "wake": "unreadable"}))
    result = invoke("vllm-audit", "--path", str(tree), "--require", "55341", "--json", "-")
    assert result.exit_code == 0, result.stderr
    states = {c["fix_id"]: c["state"] for c in json.loads(result.stdout)["checks"]}
    assert (states["55341"], states["53508"]) == ("present", "unknown")
    failed = invoke("vllm-audit", "--path", str(tree), "--require", "53508")
    assert failed.exit_code == 1 and "53508" in failed.stderr
    assert "unknown" in failed.stdout


def test_parent_never_imports_torch_before_spawning():
    """The CLI, planning and the trial runner stay torch-free: a CUDA torch import takes seconds,
    and every one of them would come before the first rank starts (time to verdict). The parent
    talks to the ranks through repro.run.protocol only, never importing the worker's entry module
    (nor the rank server's: it imports torch in its own process)."""
    code = (
        "import sys, repro.__main__, repro.cli, repro.run.runner, repro.run.isolate, repro.run.launch, repro.run.matrix\n"
        "from repro.run.runner import plan\n"
        "plan('gemma4-mtp', None, {'device': 'cpu', 'tp': 2}, [], 0)\n"
        "print(sorted(m for m in sys.modules if m in ('torch', 'repro.rank.worker', 'repro.rank.server')"
        " or m.startswith('torch.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.stdout.strip() == "[]"


def test_report_on_stdout_progress_and_warnings_on_stderr(tmp_path, no_gpu):
    result = invoke(
        "gemma4-mtp",
        "--mode",
        "fixed",
        "--tp",
        "1",
        "--steps",
        "1",
        "--guard",
        "off",
        "--forensics",
        "--artifacts",
        str(tmp_path),
    )
    assert result.exit_code == 0, result.stderr
    assert "1/1 trials met their expectation" in result.stdout  # `> report.txt` keeps it
    assert "gemma4-mtp · fixed · tp=1" in result.stdout
    report = re.sub(r"[│\s]+", " ", result.stdout)  # lines joined across the panel's wraps
    assert "guard was off: a stale capture could not have been detected" in report
    assert "--forensics was ignored" in report
    assert "trials met their expectation" not in result.stderr
    assert "started" in result.stderr and "finished CLEAN" in result.stderr  # progress
    warnings = [line for line in result.stderr.splitlines() if line.startswith("repro: warning:")]
    assert len(warnings) == 2
    assert "--guard off on CPU" in warnings[0] and "cannot be detected" in warnings[0]
    assert "--forensics is ignored on CPU" in warnings[1]


def test_json_dash_moves_the_human_report_to_stderr(tmp_path, no_gpu):
    result = invoke("selftest", "--steps", "1", "--artifacts", str(tmp_path), "--json", "-")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["trials"][0]["device"] == "cpu"
    assert "1/1 trials met their expectation" in result.stderr


def test_doctor_table_goes_to_stdout():
    result = invoke("doctor")
    assert result.exit_code == 0
    assert "torch" in result.stdout and result.stderr == ""


def test_whole_run_keeps_the_parent_torch_free_and_takes_torch_facts_from_rank_0(tmp_path):
    """Also while trials run and the report's environment is taken: torch's facts come from
    rank 0's runtime record, not from an import in the parent."""
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from repro.run.runner import plan, run_planned\n"
        "p = plan('selftest', None, {'device': 'cpu', 'tp': 1, 'steps': 1}, [], 0)\n"
        f"r = run_planned([p], Path({str(tmp_path)!r}))\n"
        "print(json.dumps([r.report.environment['torch'], r.report.environment['summary'],"
        " r.report.trials[0].runtime, sorted(m for m in sys.modules if m == 'torch')]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    env_torch, summary, runtime, imported = json.loads(out.stdout)
    import torch

    assert imported == []
    assert env_torch == runtime and runtime["version"] == torch.__version__ and runtime["error"] is None
    assert runtime["cuda"] == torch.version.cuda
    assert f"torch {torch.__version__}" in summary


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--json", "/proc/repro-x.json"], "--json /proc/repro-x.json: cannot create files in /proc"),
        (["--json", "{tmp}"], "is a directory"),
        (["--junit", "{file}/x.xml"], "is a file, not a directory"),
        (["--html", "{tmp}"], "is a directory"),
        (["--artifacts", "{file}/arts"], "is a file, not a directory"),
        (["--artifacts", "{file}"], "exists and is not a directory"),
        (["--deadline", "inf"], "deadline_s = inf must be > 0 and at most 604800 seconds"),
        (["--deadline", "1e15"], "at most 604800 seconds"),
        (["--deadline", "inf", "--print-config"], "deadline_s = inf"),
    ],
)
def test_bad_outputs_and_bounds_fail_before_any_trial(args, needle, tmp_path, no_gpu):
    (tmp_path / "f").write_text("x")
    args = [a.format(tmp=tmp_path, file=tmp_path / "f") for a in args]
    base = ["gemma4-mtp", "--device", "cpu", "--artifacts", str(tmp_path / "arts")]
    result = invoke(*base, *args)
    assert needle in one_line_error(result)
    assert not (tmp_path / "arts").exists()  # refused before any trial started


def test_matrix_checks_outputs_before_any_trial(tmp_path, no_gpu):
    assert "is a directory" in one_line_error(
        invoke("matrix", "--json", str(tmp_path), "--artifacts", str(tmp_path / "arts"))
    )
    assert not (tmp_path / "arts").exists()


def test_non_utf8_config_is_one_line(tmp_path):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('scenario = "gemma4-mtp"\ndescription = "caf\xe9"\n'.encode("latin-1"))
    assert "not UTF-8 text (byte 0xe9" in one_line_error(invoke("gemma4-mtp", "--config", str(bad)))


def test_sizes_that_cannot_fit_are_refused_up_front(tmp_path, no_gpu, monkeypatch):
    # CPU: a trillion-parameter expert set against this host's memory.
    result = invoke(
        "nvfp4-reload",
        "--config",
        "qwen3-30b-a3b-moe",
        "--device",
        "cpu",
        "--set",
        "model.num_experts=1000000",
        "--artifacts",
        str(tmp_path),
        "--json",
        "-",
    )
    assert result.exit_code == 3, result.stderr
    trial = json.loads(result.stdout)["trials"][0]
    assert trial["outcome"] == "UNSUPPORTED"
    assert "needs at least 28,839.1 GiB of host memory (lower bound)" in trial["first_failure"]["detail"]
    # GPU: the real preset at 100000 experts against an 80 GiB GPU (NVML's numbers).
    monkeypatch.setattr(repro.env.gpus, "gpu_count", lambda *a, **k: 1)
    monkeypatch.setattr(repro.env.gpus, "visible_memory", lambda *a, **k: [80 << 30])
    result = invoke(
        "nvfp4-reload",
        "--device",
        "cuda",
        "--set",
        "model.num_experts=100000",
        "--artifacts",
        str(tmp_path),
        "--json",
        "-",
    )
    assert result.exit_code == 3, result.stderr
    detail = json.loads(result.stdout)["trials"][0]["first_failure"]["detail"]
    assert "needs at least 2,883.9 GiB of GPU memory per rank" in detail and "has 80.0 GiB" in detail
    # The real preset itself fits that GPU.
    cfg = json.loads(invoke("nvfp4-reload", "--device", "cuda", "--print-config").stdout)
    assert cfg["device"] == "cuda"


def test_injected_fault_exits_1_not_met(tmp_path, no_gpu):
    result = invoke(
        "gemma4-mtp",
        "--device",
        "cpu",
        "--tp",
        "2",
        "--mode",
        "fixed",
        "--expect",
        "reproduced",
        "--inject-fault",
        "ima-message@0:0",
        "--steps",
        "1",
        "--artifacts",
        str(tmp_path),
        "--json",
        "-",
    )
    assert result.exit_code == 1, result.stderr
    trial = json.loads(result.stdout)["trials"][0]
    assert trial["outcome"] == "ILLEGAL_ADDRESS" and trial["met"] is False
    assert trial["injected_fault"] == {"kind": "ima-message", "rank": 0, "step": 0, "fired": True}
    report = re.sub(r"[│\s]+", " ", result.stderr)
    assert "injected fault ima-message on rank 0 at step 0 (fired; test hook): never counts as reproducing" in report


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["gemma4-mtp", "--json", "{tmp}/missing/dir/x.json"],
            "directory {tmp}/missing/dir does not exist; create it first",
        ),
        (["gemma4-mtp", "--html", "{tmp}/missing/x.html"], "directory {tmp}/missing does not exist"),
        (["gemma4-mtp", "--artifacts", "{tmp}/missing/arts"], "directory {tmp}/missing does not exist"),
        (["gemma4-mtp", "--json", "{tmp}/r", "--html", "{tmp}/r"], "--json and --html are the same file"),
        (["matrix", "--junit", "{tmp}/r", "--json", "{tmp}/./r"], "--json and --junit are the same file"),
        (["gemma4-mtp", "--print-config", "--json", "-"], "--print-config runs no trial, so --json would be ignored"),
        (
            ["gemma4-mtp", "--print-config", "--html", "{tmp}/r.html", "--artifacts", "{tmp}"],
            "so --html, --artifacts would be ignored",
        ),
        (["matrix", "--list", "--junit", "{tmp}/r.xml"], "--list runs no trial, so --junit would be ignored"),
        (["doctor", "--json", "{tmp}/missing/d.json"], "directory {tmp}/missing does not exist"),
        (["vllm-audit", "--json", "{tmp}/missing/a.json"], "directory {tmp}/missing does not exist"),
        (["watch", "--json", "{tmp}/missing/w.json", "--", "true"], "directory {tmp}/missing does not exist"),
        (["watch", "--json", "{tmp}/w", "--html", "{tmp}/w", "--", "true"], "--json and --html are the same file"),
    ],
)
def test_output_paths_that_would_surprise_are_refused(args, needle, tmp_path, no_gpu):
    args = [a.format(tmp=tmp_path) for a in args]
    before = sorted(tmp_path.iterdir())
    assert needle.format(tmp=tmp_path) in one_line_error(invoke(*args))
    assert sorted(tmp_path.iterdir()) == before  # nothing created, no directory grown


def test_default_run_folder_that_cannot_be_made_names_its_cause(tmp_path, monkeypatch, no_gpu):
    # A cache path under a regular file: no user (root included) can make the folder there.
    (tmp_path / "f").write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "f" / "cache"))
    line = one_line_error(invoke("gemma4-mtp", "--device", "cpu", "--steps", "1"))
    assert f"cannot create the run folder {tmp_path}/f/cache/repro/runs" in line
    assert f"{tmp_path}/f is a file, not a directory" in line and "XDG_CACHE_HOME" in line
    assert "--artifacts DIR" in line and not line.startswith("repro: error: --artifacts")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["gemma4-mtp", "--config", "."], "config . is a directory; give a preset name"),
        (
            ["matrix", "--config", "gemma4-tiny"],
            "a scenario preset (for gemma4-mtp), not a matrix; run it with `repro gemma4-mtp --config gemma4-tiny`",
        ),
        (["gemma4-mtp", "--config", "ci-smoke"], "a matrix, not a scenario preset; run it with `repro matrix"),
        (["nvfp4-reload", "--tp", "2"], "nvfp4-reload has no --tp option; --tp belongs to gemma4-mtp, selftest"),
        (["gemma4-mtp", "--tp", "0", "--device", "cpu"], "repro: error: --tp 0: tp = 0 must be >= 1"),
        (["gemma4-mtp", "--set", "run.steps=0", "--device", "cpu"], "repro: error: --set run.steps=0: steps = 0"),
        (["gemma4-mtp", "--stall", "0", "--device", "cpu"], "repro: error: --stall 0.0: stall_s = 0.0 must be > 0"),
    ],
)
def test_messages_point_at_what_the_user_did(args, needle):
    line = one_line_error(invoke(*args))
    assert needle in line
    assert "gemma4-tiny: tp" not in line and "Possible options" not in line


def test_matrix_help_names_no_option_it_lacks():
    text = invoke("matrix", "--help").stdout
    assert "--expect" not in text and "the matrix file's expect" in text


def test_small_truths_of_a_cpu_run(tmp_path, no_gpu):
    """--share-gpu on a machine without GPUs is said to do nothing; the step table's count is
    tokens (beside the graph a step used), and progress past the last step says finishing."""
    result = invoke("gemma4-mtp", "--tp", "2", "--steps", "2", "--share-gpu", "--artifacts", str(tmp_path))
    assert result.exit_code == 0, result.stderr
    assert "repro: warning: --share-gpu has no effect on CPU" in result.stderr
    assert "· tokens " in result.stdout or " tokens " in result.stdout
    assert "· batch " not in result.stdout
    assert "2/2 steps done · finishing" in result.stderr and "2/2 steps done · running" not in result.stderr


def test_guard_raise_failure_text_ends_with_its_sentence(tmp_path, no_gpu):
    result = invoke(
        "gemma4-mtp", "--tp", "2", "--steps", "1", "--guard", "raise", "--artifacts", str(tmp_path), "--json", "-"
    )
    detail = json.loads(result.stdout)["trials"][0]["first_failure"]["detail"]
    assert detail.startswith("StaleCaptureError:") and detail.endswith("re-capture after it changes.")


def test_clip_never_ends_mid_sentence():
    from repro.run.isolate import clip

    text = "First sentence is here. " * 40
    out = clip(text, 100)
    assert len(out) <= 102 and out.endswith("here. …")
    assert clip("one two three four five six", 15) == "one two three …"
    assert clip("short", 100) == "short"


def test_a_real_dims_preset_on_cpu_is_estimated_before_it_starts(tmp_path, no_gpu):
    """`--config gemma4-e2b` on CPU took 94 s with no word that it would be slow: the run says
    up front how long it should take here and whether that fits its deadline."""
    result = invoke("gemma4-mtp", "--config", "gemma4-e2b", "--deadline", "1", "--artifacts", str(tmp_path))
    warning = next(l for l in result.stderr.splitlines() if l.startswith("repro: warning: gemma4-e2b on CPU"))
    assert "about 1-9 min for 14 steps, past its 1 s deadline (DEADLINE: no verdict)" in warning
    assert "gemma4-tiny is the CPU-sized preset, --deadline 540 gives it the time" in warning
    assert result.stderr.index(warning) < result.stderr.index("started")


@pytest.mark.parametrize(
    "scenario,preset,run,needle",
    [
        ("gemma4-mtp", "gemma4-e2b", {}, "about 1-9 min for 14 steps, maybe past its 180 s deadline"),
        ("gemma4-mtp", "gemma4-e4b", {}, "gemma4-e4b on CPU: real model dimensions"),  # its sibling, as slow
        ("gemma4-mtp", "gemma4-e2b", {"steps": 1, "deadline_s": 600}, "about 23-92 s for 1 step, within its 600 s"),
        ("nvfp4-reload", "qwen3-30b-a3b-moe", {}, "(qwen3-30b-a3b-moe measured on a shared 2-core CPU"),
        ("gemma4-mtp", "gemma4-tiny", {}, None),
        ("nvfp4-reload", "moe-tiny", {}, None),
        ("sleep-wake", "sleep-wake-e2b", {}, "sleep-wake-e2b on CPU: real model dimensions, slow here"),
        ("sleep-wake", "sleep-wake-tiny", {}, None),
    ],
)
def test_cpu_estimate_is_the_scenarios_own_and_only_for_real_sizes(scenario, preset, run, needle):
    from repro.cli import cpu_warnings
    from repro.run.runner import plan

    warnings = cpu_warnings([plan(scenario, preset, {"device": "cpu", **run}, [], gpus=0)])
    if needle is None:
        assert warnings == []
    else:
        [warning] = warnings
        assert needle in warning
        other = "gemma4-e2b" if scenario == "nvfp4-reload" else "qwen3"
        assert other not in warning  # never another scenario's numbers
