"""GPU memory claimed by concurrent CUDA trials (repro/run/ledger.py), and the runner's use of it.

No GPU here: the ledger is plain bookkeeping over byte counts, and the runner's trials are
stand-ins (run_trial replaced) that record when they ran, so overlap is seen directly.
"""

import threading
import time

import pytest

from repro.run import runner
from repro.config import load_preset
from repro.run.footprint import expected_peak_bytes, needed_bytes
from repro.run.ledger import USABLE, MemoryLedger, need_on, trial_gpus
from repro.outcome import RankExit
from repro.report.view import memory_fact

GIB = 1 << 30


def in_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn()), daemon=True)
    thread.start()
    return thread, out


def test_a_claim_waits_while_it_does_not_fit_beside_running_trials():
    ledger = MemoryLedger([100 * GIB])
    first = ledger.claim({0: 60 * GIB})
    thread, out = in_thread(lambda: ledger.claim({0: 60 * GIB}))
    thread.join(0.6)
    assert thread.is_alive()  # 120 GiB > 90 GiB usable: held back
    ledger.release(first)
    thread.join(5)
    assert not thread.is_alive() and out["value"].need == {0: 60 * GIB} and out["value"].waited_s >= 0.5
    assert ledger.promised == {0: 60 * GIB}


def test_claims_that_fit_together_run_together_and_a_trial_alone_is_never_held_back():
    ledger = MemoryLedger([100 * GIB, 100 * GIB])
    a = ledger.claim({0: 40 * GIB})
    b = ledger.claim({0: 40 * GIB, 1: 40 * GIB})  # 80 GiB on GPU 0 fits in 90
    assert a.waited_s < 0.5 and b.waited_s < 0.5
    ledger.release(a)
    ledger.release(b)
    huge = ledger.claim({1: 500 * GIB})  # alone on GPU 1: runs (the footprint
    assert huge.waited_s < 0.5  # check refuses what cannot fit at all)
    assert ledger.capacity(0) == int(100 * GIB * USABLE)


def test_claims_are_served_in_order_so_a_large_trial_is_not_starved():
    ledger = MemoryLedger([100 * GIB])
    small = ledger.claim({0: 10 * GIB})
    large_thread, large = in_thread(lambda: ledger.claim({0: 85 * GIB}))
    time.sleep(0.3)
    small_thread, later = in_thread(lambda: ledger.claim({0: 10 * GIB}))
    small_thread.join(0.6)
    assert large_thread.is_alive() and small_thread.is_alive()  # the later small one waits its turn
    ledger.release(small)
    large_thread.join(5)
    assert "value" in large and small_thread.is_alive()  # 85 + 10 > 90: still behind the large
    ledger.release(large["value"])
    small_thread.join(5)
    assert "value" in later


def test_stop_while_waiting_promises_nothing():
    ledger = MemoryLedger([10 * GIB])
    held = ledger.claim({0: 8 * GIB})
    stop = threading.Event()
    thread, out = in_thread(lambda: ledger.claim({0: 8 * GIB}, stop))
    time.sleep(0.3)
    stop.set()
    thread.join(5)
    assert out["value"] is None and ledger.promised == {0: 8 * GIB} and ledger.holders == {0: 1}
    ledger.release(held)
    assert ledger.claim({0: 8 * GIB}).waited_s < 0.5  # the stopped ticket left no queue behind


@pytest.mark.parametrize(
    "slot, lanes, tp, share, gpus",
    [
        (0, 2, 1, False, [0]),
        (1, 2, 1, False, [1]),
        (3, 2, 1, False, [1]),  # TP=1 spread by slot
        (1, 4, 2, False, [1, 2]),
        (3, 4, 2, False, [3, 0]),  # rank r on the slot's r-th GPU
        (1, 2, 2, True, [1, 1]),
        (0, 0, 1, False, []),  # --share-gpu; no GPUs
    ],
)
def test_trial_gpus_follow_the_slot_rotation_of_lane_env(slot, lanes, tp, share, gpus):
    assert trial_gpus(slot, lanes, tp, share) == gpus
    if lanes and not share:
        visible = (
            (runner.lane_env(slot, [str(i) for i in range(lanes)]) or {})
            .get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(lanes)))
            .split(",")
        )
        assert [int(visible[r]) for r in range(tp)] == gpus
    assert need_on([1, 1, 2], 5) == {1: 10, 2: 5}


