"""Run a scenario's ranks' code in this process, exactly as a worker would (CPU, one rank, no
graphs), and read its records back: shared by the scenarios' CPU tests."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from repro.diagnose.forensics import MemoryHistory
from repro.rank.graphs import HarnessMemory
from repro.diagnose.guard import CaptureGuard
from repro.run.protocol import RecordSink, TrialSpec
from repro.rank.worker import WorkerContext

CPU = torch.device("cpu")


@dataclass
class Records:
    events: list[dict[str, Any]] = field(default_factory=list)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]

    @property
    def steps(self) -> list[dict[str, Any]]:
        return self.of("step")

    @property
    def details(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for e in self.of("detail"):
            merged.update(e)
        return merged


def run_in_process(out: Path, cfg: Any, module: Any) -> Records:
    """module.run(ctx) for the trial config cfg, its records written to out/rank0.jsonl."""
    out.mkdir()
    spec = TrialSpec(trial_id="t", config=cfg.to_dict(), device="cpu", world_size=1, out_dir=str(out))
    sink = RecordSink(out / "rank0.jsonl", 0)
    ctx = WorkerContext(
        spec=spec,
        cfg=cfg,
        rank=0,
        device=CPU,
        tp=None,
        sink=sink,
        guard=CaptureGuard(mode=cfg.run.guard),
        history=MemoryHistory(enabled=False),
        memory=HarnessMemory(CPU),
    )
    module.run(ctx)
    sink.file.close()
    return Records([json.loads(line) for line in (out / "rank0.jsonl").read_text().splitlines()])
