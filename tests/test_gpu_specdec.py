"""The speculative loop on a GPU: TP 2 on one GPU (--share-gpu, gloo), real centroid graphs.

What an engine shows, asserted: the fixed drafter is accepted most of the time; the unfixed one
reading reused memory (`reuse`) is almost never accepted, yet the text stays lossless and no
error is raised; `release` kills the worker.
"""

import pytest

from repro.env import gpus
from repro.outcome import Outcome
from repro.run.runner import plan, run_planned

pytestmark = pytest.mark.gpu


def shared_trial(tmp_path, **run):
    if gpus.gpu_count() < 1:
        pytest.skip("needs a CUDA GPU")
    p = plan("gemma4-mtp", "gemma4-e2b", {"tp": 2, "share_gpu": True, "steps": 14, **run}, [], gpus.gpu_count())
    assert p.device == "cuda"
    return run_planned([p], tmp_path).report.trials[0]


def test_fixed_drafter_is_accepted_and_lossless(tmp_path):
    t = shared_trial(tmp_path, mode="fixed")
    assert t.outcome == Outcome.CLEAN and t.graph_replayed
    assert t.measures["lossless"] is True and t.measures["acceptance_rate"] >= 0.5
    assert t.details["tp_transport"] == "TP over gloo, ranks share one GPU (not NCCL)"


def test_reused_memory_collapses_acceptance_silently(tmp_path):
    t = shared_trial(tmp_path, mode="unfixed", after_free="reuse")
    assert t.outcome == Outcome.MISMATCH  # graph drafts differ from the eager drafter
    assert t.measures["lossless"] is True and t.measures["acceptance_rate"] < 0.1  # same text, the drafts wasted
    assert all(r.exitcode == 0 for r in t.ranks)  # and no error anywhere


def test_released_memory_kills_the_worker(tmp_path):
    t = shared_trial(tmp_path, mode="unfixed", after_free="release")
    assert t.outcome == Outcome.ILLEGAL_ADDRESS
