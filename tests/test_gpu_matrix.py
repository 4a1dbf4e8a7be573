"""GPU outcome tables: the matrix presets run for real, and their shape is asserted.

gpu-2 (2 GPUs): gemma4-mtp at E2B dims, TP 1 and 2, every after-free value and the reload
lifecycle; nvfp4-reload at Qwen3-30B-A3B MoE dims. gpu-1: the TP=1 half, and piecewise-split
at Llama 3 8B dims (every after-free value). Set
REPRO_REPORT_DIR to keep the JSON report of the run.
"""

import os
from pathlib import Path

import pytest

from repro import report
from repro.env.gpus import gpu_count
from repro.run.matrix import load_matrix
from repro.outcome import REPRODUCED, Outcome
from repro.run.runner import run_planned

SYMPTOMS = REPRODUCED - {Outcome.STALE_CAPTURE}


def run_matrix(name, gpus, tmp_path):
    if gpu_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs")
    _, planned = load_matrix(name, gpu_count())
    # Four trials at a time, as `repro matrix --jobs 4` runs them: the tables must not depend on it.
    result = run_planned(planned, tmp_path, jobs=4)
    out = os.environ.get("REPRO_REPORT_DIR")
    if out:
        report.write_json(result.report, Path(out) / f"matrix-{name}.json")
    return result.report.trials


def key(t):
    r = t.config["run"]
    return (t.scenario, t.mode, r["tp"], r["after_free"], r["reload_drafter"], r["identity_reload"])


# Deep checks that run before the first replay: after set-up (or a reload), then before it.
FIRST_CHECKS = ("after set-up", "after drafter reload", "after reload 0", "before replay, step 0")


def finding_before_first_replay(t, needle):
    return any(f.when in FIRST_CHECKS and needle in f.slot and f.status == "freed" for f in t.guard_findings)


def assert_gemma_shape(trials):
    for t in trials:
        s, mode, tp, af, reload, _ = key(t)
        if s != "gemma4-mtp":
            continue
        if mode == "unfixed" and tp > 1:
            if af == "keep":
                assert t.outcome == Outcome.STALE_CAPTURE, key(t)  # memory untouched: latent
            else:
                assert t.outcome in SYMPTOMS, (key(t), t.outcome)  # every other value shows it
            assert finding_before_first_replay(t, "lm_head_weight"), key(t)
        elif mode == "fixed" and reload and tp > 1:
            assert t.outcome in REPRODUCED, key(t)  # upstream fix + drafter reload
        else:
            assert t.outcome == Outcome.CLEAN, (key(t), t.outcome)  # fixed, reload-safe, TP=1
            assert not t.guard_findings, key(t)
        assert t.graph_replayed, key(t)
        assert_speculative(t)


def assert_speculative(t):
    """Whatever the drafter read, the text is the target's; only healthy drafts are accepted."""
    if t.outcome in (Outcome.ILLEGAL_ADDRESS, Outcome.DEVICE_ASSERT):
        return  # the engine died: no text
    rate = t.measures["acceptance_rate"]
    assert t.measures["lossless"] is True, key(t)
    if t.outcome in (Outcome.CLEAN, Outcome.STALE_CAPTURE):
        assert rate >= 0.5, (key(t), rate)
    elif t.outcome in (Outcome.MISMATCH, Outcome.NONFINITE):
        assert rate < 0.1, (key(t), rate)  # garbage drafts rejected


def assert_moe_shape(trials):
    for t in trials:
        s, mode, _, af, _, identity = key(t)
        if s != "nvfp4-reload":
            continue
        if mode == "unfixed":
            assert t.outcome in REPRODUCED, key(t)
            assert finding_before_first_replay(t, "moe_kernel"), key(t)
            if af == "poison":
                assert t.outcome == Outcome.NONFINITE, key(t)  # the upstream symptom
        elif mode == "kernel-reuse" and not identity:
            assert t.outcome == Outcome.MISMATCH, key(t)
            assert not t.guard_findings  # nothing freed: numeric bug
        else:
            assert t.outcome == Outcome.CLEAN, (key(t), t.outcome)
            assert all(s.rel_err is not None and s.rel_err < s.tolerance / 10 for s in t.steps), key(t)


def assert_split_shape(trials):
    for t in trials:
        s, mode, _, _, _, _ = key(t)
        if s != "piecewise-split":
            continue
        if mode == "unfixed":
            assert t.outcome in SYMPTOMS, (key(t), t.outcome)  # no value hides it at 8B dims
            assert finding_before_first_replay(t, "<local attn_out of capture_after"), key(t)
        else:
            assert t.outcome == Outcome.CLEAN and not t.guard_findings, (key(t), t.outcome)
            assert all(s.rel_err == 0.0 for s in t.steps), key(t)  # replay == eager, bit for bit


@pytest.mark.multi_gpu
def test_gpu2_matrix(tmp_path):
    trials = run_matrix("gpu-2", 2, tmp_path)
    assert_gemma_shape(trials)
    assert_moe_shape(trials)
    assert all(t.met for t in trials), [(t.id, t.outcome.value) for t in trials if not t.met]


@pytest.mark.gpu
def test_gpu1_matrix(tmp_path):
    if gpu_count() >= 2:
        pytest.skip("gpu-2 covers this on a 2-GPU machine")
    trials = run_matrix("gpu-1", 1, tmp_path)
    assert_gemma_shape(trials)
    assert_moe_shape(trials)
    assert_split_shape(trials)
    assert all(t.met for t in trials), [(t.id, t.outcome.value) for t in trials if not t.met]