def test_workspace_grow_expects_its_pool_to_keep_every_ascending_capture():
    """The estimate is far above the lower bound at the real dims, and the path that empties the
    cache at each growth (unfixed, replace) is expected lower than the ones that never do."""
    cfg = load_preset("turboquant-decode")
    cfg.run.mode, cfg.run.resize_in_place = "unfixed", False
    replace = expected_peak_bytes(cfg)
    cfg.run.resize_in_place = True
    resize = expected_peak_bytes(cfg)
    assert needed_bytes(cfg) < replace < resize and resize > 20 * needed_bytes(cfg)
    other = load_preset("gemma4-e2b")
    assert expected_peak_bytes(other) == needed_bytes(other)  # no estimate of its own: the footprint


def planned_cuda(preset: str, mode: str = "", tp: int = 1):
    cfg = load_preset(preset)
    cfg.run.tp, cfg.run.mode = tp, mode or cfg.run.mode
    return runner.Planned(cfg=cfg, device="cuda")


def fake_trial(spans: list, seconds: float):
    """A run_trial stand-in: notes when it ran and returns a record with notes."""

    class Trial:
        def __init__(self):
            self.notes = []

    def run_trial(cfg, device, run_dir, tid, **kw):
        start = time.monotonic()
        time.sleep(seconds)
        spans.append((tid, start, time.monotonic()))
        return Trial()

    return run_trial


def test_the_runner_does_not_start_a_cuda_trial_beside_one_its_memory_does_not_fit(tmp_path, monkeypatch):
    spans = []
    monkeypatch.setattr(runner, "run_trial", fake_trial(spans, 1.5))  # a wait of >= 1 s is noted
    monkeypatch.setattr(runner.gpus, "visible_memory", lambda: [140 * GIB])
    planned = [planned_cuda("turboquant-decode", "fixed") for _ in range(2)]  # ~112 GiB each: one at a time
    ledger = runner.gpu_ledger(planned, ["0"])
    assert ledger is not None and ledger.totals == [140 * GIB]
    result = runner.run_all(planned, tmp_path, runner.Hooks(), None, 2, ["0"], ledger=ledger)
    (a, a0, a1), (b, b0, b1) = sorted(spans, key=lambda s: s[1])
    assert b0 >= a1  # never together
    waited = [t.notes for t in result.report.trials]
    assert sum(1 for notes in waited if notes and notes[0].startswith("waited ")) == 1
    assert "GiB a rank" in next(n[0] for n in waited if n)


def test_the_runner_runs_small_cuda_trials_together_and_has_no_ledger_without_cuda_or_nvml(tmp_path, monkeypatch):
    spans = []
    monkeypatch.setattr(runner, "run_trial", fake_trial(spans, 0.8))
    monkeypatch.setattr(runner.gpus, "visible_memory", lambda: [140 * GIB])
    planned = [planned_cuda("gemma4-tiny"), planned_cuda("gemma4-tiny")]
    ledger = runner.gpu_ledger(planned, ["0"])
    runner.run_all(planned, tmp_path, runner.Hooks(), None, 2, ["0"], ledger=ledger)
    (_, a0, a1), (_, b0, b1) = sorted(spans, key=lambda s: s[1])
    assert b0 < a1  # overlapped
    cpu = [runner.Planned(cfg=load_preset("gemma4-tiny"), device="cpu")]
    assert runner.gpu_ledger(cpu, ["0"]) is None and runner.gpu_ledger(planned, []) is None
    monkeypatch.setattr(runner.gpus, "visible_memory", lambda: [])
    assert runner.gpu_ledger(planned, ["0"]) is None


