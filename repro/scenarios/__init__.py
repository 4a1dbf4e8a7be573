"""Scenario registry: every fact the parent needs about a scenario, in one ScenarioSpec.

config (presets, validation), runner (preset choice), the CLI (one command per scenario),
the report (run keys) and the workers (which module to import) all read the specs below.
A new scenario is one module with `run(ctx: repro.worker.WorkerContext) -> None` and a
`MODES` table (mode name -> fix flags, checked against its spec by tests/test_scenarios.py),
plus one entry in SCENARIOS.

This module stays torch-free: the parent imports it. Scenario modules import torch and touch
CUDA, so they are imported lazily, inside workers only (load_scenario).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType


@dataclass
class Gemma4Dims:
    """Gemma 4 assistant (MTP drafter) dimensions; see repro/configs/gemma4-e2b.toml for sources."""
    vocab_size: int = 262144
    hidden_size: int = 256            # draft hidden; the centroid head and lm_head act on it
    backbone_hidden_size: int = 1536  # recorded for the report; the drafter head does not use it
    num_centroids: int = 2048
    centroid_top_k: int = 32
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    dtype: str = "bfloat16"


@dataclass
class MoeDims:
    """One MoE layer (router + experts) in the shape of a real model."""
    num_experts: int = 128
    hidden_size: int = 2048
    intermediate_size: int = 768
    top_k: int = 8
    tokens: int = 64                  # tokens per replay (decode batch)
    dtype: str = "bfloat16"


@dataclass
class SelftestDims:
    """The harness self-test has no model; one field so presets stay uniform."""
    dtype: str = "float32"


@dataclass(frozen=True)
class ModeSpec:
    name: str
    fixes: dict[str, bool]            # the scenario module's fix flags for this mode (its MODES table)
    help: str                         # one clause for --mode help: what this mode does


@dataclass(frozen=True)
class RunKeySpec:
    """A scenario-only [run] key (a switch, or a number whose 0 means the scenario's default),
    its CLI flag and its help."""
    name: str                         # RunConfig field, e.g. reload_drafter
    flag: str                         # Typer declaration, e.g. --reload-drafter/--no-reload-drafter
    help: str
    tag: str = ""                     # switches: appended to the trial id when on, e.g. reload
    type: type = bool
    default: str = ""                 # numbers: what 0 (left out) resolves to, for --help


@dataclass(frozen=True)
class CpuCost:
    """A real-dims preset timed on a CPU without a GPU (2 cores, shared with other work): the
    set-up (model build and the capture dry run) and one step, each the (fastest, slowest)
    seconds seen. Load moves them by 2-3x, so the CLI says a range, up front, for any CPU trial
    of about this size (repro/cli.py: cpu_warnings)."""
    preset: str
    setup_s: tuple[float, float]
    step_s: tuple[float, float]

    def estimate(self, steps: int) -> tuple[float, float]:
        return self.setup_s[0] + steps * self.step_s[0], self.setup_s[1] + steps * self.step_s[1]


@dataclass(frozen=True)
class ScenarioSpec:
    name: str                         # CLI command, preset `scenario = ...`, trial records
    module: str                       # imported in workers only
    modes: tuple[ModeSpec, ...]       # the first is the default
    default_after_free: str
    dims: type
    default_preset: str               # real dims, used on CUDA
    cpu_preset: str                   # tiny dims, used when no GPU is present and none was named
    run_keys: tuple[RunKeySpec, ...] = ()
    tensor_parallel: bool = True      # False: one rank only; the command has no --tp
    help: str = ""                    # the CLI command's help
    steps_help: str = ""              # --steps help: what one step of this scenario does
    command: bool = True              # gets a generated scenario command (selftest has its own)
    cpu_cost: CpuCost | None = None   # its real-dims preset timed on CPU: the estimate said up front

    @property
    def mode_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.modes)

    @property
    def run_key_names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.run_keys)

    def mode_help(self) -> str:
        return "; ".join(f"{m.name}: {m.help}" for m in self.modes) + "."


SCENARIOS: dict[str, ScenarioSpec] = {s.name: s for s in (
    ScenarioSpec(
        name="gemma4-mtp", module="repro.scenarios.gemma4_mtp",
        modes=(
            ModeSpec("unfixed", {"cache_gathered": False, "refresh_cache_on_reload": False},
                     "gathered lm_head in a local (before vLLM #43909)"),
            ModeSpec("fixed", {"cache_gathered": True, "refresh_cache_on_reload": False},
                     "cached on the module (#43909)"),
            ModeSpec("reload-safe", {"cache_gathered": True, "refresh_cache_on_reload": True},
                     "cache refreshed in place on reload"),
        ),
        default_after_free="release", dims=Gemma4Dims,
        default_preset="gemma4-e2b", cpu_preset="gemma4-tiny",
        # At TP 2, 2026-12-01: all 14 steps in 94 s on a quiet machine (build 19 s, a step 3-28 s);
        # under load 5 steps in 180 s (set-up 60 s, a step 10-32 s).
        cpu_cost=CpuCost("gemma4-e2b", setup_s=(20, 60), step_s=(3, 32)),
        run_keys=(RunKeySpec("reload_drafter", "--reload-drafter/--no-reload-drafter",
                             "Reload drafter weights after capture and keep replaying (RL-style lifecycle).",
                             tag="reload"),
                  RunKeySpec("num_speculative_tokens", "--num-speculative-tokens",
                             "Drafts per decode step, each fed back into the drafter (vLLM's Gemma 4 examples "
                             "use 1, which never feeds a draft back); 0: the default.", type=int, default="3")),
        help="Gemma 4 MTP speculative decoding (propose, verify, accept) under the drafter's per-batch-size "
             "centroid CUDA graphs (vLLM #43909).",
        steps_help="Decode steps: each drafts k tokens per sequence through the centroid graph of the step's "
                   "batch size, then the target verifies them."),
    ScenarioSpec(
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
        # 2026-12-01, 2 cores under load: set-up (build + capture) 74-150 s, a reload step 228-304 s
        # (quantising 128 experts, the replay and the reference; pauses of 2-3 min without a record);
        # 2 steps took 12 min. The step's range is that widened by half either way.
        cpu_cost=CpuCost("qwen3-30b-a3b-moe", setup_s=(70, 150), step_s=(150, 460)),
        run_keys=(RunKeySpec("identity_reload", "--identity-reload/--changing-reload",
                             "Reload the same weights every step (hides #57954).", tag="identity"),),
        tensor_parallel=False,  # expert parallelism is not modelled
        help="NVFP4 MoE layer under a captured graph, reloaded with new BF16 weights (vLLM #50074, #57954).",
        steps_help="Reload steps: each loads new weights, then replays the captured MoE layer once."),
    ScenarioSpec(
        name="selftest", module="repro.scenarios.selftest",
        modes=(ModeSpec("clean", {}, "no bug: ranks all-gather every step"),),
        default_after_free="keep", dims=SelftestDims,
        default_preset="selftest", cpu_preset="selftest",
        help="Check the harness itself: ranks all-gather every step; no graphs, no bug.", command=False,
        steps_help="Steps: each all-gathers across the ranks."),
)}

# Every scenario-only [run] key; a trial of another scenario must leave it off.
SCENARIO_RUN_KEYS = frozenset(k for s in SCENARIOS.values() for k in s.run_key_names)


def load_scenario(name: str) -> ModuleType:
    return importlib.import_module(SCENARIOS[name].module)
