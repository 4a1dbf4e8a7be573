"""A stand-in for the Gemma 4 target model at its real head dimensions, for the speculative loop.

Not a transformer: a recurrent backbone state per sequence [backbone_hidden] (fp32) that each
token updates, and a vocab-parallel lm_head [vocab_padded / tp, backbone_hidden] sharded over
the TP ranks as vLLM's ParallelLMHead is. Greedy over the full vocab across ranks: each rank
takes the max of its shard's logits, the ranks all-gather (value, token) pairs, the best wins
(ties: the lowest token id). It is what the loop needs from a target: deterministic greedy
tokens from hidden states, at the real head's size and cost.

How it relates to the drafter (the construction, documented because acceptance depends on it):
- the drafter's lm_head rows are cluster centres plus noise (gemma4_mtp.full_lm_head); the
  target's head holds those rows in `draft_dims` (hidden_size of the backbone_hidden
  coordinates) and private noise in the rest (PRIVATE_NOISE): the target knows more than the
  drafter, so the drafter is right only most of the time;
- the drafter's hidden state is the draft_dims part of the target's backbone state (its MTP
  layers stand-in), so its centroid-masked argmax tracks the target's greedy token;
- a token's input embedding is the head row of its successor (SUCCESSOR: a fixed random
  permutation), and the state keeps MEMORY of the previous state through a fixed signed
  permutation of coordinates, so the text is neither constant nor a pure successor chain.
"""

from __future__ import annotations

import torch

from repro.rank.dist import TP, all_gather_dim0
from repro.scenarios.gemma4_mtp_spec import Gemma4Dims

PRIVATE_NOISE = 0.45  # norm of a head row's private part (the drafter's rows have norm ~1)
# Weight of the (mixed) previous state in the next state, per sqrt(backbone_hidden): a token's
# logit gets a field of std ~MEMORY from the memory, whatever the dims, so the text depends on
# its history at E2B dims as much as at tiny ones.
MEMORY = 0.09


def padded_vocab(vocab: int, tp: int, pad_to: int = 64) -> int:
    """Vocab-parallel heads pad the vocab to a multiple of pad_to * tp."""
    unit = pad_to * tp
    return (vocab + unit - 1) // unit * unit


class TargetStandIn:
    """Backbone state [N, backbone_hidden] fp32 -> greedy token, with a vocab-parallel head."""

    def __init__(self, dims: Gemma4Dims, tp: TP, device: torch.device, seed: int, draft_rows: torch.Tensor):
        """draft_rows: the drafter's full lm_head [vocab, hidden_size] (as built on every rank)."""
        self.tp, self.device = tp, device
        self.vocab_size, self.hidden = dims.vocab_size, dims.backbone_hidden_size
        self.memory = MEMORY * self.hidden**0.5
        gen = torch.Generator(device=device)
        gen.manual_seed(seed * 7919 + 29)
        self.draft_dims = torch.randperm(self.hidden, generator=gen, device=device)[: dims.hidden_size]
        self.mix = torch.randperm(self.hidden, generator=gen, device=device)  # [Hb]
        self.signs = torch.randint(0, 2, (self.hidden,), generator=gen, device=device).float() * 2 - 1
        self.successor = torch.randperm(dims.vocab_size, generator=gen, device=device)  # [V]
        rows = padded_vocab(dims.vocab_size, tp.world_size) // tp.world_size
        self.lo = tp.rank * rows
        self.valid = max(0, min(rows, dims.vocab_size - self.lo))  # real (unpadded) rows of this shard
        # The full head is drawn on every rank and sliced, so the tokens do not depend on TP.
        private = dims.hidden_size < self.hidden
        full = torch.randn(dims.vocab_size, self.hidden, generator=gen, device=device)
        full *= PRIVATE_NOISE / max(1, self.hidden - dims.hidden_size) ** 0.5 if private else 0.0
        full[:, self.draft_dims] = draft_rows.float()
        self.head = torch.zeros(rows, self.hidden, device=device)  # [V_pad / tp, Hb]
        self.head[: self.valid] = full[self.lo : self.lo + self.valid]
        del full

    def initial(self, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(state [n, Hb], last token [n]) of n sequences at the start, seeded."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed * 1_000_003 + 5)
        state = torch.randn(n, self.hidden, generator=gen, device=self.device)
        tokens = torch.randint(0, self.vocab_size, (n,), generator=gen, device=self.device)
        return state / state.norm(dim=-1, keepdim=True), tokens

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [N] -> input embeddings [N, Hb]; vocab-parallel: each row lives on one rank."""
        ids = self.successor[tokens] - self.lo
        mine = (ids >= 0) & (ids < self.valid)
        local = self.head[ids.clamp(0, self.head.shape[0] - 1)] * mine[:, None]
        # A sum over ranks of one row and zeros: exact, so every rank holds the same embedding.
        return all_gather_dim0(local[None], self.tp).sum(dim=0)

    def advance_embedded(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """The state after consuming a token whose embedding is given: [N, Hb] -> [N, Hb]."""
        new = self.memory * state[:, self.mix] * self.signs + embedded
        return new / new.norm(dim=-1, keepdim=True)

    def advance(self, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.advance_embedded(state, self.embed(tokens))

    def greedy(self, states: list[torch.Tensor]) -> torch.Tensor:
        """states: P tensors [B, Hb] -> greedy tokens [P, B] over the full vocab, one gather.

        One head GEMM per position, each [B, Hb] x [Hb, V/tp]: target-only decoding runs the
        same shape, so a position's logits are bit-identical in both (no batch-shape effects).
        """
        pairs = torch.stack([self.local_best(s) for s in states])  # [P, B, 2]
        everyone = all_gather_dim0(pairs[None], self.tp)  # [W, P, B, 2]
        best_rank = everyone[..., 0].argmax(dim=0)  # first max: lowest ids
        return everyone[..., 1].gather(0, best_rank[None]).squeeze(0).long()  # [P, B]

    def local_best(self, state: torch.Tensor) -> torch.Tensor:
        """[B, Hb] -> [B, 2] float64 (max logit of this shard, its global token id)."""
        logits = state @ self.head.t()  # [B, V/tp]
        logits[:, self.valid :] = float("-inf")  # padding rows
        value, index = logits.max(dim=-1)
        return torch.stack([value.double(), (index + self.lo).double()], dim=-1)

    def draft_hidden(self, state: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The drafter's hidden state [N, hidden_size] from the target's backbone state."""
        return state[:, self.draft_dims].to(dtype)
