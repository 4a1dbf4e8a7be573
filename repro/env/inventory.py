"""Environment inventory: what hardware and software a run is about to meet, as a plain dict.

Everything GPU-side comes from NVML (nvidia-ml-py, import name ``pynvml``), never from
parsing nvidia-smi and never through the CUDA runtime: the runner calls this in the parent
process, which must stay free of CUDA state so that forked/spawned workers get clean
devices. NVML talks to the driver without creating a CUDA context. This module imports
neither torch nor rich: the trial parent reads the inventory, `repro doctor` (repro.env.doctor)
draws it as tables.

Every function that touches NVML takes an ``nvml`` argument (default: the real
``pynvml`` module) so tests can pass a fake object implementing the handful of calls used.
A query the device does not support (or that we may not make) yields ``None`` for that one
field; it never aborts the inventory.

NVML loading and CUDA_VISIBLE_DEVICES parsing live in repro.env.gpus (the trial parent
uses them too); torch's facts come from repro.env.runtime (imported lazily, only when the
inventory includes torch); ``vllm`` is never imported (it is heavy and pins its own torch):
its presence is read from package metadata.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import socket
from typing import Any

from repro.env.gpus import as_text, error_text, load_nvml, nvml_const, query, shutdown, visible_indices

# Variables that change how the repro behaves: the first three switch NVLink multicast
# (NVLS) off, which the multi-GPU scenarios need on machines where multicast is unusable.
ENV_VARS = (
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_NO_CUDA_MEMORY_CACHING",
)

# nvmlGpuTopologyLevel_t -> the names nvidia-smi topo -m uses. NVML_TOPOLOGY_CPU and
# NVML_TOPOLOGY_NODE share the value 40 (NODE is the newer name).
TOPOLOGY_NAMES = {
    0: "BOARD",  # NVML_TOPOLOGY_INTERNAL: both GPUs on one board
    10: "PIX",  # NVML_TOPOLOGY_SINGLE: one PCIe switch
    20: "PXB",  # NVML_TOPOLOGY_MULTIPLE: several PCIe switches, no host bridge
    30: "PHB",  # NVML_TOPOLOGY_HOSTBRIDGE: through a PCIe host bridge
    40: "NODE",  # NVML_TOPOLOGY_NODE: across host bridges within one NUMA node
    50: "SYS",  # NVML_TOPOLOGY_SYSTEM: across NUMA nodes (SMP interconnect)
}

# nvmlGpuP2PStatus_t values.
P2P_STATUS_NAMES = {
    0: "OK",
    1: "chipset not supported",
    2: "GPU not supported",
    3: "IOH topology not supported",
    4: "disabled by regkey",
    5: "not supported",
    6: "unknown",
}

MIB = 1 << 20


# --------------------------------------------------------------------------- one GPU


def pci_id(info: Any) -> str | None:
    """Canonical 'DDDDDDDD:BB:DD.0' from an nvmlPciInfo_t, for matching NVLink remotes.

    Built from the integer fields so a GPU's own id and an NVLink's remote id compare
    equal whatever case or padding the busId string came with.
    """
    if info is None:
        return None
    try:
        return f"{int(info.domain):08X}:{int(info.bus):02X}:{int(info.device):02X}.0"
    except (AttributeError, TypeError, ValueError):
        return as_text(getattr(info, "busId", None))


def describe_memory(nvml: Any, handle: Any) -> dict:
    info = query(nvml, "nvmlDeviceGetMemoryInfo", handle)
    if info is None:
        return {"memory_used_mib": None, "memory_total_mib": None}
    return {"memory_used_mib": int(info.used) // MIB, "memory_total_mib": int(info.total) // MIB}


def describe_ecc(nvml: Any, handle: Any) -> dict:
    """ECC mode and uncorrectable DRAM error counts (volatile: since driver load)."""
    enabled = nvml_const(nvml, "NVML_FEATURE_ENABLED", 1)
    mode = query(nvml, "nvmlDeviceGetEccMode", handle)
    uncorrected = nvml_const(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
    return {
        "ecc_enabled": None if mode is None else mode[0] == enabled,
        "ecc_pending": None if mode is None else mode[1] == enabled,
        "ecc_uncorrected_volatile": query(
            nvml, "nvmlDeviceGetTotalEccErrors", handle, uncorrected, nvml_const(nvml, "NVML_VOLATILE_ECC", 0)
        ),
        "ecc_uncorrected_aggregate": query(
            nvml, "nvmlDeviceGetTotalEccErrors", handle, uncorrected, nvml_const(nvml, "NVML_AGGREGATE_ECC", 1)
        ),
    }


def describe_remapped_rows(nvml: Any, handle: Any) -> dict | None:
    """Row-remapping state (Ampere and later); a pending remap needs a GPU reset."""
    rows = query(nvml, "nvmlDeviceGetRemappedRows", handle)
    if rows is None:
        return None
    corrected, uncorrected, pending, failure = rows
    return {
        "corrected": int(corrected),
        "uncorrected": int(uncorrected),
        "pending": bool(pending),
        "failure": bool(failure),
    }


def describe_compute_capability(nvml: Any, handle: Any) -> str | None:
    capability = query(nvml, "nvmlDeviceGetCudaComputeCapability", handle)
    return None if capability is None else f"{capability[0]}.{capability[1]}"


def describe_nvlinks(nvml: Any, handle: Any) -> dict | None:
    """Active NVLinks of one GPU, split by what sits at the far end.

    On HGX boards every link goes to an NVSwitch (remote type SWITCH) and any two GPUs
    reach each other over all of them; on NVLink-bridge boards links go straight to a peer
    GPU, identified by its PCI id. None when the GPU answers no NVLink query at all.
    """
    max_links = nvml_const(nvml, "NVML_NVLINK_MAX_LINKS", 18)
    switch_type = nvml_const(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    answered, active, to_switch = False, 0, 0
    peers: dict[str, int] = {}
    for link in range(max_links):
        # Links past the device's own count answer InvalidArgument: query() gives None.
        state = query(nvml, "nvmlDeviceGetNvLinkState", handle, link)
        if state is None:
            continue
        answered = True
        if not state:
            continue
        active += 1
        if query(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", handle, link) == switch_type:
            to_switch += 1
            continue
        remote = pci_id(query(nvml, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link))
        if remote is not None:
            peers[remote] = peers.get(remote, 0) + 1
    if not answered:
        return None
    return {"active": active, "to_switch": to_switch, "peers": peers}


def gpu_health(gpu: dict) -> str:
    """'ok', 'n/a' (nothing could be read) or the problems found, for the report."""
    problems = []
    if gpu.get("error"):
        return f"unreadable: {gpu['error']}"
    if gpu.get("ecc_enabled") is False:
        problems.append("ECC off")
    if gpu.get("ecc_uncorrected_volatile"):
        problems.append(f"{gpu['ecc_uncorrected_volatile']} uncorrectable ECC since boot")
    if gpu.get("ecc_uncorrected_aggregate"):
        problems.append(f"{gpu['ecc_uncorrected_aggregate']} uncorrectable ECC lifetime")
    rows = gpu.get("remapped_rows")
    if rows and rows["failure"]:
        problems.append("row remapping FAILED")
    if rows and rows["pending"]:
        problems.append("row remap pending (reset needed)")
    if problems:
        return "; ".join(problems)
    known = [gpu.get("ecc_enabled"), gpu.get("ecc_uncorrected_volatile"), rows]
    return "n/a" if all(value is None for value in known) else "ok"


def describe_gpu(nvml: Any, index: int, handle: Any) -> dict:
    gpu = {
        "index": index,
        "name": as_text(query(nvml, "nvmlDeviceGetName", handle)),
        "uuid": as_text(query(nvml, "nvmlDeviceGetUUID", handle)),
        "pci_bus_id": pci_id(query(nvml, "nvmlDeviceGetPciInfo", handle)),
        "compute_capability": describe_compute_capability(nvml, handle),
        **describe_memory(nvml, handle),
        **describe_ecc(nvml, handle),
        "remapped_rows": describe_remapped_rows(nvml, handle),
        "nvlink": describe_nvlinks(nvml, handle),
        "error": None,
    }
    gpu["health"] = gpu_health(gpu)
    return gpu


def describe_lost_gpu(index: int, error: BaseException) -> dict:
    """A GPU NVML lists but will not hand out (GPU is lost, no permission): say so."""
    gpu = {
        "index": index,
        "name": None,
        "uuid": None,
        "pci_bus_id": None,
        "compute_capability": None,
        "memory_used_mib": None,
        "memory_total_mib": None,
        "ecc_enabled": None,
        "ecc_pending": None,
        "ecc_uncorrected_volatile": None,
        "ecc_uncorrected_aggregate": None,
        "remapped_rows": None,
        "nvlink": None,
        "error": error_text(error),
    }
    gpu["health"] = gpu_health(gpu)
    return gpu


# --------------------------------------------------------------------------- GPU pairs


def pair_nvlinks(a: dict, b: dict) -> tuple[int | None, str | None]:
    """(NVLink count between two GPUs, 'direct' | 'nvswitch'), or (None, None) if unknown."""
    links_a, links_b = a.get("nvlink"), b.get("nvlink")
    if links_a is None or links_b is None:
        return None, None
    direct = max(links_a["peers"].get(b.get("pci_bus_id"), 0), links_b["peers"].get(a.get("pci_bus_id"), 0))
    if direct:
        return direct, "direct"
    # Through the switch fabric the pair gets the narrower of the two GPUs' switch links,
    # which is what nvidia-smi topo -m reports as NV18 on HGX H100/H200.
    switched = min(links_a["to_switch"], links_b["to_switch"])
    if switched:
        return switched, "nvswitch"
    return 0, None


def p2p_status(nvml: Any, handle_a: Any, handle_b: Any, caps_index: str, default: int) -> str | None:
    status = query(nvml, "nvmlDeviceGetP2PStatus", handle_a, handle_b, nvml_const(nvml, caps_index, default))
    return None if status is None else P2P_STATUS_NAMES.get(status, f"status {status}")


def describe_pair(nvml: Any, a: dict, b: dict, handle_a: Any, handle_b: Any) -> dict:
    level = query(nvml, "nvmlDeviceGetTopologyCommonAncestor", handle_a, handle_b)
    topology = None if level is None else TOPOLOGY_NAMES.get(level, f"level {level}")
    nvlinks, via = pair_nvlinks(a, b)
    return {
        "a": a["index"],
        "b": b["index"],
        "topology": topology,
        "p2p_read": p2p_status(nvml, handle_a, handle_b, "NVML_P2P_CAPS_INDEX_READ", 0),
        "p2p_nvlink": p2p_status(nvml, handle_a, handle_b, "NVML_P2P_CAPS_INDEX_NVLINK", 2),
        "nvlinks": nvlinks,
        "nvlink_via": via,
        # nvidia-smi topo -m style: NVLink wins over the PCIe path when present.
        "link": f"NV{nvlinks}" if nvlinks else (topology or "n/a"),
    }


def describe_pairs(nvml: Any, gpus: list[dict], handles: list[Any]) -> list[dict]:
    pairs = []
    for i in range(len(gpus)):
        for j in range(i + 1, len(gpus)):
            if handles[i] is None or handles[j] is None:
                continue
            pairs.append(describe_pair(nvml, gpus[i], gpus[j], handles[i], handles[j]))
    return pairs


# --------------------------------------------------------------------------- all GPUs


def cuda_version_text(version: int | None) -> str | None:
    """NVML's integer CUDA version (13000, 12080) -> '13.0', '12.8'."""
    if not version:
        return None
    return f"{version // 1000}.{(version % 1000) // 10}"


