"""Tests for the workspace-grow scenario (vLLM #45670 / #55336, FlashInfer #4398).

The workspace manager, the lock's error and the split-KV decode are tested directly; the scenario
runs in-process on a WorkerContext built from the real classes, its records read back as the
parent reads them; the command runs through Typer's CliRunner (real rank processes). On CPU no
graph is replayed: unfixed shows as the guard's findings (the old arena freed, or moved by
resize_()), and the eager decode through the live arena is right. The GPU test at the end runs
each mode and variant on CUDA.
"""

from __future__ import annotations

import inspect
import json
import re
import weakref
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from scenario_run import Records, run_in_process
from repro.env import gpus
from repro.cli import app
from repro.config import load_preset, validate
from repro.run.matrix import load_matrix
from repro.outcome import Outcome
from repro.scenarios import workspace_grow as wg
from repro.scenarios.workspace_grow_spec import WorkspaceDims, vllm_capture_sizes, workspace_bytes

CPU = torch.device("cpu")
TINY = WorkspaceDims(
    num_heads=4,
    num_kv_heads=2,
    head_size=16,
    num_kv_splits=4,
    max_seq_len=32,
    capture_sizes=[1, 2, 4, 8],
    initial_workspace_mib=0,
)
ARENA = "workspace._current_workspaces[0]"


def drive(tmp_path: Path, mode: str, resize: bool = False, steps: int = 2, guard: str = "warn") -> Records:
    """Run the scenario in this process, exactly as a worker would, and read its records back."""
    cfg = validate(load_preset("workspace-tiny"))
    cfg.run.mode, cfg.run.resize_in_place, cfg.run.steps, cfg.run.guard = mode, resize, steps, guard
    return run_in_process(tmp_path / f"{mode}-{'resize' if resize else 'replace'}-{guard}", cfg, wg)


# ------------------------------------------------------------------------ presets


def test_presets_hold_the_upstream_dims():
    real = validate(load_preset("turboquant-decode"))
    m = real.model
    assert real.scenario == "workspace-grow" and real.run.mode == "unfixed" and real.run.after_free == "release"
    assert (m.num_heads, m.num_kv_heads, m.head_size, m.num_kv_splits) == (32, 4, 128, 32)
    assert m.capture_sizes == vllm_capture_sizes(512) and len(m.capture_sizes) == 51
    assert m.capture_sizes[:5] == [1, 2, 4, 8, 16] and m.capture_sizes[-3:] == [480, 496, 512]
    assert m.initial_workspace_mib == 32  # FlashInfer's default cached workspace
    # The 32 MiB arena holds batches up to 56; the capture of 64 is the first to grow it.
    assert workspace_bytes(m, 56) <= 32 << 20 < workspace_bytes(m, 64)
    assert validate(load_preset("workspace-tiny")).model == TINY


def test_workspace_bytes_are_the_views_aligned_to_256():
    # mid_o [1, 4, 4, 17] + output [1, 4, 16] + lse [1, 4] fp32 -> 1088, 256, 16 bytes, each rounded up.
    assert workspace_bytes(TINY, 1) == 1280 + 256 + 256
    assert workspace_bytes(TINY, 8) == 8704 + 2048 + 256


# ------------------------------------------------------------------------ the manager


def test_views_are_slices_of_one_arena_on_256_byte_boundaries():
    ws = wg.WorkspaceManager(CPU, resize_in_place=False)
    mid_o, output, lse = ws.get_simultaneous(*wg.torch_views(TINY, 3))
    arena = ws.arena
    assert ws.size_bytes() == workspace_bytes(TINY, 3)
    assert (mid_o.shape, output.shape, lse.shape) == ((3, 4, 4, 17), (3, 4, 16), (3, 4))
    for view in (mid_o, output, lse):
        assert view.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
        assert (view.data_ptr() - arena.data_ptr()) % 256 == 0
    assert output.data_ptr() - arena.data_ptr() == 3 * 1088 // 256 * 256 + 256
    again = ws.get_simultaneous(*wg.torch_views(TINY, 2))  # smaller: the same arena, no growth
    assert ws.arena is arena and again[0].data_ptr() == mid_o.data_ptr() and len(ws.growths) == 1


