"""repro.env.doctor against a fake NVML: no GPU needed, nothing here may touch CUDA."""

from __future__ import annotations

import ctypes
import importlib.metadata
import inspect
import json
import sys
from types import SimpleNamespace

import pynvml
import pytest
import torch
from rich.console import Console

from repro.env import doctor, gpus, inventory

H200_MIB = 143771
UUID0 = "GPU-11111111-aaaa-bbbb-cccc-000000000000"
UUID1 = "GPU-11112222-aaaa-bbbb-cccc-111111111111"
SWITCH = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
GPU_TYPE = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU


def pci(bus: int) -> SimpleNamespace:
    # Lower-case busId on purpose: matching must go by the integer fields.
    return SimpleNamespace(domain=0, bus=bus, device=0, busId=f"00000000:{bus:02x}:00.0")


def fake_gpu(uuid: str, bus: int, links: list) -> SimpleNamespace:
    """links: one (active, remote type, remote bus) per NVLink the GPU has."""
    return SimpleNamespace(
        name="NVIDIA H200",
        uuid=uuid,
        pci=pci(bus),
        memory=SimpleNamespace(used=4 << 20, total=H200_MIB << 20, free=0),
        ecc=[1, 1],
        ecc_volatile=0,
        ecc_aggregate=0,
        remapped=(0, 0, 0, 0),
        cc=(9, 0),
        links=links,
    )


def bridged(peer_bus: int) -> list:
    """18 active links straight to one peer GPU (NVLink bridge)."""
    return [(1, GPU_TYPE, peer_bus)] * 18


def switched() -> list:
    """18 active links into the NVSwitch fabric (HGX)."""
    return [(1, SWITCH, 0x80)] * 18


class FakeNvml:
    """The subset of pynvml that doctor uses, with pynvml's own errors and constants.

    ``unsupported`` names functions that answer NVMLError_NotSupported (or ``error``).
    """

    NVMLError = pynvml.NVMLError

    def __init__(
        self,
        gpus,
        *,
        init_error=None,
        unsupported=(),
        error=None,
        lost=(),
        topology=pynvml.NVML_TOPOLOGY_NODE,
        p2p=0,
        max_links=18,
    ):
        self.gpus = gpus
        self.init_error = init_error
        self.unsupported = set(unsupported)
        self.error = error or pynvml.NVMLError_NotSupported
        self.lost = set(lost)
        self.topology = topology
        self.p2p = p2p
        self.open = 0
        self.init_calls = 0
        # pynvml's real constants, including NVML_P2P_CAPS_INDEX_READ == (0,) in 13.x.
        for name in dir(pynvml):
            if name.startswith("NVML_"):
                setattr(self, name, getattr(pynvml, name))
        self.NVML_NVLINK_MAX_LINKS = max_links

    def check(self, function):
        if function in self.unsupported:
            raise self.error()

    def nvmlInit(self):
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error()
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        if index in self.lost:
            raise pynvml.NVMLError_GpuIsLost()
        return self.gpus[index]

    def nvmlSystemGetDriverVersion(self):
        self.check("nvmlSystemGetDriverVersion")
        return "580.159.04"

    def nvmlSystemGetCudaDriverVersion(self):
        self.check("nvmlSystemGetCudaDriverVersion")
        return 13000

    def nvmlSystemGetNVMLVersion(self):
        return "13.580.159.04"

    def nvmlDeviceGetName(self, h):
        return h.name.encode()  # old bindings return bytes

    def nvmlDeviceGetUUID(self, h):
        return h.uuid

    def nvmlDeviceGetPciInfo(self, h):
        return h.pci

    def nvmlDeviceGetMemoryInfo(self, h):
        return h.memory

    def nvmlDeviceGetCudaComputeCapability(self, h):
        self.check("nvmlDeviceGetCudaComputeCapability")
        return h.cc

    def nvmlDeviceGetEccMode(self, h):
        self.check("nvmlDeviceGetEccMode")
        return h.ecc

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        self.check("nvmlDeviceGetTotalEccErrors")
        assert error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return h.ecc_volatile if counter_type == pynvml.NVML_VOLATILE_ECC else h.ecc_aggregate

    def nvmlDeviceGetRemappedRows(self, h):
        self.check("nvmlDeviceGetRemappedRows")
        return h.remapped

    def link(self, h, link, function):
        self.check(function)
        if link >= len(h.links):
            raise pynvml.NVMLError_InvalidArgument()
        return h.links[link]

    def nvmlDeviceGetNvLinkState(self, h, link):
        return self.link(h, link, "nvmlDeviceGetNvLinkState")[0]

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return self.link(h, link, "nvmlDeviceGetNvLinkRemoteDeviceType")[1]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        bus = self.link(h, link, "nvmlDeviceGetNvLinkRemotePciInfo")[2]
        return SimpleNamespace(domain=0, bus=bus, device=0, busId=f"00000000:{bus:02X}:00.0")

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        self.check("nvmlDeviceGetP2PStatus")
        if not isinstance(index, int):  # what ctypes does with pynvml's (0,) constant
            raise ctypes.ArgumentError("argument 3: don't know how to convert parameter")
        return self.p2p

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        self.check("nvmlDeviceGetTopologyCommonAncestor")
        return self.topology