def describe_driver(nvml: Any) -> dict:
    return {
        "version": as_text(query(nvml, "nvmlSystemGetDriverVersion")),
        "cuda": cuda_version_text(query(nvml, "nvmlSystemGetCudaDriverVersion")),
        "nvml": as_text(query(nvml, "nvmlSystemGetNVMLVersion")),
    }


def no_gpus(reason: str) -> dict:
    return {"nvml_error": reason, "driver": None, "gpus": [], "gpu_pairs": []}


def mark_visible(gpus: list[dict]) -> None:
    """cuda_index: the torch ``cuda:N`` each GPU becomes under CUDA_VISIBLE_DEVICES.

    Assumes CUDA enumerates in PCI order like NVML; that holds with CUDA_DEVICE_ORDER=
    PCI_BUS_ID and, for identical GPUs, with CUDA's default FASTEST_FIRST too.
    """
    uuids = [gpu["uuid"] or "" for gpu in gpus]
    order = visible_indices(os.environ.get("CUDA_VISIBLE_DEVICES"), uuids)
    for gpu in gpus:
        gpu["cuda_index"] = order.index(gpu["index"]) if gpu["index"] in order else None


def read_gpus(nvml: Any) -> dict:
    """Everything NVML knows; the caller has initialized NVML and will shut it down."""
    try:
        count = nvml.nvmlDeviceGetCount()
    except nvml.NVMLError as error:
        return {**no_gpus(error_text(error)), "driver": describe_driver(nvml)}
    gpus, handles = [], []
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as error:
            gpus.append(describe_lost_gpu(index, error))
            handles.append(None)
            continue
        gpus.append(describe_gpu(nvml, index, handle))
        handles.append(handle)
    mark_visible(gpus)
    return {
        "nvml_error": None,
        "driver": describe_driver(nvml),
        "gpus": gpus,
        "gpu_pairs": describe_pairs(nvml, gpus, handles),
    }