def test_replacing_frees_the_old_arena():
    ws = wg.WorkspaceManager(CPU, resize_in_place=False)
    ws.get_simultaneous(*wg.torch_views(TINY, 1))
    old = weakref.ref(ws.arena)
    ws.get_simultaneous(*wg.torch_views(TINY, 8))
    assert old() is None and ws.size_bytes() == workspace_bytes(TINY, 8)
    assert [g.how for g in ws.growths] == ["allocate", "replace"]


def test_resize_in_place_keeps_the_tensor_and_moves_its_storage():
    ws = wg.WorkspaceManager(CPU, resize_in_place=True)
    ws.get_simultaneous(*wg.torch_views(TINY, 1))
    arena, before = ws.arena, ws.arena.data_ptr()
    arena.fill_(7)
    ws.get_simultaneous(*wg.torch_views(TINY, 8))
    assert ws.arena is arena and arena.data_ptr() != before  # the same tensor, new memory
    assert bool((arena[: workspace_bytes(TINY, 1)] == 7).all())  # resize_ copied the old bytes
    assert [g.how for g in ws.growths] == ["allocate", "resize_"]


def test_the_lock_refuses_growth_with_the_sizes_and_the_fix():
    ws = wg.WorkspaceManager(CPU, resize_in_place=False, initial_bytes=4096)
    ws.lock()
    arena, ptr = ws.arena, ws.arena.data_ptr()
    ws.get_simultaneous(*wg.torch_views(TINY, 1))  # fits: a locked arena still serves
    with pytest.raises(wg.WorkspaceLockedError) as err:
        ws.get_simultaneous(*wg.torch_views(TINY, 8))
    message = str(err.value)
    assert "locked at 4096 bytes (4 KiB)" in message
    assert f"asks for {workspace_bytes(TINY, 8)} bytes (10.8 KiB)" in message
    assert "test_workspace_grow.py:" in message and "test_the_lock_refuses_growth" in message  # who asked
    assert "would free the arena the captured graphs read" in message
    assert "Reserve the largest request before capture" in message
    assert ws.arena is arena and arena.data_ptr() == ptr and len(ws.growths) == 0  # nothing freed


def test_fixed_capture_reserves_the_largest_size_and_locks(tmp_path):
    rec = drive(tmp_path, "fixed", steps=1)
    ws = rec.details["workspace"]
    assert ws["reserved_bytes"] == ws["final_bytes"] == workspace_bytes(TINY, 8)
    assert ws["locked"] and ws["grown_at_sizes"] == [] and [g["how"] for g in ws["grows"]] == ["allocate"]


# ------------------------------------------------------------------------ the decode