def two_bridged_gpus(**kwargs) -> FakeNvml:
    return FakeNvml([fake_gpu(UUID0, 0x18, bridged(0x2A)), fake_gpu(UUID1, 0x2A, bridged(0x18))], **kwargs)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in inventory.ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def text_of(env: dict) -> str:
    console = Console(record=True, width=120)
    doctor.render(env, console)
    return console.export_text()


# --------------------------------------------------------------------------- inventory


def test_two_gpus_with_nvlink_bridge():
    nvml = two_bridged_gpus()
    env = inventory.collect(nvml=nvml)
    assert env["nvml_error"] is None
    assert env["driver"] == {"version": "580.159.04", "cuda": "13.0", "nvml": "13.580.159.04"}
    assert [gpu["index"] for gpu in env["gpus"]] == [0, 1]
    gpu = env["gpus"][0]
    assert gpu["name"] == "NVIDIA H200"
    assert gpu["uuid"] == UUID0
    assert gpu["pci_bus_id"] == "00000000:18:00.0"
    assert gpu["compute_capability"] == "9.0"
    assert (gpu["memory_used_mib"], gpu["memory_total_mib"]) == (4, H200_MIB)
    assert gpu["ecc_enabled"] is True and gpu["ecc_uncorrected_aggregate"] == 0
    assert gpu["remapped_rows"] == {"corrected": 0, "uncorrected": 0, "pending": False, "failure": False}
    assert gpu["nvlink"] == {"active": 18, "to_switch": 0, "peers": {"00000000:2A:00.0": 18}}
    assert gpu["health"] == "ok"
    assert [g["cuda_index"] for g in env["gpus"]] == [0, 1]
    assert env["gpu_pairs"] == [
        {
            "a": 0,
            "b": 1,
            "topology": "NODE",
            "p2p_read": "OK",
            "p2p_nvlink": "OK",
            "nvlinks": 18,
            "nvlink_via": "direct",
            "link": "NV18",
        }
    ]
    assert nvml.open == 0, "collect() must shut NVML down again"
    json.dumps(env)  # plain data only


def test_two_gpus_on_nvswitch_fabric():
    nvml = FakeNvml(
        [fake_gpu(UUID0, 0x18, switched()), fake_gpu(UUID1, 0x2A, switched())], topology=pynvml.NVML_TOPOLOGY_SYSTEM
    )
    pair = inventory.collect(nvml=nvml)["gpu_pairs"][0]
    assert (pair["nvlinks"], pair["nvlink_via"], pair["link"]) == (18, "nvswitch", "NV18")
    assert pair["topology"] == "SYS"


