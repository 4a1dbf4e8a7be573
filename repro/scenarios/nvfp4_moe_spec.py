"""nvfp4-reload's facts for the parent: dims, modes, run keys, rules, expectation, footprint.

Torch-free (the parent imports it); the ranks' code is repro/scenarios/nvfp4_moe.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from repro.scenarios.spec import ITEMSIZE, Check, ModeSpec, RunKeySpec, ScenarioSpec

NVFP4_BYTES = 0.5 + 1 / 16      # packed E2M1 codes + one E4M3 scale per 16 elements


@dataclass
class MoeDims:
    """One MoE layer (router + experts) in the shape of a real model."""
    num_experts: int = 128
    hidden_size: int = 2048
    intermediate_size: int = 768
    top_k: int = 8
    tokens: int = 64                  # tokens per replay (decode batch)
    dtype: str = "bfloat16"


def validate(m: MoeDims, r: Any, check: Check) -> None:
    for key in ("num_experts", "hidden_size", "intermediate_size", "top_k", "tokens"):
        check(getattr(m, key) >= 1, "", f"model.{key} = {getattr(m, key)} must be >= 1")
    for key in ("hidden_size", "intermediate_size"):
        check(getattr(m, key) % 16 == 0, "",
              f"model.{key} = {getattr(m, key)} is not a multiple of 16 (the NVFP4 block size along K)")
    check(m.top_k <= m.num_experts, "", f"model.top_k = {m.top_k} exceeds model.num_experts = {m.num_experts}")


def expectation(r: Any) -> str:
    if r.mode == "kernel-reuse":
        return "clean" if r.identity_reload else "MISMATCH"
    return ""


def footprint(m: MoeDims, tp: int) -> int:
    """A reload holds the new BF16 checkpoint, the re-materialised BF16 parameters, the live
    kernel's dequantised workspaces and the NVFP4 experts at once (measured peak on CPU:
    ~16 bytes per expert weight element; this counts 6.6)."""
    elements = m.num_experts * 3 * m.intermediate_size * m.hidden_size    # w13 [E, 2I, D] + w2 [E, D, I]
    return int(elements * (3 * ITEMSIZE[m.dtype] + NVFP4_BYTES))


SPEC = ScenarioSpec(
    name="nvfp4-reload", module="repro.scenarios.nvfp4_moe",
    modes=(
        ModeSpec("unfixed", {"reuse_kernel": False, "refresh_alphas": False},
                 "kernel rebuilt every reload (before #50074)"),
        ModeSpec("kernel-reuse", {"reuse_kernel": True, "refresh_alphas": False},
                 "built once (#50074)"),
        ModeSpec("fixed", {"reuse_kernel": True, "refresh_alphas": True},
                 "built once + alphas refreshed (#50074 + #57954)"),
    ),
    default_after_free="poison", dims=MoeDims,
    default_preset="qwen3-30b-a3b-moe", cpu_preset="moe-tiny",
    run_keys=(RunKeySpec("identity_reload", "--identity-reload/--changing-reload",
                         "Reload the same weights every step (hides #57954).", tag="identity"),),
    tensor_parallel=False,  # expert parallelism is not modelled
    help="NVFP4 MoE layer under a captured graph, reloaded with new BF16 weights (vLLM #50074, #57954).",
    steps_help="Reload steps: each loads new weights, then replays the captured MoE layer once.",
    validate=validate, expectation=expectation, footprint=footprint)
