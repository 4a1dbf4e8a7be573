"""Contents lost at the same address (repro/diagnose/fingerprint.py), on CPU: the guard records a dry run
of the capture as the scenarios' CPU path does, memory is overwritten behind torch's back with
ctypes.memset (what a level-1 sleep does to memory in a discarded pool: vLLM #53508), and only
a deep check's fingerprint sees it; program writes and graph writes never read as a loss."""

from __future__ import annotations

import ctypes
import io
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from rich.console import Console

from repro.diagnose import fingerprint
from repro import report as rp
from repro.config import load_preset, validate
from repro.diagnose.forensics import MemoryHistory
from repro.rank.graphs import HarnessMemory, capture
from repro.diagnose.guard import CaptureGuard, StaleCaptureError
from repro.outcome import Outcome, Report, TrialRecord, report_from_dict, to_jsonable
from repro.run.protocol import RecordSink, TrialSpec
from repro.report import view
from repro.scenarios import nvfp4_moe
from repro.rank.worker import WorkerContext

CPU = torch.device("cpu")
GRAPH = "decode bs=4"


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


class Runner:
    """An engine's persistent state: metadata a graph reads, a KV cache it writes."""

    def __init__(self, big: int = 0):
        self.meta = torch.arange(64, dtype=torch.int32)  # block table / seq lens: read-only to the graph
        self.kv = torch.zeros(16, 8)  # written by the graph (index_copy_)
        self.out = torch.zeros(4, 8)  # written by the graph (out=)
        self.weight = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
        self.big = torch.randn(big) if big else None  # over FULL_BYTES: sampled
        self.x = torch.ones(4, 8)  # the static input, written before each replay


def decode(r: Runner, x: torch.Tensor) -> torch.Tensor:
    """x [4, 8] -> [4, 8]; what the captured region does."""
    slots = r.meta[:4].long()
    r.kv.index_copy_(0, slots, x)
    torch.mul(x, r.meta[:4, None].float(), out=r.out)
    y = r.out @ r.weight
    return y + r.big[:8].sum() if r.big is not None else y


def record(r: Runner, mode: str = "warn") -> CaptureGuard:
    guard = CaptureGuard(mode)
    guard.watch("runner", r)
    with guard.recording(GRAPH):  # CPU: the dry run the scenarios' capture makes
        decode(r, r.x)
    return guard


def wipe(t: torch.Tensor, byte: int = 0, offset: int = 0, nbytes: int | None = None) -> None:
    """Overwrite the bytes under a live tensor without torch: same address, same _version."""
    ctypes.memset(t.data_ptr() + offset, byte, t.nbytes - offset if nbytes is None else nbytes)


# -- the loss, and what pointer checks say about it -------------------------------------------------


def test_memset_of_captured_metadata_is_one_contents_changed_finding_naming_it():
    r = Runner()
    guard = record(r)
    version = r.meta._version
    r.x.copy_(torch.randn(4, 8))  # the program's own write of the static input
    wipe(r.meta)  # level-1 sleep: discarded and handed back zeroed

    assert r.meta._version == version and guard.check("after wake", deep=False) == []  # liveness: nothing
    assert guard.manifest("after wake").unchanged == len(guard.slots)  # pointer census: nothing
    findings = guard.check("after wake")

    assert [(f.slot, f.status) for f in findings] == [("runner.meta", "contents-changed")]
    f = findings[0]
    assert (f.graph, f.when, f.old_ptr, f.new_ptr) == (GRAPH, "after wake", r.meta.data_ptr(), None)
    assert (f.shape, f.dtype, f.nbytes, f.mechanism) == ([64], "int32", 256, "guard")
    assert f"since the end of capture '{GRAPH}'" in f.message and "same address" in f.message
    assert guard.check("after wake, again") == []  # each slot once per status


def test_raise_mode_raises_on_the_contents_finding():
    r = Runner()
    guard = record(r, mode="raise")
    wipe(r.meta, 0xFF)
    with pytest.raises(StaleCaptureError) as e:
        guard.check("after wake")
    assert [f.status for f in e.value.findings] == ["contents-changed"]


def test_guard_off_fingerprints_and_reports_nothing():
    r = Runner()
    guard = record(r, mode="off")
    wipe(r.meta, 0xFF)
    assert guard.check("after wake") == [] and guard.slots == []


# -- program writes are not a loss ------------------------------------------------------------------