def test_pcie_only_pair_reports_pcie_path():
    inactive = [(0, GPU_TYPE, 0)] * 18
    nvml = FakeNvml(
        [fake_gpu(UUID0, 0x18, inactive), fake_gpu(UUID1, 0x2A, inactive)],
        topology=pynvml.NVML_TOPOLOGY_HOSTBRIDGE,
        p2p=pynvml.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED,
    )
    env = inventory.collect(nvml=nvml)
    assert env["gpus"][0]["nvlink"] == {"active": 0, "to_switch": 0, "peers": {}}
    pair = env["gpu_pairs"][0]
    assert (pair["nvlinks"], pair["link"], pair["p2p_read"]) == (0, "PHB", "chipset not supported")


def test_links_past_max_links_constant_are_not_queried():
    nvml = two_bridged_gpus(max_links=4)
    assert inventory.collect(nvml=nvml)["gpus"][0]["nvlink"]["active"] == 4


def test_inventory_line_two_gpus():
    env = inventory.collect(nvml=two_bridged_gpus())
    line = inventory.inventory_line(env)
    assert line.startswith(f"2x NVIDIA H200 ({H200_MIB} MiB), driver 580.159.04, CUDA 13.0 | torch {torch.__version__}")
    assert line.endswith(f" | python {env['host']['python']}")


def test_inventory_line_fixed_inventory():
    env = {
        "host": {"python": "3.12.3"},
        "gpus": [{"name": "NVIDIA H200", "memory_total_mib": H200_MIB, "cuda_index": i} for i in range(2)],
        "driver": {"version": "580.159.04", "cuda": "13.0"},
        "torch": {"version": "2.11.0+cu130", "nccl": "2.27.7"},
        "vllm": {"installed": False},
        "env": {},
    }
    assert inventory.inventory_line(env) == (
        "2x NVIDIA H200 (143771 MiB), driver 580.159.04, CUDA 13.0 | torch 2.11.0+cu130, NCCL 2.27.7 | python 3.12.3"
    )


def test_inventory_line_no_gpu():
    env = {
        "host": {"python": "3.11.7"},
        "gpus": [],
        "nvml_error": "Driver Not Loaded",
        "torch": {"version": "2.13.0+cpu", "nccl": None},
        "vllm": {"installed": False},
    }
    assert inventory.inventory_line(env) == ("no GPU (NVML: Driver Not Loaded) | torch 2.13.0+cpu | python 3.11.7")


UNSUPPORTED = {
    "nvmlDeviceGetEccMode",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkRemoteDeviceType",
    "nvmlDeviceGetNvLinkRemotePciInfo",
    "nvmlDeviceGetP2PStatus",
    "nvmlDeviceGetTopologyCommonAncestor",
    "nvmlSystemGetCudaDriverVersion",
}


@pytest.mark.parametrize(
    "error", [pynvml.NVMLError_NotSupported, pynvml.NVMLError_NoPermission, pynvml.NVMLError_FunctionNotFound]
)
def test_unsupported_queries_give_none(error):
    nvml = two_bridged_gpus(unsupported=UNSUPPORTED, error=error)
    env = inventory.collect(nvml=nvml)
    assert env["nvml_error"] is None
    assert len(env["gpus"]) == 2
    for gpu in env["gpus"]:
        assert gpu["name"] == "NVIDIA H200" and gpu["memory_total_mib"] == H200_MIB
        for field in (
            "ecc_enabled",
            "ecc_pending",
            "ecc_uncorrected_volatile",
            "ecc_uncorrected_aggregate",
            "remapped_rows",
            "compute_capability",
            "nvlink",
        ):
            assert gpu[field] is None, field
        assert gpu["health"] == "n/a"
    assert env["driver"] == {"version": "580.159.04", "cuda": None, "nvml": "13.580.159.04"}
    assert env["gpu_pairs"] == [
        {
            "a": 0,
            "b": 1,
            "topology": None,
            "p2p_read": None,
            "p2p_nvlink": None,
            "nvlinks": None,
            "nvlink_via": None,
            "link": "n/a",
        }
    ]
    assert "NVIDIA H200" in text_of(env)
    assert nvml.open == 0


