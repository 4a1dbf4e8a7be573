"""Forensics on synthetic snapshots shaped like torch.cuda.memory._snapshot()."""

from __future__ import annotations

import torch

from repro.diagnose.forensics import MemoryHistory, find_events, format_frame, snapshot_name, user_frames
from repro.outcome import Finding

MiB = 1 << 20
TORCH_FILE = "/usr/lib/python3/site-packages/torch/nn/modules/module.py"


def frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


def event(action: str, addr: int, size: int, *frames: dict) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}


GATHER = frame("/src/vllm/model_executor/models/gemma4_mtp.py", 88, "full_lm_head_weight")
SETUP = frame("/src/vllm/v1/spec_decode/gemma4.py", 120, "setup_centroid_graphs")
RETURN = frame("/src/vllm/v1/worker/gpu_model_runner.py", 900, "capture_model")
KV = frame("/src/vllm/v1/worker/gpu_model_runner.py", 700, "initialize_kv_cache")
SEG = 0x7F00_0000_0000


def gemma_trace(reuse: bool = False, release: bool = False) -> list[dict]:
    """The unfixed TP=2 story: a 128 MiB gathered lm_head, freed when setup returns."""
    trace = [
        event("segment_alloc", SEG, 256 * MiB),
        event("alloc", SEG, 128 * MiB, frame(TORCH_FILE, 1, "_call_impl"), GATHER, SETUP),
        event("alloc", SEG + 128 * MiB, 2 * MiB, SETUP),  # a neighbour that stays
        event("free_requested", SEG, 128 * MiB, RETURN),
        event("free_completed", SEG, 128 * MiB, RETURN),
    ]
    if reuse:
        trace.append(event("alloc", SEG, 64 * MiB, KV))
    if release:
        trace.append(event("segment_free", SEG, 256 * MiB))
    return trace


def test_find_events_alloc_and_frees():
    found = find_events([gemma_trace()], SEG + 5 * MiB)
    assert found is not None
    assert (found.device, found.alloc["addr"], found.alloc["size"]) == (0, SEG, 128 * MiB)
    assert found.free_requested["action"] == "free_requested"
    assert found.free_completed["action"] == "free_completed"
    assert found.released is None
    assert found.freed


def test_find_events_segment_free_after_free_means_released():
    found = find_events([gemma_trace(release=True)], SEG)
    assert found.released is not None and found.released["size"] == 256 * MiB


def test_an_unmapped_expandable_segment_means_released():
    """Under expandable_segments:True the allocator gives memory back by unmapping pages of its one
    segment (trace action segment_unmap), never segment_free."""
    trace = gemma_trace() + [event("segment_unmap", SEG, 128 * MiB)]
    found = find_events([trace], SEG + MiB)
    assert found.released is not None and found.released["action"] == "segment_unmap"


def test_segment_free_before_any_free_does_not_count():
    trace = [event("alloc", SEG, MiB, GATHER), event("segment_free", SEG, 2 * MiB)]
    found = find_events([trace], SEG)
    assert not found.freed and found.released is None


def test_last_alloc_covering_the_address_wins_on_reuse():
    found = find_events([gemma_trace(reuse=True)], SEG + MiB)
    assert found.alloc["size"] == 64 * MiB  # the KV-cache-like reuse, not the lm_head
    assert found.alloc["frames"] == [KV]
    assert found.free_requested is None and not found.freed
    # past the reuse's end, the original (freed) allocation is the last one covering it
    beyond = find_events([gemma_trace(reuse=True)], SEG + 100 * MiB)
    assert beyond.alloc["size"] == 128 * MiB and beyond.freed


def test_address_outside_every_alloc_and_other_devices():
    assert find_events([gemma_trace()], SEG + 200 * MiB) is None  # only in the segment
    assert find_events([], SEG) is None
    found = find_events([[], gemma_trace()], SEG)  # lives on device 1
    assert found.device == 1
    assert find_events(gemma_trace(), SEG).alloc["addr"] == SEG  # one device's flat list


