"""Which GPUs a process started now would see, through NVML: no CUDA context, no torch.

The trial parent decides with these whether a scenario can run (how many GPUs, how much
memory each) and how concurrent trials share the GPUs; `repro doctor`'s inventory loads and
queries NVML through the same helpers. Every function that touches NVML takes an ``nvml`` argument (default:
the real ``pynvml`` module) so tests can pass a fake implementing the calls used.
"""

from __future__ import annotations

import ctypes
import os
import re
from typing import Any


# --------------------------------------------------------------------------- NVML: load, query, shut down


def load_nvml() -> Any:
    """The real pynvml module, or None when nvidia-ml-py is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def nvml_const(nvml: Any, name: str, default: int) -> int:
    """An NVML constant as a plain int.

    nvidia-ml-py 13.x defines ``NVML_P2P_CAPS_INDEX_READ = 0,`` (a stray comma makes it the
    tuple ``(0,)``), and ctypes cannot pass a tuple, so every constant is unwrapped here.
    """
    value = getattr(nvml, name, default)
    if isinstance(value, tuple):
        value = value[0] if value else default
    return int(value)


def query(nvml: Any, function: str, *args: Any) -> Any:
    """Call one NVML function; None when it is missing, unsupported or refused.

    One unsupported field (ECC on a consumer card, remapped rows before Ampere, NVLink on
    a PCIe card, no permission inside a container) must not sink the whole inventory, so
    any NVMLError - and a ctypes argument mismatch from an older binding - becomes None.
    """
    fn = getattr(nvml, function, None)
    if fn is None:  # an older nvidia-ml-py that predates this call
        return None
    try:
        return fn(*args)
    except (nvml.NVMLError, ctypes.ArgumentError):
        return None


def as_text(value: Any) -> str | None:
    """NVML strings arrive as bytes from old bindings and str from new ones."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def error_text(error: BaseException) -> str:
    """NVML's own wording ('NVML Shared Library Not Found'), else the error's class name."""
    try:
        message = str(error)
    except Exception:  # pynvml's __str__ calls back into NVML, which may be the problem
        message = ""
    return message or type(error).__name__


def shutdown(nvml: Any) -> None:
    """nvmlShutdown, ignoring failures: NVML is refcounted and a failed shutdown is harmless."""
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError:
        pass


# --------------------------------------------------------------------------- CUDA_VISIBLE_DEVICES


def parse_ordinal(text: str) -> int:
    """strtoul-like: the leading integer of text, or -1. CUDA reads '1gpu' as 1."""
    match = re.match(r"[+-]?\d+", text)
    return int(match.group()) if match else -1


def parse_ordinals(spec: str) -> list[int]:
    """A comma list of indices, read the way CUDA (and torch's NVML count) read it.

    A negative or unparsable entry ends the list; a repeated entry makes it empty.
    """
    ordinals: list[int] = []
    for entry in spec.split(","):
        ordinal = parse_ordinal(entry.strip())
        if ordinal in ordinals:
            return []
        if ordinal < 0:
            break
        ordinals.append(ordinal)
    return ordinals


def match_uuid(candidate: str, uuids: list[str]) -> int:
    """Position of the one UUID that starts with candidate (CUDA accepts prefixes), or -1."""
    hits = [i for i, uuid in enumerate(uuids) if uuid and uuid.startswith(candidate)]
    return hits[0] if len(hits) == 1 else -1


def parse_uuids(spec: str, uuids: list[str]) -> list[int]:
    """A comma list of GPU UUIDs (or unique prefixes) -> physical indices, CUDA's rules."""
    ordinals: list[int] = []
    for entry in spec.split(","):
        entry = entry.strip()
        if not entry.startswith("GPU-"):
            break
        ordinal = match_uuid(entry, uuids)
        if ordinal < 0:
            break
        if ordinal in ordinals:
            return []
        ordinals.append(ordinal)
    return ordinals


def visible_indices(spec: str | None, uuids: list[str]) -> list[int]:
    """Physical (NVML) indices that CUDA will expose, in CUDA order (cuda:0 first).

    ``uuids`` is NVML's list, one per physical GPU. Unset -> all of them. Indices past the
    last GPU end the list, as in CUDA. MIG UUIDs cannot be mapped to whole GPUs here and
    give an empty list (see :func:`count_visible`).
    """
    if spec is None:
        return list(range(len(uuids)))
    spec = spec.strip()
    if spec.startswith("GPU-"):
        return parse_uuids(spec, uuids)
    if spec.startswith("MIG-"):
        return []
    visible: list[int] = []
    for ordinal in parse_ordinals(spec):
        if ordinal >= len(uuids):
            break
        visible.append(ordinal)
    return visible


def count_visible(spec: str | None, uuids: list[str]) -> int:
    """How many CUDA devices a process started with this CUDA_VISIBLE_DEVICES will see."""
    if spec is not None and spec.strip().startswith("MIG-"):
        # Each MIG instance is one CUDA device; NVML's whole-GPU UUIDs cannot check them.
        return len([e for e in spec.split(",") if e.strip().startswith("MIG-")])
    return len(visible_indices(spec, uuids))


def device_uuids(nvml: Any, count: int) -> list[str]:
    """NVML's UUID per physical index; '' where the GPU cannot be queried (never matches)."""
    uuids = []
    for index in range(count):
        handle = query(nvml, "nvmlDeviceGetHandleByIndex", index)
        uuid = as_text(query(nvml, "nvmlDeviceGetUUID", handle)) if handle is not None else None
        uuids.append(uuid or "")
    return uuids


def gpu_count(nvml: Any = None) -> int:
    """GPUs a CUDA process started now would see; 0 when NVML is unavailable.

    Honors CUDA_VISIBLE_DEVICES (indices or GPU UUIDs). Used by the runner's parent
    process to decide whether a multi-GPU scenario can run, so it must not touch CUDA.
    """
    nvml = load_nvml() if nvml is None else nvml
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if nvml is None or (spec is not None and not spec.strip()):
        return 0
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return 0
    try:
        count = query(nvml, "nvmlDeviceGetCount") or 0
        return count_visible(spec, device_uuids(nvml, count))
    finally:
        shutdown(nvml)


def gpu_lanes(gpus: int, env: dict[str, str]) -> list[str]:
    """The devices a child may see, as CUDA_VISIBLE_DEVICES tokens (indices or UUIDs)."""
    spec = env.get("CUDA_VISIBLE_DEVICES")
    tokens = [t.strip() for t in spec.split(",")] if spec is not None else [str(i) for i in range(gpus)]
    return tokens[:gpus]


def visible_memory(nvml: Any = None) -> list[int]:
    """Total bytes of each GPU a CUDA process started now would see, in CUDA order; [] without NVML."""
    nvml = load_nvml() if nvml is None else nvml
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if nvml is None or (spec is not None and not spec.strip()):
        return []
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return []
    try:
        count = query(nvml, "nvmlDeviceGetCount") or 0
        totals = []
        for index in visible_indices(spec, device_uuids(nvml, count)):
            handle = query(nvml, "nvmlDeviceGetHandleByIndex", index)
            info = query(nvml, "nvmlDeviceGetMemoryInfo", handle) if handle is not None else None
            totals.append(int(info.total) if info is not None else 0)
        return totals
    finally:
        shutdown(nvml)
