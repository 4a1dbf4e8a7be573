"""piecewise-split (vLLM #53915, #37363): piecewise graphs around an eager split op whose output
is fresh every step. CPU: the scenario in this process and through the CLI and the isolated
runner; GPU (marked gpu): each mode and after-free value on CUDA at Llama 3 8B dims."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from scenario_run import Records, run_in_process
from repro.cli import app
from repro.scenarios.compare import compare
from repro.config import load_preset, validate
from repro.diagnose.guard import CaptureGuard
from repro.outcome import Outcome
from repro.scenarios import piecewise_split as ps
from repro.scenarios.piecewise_split_spec import DecoderDims, footprint

CPU = torch.device("cpu")
TINY = DecoderDims(
    hidden_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    rope_theta=10000.0,
    context_len=32,
    batch_sizes=[1, 2, 4],
)
SPLIT_OUTPUT = "<local attn_out of capture_after, created by aten.bmm"
runner = CliRunner()


def drive(tmp_path: Path, mode: str, guard: str = "warn", steps: int = 6) -> Records:
    """Run the scenario in this process, exactly as a worker would, and read its records back."""
    cfg = validate(load_preset("llama-tiny"))
    cfg.run.mode, cfg.run.guard, cfg.run.steps = mode, guard, steps
    return run_in_process(tmp_path / f"{mode}-{guard}", cfg, ps)


@dataclass
class FakeContext:
    """What capture_size reads of a WorkerContext, on CPU."""

    cfg: Any
    guard: Any
    census: Any = None

    def replaying(self, graph: str) -> None:
        pass


def captured(mode: str, dims: DecoderDims = TINY) -> ps.Engine:
    """An engine with every size's pieces captured (a dry run on CPU) and its cache prefilled."""
    engine = ps.build_engine(dims, ps.MODES[mode], 0, CPU)
    ctx = FakeContext(cfg=type("Cfg", (), {"model": dims}), guard=CaptureGuard(mode="off"))
    for size in sorted(dims.batch_sizes, reverse=True):
        ps.capture_size(ctx, engine, size)
    engine.cache.prefill(0)
    return engine


def feed(engine: ps.Engine, step: int, size: int) -> int:
    pos = ps.decode_position(TINY, step)
    engine.input_ids[:size].copy_(ps.make_tokens(TINY, 0, step, size, CPU))
    engine.positions[:size].fill_(pos)
    return pos


# ------------------------------------------------------------------------ configs


def test_presets_have_llama3_8b_dims_and_a_tiny_twin():
    real = validate(load_preset("llama3-8b"))
    assert real.scenario == "piecewise-split" and real.run.after_free == "reuse" and real.run.steps == 16
    m = real.model
    assert (
        m.hidden_size,
        m.num_layers,
        m.num_heads,
        m.num_kv_heads,
        m.head_dim,
        m.intermediate_size,
        m.vocab_size,
        m.rope_theta,
    ) == (4096, 32, 32, 8, 128, 14336, 128256, 500000.0)
    assert m.batch_sizes == [1, 2, 4, 8, 16, 32, 64, 128]
    tiny = validate(load_preset("llama-tiny"))
    assert tiny.model == TINY and tiny.run.steps == 2 * len(TINY.batch_sizes)  # every size twice


def test_footprint_counts_what_the_engine_holds():
    engine = ps.build_engine(TINY, ps.MODES["unfixed"], 0, CPU)
    weights = sum(p.nbytes for p in engine.model.parameters())
    logits = max(TINY.batch_sizes) * TINY.vocab_size * 2
    assert footprint(TINY, 1) == weights + engine.cache.k.nbytes + engine.cache.v.nbytes + logits
    assert 18 * 2**30 < footprint(validate(load_preset("llama3-8b")).model, 1) < 20 * 2**30


# ------------------------------------------------------------------------ the mode difference