def test_user_frames_drop_torch_and_native_and_keep_order():
    frames = [
        frame("/pytorch/c10/cuda/CUDACachingAllocator.cpp", 10, "malloc"),
        frame("??", 0, "unwind::unwind"),
        frame(TORCH_FILE, 1, "_call_impl"),
        GATHER,
        SETUP,
        RETURN,
    ]
    assert user_frames(frames) == [
        "gemma4_mtp.py:88 in full_lm_head_weight",
        "gemma4.py:120 in setup_centroid_graphs",
        "gpu_model_runner.py:900 in capture_model",
    ]
    assert user_frames(frames, limit=1) == ["gemma4_mtp.py:88 in full_lm_head_weight"]
    assert user_frames([frame(TORCH_FILE, 1, "x")] * 3) == []
    assert len(user_frames([GATHER] * 20)) == 8
    assert format_frame(GATHER) == "gemma4_mtp.py:88 in full_lm_head_weight"


def test_installed_torch_frames_are_dropped():
    installed = torch.__file__.rsplit("/", 1)[0] + "/cuda/memory.py"
    assert user_frames([frame(installed, 5, "_snapshot"), SETUP]) == ["gemma4.py:120 in setup_centroid_graphs"]


def test_locate_and_annotate_on_a_synthetic_snapshot():
    history = MemoryHistory(enabled=True)
    snap = {"segments": [], "device_traces": [gemma_trace(release=True)]}
    where = history.locate(SEG + 3 * MiB, snapshot=snap)
    assert where == {
        "addr": SEG,
        "size": 128 * MiB,
        "device": 0,
        "freed": True,
        "alloc_stack": ["gemma4_mtp.py:88 in full_lm_head_weight", "gemma4.py:120 in setup_centroid_graphs"],
        "free_stack": ["gpu_model_runner.py:900 in capture_model"],
        "released_to_driver": True,
    }
    assert history.locate(1, snapshot=snap) is None
    assert "0x1" in history.reason

    finding = Finding(
        slot="drafter.<local>",
        graph="g",
        status="freed",
        when="w",
        rank=0,
        shape=[262144, 256],
        dtype="bfloat16",
        nbytes=128 * MiB,
        old_ptr=SEG + 4096,
    )
    history.snapshot = lambda: snap  # stand in for torch.cuda.memory._snapshot on CPU
    assert history.annotate([finding]) == 1
    assert finding.alloc_stack[0] == "gemma4_mtp.py:88 in full_lm_head_weight"
    assert finding.free_stack == ["gpu_model_runner.py:900 in capture_model"]


def test_memory_history_on_cpu_is_a_noop_with_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # CPU-only on any machine
    history = MemoryHistory(enabled=True, max_entries=1000)
    assert not history.available
    assert "CUDA is not available" in history.reason
    assert history.start() is False and not history.active
    history.stop()
    assert history.snapshot() is None
    assert history.locate(0x1000) is None
    assert history.dump(tmp_path / "m.pickle") is None
    assert list(tmp_path.iterdir()) == []
    finding = Finding(
        slot="s", graph="g", status="freed", when="w", rank=0, shape=[1], dtype="float32", nbytes=4, old_ptr=0x1000
    )
    assert history.annotate([finding]) == 0 and finding.alloc_stack == []


def test_disabled_history_says_so():
    history = MemoryHistory(enabled=False)
    assert not history.available and history.reason == "memory history disabled"
    with history:
        assert not history.active


def test_snapshot_name():
    assert snapshot_name("gemma4-mtp", 0, 1234) == "memory-gemma4-mtp-rank0-pid1234.pickle"
    assert MemoryHistory.snapshot_name("nvfp4-reload", 1, 7) == "memory-nvfp4-reload-rank1-pid7.pickle"


def test_guard_dispatch_frame_is_not_a_user_frame():
    # Every allocation made during a guarded capture has the guard's __torch_dispatch__ on its
    # stack; the report must start at the scenario line instead (seen on an H200 run).
    from repro.diagnose import guard
    from repro.diagnose.forensics import user_frames

    frames = [
        {"filename": guard.__file__, "line": 206, "name": "__torch_dispatch__"},
        {"filename": "/site/repro/scenarios/gemma4_mtp.py", "line": 100, "name": "full_lm_head_weight"},
    ]
    plumbing = guard.CaptureGuard("warn").plumbing
    assert user_frames(frames, plumbing=plumbing) == ["gemma4_mtp.py:100 in full_lm_head_weight"]
    assert user_frames(frames)[0].startswith("guard.py:206")  # nothing is plumbing unless told
