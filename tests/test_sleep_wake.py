"""sleep-wake on CPU: the discard, each mode's wake at both levels, the symptoms, verdicts through
the runner and the CLI; on a GPU (marked gpu), the outcome table of the GPU matrices."""

import json
import re
import tomllib

import pytest
import torch
from typer.testing import CliRunner

from conftest import REPO
from repro.cli import app
from repro.config import load_preset
from repro.rank.dist import TP
from repro.diagnose.guard import CaptureGuard
from repro.run.matrix import load_matrix
from repro.outcome import Outcome
from repro.run.runner import plan, run_planned
from repro.scenarios.gemma4_mtp import Gemma4Drafter, Sequences, decode_step, full_lm_head
from repro.scenarios.gemma4_target import TargetStandIn
from repro.scenarios.sleep_wake import (
    BLOCK_SIZE,
    DRAFTER_MODE,
    MAX_BLOCKS,
    Checkpoint,
    Engine,
    Fixes,
    discard,
    target_tensors,
)

DIMS = load_preset("sleep-wake-tiny").model
CPU = torch.device("cpu")
TP1 = TP(0, 1, None)
runner = CliRunner()


@pytest.fixture(autouse=True)
def no_autograd():
    with torch.no_grad():  # as in the harness's workers
        yield


# ---------------------------------------------------------------------------- the discard


def test_discard_keeps_address_and_version_but_not_contents():
    t = torch.arange(1, 33, dtype=torch.int64)
    view = t[4:8]  # a view: its whole storage goes, as an allocation does
    ptr, version = t.data_ptr(), t._version
    discard(view)
    assert t.data_ptr() == ptr and view.data_ptr() == ptr + 4 * 8
    assert t._version == version  # no program write: how a check tells a lost content
    assert torch.count_nonzero(t) == 0
    w = torch.randn(16, 8, dtype=torch.bfloat16)
    discard(w)
    assert torch.equal(w, torch.zeros_like(w)) and w._version == 0


def test_a_torch_write_of_the_same_bytes_bumps_the_version():
    """The contrast the content check relies on: the program's own zero_() is a write."""
    t = torch.arange(8)
    version = t._version
    t.zero_()
    assert t._version > version


# ----------------------------------------------------------------------------- the engine


def build(mode: str, fixes: Fixes | None = None) -> tuple[Engine, Checkpoint, Sequences]:
    drafter = Gemma4Drafter(DIMS, TP1, DRAFTER_MODE, CPU, seed=0)
    target = TargetStandIn(DIMS, TP1, CPU, 0, full_lm_head(DIMS, 0, CPU))
    engine = Engine(drafter, target, DIMS.batch_sizes, mode, 0, CaptureGuard())
    if fixes is not None:
        engine.fixes = fixes
    engine.capture_draft_graphs()  # the CPU dry run under the guard
    seqs = Sequences(*target.initial(max(DIMS.batch_sizes), 0))
    return engine, Checkpoint.of(drafter, target), seqs


def healthy_drafts(checkpoint: Checkpoint, hidden: torch.Tensor) -> torch.Tensor:
    """What the drafter as loaded drafts for these rows (a fresh one on the checkpoint's weights)."""
    fresh = Gemma4Drafter(DIMS, TP1, DRAFTER_MODE, CPU, seed=0)
    for name, p in fresh.named_parameters():
        assert torch.equal(p, checkpoint.drafter[name])
    return fresh.masked_embedding.get_top_tokens(hidden, fresh.full_lm_head_weight())[0]