def test_the_mode_difference_is_the_marked_lines():
    source = inspect.getsource(ps.SplitAttention)
    marked = [line for line in source.splitlines() if "# fix (#53915)" in line]
    assert len(marked) == 6
    # Every line that reads the fix flag or the static buffers is a marked line.
    for line in source.splitlines():
        if "self.fixes.static_output" in line or "self.outputs" in line or "static_output(" in line:
            assert "# fix (#53915)" in line, line


@pytest.mark.parametrize("mode, fresh", [("unfixed", True), ("fixed", False)])
def test_split_output_is_a_new_tensor_each_call_only_when_unfixed(mode, fresh):
    engine = captured(mode)
    model, size, pos = engine.model, 2, feed(engine, 0, 2)
    _, q, k, v = model.piece(0, engine.input_ids[:size], None, engine.positions[:size])
    first = engine.split(0, q, k, v, pos)
    first_ptr, first_values = first.data_ptr(), first.clone()
    second = engine.split(0, q, k, v, pos)  # held: the first is still alive
    assert (second.data_ptr() != first_ptr) == fresh
    assert torch.equal(second, first_values)  # same values either way
    assert (first_ptr == engine.captured_at[size][0]) == (not fresh)


def test_capture_records_one_split_address_per_layer_and_size():
    for mode in ("unfixed", "fixed"):
        engine = captured(mode)
        assert sorted(engine.pieces) == TINY.batch_sizes
        assert all(len(engine.pieces[b]) == TINY.num_layers + 1 for b in TINY.batch_sizes)
        assert all(len(engine.captured_at[b]) == TINY.num_layers for b in TINY.batch_sizes)
    assert {b: t.data_ptr() for b, t in engine.split.outputs.items()} == {
        b: engine.captured_at[b][0] for b in TINY.batch_sizes
    }  # fixed: one buffer per size


# ------------------------------------------------------------------------ the forward


@pytest.mark.parametrize("mode", ["unfixed", "fixed"])
def test_piecewise_forward_equals_the_eager_reference(mode):
    engine = captured(mode)
    for step, size in enumerate([4, 1, 2]):
        pos = feed(engine, step, size)
        decoded = ps.decode(engine, size, pos)  # CPU: the pieces run eagerly
        assert not decoded.replayed
        assert torch.equal(decoded.hidden, ps.decode_eager(engine, size, pos))


def stale_forward(engine: ps.Engine, size: int, pos: int, layer: int, stale: torch.Tensor) -> torch.Tensor:
    """What a replay computes when piece layer+1 reads `stale` instead of layer's split output."""
    model, positions = engine.model, engine.positions[:size]
    out = model.piece(0, engine.input_ids[:size], None, positions)
    for j in range(TINY.num_layers):
        x, q, k, v = out
        attn = ps.attend(engine.cache, j, q, k, v, pos)
        out = model.piece(j + 1, x, stale if j == layer else attn, positions)
    return out[0]


@pytest.mark.parametrize("layer", range(TINY.num_layers))
def test_one_stale_split_read_is_far_beyond_the_tolerance(layer):
    """What each after-free value leaves in the capture-time block, read by one piece at one
    layer: another call's attention output (keep: the program's own reuse), the knob's
    N(0, 0.05) bf16 fill (reuse), 0xFF bytes (poison: NaN)."""
    engine = captured("unfixed")
    size = 4
    pos = feed(engine, 1, size)
    other = ps.attend(
        engine.cache,
        (layer + 1) % TINY.num_layers,
        *engine.model.piece(0, engine.input_ids[:size], None, engine.positions[:size])[1:],
        pos,
    )
    ref = ps.decode_eager(engine, size, pos)
    fill = torch.empty_like(other).normal_(0.0, 0.05, generator=torch.Generator().manual_seed(0))
    for stale in (other, fill):
        cmp = compare(stale_forward(engine, size, pos, layer, stale), ref, ps.TOLERANCE)
        assert cmp.nonfinite == 0
        assert cmp.max_scaled_err > 4 * ps.TOLERANCE and cmp.mismatches >= cmp.numel // 4, (layer, cmp)
    poisoned = compare(stale_forward(engine, size, pos, layer, torch.full_like(other, float("nan"))), ref, ps.TOLERANCE)
    assert poisoned.nonfinite == poisoned.numel