def describe_gpus(nvml: Any) -> dict:
    """{'nvml_error', 'driver', 'gpus', 'gpu_pairs'}; gpus == [] with a reason on failure."""
    if nvml is None:
        return no_gpus("nvidia-ml-py (pynvml) is not installed")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        return no_gpus(error_text(error))
    try:
        return read_gpus(nvml)
    finally:
        shutdown(nvml)


# --------------------------------------------------------------------------- software, host


def describe_host() -> dict:
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        usable = None
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable,
    }


def torch_requirements(requires: list[str] | None) -> list[str]:
    """The lines of a Requires-Dist list that pin torch itself (not torchvision etc.)."""
    return [line for line in requires or [] if re.match(r"torch(?![\w.-])", line.strip())]


def describe_vllm(include_location: bool = False) -> dict:
    """vLLM's presence from package metadata only: importing vllm would pull in its torch."""
    try:
        dist = importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return {"installed": False, "version": None}
    info = {"installed": True, "version": dist.version}
    if include_location:
        info["location"] = str(dist.locate_file("vllm"))
        info["requires_torch"] = torch_requirements(dist.requires)
    return info


def describe_env() -> dict:
    """The ENV_VARS that are set, with their values (unset ones are left out)."""
    return {name: os.environ[name] for name in ENV_VARS if name in os.environ}