def decode_inputs(dims: WorkspaceDims, b: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (b, dims.max_seq_len, dims.num_kv_heads, dims.head_size)
    k = torch.randn(shape, generator=gen).bfloat16()
    v = torch.randn(shape, generator=gen).bfloat16()
    q = torch.randn(b, dims.num_heads, dims.head_size, generator=gen).bfloat16()
    lens = torch.randint(1, dims.max_seq_len + 1, (b,), generator=gen, dtype=torch.int32)
    lens[0], lens[-1] = 1, dims.max_seq_len  # a one-token sequence and a full one
    return q, k, v, lens


@pytest.mark.parametrize(
    "dims, b",
    [(TINY, 8), (WorkspaceDims(num_heads=16, num_kv_heads=4, head_size=64, num_kv_splits=8, max_seq_len=256), 12)],
)
def test_split_kv_decode_matches_one_softmax_within_a_third_of_the_tolerance(dims, b):
    q, k, v, lens = decode_inputs(dims, b)
    ws = wg.WorkspaceManager(CPU, resize_in_place=False)
    out = wg.split_kv_decode(q, k, v, lens, ws, dims).bfloat16()  # the graph's bf16 output
    cmp = wg.compare(out, wg.reference_attention(q, k, v, lens), wg.TOLERANCE)
    assert cmp.nonfinite == 0 and cmp.mismatches == 0
    assert cmp.max_scaled_err < wg.TOLERANCE / 3, cmp


def test_the_decode_reads_its_scratch_back_from_the_arena():
    """Stage 2 reads what stage 1 left in the arena: change those bytes and the output changes."""
    q, k, v, lens = decode_inputs(TINY, 4)
    ws = wg.WorkspaceManager(CPU, resize_in_place=False)
    mid_o, output, lse = ws.get_simultaneous(*wg.torch_views(TINY, 4))
    wg.split_kv_stage1(q, k, v, lens, mid_o)
    wg.reduce_splits(mid_o, output, lse)
    right = output.clone()
    in_arena = ws.arena[: mid_o.numel() * 4].view(torch.float32).view(mid_o.shape)  # the bytes, not a copy
    in_arena[..., : TINY.head_size].mul_(2)  # every split's output, not its lse
    wg.reduce_splits(mid_o, output, lse)
    assert torch.allclose(output, 2 * right)
    returned = wg.split_kv_decode(q, k, v, lens, ws, TINY)
    assert returned.untyped_storage().data_ptr() == ws.arena.untyped_storage().data_ptr()


def test_compare_counts_nonfinite_apart_from_mismatches():
    ref = torch.ones(2, 4, 16)
    out = ref.clone()
    out[0, 0, :3] = float("nan")
    out[1, 0, 0] = 1.5
    cmp = wg.compare(out, ref, wg.TOLERANCE)
    assert (cmp.nonfinite, cmp.compared, cmp.mismatches) == (3, 125, 1)


# ------------------------------------------------------------------------ the scenario, in-process


def test_unfixed_replace_frees_the_arena_of_every_smaller_graph(tmp_path):
    rec = drive(tmp_path, "unfixed")
    findings = rec.of("finding")
    assert len(findings) == 3 and {f["slot"] for f in findings} == {ARENA}
    assert all(f["status"] == "freed" and f["when"] == "after capture" for f in findings)
    assert {f["graph"] for f in findings} == {"decode bs=1", "decode bs=2", "decode bs=4"}
    assert all("in _grow (deleted)" in f["freed_at"] for f in findings)
    assert [m["freed"] for m in rec.of("manifest")] == [3]
    ws = rec.details["workspace"]
    assert ws["grown_at_sizes"] == [1, 2, 4, 8] and ws["stale_sizes"] == [1, 2, 4]
    assert [g["how"] for g in ws["grows"]] == ["allocate", "replace", "replace", "replace"]
    assert ws["final_bytes"] == workspace_bytes(TINY, 8) and not ws["locked"]
    # Eager on CPU runs through the live arena: every graph's output right, the bug only latent.
    steps = rec.of("step")
    assert len(steps) == 2 and all(s["mismatches"] == 0 and s["nonfinite"] == 0 and not s["replayed"] for s in steps)
    assert all(s["compared"] == 15 * 4 * 16 and s["extra"]["stale_graphs"] == 3 for s in steps)
    assert [n["text"] for n in rec.of("note")] == [wg.CPU_NOTE]


def test_unfixed_resize_moves_the_arena_under_exactly_the_graphs_captured_before_a_growth(tmp_path):
    """One storage, resized in place at each larger capture: each graph captured before a
    growth read an address the arena left (one finding each, its own address); the last one
    reads the live arena."""
    rec = drive(tmp_path, "unfixed", resize=True)
    ws = rec.details["workspace"]
    assert [g["how"] for g in ws["grows"]] == ["allocate", "resize_", "resize_", "resize_"]
    assert ws["stale_sizes"] == [1, 2, 4]
    findings = rec.of("finding")
    assert [f["graph"] for f in findings] == [f"decode bs={b}" for b in ws["stale_sizes"]]
    assert all(f["slot"].startswith(ARENA) and f["status"] == "moved" for f in findings)
    assert len({f["old_ptr"] for f in findings}) == 3 and len({f["new_ptr"] for f in findings}) == 1
    assert all("it was resized or re-pointed" in f["message"] for f in findings)
    assert [m["moved"] for m in rec.of("manifest")] == [3]
    assert all(s["mismatches"] == 0 for s in rec.of("step"))


@pytest.mark.parametrize("resize", [False, True])
def test_fixed_is_clean_and_no_graph_is_stale(tmp_path, resize):
    rec = drive(tmp_path, "fixed", resize=resize)
    assert not rec.of("finding")
    assert [(m["freed"], m["moved"]) for m in rec.of("manifest")] == [(0, 0)]
    assert rec.details["workspace"]["stale_sizes"] == []
    for s in rec.of("step"):
        assert s["mismatches"] == 0 and s["nonfinite"] == 0 and s["extra"]["worst_scaled_err"] < wg.TOLERANCE / 3


def test_records_say_what_the_knob_did_and_keep_no_fills_on_cpu(tmp_path):
    rec = drive(tmp_path, "unfixed", steps=1)
    d = rec.details
    assert d["after_free"]["knob"] == "release" and "CPU" in d["after_free"]["note"]
    assert d["tolerance"] == wg.TOLERANCE and d["dims"]["capture_sizes"] == [1, 2, 4, 8]
    assert all("overwritten_bytes" not in s["extra"] for s in rec.of("step"))  # no fills without a GPU
    assert {p["name"] for p in rec.of("phase")} >= {"build", "capture", "replays", "oracle"}


def test_the_mode_difference_is_the_marked_lines():
    source = inspect.getsource(wg.capture_decode_graphs)
    guarded = [line for line in source.splitlines() if "# fix (#" in line]
    assert len(guarded) == 4
    assert "if fixes.reserve_before_capture:" in guarded[0] and "get_simultaneous" in guarded[1]
    assert "if fixes.lock_after_capture:" in guarded[2] and "workspace.lock()" in guarded[3]
    assert wg.MODES["unfixed"] == wg.Fixes(False, False) and wg.MODES["fixed"] == wg.Fixes(True, True)


def test_fills_count_the_bytes_a_replay_wrote_over():
    holders = [torch.full((64,), 0xFF, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)]
    fills = wg.Fills(holders=holders, written=[h.clone() for h in holders])
    assert fills.overwritten_bytes() == 0 and fills.nbytes == 80
    holders[0][:10] = 3
    holders[1][5] = 1
    assert fills.overwritten_bytes() == 11


# ------------------------------------------------------------------------ matrices


def test_ci_smoke_runs_every_mode_and_variant_on_cpu():
    _, planned = load_matrix("ci-smoke", 0)
    mine = {(p.cfg.run.mode, p.cfg.run.resize_in_place): p for p in planned if p.cfg.scenario == "workspace-grow"}
    assert set(mine) == {("unfixed", False), ("unfixed", True), ("fixed", False), ("fixed", True)}
    assert all(p.cfg.preset == "workspace-tiny" and p.device == "cpu" for p in mine.values())


@pytest.mark.parametrize("name", ["gpu-1", "gpu-1-shared"])
def test_gpu_matrices_give_every_knob_of_the_unfixed_variants_an_outcome(name):
    _, planned = load_matrix(name, 1)
    mine = [p.cfg for p in planned if p.cfg.scenario == "workspace-grow"]
    for resize in (False, True):
        knobs = {c.run.after_free for c in mine if c.run.mode == "unfixed" and c.run.resize_in_place == resize}
        assert knobs == {"keep", "release", "reuse", "poison"}, (name, resize)
    assert all(c.run.expect for c in mine) and any(c.run.mode == "fixed" for c in mine)
    assert all(c.preset == "turboquant-decode" for c in mine)


# ------------------------------------------------------------------------ the command

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def one_line_error(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("repro: error:") and "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "model.num_kv_heads=3"], "model.num_heads = 4 is not a multiple of model.num_kv_heads = 3"),
        (["--set", "model.max_seq_len=30"], "model.max_seq_len = 30 is not a multiple of model.num_kv_splits = 4"),
        (["--set", "model.capture_sizes=[4, 2]"], "must be positive, strictly increasing integers"),
        (["--set", "model.initial_workspace_mib=-1"], "model.initial_workspace_mib = -1 must be >= 0"),
        (["--mode", "reload-safe"], "is not one of 'unfixed', 'fixed'"),
        (["--tp", "2"], "workspace-grow has no --tp option"),  # one rank: no TP
        (["--identity-reload"], "--identity-reload belongs to nvfp4-reload"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle):
    assert needle in one_line_error(invoke("workspace-grow", "--device", "cpu", *args))


def test_other_scenarios_refuse_the_resize_switch():
    error = one_line_error(invoke("nvfp4-reload", "--device", "cpu", "--set", "run.resize_in_place=true"))
    assert "resize_in_place does not apply to nvfp4-reload (it belongs to workspace-grow)" in error


def test_print_config_resolves_the_tiny_preset_on_cpu_and_the_switch():
    result = invoke("workspace-grow", "--device", "cpu", "--resize-in-place", "--print-config")
    assert result.exit_code == 0, result.stderr
    cfg = json.loads(result.stdout)
    assert cfg["preset"] == "workspace-tiny" and cfg["run"]["resize_in_place"] is True
    assert cfg["run"]["after_free"] == "release"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, outcome, code",
    [
        ([], "STALE_CAPTURE", 0),  # unfixed: reproduced, as expected
        (["--mode", "fixed", "--resize-in-place"], "CLEAN", 0),
        (["--expect", "clean"], "STALE_CAPTURE", 1),  # the bug shows: that expectation fails
    ],
)
def test_the_command_runs_a_trial_and_exits_by_its_expectation(tmp_path, no_gpu, args, outcome, code):
    result = invoke("workspace-grow", "--steps", "1", "--artifacts", str(tmp_path), "--json", "-", *args)
    assert result.exit_code == code, result.stderr
    [trial] = json.loads(result.stdout)["trials"]
    assert trial["outcome"] == outcome and trial["met"] is (code == 0) and not trial["graph_replayed"]
    assert trial["config"]["preset"] == "workspace-tiny"
    report = re.sub(r"[│\s]+", " ", result.stderr)
    assert "Workspace: " in report


# ------------------------------------------------------------------------ on a GPU

GPU_OUTCOMES = {
    # (mode, resize, after_free): the outcome measured on an H200 (docs/RESULTS.md, sixth series)
    ("unfixed", False, "release"): {Outcome.ILLEGAL_ADDRESS},  # the grow's own empty_cache() unmaps
    ("unfixed", True, "keep"): {Outcome.ILLEGAL_ADDRESS},  # the old arenas' segments are released too
    ("unfixed", True, "release"): {Outcome.ILLEGAL_ADDRESS},
    ("unfixed", True, "reuse"): {Outcome.ILLEGAL_ADDRESS},
    ("fixed", False, "release"): {Outcome.CLEAN},
    ("fixed", True, "reuse"): {Outcome.CLEAN},
}


@pytest.mark.gpu
@pytest.mark.parametrize("mode, resize, after_free", list(GPU_OUTCOMES))
def test_each_mode_on_cuda(tmp_path, mode, resize, after_free):
    from repro.run.footprint import peak_shortfall
    from repro.run.runner import plan, run_planned

    if gpus.gpu_count() < 1:
        pytest.skip("needs a CUDA GPU")
    p = plan(
        "workspace-grow",
        "turboquant-decode",
        {"mode": mode, "resize_in_place": resize, "after_free": after_free, "steps": 2},
        [],
        gpus.gpu_count(),
    )
    assert p.device == "cuda"
    # The fixed mode's shared pool keeps every capture's temporaries: ~112 GiB at these dims, more than an
    # 80 GB card holds (measured on an H100: CUDA out of memory, docs/RESULTS.md, twelfth series).
    # The unfixed modes fault at their first replay, long before that peak.
    if mode == "fixed" and (shortfall := peak_shortfall(p.cfg)):
        pytest.skip(f"would run out of GPU memory here: {shortfall}")
    t = run_planned([p], tmp_path).report.trials[0]
    assert t.outcome in GPU_OUTCOMES[(mode, resize, after_free)], (t.outcome, t.first_failure)
    assert t.graph_replayed
    ws = t.details["workspace"]
    if mode == "fixed":
        assert not t.guard_findings and ws["stale_sizes"] == [] and ws["locked"]
        assert all(s.mismatches == 0 and s.nonfinite == 0 for s in t.steps)
    else:
        assert t.guard_findings and ws["stale_graphs"] == len(ws["stale_sizes"]) > 0
        assert all(f.when == "after capture" for f in t.guard_findings[:1])
    if mode == "unfixed" and resize:
        # One finding per placement the arena left (each resize_ leaves one), none for the live one.
        moved = [f for f in t.guard_findings if f.status == "moved"]
        assert len(moved) == sum(g["how"] == "resize_" for g in ws["grows"]) and len({f.old_ptr for f in moved}) == len(
            moved
        )
    # The estimate the matrix packs concurrent trials by is not below what the trial reached
    # (a rank that died of the fault may not have said its peak).
    from repro.run.footprint import expected_peak_bytes

    peaks = [r.peak_reserved_bytes for r in t.ranks if r.peak_reserved_bytes is not None]
    assert peaks or t.outcome is not Outcome.CLEAN
    assert all(0 < n <= expected_peak_bytes(p.cfg) for n in peaks), (peaks, expected_peak_bytes(p.cfg))
    if t.outcome is Outcome.MISMATCH:
        # The graphs' own outputs are right; what changed is the other tensors' memory.
        graphs = [s for s in t.steps if "worst_graph" in s.extra]
        fills = [s for s in t.steps if "overwritten_bytes" in s.extra]
        assert all(s.mismatches == 0 for s in graphs) and fills and all(s.mismatches > 0 for s in fills)