def test_function_missing_from_old_binding_gives_none():
    class OldBinding(FakeNvml):
        nvmlDeviceGetRemappedRows = None  # an nvidia-ml-py that predates the call

    env = inventory.collect(nvml=OldBinding([fake_gpu(UUID0, 0x18, [])]))
    assert env["gpus"][0]["remapped_rows"] is None
    assert env["gpus"][0]["ecc_enabled"] is True


def test_lost_gpu_is_listed_with_its_error():
    nvml = two_bridged_gpus(lost={1})
    env = inventory.collect(nvml=nvml)
    assert env["gpus"][0]["health"] == "ok"
    lost = env["gpus"][1]
    assert lost["error"] == "GPU is lost" and lost["name"] is None
    assert lost["health"].startswith("unreadable")
    assert env["gpu_pairs"] == []
    json.dumps(env)
    assert "GPU is lost" in text_of(env)


@pytest.mark.parametrize(
    "error, reason",
    [
        (pynvml.NVMLError_LibraryNotFound, "NVML Shared Library Not Found"),
        (pynvml.NVMLError_DriverNotLoaded, "Driver Not Loaded"),
    ],
)
def test_nvml_init_failure(error, reason):
    nvml = FakeNvml([], init_error=error)
    env = inventory.collect(nvml=nvml)
    assert env["gpus"] == [] and env["gpu_pairs"] == []
    assert env["nvml_error"] == reason
    assert env["driver"] is None
    assert inventory.inventory_line(env).startswith(f"no GPU (NVML: {reason}) | torch ")
    assert gpus.gpu_count(nvml) == 0
    json.dumps(env)


def test_real_nvml_never_raises():
    env = inventory.collect()
    assert set(env) == {"host", "nvml_error", "driver", "gpus", "gpu_pairs", "torch", "vllm", "env"}
    if env["nvml_error"] is not None:
        assert env["gpus"] == [] and env["gpu_pairs"] == []
    json.dumps(env)


def test_health_reports_problems():
    gpu = {
        "ecc_enabled": True,
        "ecc_uncorrected_volatile": 2,
        "ecc_uncorrected_aggregate": 5,
        "remapped_rows": {"corrected": 0, "uncorrected": 1, "pending": True, "failure": False},
    }
    health = inventory.gpu_health(gpu)
    assert "2 uncorrectable ECC since boot" in health
    assert "5 uncorrectable ECC lifetime" in health
    assert "pending" in health
    assert inventory.gpu_health({"ecc_enabled": False}) == "ECC off"


@pytest.mark.parametrize("version, text", [(13000, "13.0"), (12080, "12.8"), (12020, "12.2"), (None, None), (0, None)])
def test_cuda_version_text(version, text):
    assert inventory.cuda_version_text(version) == text


# --------------------------------------------------------------------------- gpu_count


@pytest.mark.parametrize(
    "spec, count",
    [
        (None, 2),
        ("0", 1),
        ("1", 1),
        ("1,0", 2),
        (" 0 , 1 ", 2),
        ("0,1,2", 2),  # an index past the last GPU ends the list
        ("2", 0),
        ("2,0", 0),
        ("0,-1,1", 1),  # a negative index ends the list
        ("0,0", 0),  # a repeated index empties it
        ("", 0),
        ("  ", 0),
        ("nope", 0),
        (UUID1, 1),
        (f"{UUID0},{UUID1}", 2),
        ("GPU-11112222", 1),  # a unique prefix is enough
        ("GPU-1111", 0),  # an ambiguous prefix matches nothing
        (f"{UUID0},GPU-ffffffff", 1),  # an unknown UUID ends the list
        (f"{UUID0},{UUID0}", 0),
        ("MIG-aaaa,MIG-bbbb", 2),
    ],
)
def test_gpu_count_honors_cuda_visible_devices(monkeypatch, spec, count):
    if spec is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", spec)
    nvml = two_bridged_gpus()
    assert gpus.gpu_count(nvml) == count
    assert nvml.open == 0


