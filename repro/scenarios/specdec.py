"""Greedy speculative decoding bookkeeping: accept the longest agreeing prefix, then the bonus token.

The target scores a sequence's k drafts in one pass, which gives its own greedy token at each
of the k+1 positions (after the last emitted token, and after each draft). The drafts are
accepted up to the first one that differs from the target's token at its position; the
target's token at that position (the "bonus" token: a correction, or the token after k
accepted drafts) is emitted too. So every pass emits 1..k+1 tokens, and exactly the tokens
target-only greedy decoding would emit: a wrong draft costs throughput, never text. That is
why an engine whose drafter reads garbage shows no error and the same output, only a lower
acceptance rate.

Pure tensor code, no collectives: the scenario and the tests share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def accepted_lengths(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """drafts [B, k], target [B, k+1] (the target's token at each position) -> accepted [B] in 0..k."""
    k = drafts.shape[1]
    if target.shape != (drafts.shape[0], k + 1):
        raise ValueError(
            f"target tokens {tuple(target.shape)} must be [B, k+1] = [{drafts.shape[0]}, {k + 1}] "
            f"for drafts {tuple(drafts.shape)}"
        )
    agree = (drafts == target[:, :k]).to(torch.int64)  # [B, k]
    return agree.cumprod(dim=1).sum(dim=1)  # length of the agreeing prefix


def emitted_tokens(target: torch.Tensor, accepted: torch.Tensor) -> list[list[int]]:
    """The tokens each sequence emits: its accepted drafts (equal to the target's tokens at
    those positions) and the bonus token, i.e. target[i, :accepted[i] + 1]."""
    rows = target.tolist()
    return [row[: n + 1] for row, n in zip(rows, accepted.tolist())]


@dataclass
class SpecStats:
    """Counts over one or more verification passes (one per sequence per step)."""

    passes: int = 0  # sequence-steps: one target verification each
    proposed: int = 0  # drafts proposed (passes * k)
    accepted: int = 0  # drafts accepted
    emitted: int = 0  # tokens emitted (accepted + one bonus per pass)

    def add(self, accepted: torch.Tensor, k: int) -> None:
        n = accepted.numel()
        total = int(accepted.sum())
        self.passes += n
        self.proposed += n * k
        self.accepted += total
        self.emitted += total + n

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (vLLM's draft acceptance rate)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target pass, the bonus token included: 1 (no draft accepted) .. k+1."""
        return self.emitted / self.passes if self.passes else 0.0


def first_divergence(emitted: list[list[int]], reference: list[list[int]]) -> tuple[int, int] | None:
    """(sequence, position) of the first emitted token that differs from the reference, or None."""
    for i, (got, want) in enumerate(zip(emitted, reference)):
        for j, (a, b) in enumerate(zip(got, want)):
            if a != b:
                return i, j
        if len(got) != len(want):
            return i, min(len(got), len(want))
    return None