def test_decode_positions_append_after_the_prompt_and_wrap():
    p = ps.prompt_len(TINY)
    assert [ps.decode_position(TINY, k) for k in (0, 1, TINY.context_len - p - 1, TINY.context_len - p)] == [
        p,
        p + 1,
        TINY.context_len - 1,
        p,
    ]


# ------------------------------------------------------------------------ the scenario, in this process


def test_unfixed_guard_names_every_freed_split_output(tmp_path):
    rec = drive(tmp_path, "unfixed")
    findings = rec.of("finding")
    assert len(findings) == TINY.num_layers * len(TINY.batch_sizes)  # one per layer and size
    assert all(
        f["slot"].startswith(SPLIT_OUTPUT) and f["status"] == "freed" and f["when"] == "after set-up" for f in findings
    )
    assert {f["graph"] for f in findings} == {
        ps.piece_label(j, b) for j in range(1, TINY.num_layers + 1) for b in TINY.batch_sizes
    }
    assert all("capture_size" in f["freed_at"] for f in findings)  # dropped where the capture loop frees it
    # Eager on CPU: the pieces read the live outputs, the numbers are right; the bug is latent.
    assert all(s["mismatches"] == 0 and s["nonfinite"] == 0 and not s["replayed"] for s in rec.steps)
    assert all(s["extra"]["wrong_tokens"] == 0 and s["extra"]["split_calls"] == TINY.num_layers for s in rec.steps)
    assert [s["batch"] for s in rec.steps] == TINY.batch_sizes * 2


def test_fixed_is_clean_and_its_split_outputs_never_move(tmp_path):
    rec = drive(tmp_path, "fixed")
    assert not rec.of("finding")
    assert all(s["mismatches"] == 0 and s["rel_err"] == 0.0 and s["extra"]["moved"] == 0 for s in rec.steps)


def test_guard_off_finds_nothing_and_changes_no_number(tmp_path):
    on, off = drive(tmp_path, "unfixed"), drive(tmp_path, "unfixed", guard="off")
    assert not off.of("finding")
    keys = ("batch", "mismatches", "nonfinite", "rel_err", "label")
    assert [{k: s[k] for k in keys} for s in on.steps] == [{k: s[k] for k in keys} for s in off.steps]


def test_records_say_it_ran_on_cpu_and_what_the_knob_did(tmp_path):
    rec = drive(tmp_path, "unfixed", steps=1)
    notes = [n["text"] for n in rec.of("note")]
    assert any(n.startswith("CPU: no CUDA graph was captured or replayed") for n in notes)
    detail: dict[str, Any] = {}
    for d in rec.of("detail"):
        detail.update(d)
    assert detail["after_free"]["knob"] == "reuse" and "no effect" in detail["after_free"]["note"]
    assert detail["dims"]["graphs"] == (TINY.num_layers + 1) * len(TINY.batch_sizes)
    assert detail["mode_fixes"] == {"static_output": False} and detail["tolerance"] == ps.TOLERANCE


# ------------------------------------------------------------------------ the CLI


def invoke(*args):
    return runner.invoke(app, list(args))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "model.num_kv_heads=3"], "model.num_heads = 4 is not a multiple of model.num_kv_heads = 3"),
        (["--set", "model.head_dim=15"], "model.head_dim = 15 must be even"),
        (["--set", "model.batch_sizes=[4, 2]"], "model.batch_sizes = [4, 2] must be positive, strictly increasing"),
        (["--set", "model.num_layers=0"], "model.num_layers = 0 must be >= 1"),
        (["--set", "model.context_len=1"], "model.context_len = 1 must be >= 2"),
        (["--mode", "kernel-reuse"], "'--mode': 'kernel-reuse' is not one of 'unfixed', 'fixed'"),
        (["--tp", "2"], "piecewise-split has no --tp option"),
        (["--config", "moe-tiny"], "preset is for scenario 'nvfp4-reload'"),
        (["--identity-reload"], "--identity-reload belongs to nvfp4-reload"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle):
    result = invoke("piecewise-split", *args, "--device", "cpu")
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("repro: error:") and needle in lines[0], result.stderr