def test_memory_fact_says_each_ranks_peak_only_where_a_rank_said_it():
    def rank(r, peak):
        return RankExit(
            rank=r, pid=1, exitcode=0, signal=None, killed_by_harness=False, stderr_tail="", peak_reserved_bytes=peak
        )

    class Trial:
        ranks = [rank(0, 3 * GIB), rank(1, None)]

    assert memory_fact(Trial()) == "peak reserved 3 GiB (rank 0)"
    Trial.ranks = [rank(0, None)]
    assert memory_fact(Trial()) is None


def test_a_ranks_last_word_gives_its_peak_and_a_cpu_trial_has_none(tmp_path):
    """The peak comes from the rank's done (or error) record; a CPU rank says None."""
    import types
    from repro.run import isolate
    from repro.run.protocol import Event, RankRecords

    proc = types.SimpleNamespace(returncode=0, pid=7)
    rank = isolate.Rank(rank=0, proc=proc, log=None, pgid=7)
    said = RankRecords(
        [
            {"event": Event.START.value, "pid": 7},
            {"event": Event.DONE.value, "timings": {}, "peak_reserved_bytes": 5 * GIB},
        ]
    )
    assert isolate.rank_exit(rank, said, str(tmp_path)).peak_reserved_bytes == 5 * GIB
    failed = RankRecords(
        [
            {"event": Event.START.value, "pid": 7},
            {
                "event": Event.ERROR.value,
                "type": "OutOfMemoryError",
                "message": "",
                "traceback": "",
                "peak_reserved_bytes": 9 * GIB,
            },
        ]
    )
    assert isolate.rank_exit(rank, failed, str(tmp_path)).peak_reserved_bytes == 9 * GIB
    assert isolate.rank_exit(rank, RankRecords([]), str(tmp_path)).peak_reserved_bytes is None


def test_a_cpu_trial_records_no_gpu_memory(tmp_path):
    result = runner.run_planned(
        [runner.plan("selftest", None, {"tp": 1, "steps": 1, "device": "cpu"}, [], gpus=0)], tmp_path
    )
    (trial,) = result.report.trials
    assert [r.peak_reserved_bytes for r in trial.ranks] == [None] and memory_fact(trial) is None


class NewStorages:
    """Live bytes of the storages that ops make inside the block (not those made before it),
    and their peak: what the caching allocator must hold at once for them."""

    def __init__(self, before):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten
        import weakref

        self.live, self.peak, refs = {}, 0, []
        known = {t.untyped_storage()._cdata for t in before}
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        storage = t.untyped_storage()
                        key = storage._cdata
                        if key in known or key in outer.live:
                            continue
                        outer.live[key] = storage.nbytes()
                        refs.append(weakref.ref(storage, lambda _, key=key: outer.live.pop(key, None)))
                        outer.peak = max(outer.peak, sum(outer.live.values()))
                return out

        self.mode = Mode()


@pytest.mark.parametrize("preset, batch", [("workspace-tiny", 8), ("turboquant-decode", 2)])
def test_workspace_grows_scratch_estimate_covers_what_its_decode_allocates(preset, batch):
    """The per-size term of workspace-grow's peak estimate against the decode's own ops (the
    same aten ops on any device, run here on CPU): not below their peak of new storages, and
    not far above it (4.90 MiB a sequence measured at turboquant-decode's dims, 5.38 estimated)."""
    import torch
    from repro.scenarios import workspace_grow as wg
    from repro.scenarios.workspace_grow_spec import decode_scratch

    dims = load_preset(preset).model
    dims.capture_sizes = [batch]
    cpu = torch.device("cpu")
    state = wg.make_state(dims, 0, torch.bfloat16, cpu)
    ws = wg.WorkspaceManager(cpu, resize_in_place=False)
    mid_o, output, lse = ws.get_simultaneous(*wg.torch_views(dims, batch))
    new = NewStorages([state.k_cache, state.v_cache, state.q, state.seq_lens, mid_o])
    with torch.no_grad(), new.mode:
        wg.split_kv_stage1(state.q[:batch], state.k_cache[:batch], state.v_cache[:batch], state.seq_lens[:batch], mid_o)
        wg.reduce_splits(mid_o, output, lse)
    assert new.peak <= decode_scratch(dims, batch) <= 1.3 * new.peak, (new.peak, decode_scratch(dims, batch))