def test_gpu_count_empty_spec_skips_nvml(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    nvml = two_bridged_gpus()
    assert gpus.gpu_count(nvml) == 0
    assert nvml.init_calls == 0


def test_gpu_count_without_nvml():
    assert gpus.gpu_count(FakeNvml([], init_error=pynvml.NVMLError_LibraryNotFound)) == 0
    assert gpus.gpu_count() >= 0  # real pynvml: 0 here, the real count on a GPU box


def test_cuda_visible_devices_maps_cuda_indices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    env = inventory.collect(nvml=two_bridged_gpus())
    assert [gpu["cuda_index"] for gpu in env["gpus"]] == [None, 0]
    assert env["env"] == {"CUDA_VISIBLE_DEVICES": "1"}
    assert "2x NVIDIA H200 (143771 MiB) [1 visible]" in inventory.inventory_line(env)


def test_env_lists_only_set_variables(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    env = inventory.collect(nvml=two_bridged_gpus())
    assert env["env"] == {"NCCL_NVLS_ENABLE": "0", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


# --------------------------------------------------------------------------- render


def test_render_two_gpus():
    env = inventory.collect(nvml=two_bridged_gpus())
    out = text_of(env)
    assert out.count("NVIDIA H200") >= 2
    assert "NV18" in out and "P2P OK" in out
    assert "GPU-11111111" in out and str(H200_MIB) in out
    assert "check_input_liveness" in out
    assert "NCCL_NVLS_ENABLE" in out and "unset" in out
    assert "no GPU found" not in out


def test_render_no_gpu():
    env = inventory.collect(nvml=FakeNvml([], init_error=pynvml.NVMLError_DriverNotLoaded))
    out = text_of(env)
    assert "no GPU found" in out and "Driver Not Loaded" in out
    assert torch.__version__ in out


def test_render_does_not_read_markup_from_values(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "[bold]x[/bold]")
    assert "[bold]x[/bold]" in text_of(inventory.collect(nvml=two_bridged_gpus()))


# --------------------------------------------------------------------------- software side


def test_torch_facts_read_without_cuda():
    facts = inventory.collect(nvml=two_bridged_gpus())["torch"]
    assert facts["version"] == torch.__version__
    assert facts["cuda"] == torch.version.cuda
    assert facts["graph_check_input_liveness"] == (
        "check_input_liveness" in inspect.signature(torch.cuda.graph).parameters
    )
    assert facts["error"] is None


def test_collect_never_initializes_cuda():
    inventory.collect(include_vllm=True)
    inventory.collect(include_vllm=True, nvml=two_bridged_gpus())
    gpus.gpu_count()
    assert torch.cuda.is_initialized() is False


def test_vllm_absent_is_not_imported(monkeypatch):
    real = importlib.metadata.distribution

    def distribution(name):
        if name == "vllm":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    for include in (False, True):
        assert inventory.collect(include_vllm=include, nvml=two_bridged_gpus())["vllm"] == {
            "installed": False,
            "version": None,
        }
    assert "vllm" not in sys.modules


def test_vllm_present_is_read_from_metadata_only(monkeypatch, tmp_path):
    # A vllm that blows up when imported, with metadata saying it pins torch.
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise RuntimeError('imported vllm')\n")
    info = tmp_path / "vllm-0.11.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm\nVersion: 0.11.0\n"
        "Requires-Dist: torch==2.9.0\nRequires-Dist: torchvision==0.24.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)

    assert inventory.collect(nvml=two_bridged_gpus())["vllm"] == {"installed": True, "version": "0.11.0"}
    env = inventory.collect(include_vllm=True, nvml=two_bridged_gpus())
    assert env["vllm"]["version"] == "0.11.0"
    assert env["vllm"]["location"] == str(tmp_path / "vllm")
    assert env["vllm"]["requires_torch"] == ["torch==2.9.0"]
    assert "vllm" not in sys.modules
    assert inventory.inventory_line(env).split(" | ")[1].endswith(", vllm 0.11.0")
    assert "0.11.0" in text_of(env)