@pytest.mark.parametrize(
    "write",
    [
        lambda r: r.meta.add_(1),  # in place
        lambda r: r.meta[:8].fill_(7),  # through a view (shares the counter)
        lambda r: r.meta.copy_(torch.arange(64, dtype=torch.int32).flip(0)),
        lambda r: r.weight.copy_(torch.randn(8, 8)),  # a reload's copy-back into the parameter
    ],
    ids=["add_", "view fill_", "copy_", "parameter copy_"],
)
def test_a_torch_write_is_not_a_loss_and_the_next_loss_is_judged_from_it(write):
    r = Runner()
    guard = record(r)
    write(r)
    assert guard.check("after reload") == []
    wipe(r.meta, 0xFF)
    wipe(r.weight, 0xFF)
    assert sorted(f.slot for f in guard.check("after wake")) == ["runner.meta", "runner.weight"]


def test_a_data_alias_write_is_the_programs_only_inside_program_writes():
    """param.data is a new TensorImpl with a version counter of its own: the parameter's does
    not move. Inside program_writes() the dispatcher sees the write instead."""
    r = Runner()
    guard = record(r)
    with guard.program_writes():
        r.weight.data.copy_(torch.randn(8, 8))
    assert guard.check("after reload") == []
    r.weight.data.copy_(torch.randn(8, 8))  # the same write, outside the block
    assert [f.slot for f in guard.check("after the second reload")] == ["runner.weight"]


def test_writes_the_graph_makes_are_never_a_loss():
    r = Runner()
    guard = record(r)
    assert {s.name for s in guard.slots if s.written} == {"runner.kv", "runner.out"}  # index_copy_, out=
    wipe(r.kv, 0xFF)
    wipe(r.out, 0xFF)
    assert guard.check("after wake") == []


def test_what_the_first_replay_changes_is_graph_written():
    """A write no schema declares (a raw kernel inside the graph) shows as bytes that change
    across the first replay; the replay here is that write alone."""
    r = Runner()
    guard = record(r)
    with guard.replaying(GRAPH):
        wipe(r.weight, 0x11)
    assert [s.name for s in guard.slots if s.written] == ["runner.kv", "runner.out", "runner.weight"]
    wipe(r.weight, 0x22)
    wipe(r.meta, 0x22)
    assert [f.slot for f in guard.check("after wake")] == ["runner.meta"]


def test_graph_pool_memory_is_not_fingerprinted():
    r = Runner()
    guard = record(r)
    own, other = (1, 1), (2, 2)
    pools = {r.meta.data_ptr(): own, r.weight.data_ptr(): other}
    guard.assign_pools(GRAPH, own, pools.get)
    wipe(r.meta, 0xFF)  # the graph's own pool: the pool's business
    wipe(r.weight, 0xFF)  # another graph's pool: that graph's replays write it
    assert guard.check("after wake") == []


# -- what it cannot tell, said rather than guessed -----------------------------------------------


def test_an_inference_tensor_has_no_counter_and_is_never_reported():
    with torch.inference_mode():
        meta = torch.arange(64, dtype=torch.int32)
    guard = CaptureGuard("warn")
    with guard.recording(GRAPH):
        meta.sum()
    wipe(meta, 0xFF)
    assert guard.check("after wake") == []


def test_a_freed_or_moved_storage_is_said_so_not_contents_changed():
    r = Runner()
    guard = record(r)
    r.meta.resize_(4096)  # re-pointed: a new allocation
    statuses = {f.slot: f.status for f in guard.check("after resize")}
    assert statuses == {"runner.meta": "moved"}