def draft_rows(engine: Engine, seqs: Sequences, b: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(the draft graph's tokens, the rows it was asked to draft) for position 0 of b sequences."""
    state = engine.target.advance(seqs.state[:b], seqs.last[:b])
    hidden = engine.target.draft_hidden(state, engine.drafter.dtype)
    tokens, _, replayed = engine.sample(hidden, 0)
    assert not replayed  # CPU: the eager path stood in
    return tokens, hidden


def test_the_draft_graph_reads_its_rows_through_the_table_and_layout():
    engine, checkpoint, seqs = build("fixed")
    assert engine.layout.strides.tolist() == [MAX_BLOCKS] and engine.layout.block_sizes.tolist() == [BLOCK_SIZE]
    assert engine.table.shape == (max(DIMS.batch_sizes), MAX_BLOCKS)
    assert sorted(engine.table.flatten().tolist()) == list(range(engine.table.numel()))  # every page once
    tokens, hidden = draft_rows(engine, seqs)
    assert torch.equal(tokens, healthy_drafts(checkpoint, hidden))


LEVEL1 = {  # mode -> (layout at the same address, layout values right after the wake)
    "unfixed": (True, False),
    "rebuild": (False, True),
    "fixed": (True, True),
}


@pytest.mark.parametrize("mode", list(LEVEL1))
def test_level1_wake_by_mode(mode):
    engine, checkpoint, seqs = build(mode)
    draft_rows(engine, seqs)  # a step before the sleep: the cache holds its rows
    assert torch.count_nonzero(engine.kv) > 0
    old = [(t.data_ptr(), t._version) for t in engine.layout.tensors()]
    kv_ptr = engine.kv.data_ptr()
    weights = [p.clone() for p in engine.drafter.parameters()]
    engine.wake_up(1, checkpoint, engine.sleep(1))
    same_address, right = LEVEL1[mode]
    assert ([t.data_ptr() for t in engine.layout.tensors()] == [p for p, _ in old]) is same_address
    values = engine.layout.strides.tolist(), engine.layout.block_sizes.tolist()
    assert (values == ([MAX_BLOCKS], [BLOCK_SIZE])) is right
    if mode == "unfixed":  # lost, and nothing in the program wrote it: only a content check tells
        assert [t._version for t in engine.layout.tensors()] == [v for _, v in old]
        assert engine.layout.strides.tolist() == [0] and engine.layout.block_sizes.tolist() == [0]
    if mode == "fixed":  # refreshed by the program: a write
        assert all(t._version > v for t, (_, v) in zip(engine.layout.tensors(), old))
    assert engine.kv.data_ptr() == kv_ptr and torch.count_nonzero(engine.kv) == 0  # the backing: discarded
    assert all(torch.equal(p, w) for p, w in zip(engine.drafter.parameters(), weights))  # level 1 keeps them
    tokens, hidden = draft_rows(engine, seqs)
    # CPU: the eager path reads what Python holds now, so a rebuilt layout drafts right here.
    assert torch.equal(tokens, healthy_drafts(checkpoint, hidden)) is right
    if not right:
        assert (tokens != healthy_drafts(checkpoint, hidden)).float().mean() > 0.5


MODES_RELOAD_DRAFTER = {"unfixed": False, "rebuild": True, "fixed": True}


@pytest.mark.parametrize("mode", list(LEVEL1))
def test_level2_wake_by_mode(mode):
    engine, checkpoint, seqs = build(mode)
    drafter, target = engine.drafter, engine.target
    order = drafter.masked_embedding.token_ordering.clone()
    params = {name: (p.data_ptr(), p._version) for name, p in drafter.named_parameters()}
    engine.wake_up(2, checkpoint, engine.sleep(2))
    assert torch.equal(drafter.masked_embedding.token_ordering, order)  # buffers: saved and restored
    for name, t in target_tensors(target).items():  # the target: reloaded
        assert torch.equal(t, checkpoint.target[name]), name
    reloaded = MODES_RELOAD_DRAFTER[mode]
    for name, p in drafter.named_parameters():
        assert p.data_ptr() == params[name][0]  # in place, either way
        if reloaded:
            assert torch.equal(p, checkpoint.drafter[name]) and p._version > params[name][1]
        else:  # #52487: read back as 0.0
            assert torch.count_nonzero(p) == 0 and p._version == params[name][1]
    tokens, hidden = draft_rows(engine, seqs)
    assert torch.equal(tokens, healthy_drafts(checkpoint, hidden)) is (mode != "unfixed")


def test_level2_draft_weights_alone_wreck_the_drafts():
    """#52487 on its own: the layout refreshed in place, only the drafter left unloaded."""
    engine, checkpoint, seqs = build(
        "fixed", Fixes(restore_layout=True, layout_in_place=True, reload_draft_weights=False)
    )
    engine.wake_up(2, checkpoint, engine.sleep(2))
    assert engine.layout.strides.tolist() == [MAX_BLOCKS]
    tokens, hidden = draft_rows(engine, seqs)
    assert (tokens != healthy_drafts(checkpoint, hidden)).float().mean() > 0.5


def test_the_target_rejects_the_drafts_of_a_zeroed_drafter():
    """A decode step after an unfixed level-2 wake: k drafts per sequence, through the draft graph
    and fed back, next to none accepted (#52487: 0 of 4560)."""
    engine, checkpoint, seqs = build("unfixed")
    engine.wake_up(2, checkpoint, engine.sleep(2))
    drafted, _, accepted = decode_step(engine.target, engine.sampler(), seqs, 8, 3, engine.drafter.dtype, TP1)
    assert drafted.tokens.shape == (8, 3) and int(accepted.sum()) <= 1


# -------------------------------------------------------------------- through the runner

VERDICTS = {  # name -> (run overrides, expected outcome on CPU)
    "unfixed level1": ({"mode": "unfixed", "sleep_level": 1}, Outcome.MISMATCH),
    "unfixed level2": ({"mode": "unfixed", "sleep_level": 2}, Outcome.MISMATCH),
    "rebuild level1": ({"mode": "rebuild", "sleep_level": 1}, Outcome.STALE_CAPTURE),
    "rebuild level2": ({"mode": "rebuild", "sleep_level": 2}, Outcome.STALE_CAPTURE),
    "fixed level1": ({"mode": "fixed", "sleep_level": 1}, Outcome.CLEAN),
    "fixed level2 tp2": ({"mode": "fixed", "sleep_level": 2, "tp": 2}, Outcome.CLEAN),
    "unfixed level1 guard off": ({"mode": "unfixed", "sleep_level": 1, "guard": "off"}, Outcome.MISMATCH),
}


@pytest.fixture(scope="module")
def cpu_trials(tmp_path_factory):
    planned = [
        plan("sleep-wake", "sleep-wake-tiny", {"device": "cpu", "steps": 4, **run}, [], gpus=0)
        for run, _ in VERDICTS.values()
    ]
    result = run_planned(planned, tmp_path_factory.mktemp("sleep-wake-cpu"), jobs=3)
    return dict(zip(VERDICTS, result.report.trials))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VERDICTS))