def test_an_interrupt_while_a_trial_waits_for_memory_leaves_it_not_run(tmp_path, monkeypatch):
    spans = []
    monkeypatch.setattr(runner, "run_trial", fake_trial(spans, 1.5))
    monkeypatch.setattr(runner.gpus, "visible_memory", lambda: [140 * GIB])
    planned = [planned_cuda("turboquant-decode", "fixed") for _ in range(2)]
    start = time.monotonic()

    class Interrupts:  # a Ctrl-C half a second in
        name = "SIGINT"

        def pending(self):
            return time.monotonic() - start > 0.5

    result = runner.run_all(
        planned,
        tmp_path,
        runner.Hooks(),
        None,
        2,
        ["0"],
        interrupts=Interrupts(),
        ledger=runner.gpu_ledger(planned, ["0"]),
    )
    assert len(spans) == 1 and len(result.report.trials) == 1 and result.report.not_run == 1
    assert result.interrupted and result.report.interrupted_by == "SIGINT"


def test_an_out_of_memory_crash_says_first_when_the_scenario_outgrows_the_gpu(monkeypatch):
    """workspace-grow fixed at turboquant-decode's dims is expected to keep ~112 GiB in its
    shared pool: on an 80 GB card (79.2 GiB) torch's allocator raises. The trial stays CRASH
    (it did crash), and its detail names the estimate and the GPU first; on a GPU the estimate
    fits, or for an error that is not out-of-memory, the detail is the error alone."""
    from repro.outcome import Outcome
    from repro.run import footprint, isolate
    from repro.run.protocol import RankRecords

    cfg = load_preset("turboquant-decode")
    cfg.run.mode = "fixed"
    message = (
        "CUDA out of memory. Tried to allocate 928.00 MiB. GPU 0 has a total capacity of 79.18 GiB "
        "of which 830.19 MiB is free."
    )
    recs = [
        RankRecords([{"event": "begin", "step": 0}, {"event": "error", "type": "OutOfMemoryError", "message": message}])
    ]
    exits = [RankExit(0, 123, 1, None, False, "", error=f"OutOfMemoryError: {message}")]
    waited = isolate.Waited(spawned_at=0.0, ended_at=1.0, first_death=0)
    peak = expected_peak_bytes(cfg)

    def classify_on(total: int):
        monkeypatch.setattr(footprint.gpus, "visible_memory", lambda *a, **k: [total])
        return isolate.classify(cfg, recs, exits, waited)

    outcome, first = classify_on(int(79.18 * GIB))
    assert outcome == Outcome.CRASH and first.step == 0
    assert first.detail.startswith(
        f"out of GPU memory: workspace-grow at these model sizes is expected to reach about {peak / GIB:,.1f} GiB"
    )
    assert "the GPU it runs on has 79.2 GiB" in first.detail and "OutOfMemoryError: CUDA out of memory" in first.detail
    outcome, first = classify_on(peak + GIB)  # it was expected to fit: the error alone
    assert outcome == Outcome.CRASH and first.detail.startswith("OutOfMemoryError: CUDA out of memory")
    other = [RankExit(0, 123, 1, None, False, "", error="RuntimeError: cuBLAS handle")]
    other_recs = [RankRecords([{"event": "error", "type": "RuntimeError", "message": "cuBLAS handle"}])]
    monkeypatch.setattr(footprint.gpus, "visible_memory", lambda *a, **k: [int(79.18 * GIB)])
    _, first = isolate.classify(cfg, other_recs, other, waited)
    assert first.detail == "RuntimeError: cuBLAS handle"
