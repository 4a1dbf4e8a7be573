"""The speculative loop's bookkeeping on CPU: accept-prefix, bonus token, lossless vs target-only."""

import pytest
import torch

from repro.config import load_preset, validate
from repro.rank.dist import TP
from repro.outcome import StepRecord
from repro.scenarios import gemma4_mtp as g
from repro.scenarios.gemma4_mtp_spec import measure
from repro.scenarios.gemma4_target import TargetStandIn
from repro.scenarios.specdec import SpecStats, accepted_lengths, emitted_tokens, first_divergence

DIMS = validate(load_preset("gemma4-tiny")).model
CPU = torch.device("cpu")
TP1 = TP(0, 1, None)


def t(rows):
    return torch.tensor(rows, dtype=torch.int64)


def test_accepts_the_longest_agreeing_prefix_then_the_bonus_token():
    drafts = t([[5, 6, 7], [5, 6, 7], [5, 9, 7], [1, 6, 7]])
    target = t([[5, 6, 7, 8], [5, 6, 4, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    accepted = accepted_lengths(drafts, target)
    assert accepted.tolist() == [3, 2, 1, 0]  # a later agreement after a miss does not count
    # Accepted drafts, then the target's own token at the first miss (or after all k).
    assert emitted_tokens(target, accepted) == [[5, 6, 7, 8], [5, 6, 4], [5, 6], [5]]


def test_accept_rejects_a_target_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"must be \[B, k\+1\] = \[1, 3\]"):
        accepted_lengths(t([[1, 2]]), t([[1, 2]]))


def test_stats_count_bonus_tokens_per_pass():
    s = SpecStats()
    s.add(t([3, 0]), k=3)
    s.add(t([1]), k=3)
    assert (s.passes, s.proposed, s.accepted, s.emitted) == (3, 9, 4, 7)
    assert s.acceptance_rate == pytest.approx(4 / 9)
    assert s.mean_accepted_length == pytest.approx(7 / 3)  # bonus included: 1..k+1


def test_first_divergence_names_sequence_and_position():
    assert first_divergence([[1, 2], [3]], [[1, 2], [3]]) is None
    assert first_divergence([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == (1, 1)
    assert first_divergence([[1, 2]], [[1, 2, 3]]) == (0, 2)


def build(mode="fixed"):
    drafter = g.Gemma4Drafter(DIMS, TP1, mode, CPU, seed=0)
    proposer = g.Proposer(drafter, DIMS.batch_sizes, None, CPU)
    target = TargetStandIn(DIMS, TP1, CPU, 0, g.full_lm_head(DIMS, 0, CPU))
    seqs = g.Sequences(*target.initial(max(DIMS.batch_sizes), 0))
    return drafter, proposer, target, seqs


def run_loop(sample, steps=7, k=3, commit=g.commit):
    """The scenario's loop at TP=1 with a given sampler; returns (stats, lossless per step)."""
    drafter, _, target, seqs = build()
    ref = seqs.clone()
    stats, lossless = SpecStats(), []
    sizes = [b for b in g.SCHEDULE if b <= max(DIMS.batch_sizes)]
    for step in range(steps):
        b = sizes[step % len(sizes)]
        drafted = g.propose(target, sample, seqs, b, k, drafter.dtype, TP1)
        target_tokens, states = g.verify(target, seqs, b, drafted.tokens)
        accepted = accepted_lengths(drafted.tokens, target_tokens)
        commit(seqs, b, target_tokens, states, accepted)
        emitted = emitted_tokens(target_tokens, accepted)
        lossless.append(first_divergence(emitted, g.target_only(target, ref, b, [len(e) for e in emitted])) is None)
        stats.add(accepted, k)
    return stats, lossless


def test_fixed_drafter_acceptance_is_high_and_the_loop_lossless():
    _, proposer, _, _ = build()
    stats, lossless = run_loop(proposer.eager_sample)
    assert all(lossless)
    assert stats.acceptance_rate >= 0.5, stats
    assert 1 + 3 * 0.5 <= stats.mean_accepted_length <= 4


def garbage_sampler(hidden):
    """A drafter reading garbage weights: valid token ids, unrelated to the hidden state."""
    gen = torch.Generator().manual_seed(int(hidden.float().sum().abs() * 1000) % 2**31)
    tokens = torch.randint(0, DIMS.vocab_size, (hidden.shape[0],), generator=gen)
    return tokens, torch.zeros(hidden.shape[0]), False


def test_garbage_drafts_collapse_acceptance_but_not_the_text():
    stats, lossless = run_loop(garbage_sampler)
    assert all(lossless)  # verification is lossless
    assert stats.acceptance_rate < 0.05
    assert stats.mean_accepted_length == pytest.approx(1.0, abs=0.1)  # the bonus token only


def test_lossless_check_catches_a_loop_that_accepts_one_draft_too_many():
    _, proposer, _, _ = build()

    def greedy_commit(seqs, b, target_tokens, states, accepted):
        g.commit(seqs, b, target_tokens, states, (accepted + 1).clamp(max=target_tokens.shape[1] - 1))

    _, lossless = run_loop(proposer.eager_sample, commit=greedy_commit)
    assert not all(lossless)


def test_target_greedy_is_the_argmax_over_the_whole_vocab():
    _, _, target, seqs = build()
    state = seqs.state[:5]
    full = state @ target.head[: DIMS.vocab_size].t()
    assert torch.equal(target.greedy([state])[0], full.argmax(dim=-1))


def test_drafter_centroids_are_the_cluster_directions_of_the_lm_head_rows():
    drafter = g.Gemma4Drafter(DIMS, TP1, "fixed", CPU, seed=0)
    rows = g.full_lm_head(DIMS, 0, CPU).float()
    groups = drafter.masked_embedding.token_ordering.view(DIMS.num_centroids, -1)
    centroids = drafter.masked_embedding.centroids.weight.float()
    # Every token's own cluster is its best centroid: the clustering is known by construction.
    best = (rows @ centroids.t()).argmax(dim=-1)
    cluster = torch.empty(DIMS.vocab_size, dtype=torch.int64)
    cluster[groups.flatten()] = torch.arange(DIMS.num_centroids).repeat_interleave(groups.shape[1])
    assert (best == cluster).float().mean() > 0.99


def test_trial_metrics_come_from_rank_0_steps():
    steps = [
        StepRecord(
            step=i,
            rank=r,
            batch=2,
            replayed=True,
            seconds=0.5,
            extra={"passes": 2, "proposed": 6, "accepted": a, "emitted": a + 2, "lossless": True},
        )
        for i, a in enumerate([6, 0])
        for r in (0, 1)
    ]
    m = measure(steps)
    assert m["acceptance_rate"] == pytest.approx(0.5)
    assert m["mean_accepted_length"] == pytest.approx(10 / 4)
    assert m["lossless"] is True and m["tokens_per_s"] == pytest.approx(10 / 1.0)
    assert measure([StepRecord(step=0, rank=0, batch=1, replayed=False)]) == {}