def test_cpu_verdicts(cpu_trials, name):
    run, expected = VERDICTS[name]
    t = cpu_trials[name]
    assert t.outcome == expected and t.met, (t.outcome, t.first_failure)
    assert not t.graph_replayed and any("no CUDA graph" in n for n in t.notes)
    assert t.details["sleep_level"] == run["sleep_level"] and t.details["sleep_before_step"] == 2
    before = [s for s in t.steps if not s.extra["after_wake"]]
    assert [s.step for s in before if s.rank == 0] == [0, 1]
    assert all(s.mismatches == 0 for s in before)  # healthy until the sleep
    assert t.measures["lossless"] is True
    if expected == Outcome.MISMATCH:  # the collapse, after the wake only
        assert t.measures["acceptance_rate"] < 0.1
        assert t.first_failure.step == 2 and "after wake" in t.first_failure.detail
    else:
        assert t.measures["acceptance_rate"] >= 0.5


@pytest.mark.slow
def test_cpu_rebuild_names_the_layout_the_wake_freed(cpu_trials):
    t = cpu_trials["rebuild level1"]
    freed = {f.slot for f in t.guard_findings if f.status == "freed" and f.when == "after wake"}
    assert freed == {"engine.layout.strides", "engine.layout.block_sizes"}
    assert all("post_kv_cache_wake_up" in (f.freed_at or "") for f in t.guard_findings)
    [m] = [m for m in t.manifests if m.when == "after wake"]
    assert m.freed == 2


