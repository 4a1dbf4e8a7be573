"""Tensor parallelism in the workers: the process group (NCCL on GPU, gloo on CPU) and its gathers.

At world size 1 there is no process group and the helpers are identities, so scenario code
reads the same at every TP size.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass
class TP:
    rank: int
    world_size: int
    backend: str | None  # None at world size 1

    @property
    def active(self) -> bool:
        return self.world_size > 1


def open_store(rank: int, world_size: int, rendezvous: Path, timeout: timedelta) -> dist.TCPStore:
    """The ranks' TCPStore. Rank 0 binds port 0 (the kernel picks a free port and it is bound
    at once) and publishes the port in the rendezvous file; the others wait for the file.

    Not a port chosen by the parent: between choosing and binding (a worker's whole start-up)
    another process can take it, a real window with many trials starting NCCL at once.
    """
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        if not store.port:
            raise RuntimeError("TCPStore did not report the port it bound (port 0 unsupported by this torch?)")
        tmp = rendezvous.with_name(rendezvous.name + ".tmp")
        tmp.write_text(str(store.port))
        tmp.replace(rendezvous)  # atomic: readers never see a partial number
        return store
    end = time.monotonic() + timeout.total_seconds()
    while not rendezvous.exists():
        if time.monotonic() > end:
            raise TimeoutError(
                f"rank {rank}: rank 0 published no store port in {rendezvous} within {timeout.total_seconds():g} s"
            )
        time.sleep(0.01)
    return dist.TCPStore("127.0.0.1", int(rendezvous.read_text()), world_size, is_master=False, timeout=timeout)


def init_tp(
    rank: int, world_size: int, rendezvous: Path, device: torch.device, timeout_s: float, share_gpu: bool = False
) -> TP:
    """rendezvous: a file path shared by the trial's ranks (absent until rank 0 writes it).

    share_gpu: the ranks sit on one GPU; NCCL refuses that ("Duplicate GPU detected"), gloo
    gathers CUDA tensors through the host.
    """
    if world_size == 1:
        return TP(rank=0, world_size=1, backend=None)
    backend = backend_for(device, share_gpu)
    timeout = timedelta(seconds=timeout_s)
    store = open_store(rank, world_size, rendezvous, timeout)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    return TP(rank=rank, world_size=world_size, backend=backend)


def backend_for(device: torch.device, share_gpu: bool = False) -> str:
    """NCCL between GPUs, gloo on CPU and between ranks that share one GPU."""
    return "nccl" if device.type == "cuda" and not share_gpu else "gloo"


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


def shutdown(tp: TP) -> None:
    if tp.active and dist.is_initialized():
        dist.destroy_process_group()