def test_print_config_on_cpu_is_the_tiny_preset(no_gpu):
    result = invoke("piecewise-split", "--print-config")
    assert result.exit_code == 0, result.stderr
    cfg = json.loads(result.stdout)
    assert cfg["preset"] == "llama-tiny" and cfg["device"] == "cpu" and cfg["run"]["after_free"] == "reuse"


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, expect, code, outcome",
    [
        ("unfixed", None, 0, "STALE_CAPTURE"),  # reproduced: the guard's verdict on CPU
        ("fixed", None, 0, "CLEAN"),
        ("unfixed", "clean", 1, "STALE_CAPTURE"),  # an expectation it does not meet
    ],
)
def test_cli_runs_each_mode_with_its_exit_code(tmp_path, no_gpu, mode, expect, code, outcome):
    args = ["piecewise-split", "--mode", mode, "--steps", "3", "--artifacts", str(tmp_path), "--json", "-"]
    result = invoke(*args, *(["--expect", expect] if expect else []))
    assert result.exit_code == code, (result.stdout, result.stderr)
    trial = json.loads(result.stdout)["trials"][0]
    assert trial["outcome"] == outcome and trial["device"] == "cpu" and not trial["graph_replayed"]
    assert len(trial["steps"]) == 3 and all("moved" in s["extra"] for s in trial["steps"])
    assert "Split op:" in result.stderr and "CPU: no piece was replayed" in result.stderr  # its report line


# ------------------------------------------------------------------------ through the isolated runner

CPU_OUTCOMES = {"unfixed": Outcome.STALE_CAPTURE, "fixed": Outcome.CLEAN}


@pytest.mark.slow
def test_ci_smoke_trials_meet_their_expectations(tmp_path):
    from repro.run.matrix import load_matrix
    from repro.run.runner import run_planned

    _, planned = load_matrix("ci-smoke", 0)
    mine = [p for p in planned if p.cfg.scenario == "piecewise-split"]
    assert {p.cfg.run.mode for p in mine} == set(CPU_OUTCOMES)
    result = run_planned(mine, tmp_path, jobs=len(mine))
    for trial in result.report.trials:
        assert trial.outcome == CPU_OUTCOMES[trial.mode] and trial.met, (trial.id, trial.first_failure)
        assert not trial.graph_replayed and trial.device == "cpu"


# ------------------------------------------------------------------------ GPU

# Llama 3 8B dims on one GPU, the preset's 16 steps: (mode, after-free) -> the outcome
# (docs/RESULTS.md, measured on an H200). keep and release: the program's own allocations decide.
# Batch 64's fresh outputs never land where its graphs read (another call's values: MISMATCH in
# both rounds), and in the second round batch 32's captured block holds non-finite bytes that
# another eager tensor left there (NONFINITE, the trial's worst step); the other 13 steps read
# this step's values by accident. release returns nothing: the freed blocks share their 2 MiB
# segment with live tensors. reuse and poison take the freed blocks before the first replay.
GPU_OUTCOMES = {
    ("unfixed", "keep"): Outcome.NONFINITE,
    ("unfixed", "release"): Outcome.NONFINITE,
    ("unfixed", "reuse"): Outcome.MISMATCH,
    ("unfixed", "poison"): Outcome.NONFINITE,
    ("fixed", "keep"): Outcome.CLEAN,
    ("fixed", "reuse"): Outcome.CLEAN,
    ("fixed", "poison"): Outcome.CLEAN,
}
GPU_STEPS = 16


