"""GPU outcomes of nvfp4-reload on the real preset (Qwen3-30B-A3B MoE layer), one trial each.

Each trial runs in its own process group through repro.isolate.run_trial, as the CLI does:
a sticky CUDA error (illegal address, device assert) kills only that trial. The expected
table (BACKGROUND.md section 1, DESIGN.md "after-free knob"):

  unfixed       poison  -> NONFINITE        (dead kernel's derived scales re-allocated as NaN)
  unfixed       release -> ILLEGAL_ADDRESS  (dead workspace segment returned to the driver)
  unfixed       reuse   -> DEVICE_ASSERT or MISMATCH (garbage in the dead routing table)
  unfixed       keep    -> MISMATCH; STALE_CAPTURE under identity reload
  kernel-reuse  any     -> MISMATCH; CLEAN under identity reload
  fixed         any     -> CLEAN
"""
from __future__ import annotations

import pytest

from repro import doctor
from repro.config import AFTER_FREE, load_preset, validate
from repro.outcome import Outcome

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(doctor.gpu_count() < 1, reason="needs one CUDA GPU"),
]

PRESET = "qwen3-30b-a3b-moe"
HOPPER_NOTE_START = "Hopper: NVFP4 MoE runs as weight-only W4A16"


def trial(tmp_path, mode: str, after_free: str, identity: bool = False):
    from repro.isolate import run_trial
    cfg = validate(load_preset(PRESET))
    cfg.run.mode, cfg.run.after_free, cfg.run.identity_reload = mode, after_free, identity
    name = f"{mode}-{after_free}{'-identity' if identity else ''}"
    return run_trial(cfg, "cuda", tmp_path, name)


def explain(t) -> str:
    return f"{t.outcome.value}: {t.first_failure}; ranks {[(r.exitcode, r.error) for r in t.ranks]}"


@pytest.mark.parametrize("after_free, identity, allowed", [
    ("poison", False, {Outcome.NONFINITE}),
    ("poison", True, {Outcome.NONFINITE}),
    ("release", False, {Outcome.ILLEGAL_ADDRESS}),
    ("reuse", False, {Outcome.DEVICE_ASSERT, Outcome.MISMATCH}),
    ("keep", False, {Outcome.MISMATCH}),
    ("keep", True, {Outcome.STALE_CAPTURE}),
])
def test_unfixed_reproduces(tmp_path, after_free, identity, allowed):
    t = trial(tmp_path, "unfixed", after_free, identity)
    assert t.outcome in allowed and t.met, explain(t)
    # The guard named the dead kernel tensors before the first replay, whatever came after.
    slots = {f.slot for f in t.guard_findings}
    assert "moe.quant_method.moe_kernel.workspace13" in slots, slots
    assert all(f.status == "freed" and f.when == "before replay, step 0" for f in t.guard_findings)
    assert t.first_failure is not None and t.first_failure.step in (0, None)
    if t.outcome == Outcome.NONFINITE:
        assert t.steps[0].replayed and t.steps[0].nonfinite == t.steps[0].numel


def test_kernel_reuse_mismatches_once_weights_change(tmp_path):
    t = trial(tmp_path, "kernel-reuse", "poison")
    assert t.outcome == Outcome.MISMATCH and t.met, explain(t)
    assert not t.guard_findings and all(m.freed == 0 for m in t.manifests)
    assert len(t.steps) == 5 and all(s.replayed and s.mismatches > 0 for s in t.steps)
    assert all(s.rel_err > 0.25 for s in t.steps)


def test_kernel_reuse_identity_reload_is_clean(tmp_path):
    t = trial(tmp_path, "kernel-reuse", "poison", identity=True)
    assert t.outcome == Outcome.CLEAN and t.met, explain(t)


@pytest.mark.parametrize("after_free", AFTER_FREE)
def test_fixed_is_clean(tmp_path, after_free):
    t = trial(tmp_path, "fixed", after_free)
    assert t.outcome == Outcome.CLEAN and t.met, explain(t)
    assert t.graph_replayed and len(t.steps) == 5
    assert not t.guard_findings and all(m.freed == 0 for m in t.manifests)
    # Graph replay vs a cold eager layer on the same weights: expected bit-identical, and far
    # inside the tolerance in any case.
    assert all(s.rel_err is not None and s.rel_err < s.tolerance / 10 for s in t.steps), \
        [(s.step, s.rel_err, s.extra.get("max_scaled_err")) for s in t.steps]
    assert any(n.startswith(HOPPER_NOTE_START) for n in t.notes)
    quant = t.details["quant_reloads"]
    assert len(quant) == 5 and all(q["gbps"] and q["gbps"] > 0 for q in quant)
