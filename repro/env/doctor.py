"""`repro doctor`: the environment inventory (repro.env.inventory) drawn as rich tables."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from repro.env.inventory import ENV_VARS, inventory_line

TOPOLOGY_LEGEND = (
    "NVn = n NVLinks (direct or through NVSwitch); otherwise the PCIe path: "
    "PIX one switch, PXB several, PHB host bridge, NODE within a NUMA node, "
    "SYS across NUMA nodes; P2P = NVML's peer-read status"
)


def short_uuid(uuid: str | None) -> str:
    return "n/a" if not uuid else (uuid[:12] + "…" if len(uuid) > 12 else uuid)


def or_na(value: Any) -> str:
    return "n/a" if value is None else str(value)


def ecc_text(gpu: dict) -> str:
    if gpu.get("ecc_enabled") is None:
        return "n/a"
    text = "on" if gpu["ecc_enabled"] else "off"
    if gpu.get("ecc_pending") is not None and gpu["ecc_pending"] != gpu["ecc_enabled"]:
        text += " (pending " + ("on" if gpu["ecc_pending"] else "off") + ")"
    return text


def remap_text(gpu: dict) -> str:
    rows = gpu.get("remapped_rows")
    if rows is None:
        return "n/a"
    return f"{rows['corrected']}c/{rows['uncorrected']}u"


def memory_text(gpu: dict) -> str:
    if gpu.get("memory_total_mib") is None:
        return "n/a"
    return f"{gpu['memory_used_mib']} / {gpu['memory_total_mib']} MiB"


def gpu_table(env: dict) -> Any:
    table = Table(title="GPUs (NVML)", title_justify="left")
    for column in ("#", "cuda", "name", "memory used / total", "ECC", "remapped rows", "health", "CC", "PCI", "UUID"):
        table.add_column(column)
    for gpu in env["gpus"]:
        health = gpu.get("health") or "n/a"
        style = "green" if health == "ok" else ("dim" if health == "n/a" else "bold red")
        cuda = gpu.get("cuda_index")
        table.add_row(
            str(gpu["index"]),
            "hidden" if cuda is None else str(cuda),
            or_na(gpu.get("name")),
            memory_text(gpu),
            ecc_text(gpu),
            remap_text(gpu),
            Text(health, style=style),
            or_na(gpu.get("compute_capability")),
            or_na(gpu.get("pci_bus_id")),
            short_uuid(gpu.get("uuid")),
        )
    return table


def pair_cell(pair: dict | None) -> str:
    if pair is None:
        return "n/a"
    p2p = pair.get("p2p_read")
    return pair["link"] + ("" if p2p is None else f" · P2P {p2p}")


def topology_table(env: dict) -> Any:
    pairs = {(p["a"], p["b"]): p for p in env.get("gpu_pairs") or []}
    pairs.update({(b, a): p for (a, b), p in list(pairs.items())})
    indices = [gpu["index"] for gpu in env["gpus"]]
    table = Table(title="GPU topology", title_justify="left")
    table.add_column("")
    for index in indices:
        table.add_column(f"GPU{index}")
    for a in indices:
        cells = ["X" if a == b else pair_cell(pairs.get((a, b))) for b in indices]
        table.add_row(f"GPU{a}", *cells)
    return table


def software_table(env: dict) -> Any:
    torch = env.get("torch") or {}
    vllm = env.get("vllm") or {}
    driver = env.get("driver") or {}
    host = env.get("host") or {}
    vllm_text = f"{vllm.get('version')}" if vllm.get("installed") else "not installed"
    if vllm.get("location"):
        vllm_text += f" ({vllm['location']})"
    liveness = "yes" if torch.get("graph_check_input_liveness") else "no"
    rows = [
        ("python", f"{host.get('python')} on {host.get('platform')}"),
        ("host", f"{host.get('hostname')}, {host.get('cpu_count')} CPUs"),
        ("torch", or_na(torch.get("version")) + (f" ({torch['error']})" if torch.get("error") else "")),
        ("CUDA runtime (torch)", or_na(torch.get("cuda"))),
        ("CUDA driver", or_na(driver.get("cuda"))),
        ("NVIDIA driver", or_na(driver.get("version"))),
        ("NCCL (torch)", or_na(torch.get("nccl"))),
        ("vLLM", vllm_text),
        ("torch.cuda.graph(check_input_liveness=)", liveness),
    ]
    table = Table(title="Software", title_justify="left", show_header=False)
    table.add_column("what", no_wrap=True)
    table.add_column("version", overflow="fold")  # folded, never cut with an ellipsis
    for name, value in rows:
        table.add_row(name, Text(value))
    return table


def env_table(env: dict) -> Any:
    values = env.get("env") or {}
    table = Table(title="Environment", title_justify="left", show_header=False)
    table.add_column("variable", no_wrap=True)
    table.add_column("value", overflow="fold")
    for name in ENV_VARS:
        value = values.get(name)
        table.add_row(name, Text("unset", style="dim") if value is None else Text(repr(value)))
    return table


def render(env: dict, console: Any) -> None:
    """The inventory as rich tables on console (no print(): the caller owns the output)."""
    console.print(Text(inventory_line(env), style="bold"))
    if env.get("gpus"):
        console.print(fold_cells(gpu_table(env)))
        if len(env["gpus"]) > 1:
            console.print(fold_cells(topology_table(env)))
            console.print(Text(TOPOLOGY_LEGEND, style="dim"))
    else:
        reason = env.get("nvml_error") or "NVML reports no devices"
        console.print(Text(f"no GPU found (NVML: {reason})", style="bold yellow"))
    console.print(software_table(env))
    console.print(env_table(env))


def fold_cells(table: Any) -> Any:
    """Narrow consoles fold a cell's text onto more lines; a cut value ("…") would be a lie."""
    for column in table.columns:
        if not column.no_wrap:
            column.overflow = "fold"
    return table
