"""Tensor-parallel plumbing in the workers: process group (NCCL on GPU, gloo on CPU), gathers.

At world size 1 there is no process group and the helpers are identities, so scenario code
reads the same at every TP size.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TP:
    rank: int
    world_size: int
    backend: str | None               # None at world size 1

    @property
    def active(self) -> bool:
        return self.world_size > 1


def init_tp(rank: int, world_size: int, port: int, device: torch.device, timeout_s: float) -> TP:
    if world_size == 1:
        return TP(rank=0, world_size=1, backend=None)
    backend = "nccl" if device.type == "cuda" else "gloo"
    from datetime import timedelta
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s), **kwargs)
    return TP(rank=rank, world_size=world_size, backend=backend)


def all_gather_dim0(t: torch.Tensor, tp: TP) -> torch.Tensor:
    """[n, ...] per rank -> [world*n, ...] in a NEW tensor (the allocation the gemma bug is about)."""
    if not tp.active:
        return t
    out = torch.empty((tp.world_size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    with warnings.catch_warnings():
        # gloo on torch >= 2.13 warns that all_gather_into_tensor is deprecated in favour of
        # all_gather_single, which torch 2.11 (the GPU image) does not have.
        warnings.simplefilter("ignore")
        dist.all_gather_into_tensor(out, t.contiguous())
    return out


def all_reduce_sum(t: torch.Tensor, tp: TP) -> torch.Tensor:
    if tp.active:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def shutdown(tp: TP) -> None:
    if tp.active and dist.is_initialized():
        dist.destroy_process_group()