def test_a_large_region_is_sampled_at_fixed_positions():
    r = Runner(big=1 << 21)  # 8 MiB
    guard = record(r)
    words = fingerprint.words_of(r.big.untyped_storage(), 0, r.big.nbytes)
    stride = -(-words.numel() // fingerprint.SAMPLES)
    assert words[::stride].numel() <= fingerprint.SAMPLES
    wipe(r.big, 0x7F, offset=4 * (stride + 1), nbytes=4)  # one word between samples: unseen
    assert guard.check("after a one-word write") == []
    wipe(r.big, 0, offset=1 << 20, nbytes=1 << 20)  # a discarded MiB: seen
    assert [f.slot for f in guard.check("after wake")] == ["runner.big"]


# -- the scenarios' own writes, through the worker ------------------------------------------------


def ctx_for(tmp_path: Path, cfg) -> WorkerContext:
    spec = TrialSpec(trial_id="t", config=cfg.to_dict(), device="cpu", world_size=1, out_dir=str(tmp_path))
    memory = HarnessMemory(CPU)
    return WorkerContext(
        spec=spec,
        cfg=cfg,
        rank=0,
        device=CPU,
        tp=None,
        sink=RecordSink(tmp_path / "rank0.jsonl", 0),
        guard=CaptureGuard(mode="warn", scratch=memory.use),
        history=MemoryHistory(enabled=False),
        memory=memory,
    )


def records(ctx: WorkerContext) -> list[dict]:
    ctx.sink.file.close()
    return [json.loads(line) for line in (Path(ctx.spec.out_dir) / "rank0.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode,identity", [("fixed", False), ("kernel-reuse", True)])
def test_nvfp4_reloads_copy_back_is_checked_and_never_a_loss(tmp_path, mode, identity):
    """Every reload rewrites the captured parameters (copy-back) and the kernel's alphas: the
    fingerprints see the bytes change at every step, the counters say who wrote them."""
    cfg = validate(load_preset("moe-tiny"))
    cfg.run.mode, cfg.run.identity_reload, cfg.run.steps = mode, identity, 3
    ctx = ctx_for(tmp_path, cfg)
    nvfp4_moe.run(ctx)
    checked = [
        s.name
        for s in ctx.guard.slots
        if s.contents is not None and s.contents.when == "the check 'before replay, step 2'"
    ]
    assert {"moe.w13_weight", "moe.router_weight", "moe.quant_method.moe_kernel.w13_alpha"} <= set(checked)
    assert not any(s.contents for s in ctx.guard.slots if s.written)  # the workspaces: graph-written
    assert [e for e in records(ctx) if e["event"] == "finding"] == []


def test_a_sleep_between_replays_is_a_finding_record_before_the_next_replay(tmp_path):
    """What the sleep-wake scenario does, through the harness: capture (CPU: the dry run),
    overwrite captured metadata without torch, ctx.check_guard("after wake")."""
    cfg = validate(load_preset("moe-tiny"))
    ctx = ctx_for(tmp_path, cfg)
    r = Runner()
    ctx.guard.watch("runner", r)
    captured = capture(lambda x: decode(r, x), (r.x,), GRAPH, ctx.guard)
    assert captured.replay() is None  # CPU: nothing replayed
    wipe(r.meta)
    wipe(r.kv, 0xFF)
    found = ctx.check_guard("after wake")
    assert [(f.slot, f.status) for f in found] == [("runner.meta", "contents-changed")]
    events = [e for e in records(ctx) if e["event"] == "finding"]
    assert [(e["slot"], e["status"], e["when"]) for e in events] == [("runner.meta", "contents-changed", "after wake")]


# -- the report: a status of its own, rendered like the others --------------------------------------


def test_contents_changed_is_rendered_in_the_console_json_and_junit(tmp_path):
    r = Runner()
    guard = record(r)
    wipe(r.meta)
    finding = guard.check("after wake")[0]
    trial = TrialRecord(
        id="sleep-wake-fixed",
        scenario="nvfp4-reload",
        mode="fixed",
        config={"scenario": "nvfp4-reload", "run": {"mode": "fixed", "tp": 1}},
        outcome=Outcome.STALE_CAPTURE,
        expected=[Outcome.CLEAN],
        met=False,
        graph_replayed=False,
        guard_findings=[finding],
        device="cpu",
    )
    console = Console(record=True, width=160, file=io.StringIO(), color_system=None)
    rp.render_trial(trial, console)
    text = console.export_text()
    assert "CONTENTS-CHANGED runner.meta" in text and "no pointer check can see this" in text
    assert view.finding_view(view.group_findings([finding])[0]).tone == view.BAD

    report = Report(environment={}, trials=[trial])
    back = report_from_dict(json.loads(json.dumps(to_jsonable(report))))
    assert back.trials[0].guard_findings[0].status == "contents-changed"
    rp.write_junit(report, tmp_path / "junit.xml")
    failure = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite/testcase/failure")
    assert "finding: rank 0 runner.meta contents-changed" in failure.text


def test_harness_memory_use_nests_without_beginning_the_pool_twice(monkeypatch):
    """The guard's checks allocate in the harness pool from inside a scenario's own use() blocks;
    torch refuses a second begin on a pool it already allocates to, so inner blocks only count."""
    import contextlib

    entered = []

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        if entered:
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        entered.append(pool)
        try:
            yield
        finally:
            entered.pop()

    memory = HarnessMemory(CPU)
    memory.pool = "harness pool"
    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    with memory.use():
        with memory.use():
            assert entered == ["harness pool"] and memory.depth == 2
        assert memory.depth == 1
    assert entered == [] and memory.depth == 0
    with pytest.raises(ValueError):
        with memory.use():
            raise ValueError("a scenario's error")
    assert entered == [] and memory.depth == 0