@pytest.mark.slow
def test_cpu_content_loss_is_invisible_to_pointer_checks(cpu_trials):
    """unfixed: the symptom shows, the guard's pointer checks find nothing (same storage, same
    pointer), its contents check names the discarded layout at the wake, and the symptom is
    the same with the guard off."""
    on, off = cpu_trials["unfixed level1"], cpu_trials["unfixed level1 guard off"]
    assert not [f for f in on.guard_findings if f.status != "contents-changed"] and not off.guard_findings
    assert {(f.slot, f.when) for f in on.guard_findings} == {
        ("engine.layout.strides", "after wake"),
        ("engine.layout.block_sizes", "after wake"),
    }
    assert [(s.step, s.mismatches) for s in on.steps] == [(s.step, s.mismatches) for s in off.steps]


@pytest.mark.slow
def test_cpu_report_says_acceptance_before_and_after(cpu_trials):
    from repro.scenarios.sleep_wake_spec import SPEC

    lines = SPEC.report_lines(cpu_trials["unfixed level2"])
    assert lines[0].startswith("Sleep level 2 after 2 decode steps: before it, acceptance")
    assert "acceptance 0.0%" in lines[1] and "no error" in lines[1]
    chart = SPEC.chart(cpu_trials["unfixed level2"].steps)
    assert [s.name for s in chart.series] == ["before the sleep", "after the wake"]
    assert [x for x, _ in chart.series[1].points] == [2, 3]


# ---------------------------------------------------------------------------------- CLI


@pytest.mark.slow
def test_cli_runs_a_trial_and_exits_0_when_it_reproduces(tmp_path, no_gpu):
    result = runner.invoke(
        app, ["sleep-wake", "--sleep-level", "2", "--steps", "2", "--artifacts", str(tmp_path), "--json", "-"]
    )
    assert result.exit_code == 0, result.stderr
    [t] = json.loads(result.stdout)["trials"]
    assert t["id"] == "00-sleep-wake-unfixed-tp1-reuse-level2" and t["outcome"] == "MISMATCH"
    assert t["acceptance_rate"] < 0.1 and t["lossless"] is True


