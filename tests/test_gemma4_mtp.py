"""gemma4-mtp on CPU: TP math on gloo, the mode difference, guard verdicts through the runner."""

import pytest
import torch
import torch.multiprocessing as mp

from repro.config import load_preset
from repro.rank.dist import TP, init_tp, shutdown
from repro.outcome import Outcome
from repro.run.runner import plan, run_planned
from repro.scenarios.gemma4_mtp import (
    Gemma4Drafter,
    Oracle,
    Proposer,
    Sequences,
    decode_step,
    full_lm_head,
    make_lm_head_shard,
    padded_vocab,
    target_only,
)
from repro.scenarios.gemma4_target import TargetStandIn
from repro.scenarios.specdec import emitted_tokens, first_divergence

DIMS = load_preset("gemma4-tiny").model  # vocab 4000, 50 centroids, top-4, hidden 64
CPU = torch.device("cpu")


def test_padded_vocab_like_a_vocab_parallel_head():
    assert padded_vocab(262144, 2) == 262144
    assert padded_vocab(4000, 1) == 4032
    assert padded_vocab(4000, 3) == 4032  # multiple of 64 * 3 = 192
    assert padded_vocab(4000, 4) == 4096


def test_tp1_full_weight_is_a_view_of_the_live_parameter():
    d = Gemma4Drafter(DIMS, TP(0, 1, None), "unfixed", CPU, seed=0)
    w = d.full_lm_head_weight()
    assert w.untyped_storage().data_ptr() == d.lm_head.weight.untyped_storage().data_ptr()
    assert w.shape == (DIMS.vocab_size, DIMS.hidden_size)
    assert d._stable_full_lm_head_weight is None  # TP=1 never caches, in any mode


def _tp_worker(rank, world, rendezvous, queue, received):
    torch.set_grad_enabled(False)  # as in the harness's workers
    tp = init_tp(rank, world, rendezvous, CPU, timeout_s=60)
    try:
        out = {}
        for mode in ("unfixed", "fixed"):
            d = Gemma4Drafter(DIMS, tp, mode, CPU, seed=0)
            first, second = d.full_lm_head_weight(), d.full_lm_head_weight()
            out[mode] = {
                "full": first.clone(),
                "fresh_each_call": first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr(),
                "cached": d._stable_full_lm_head_weight is not None,
                "shard_rows": d.lm_head.weight.shape[0],
            }
            if mode == "fixed":
                d.load_weights(make_lm_head_shard(DIMS, tp, CPU, seed=1))
                out[mode]["cache_after_reload"] = d._stable_full_lm_head_weight is not None
        h = torch.randn(8, DIMS.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
        out["tokens"] = Oracle(d.masked_embedding, out["unfixed"]["full"]).top_tokens(h, 8)
        out["emitted"], out["accepted"] = decode(tp)
        queue.put((rank, out))
        # Tensors travel as shared memory the parent maps on unpickling: stay alive until it has.
        received.wait(timeout=120)
    finally:
        shutdown(tp)


def decode(tp, steps=4, k=3):
    """The speculative loop for a few steps: (emitted tokens per step, accepted per step)."""
    drafter = Gemma4Drafter(DIMS, tp, "fixed", CPU, seed=0)
    proposer = Proposer(drafter, DIMS.batch_sizes, None, CPU)
    target = TargetStandIn(DIMS, tp, CPU, 0, full_lm_head(DIMS, 0, CPU))
    seqs = Sequences(*target.initial(max(DIMS.batch_sizes), 0))
    ref, emitted, accepted = seqs.clone(), [], []
    for step, b in enumerate([1, 8, 5, 2][:steps]):
        drafted, target_tokens, acc = decode_step(target, proposer.eager_sample, seqs, b, k, drafter.dtype, tp)
        emitted.append(emitted_tokens(target_tokens, acc))
        accepted.append(acc.tolist())
        assert first_divergence(emitted[-1], target_only(target, ref, b, [len(e) for e in emitted[-1]])) is None
        assert drafted.rank_disagreements == 0
    return emitted, accepted


def run_tp(world, rendezvous):
    ctx = mp.get_context("spawn")
    queue, received = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_tp_worker, args=(r, world, rendezvous, queue, received)) for r in range(world)]
    return procs, queue, received