@pytest.fixture(scope="module")
def gpu_trials(tmp_path_factory):
    from repro.env.gpus import gpu_count
    from repro.run.runner import plan, run_planned

    if gpu_count() < 1 or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    planned = [
        plan("piecewise-split", "llama3-8b", {"device": "cuda", "mode": mode, "after_free": knob}, [], gpus=1)
        for mode, knob in GPU_OUTCOMES
    ]
    result = run_planned(planned, tmp_path_factory.mktemp("piecewise-gpu"), jobs=4)
    return dict(zip(GPU_OUTCOMES, result.report.trials))


@pytest.mark.gpu
@pytest.mark.parametrize("mode, knob", list(GPU_OUTCOMES))
def test_gpu_outcome(gpu_trials, mode, knob):
    t = gpu_trials[(mode, knob)]
    assert t.outcome == GPU_OUTCOMES[(mode, knob)], (t.outcome, t.first_failure, t.notes)
    assert t.graph_replayed and t.device == "cuda" and len(t.steps) == GPU_STEPS
    if mode == "fixed":
        assert not t.guard_findings
        assert all(s.rel_err == 0.0 and s.extra["moved"] == 0 and s.extra["wrong_tokens"] == 0 for s in t.steps)
        return
    # The captured split outputs are named, freed, before the first replay, by the guard and the census.
    before = [f for f in t.guard_findings if f.when == "after set-up" and f.status == "freed"]
    assert any(f.slot.startswith(SPLIT_OUTPUT) and f.mechanism == "both" for f in before), t.guard_findings[:3]
    if knob in ("reuse", "poison"):
        # The knob's fill holds the capture-time blocks: every fresh output lands elsewhere.
        assert t.details["after_free"]["landed"] == t.details["after_free"]["blocks"] >= 1
        assert all(s.extra["moved"] == s.extra["split_calls"] for s in t.steps)
        assert all(
            s.nonfinite == s.numel if knob == "poison" else s.mismatches and s.extra["wrong_tokens"] for s in t.steps
        )
    else:
        # A replay is wrong exactly when a split output was not where its graph reads.
        assert t.details["after_free"]["released_bytes"] == 0
        assert 0 < sum(bool(s.extra["moved"]) for s in t.steps) < len(t.steps)
        assert all(bool(s.mismatches or s.nonfinite) == bool(s.extra["moved"]) for s in t.steps)


def allocator_block_at(addr: int) -> tuple[int, int, str, str]:
    """(start, size, segment type, state) of the caching-allocator block holding addr."""
    for seg in torch.cuda.memory_snapshot():
        start = seg["address"]
        for block in seg["blocks"]:
            if start <= addr < start + block["size"]:
                return start, block["size"], seg["segment_type"], block["state"]
            start += block["size"]
    raise AssertionError(f"no allocator block holds {addr:#x}")


@pytest.mark.gpu
def test_after_free_covers_a_small_pool_region_above_one_mib(cuda_only):
    """Freed small blocks coalesce into a free region of a 2 MiB small segment larger than 1 MiB
    (the split outputs' blocks do at Llama 3 8B dims): a request of its size goes to the large
    pool and never lands there, so the knob covers it in pieces of at most 1 MiB."""
    from repro.rank.graphs import land_on, land_over

    dev, part = torch.device("cuda"), 384 * 1024
    held = [torch.empty(part, dtype=torch.uint8, device=dev) for _ in range(32)]
    ptrs = [t.data_ptr() for t in held]
    run = next(i for i in range(len(held) - 4) if all(ptrs[i + k + 1] == ptrs[i + k] + part for k in range(4)))
    addr = ptrs[run]
    del held[run : run + 4]  # four neighbours freed: one free block
    start, size, kind, state = allocator_block_at(addr)
    assert (kind, state) == ("small", "inactive") and start <= addr and size >= 4 * part > 1 << 20
    assert land_on(start, size, dev) is None  # a request of its size never reaches it
    pieces = land_over(start, size, dev)
    assert [t.data_ptr() for t in pieces] == list(range(start, start + size, 1 << 20))
    assert sum(t.numel() for t in pieces) == size