def collect(include_vllm: bool = False, nvml: Any = None, include_torch: bool = True) -> dict:
    """The whole inventory as a plain JSON-able dict. Never initializes CUDA.

    Keys: host, nvml_error, driver, gpus, gpu_pairs, torch, vllm, env. include_torch=False
    leaves "torch" out (the trial parent, which must not import torch, takes it from rank 0).
    """
    nvml = load_nvml() if nvml is None else nvml
    env = {"host": describe_host(), **describe_gpus(nvml)}
    if include_torch:
        from repro.env.runtime import describe_torch

        env["torch"] = describe_torch()
    return {**env, "vllm": describe_vllm(include_location=include_vllm), "env": describe_env()}


# --------------------------------------------------------------------------- text


def gpu_groups(gpus: list[dict]) -> list[str]:
    """'2x NVIDIA H200 (143771 MiB)' per distinct (name, memory), in index order."""
    counts: dict[tuple, int] = {}
    for gpu in gpus:
        key = (gpu.get("name") or "unknown GPU", gpu.get("memory_total_mib"))
        counts[key] = counts.get(key, 0) + 1
    groups = []
    for (name, total), count in counts.items():
        memory = f" ({total} MiB)" if total is not None else ""
        groups.append(f"{count}x {name}{memory}")
    return groups


def gpu_part(env: dict) -> str:
    gpus = env.get("gpus") or []
    if not gpus:
        return f"no GPU (NVML: {env.get('nvml_error') or 'no devices'})"
    parts = [" + ".join(gpu_groups(gpus))]
    visible = [gpu for gpu in gpus if gpu.get("cuda_index") is not None]
    if "CUDA_VISIBLE_DEVICES" in (env.get("env") or {}) and len(visible) != len(gpus):
        parts[0] += f" [{len(visible)} visible]"
    driver = env.get("driver") or {}
    if driver.get("version"):
        parts.append(f"driver {driver['version']}")
    if driver.get("cuda"):
        parts.append(f"CUDA {driver['cuda']}")
    return ", ".join(parts)


def software_part(env: dict) -> str:
    torch = env.get("torch") or {}
    parts = [f"torch {torch.get('version') or 'missing'}"]
    if torch.get("nccl"):
        parts.append(f"NCCL {torch['nccl']}")
    vllm = env.get("vllm") or {}
    if vllm.get("installed"):
        parts.append(f"vllm {vllm.get('version')}")
    return ", ".join(parts)


def inventory_line(env: dict) -> str:
    """One line for report headers: GPUs and driver | torch and NCCL | python."""
    python = (env.get("host") or {}).get("python") or "?"
    return f"{gpu_part(env)} | {software_part(env)} | python {python}"