@pytest.mark.parametrize("world", [2, 3])  # even and uneven shards of the padded vocab
def test_tp_gather_equals_full_weight_and_tokens_match_tp1(world, tmp_path):
    procs, queue, received = run_tp(world, tmp_path / "store_port")
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    received.set()
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    ref = Gemma4Drafter(DIMS, TP(0, 1, None), "unfixed", CPU, seed=0)
    full_ref = ref.full_lm_head_weight()
    h = torch.randn(8, DIMS.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    tokens_ref = Oracle(ref.masked_embedding, full_ref).top_tokens(h, 8)
    for rank, out in results.items():
        assert out["unfixed"]["shard_rows"] == padded_vocab(DIMS.vocab_size, world) // world
        assert torch.equal(out["unfixed"]["full"], full_ref)  # gather + slice = the TP=1 weight
        assert torch.equal(out["tokens"], tokens_ref)  # same draft tokens at any TP
        assert out["unfixed"]["fresh_each_call"] and not out["unfixed"]["cached"]  # the bug's shape
        assert not out["fixed"]["fresh_each_call"] and out["fixed"]["cached"]  # the fix's shape
        assert out["fixed"]["cache_after_reload"] is False  # upstream resets it
        # The loop (vocab-parallel target, greedy across ranks) emits what it emits at TP=1.
        assert (out["emitted"], out["accepted"]) == decode(TP(0, 1, None))


VERDICTS = {  # name -> (run overrides, expected outcome)
    "unfixed tp2": ({"mode": "unfixed", "tp": 2}, Outcome.STALE_CAPTURE),
    "fixed tp2": ({"mode": "fixed", "tp": 2}, Outcome.CLEAN),
    "reload-safe reload": ({"mode": "reload-safe", "tp": 2, "reload_drafter": True}, Outcome.CLEAN),
    "unfixed tp1": ({"mode": "unfixed", "tp": 1}, Outcome.CLEAN),
    "fixed reload": ({"mode": "fixed", "tp": 2, "reload_drafter": True}, Outcome.STALE_CAPTURE),
}


@pytest.fixture(scope="module")
def cpu_trials(tmp_path_factory):
    """Every CPU verdict case through the runner, several at once (each in its own processes)."""
    planned = [
        plan("gemma4-mtp", "gemma4-tiny", {"device": "cpu", "steps": 4, **run}, [], gpus=0)
        for run, _ in VERDICTS.values()
    ]
    result = run_planned(planned, tmp_path_factory.mktemp("gemma4-cpu"), jobs=3)
    return dict(zip(VERDICTS, result.report.trials))


def test_cpu_unfixed_tp2_is_stale_capture_naming_the_gathered_local(cpu_trials):
    t = cpu_trials["unfixed tp2"]
    assert t.outcome == Outcome.STALE_CAPTURE and t.met
    assert not t.graph_replayed
    assert {f.rank for f in t.guard_findings} == {0, 1}
    f = t.guard_findings[0]
    assert f.status == "freed" and "lm_head_weight" in f.slot
    assert f.shape == [DIMS.vocab_size, DIMS.hidden_size] and f.dtype.endswith("bfloat16")
    assert "setup_centroid_graphs" in (f.freed_at or "") or "setup_centroid_graphs" in f.slot
    assert any("no CUDA graph" in n for n in t.notes)
    assert all(s.mismatches == 0 for s in t.steps)  # eager stand-in uses live weights: no symptom on CPU


@pytest.mark.parametrize("name", list(VERDICTS))
def test_cpu_verdicts(cpu_trials, name):
    run, expected = VERDICTS[name]
    t = cpu_trials[name]
    assert t.outcome == expected and t.met, (t.outcome, t.first_failure)
    if run.get("reload_drafter"):
        m = [m for m in t.manifests if m.rank == 0][0]
        assert m.when == "after drafter reload"
        assert (m.freed > 0) == (expected == Outcome.STALE_CAPTURE)


def test_cpu_trial_measures_acceptance_and_lossless_on_gloo(cpu_trials):
    t = cpu_trials["fixed tp2"]
    assert t.outcome == Outcome.CLEAN and t.met
    m = t.measures
    assert m["lossless"] is True
    assert m["acceptance_rate"] >= 0.5  # a drafter worth its name
    k = t.config["run"]["num_speculative_tokens"]
    assert k == 3 and 1 <= m["mean_accepted_length"] <= k + 1
    assert m["tokens_per_s"] and m["tokens_per_s"] > 0
    per_rank = [[(s.step, s.extra["accepted"], s.extra["emitted"]) for s in t.steps if s.rank == r] for r in (0, 1)]
    assert per_rank[0] == per_rank[1] and len(per_rank[0]) == 4  # both ranks verified the same drafts
    assert all(s.compared == s.batch * k for s in t.steps)
    assert t.details["num_speculative_tokens"] == 3 and t.details["tp_transport"] == "gloo"


def test_rank_waits_for_rank0_store_port_and_says_where(tmp_path):
    from datetime import timedelta
    from repro.rank.dist import open_store

    with pytest.raises(TimeoutError, match="rank 1: rank 0 published no store port in .*store_port"):
        open_store(1, 2, tmp_path / "store_port", timedelta(seconds=0.2))


def test_rank0_binds_its_own_port_and_publishes_it(tmp_path):
    from datetime import timedelta
    from repro.rank.dist import open_store

    master = open_store(0, 2, tmp_path / "store_port", timedelta(seconds=5))
    port = int((tmp_path / "store_port").read_text())
    assert port == master.port and port > 0
    client = open_store(1, 2, tmp_path / "store_port", timedelta(seconds=5))
    client.set("k", "v")
    assert master.get("k") == b"v"