@pytest.mark.parametrize(
    "argv, says",
    [
        (["sleep-wake", "--sleep-level", "3"], "--sleep-level 3: sleep_level = 3 is not a vLLM sleep level"),
        (["sleep-wake", "--sleep-level", "one"], "Invalid value for '--sleep-level'"),
        (["sleep-wake", "--mode", "reload-safe"], "'reload-safe'"),
        (["sleep-wake", "--set", "run.sleep_level=-1"], "--set run.sleep_level=-1: sleep_level = -1"),
        (["gemma4-mtp", "--sleep-level", "2"], "--sleep-level belongs to sleep-wake"),
        (["gemma4-mtp", "--set", "run.sleep_level=2"], "sleep_level does not apply to gemma4-mtp"),
        (["sleep-wake", "--set", "run.reload_drafter=true"], "reload_drafter does not apply to sleep-wake"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, says, no_gpu):
    result = runner.invoke(app, [*argv, "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.output


def test_print_config_fills_the_default_level(no_gpu):
    result = runner.invoke(app, ["sleep-wake", "--print-config"])
    assert result.exit_code == 0
    cfg = json.loads(result.stdout)
    assert cfg["run"]["sleep_level"] == 1 and cfg["preset"] == "sleep-wake-tiny" and cfg["device"] == "cpu"


# ------------------------------------------------------------------- presets and matrices


def test_presets_carry_gemma4_mtp_dims():
    """The same drafter and target: sleep-wake's presets are gemma4-mtp's dims, kept equal."""
    assert load_preset("sleep-wake-e2b").model == load_preset("gemma4-e2b").model
    assert load_preset("sleep-wake-tiny").model == load_preset("gemma4-tiny").model


def test_ci_smoke_covers_every_mode_at_both_levels():
    _, planned = load_matrix("ci-smoke", 0)
    mine = {(p.cfg.run.mode, p.cfg.run.sleep_level) for p in planned if p.cfg.scenario == "sleep-wake"}
    assert mine == {(m, level) for m in ("unfixed", "rebuild", "fixed") for level in (1, 2)}


def results_table() -> list[dict[str, str]]:
    """The measured-outcome table of docs/RESULTS.md the GPU matrices' sleep-wake trials come from."""
    text = (REPO / "docs" / "RESULTS.md").read_text()
    section = text[text.index("### sleep-wake: GPU outcomes (measured)") :]
    rows = [line for line in section.splitlines()[1:] if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip().strip("`") for c in r.strip("|").split("|")))) for r in rows[2:]]


@pytest.mark.parametrize("matrix", ["gpu-1", "gpu-1-shared"])
def test_gpu_matrices_are_the_results_table(matrix):
    """Each GPU matrix's sleep-wake trials are the rows of docs/RESULTS.md's table for it, with
    the same expected outcome (the tomls say they are generated from it)."""
    data = tomllib.loads((REPO / "repro" / "configs" / f"{matrix}.toml").read_text())
    trials = [t for t in data["trial"] if t["scenario"] == "sleep-wake"]
    table = [r for r in results_table() if r["matrix"] == matrix]
    assert trials and len(trials) == len(table)
    for t, r in zip(trials, table):
        shown = (r["mode"], int(r["TP"]), int(r["level"]), r["after-free"], r["guard"], r["measured"])
        got = (
            t["mode"],
            t.get("tp", 1),
            t["sleep_level"],
            t.get("after_free", "reuse"),
            t.get("guard", "warn"),
            t["expect"],
        )
        assert shown == got


# ------------------------------------------------------------------------------------ GPU

GPU_TABLE = {  # (mode, level, after_free) -> outcome on one GPU at E2B dims, TP 1
    ("unfixed", 1, "reuse"): Outcome.MISMATCH,
    ("unfixed", 2, "reuse"): Outcome.MISMATCH,
    ("rebuild", 1, "keep"): Outcome.DEVICE_ASSERT,  # measured on an H200 (docs/RESULTS.md)
    ("rebuild", 1, "reuse"): Outcome.DEVICE_ASSERT,
    ("fixed", 1, "reuse"): Outcome.CLEAN,
    ("fixed", 2, "reuse"): Outcome.CLEAN,
}


@pytest.mark.gpu
def test_gpu_outcomes_at_e2b_dims(tmp_path):
    from repro.env import gpus

    if gpus.gpu_count() < 1:
        pytest.skip("needs a CUDA GPU")
    planned = [
        plan("sleep-wake", "sleep-wake-e2b", {"mode": m, "sleep_level": level, "after_free": af}, [], gpus.gpu_count())
        for m, level, af in GPU_TABLE
    ]
    assert all(p.device == "cuda" for p in planned)
    trials = run_planned(planned, tmp_path, jobs=2).report.trials
    for (mode, level, af), t in zip(GPU_TABLE, trials):
        key = (mode, level, af)
        assert t.outcome == GPU_TABLE[key] and t.graph_replayed, (key, t.outcome, t.first_failure)
        if t.outcome in (Outcome.CLEAN, Outcome.MISMATCH):
            assert t.measures["lossless"] is True, key
            rate = t.measures["acceptance_rate"]
            assert (rate >= 0.5) if t.outcome == Outcome.CLEAN else (rate < 0.1), (key, rate)
        if mode == "rebuild":  # the freed layout, named before the first replay after the wake
            assert any(f.when == "after wake" and "engine.layout" in f.slot for f in t.guard_findings), key
        if mode == "unfixed":  # content lost at a live address: no pointer check sees it
            assert not [f for f in t.guard_findings if re.search(r"freed|moved|rebound", f.status)], key
