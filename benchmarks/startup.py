"""What a rank's start-up costs, piece by piece, each in a fresh interpreter (medians of N).

The floor of a trial is: interpreter + torch import, CUDA context, NCCL, the captures. This
measures each piece alone, what the dispatcher-level recording's first use costs (does it
import torch._dynamo on this torch?), and whether a process that imported torch (no CUDA)
can fork a child that then uses CUDA: what a pre-forked rank server relies on.

Usage: PYTHONPATH=$PWD python3 benchmarks/startup.py [--runs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from common import emit

# Each snippet prints one JSON object on its last line; the wall clock includes the interpreter.
SNIPPETS = {
    "python": "print('{}')",
    "parent (import repro.cli)": "import repro.cli; print('{}')",
    "import torch": "import torch; print('{}')",
    "import torch + torch._dynamo": "import torch, torch._dynamo; print('{}')",
    "import torch + CUDA context": (
        "import torch, time, json; t=time.perf_counter(); torch.zeros(1, device='cuda'); "
        "torch.cuda.synchronize(); print(json.dumps({'cuda_init_s': time.perf_counter()-t}))"
    ),
    "rank preload (repro.rank.server.preload)": (
        "import json, sys, time, os; t=time.perf_counter(); from repro.rank import server as rankserver; rankserver.preload(); "
        "print(json.dumps({'preload_s': time.perf_counter()-t, "
        "'dynamo_imported': 'torch._dynamo' in sys.modules, 'threads': rankserver.thread_count(), "
        "'libcuda_mapped': 'libcuda.so' in open('/proc/self/maps').read(), 'unfit': rankserver.unfit_reason(), "
        "'driver_initialized': rankserver.driver_initialized()}))"
    ),
    "the rank server's CUDA check after CUDA is initialised": (
        "import json, torch; from repro.rank import server as rankserver; torch.cuda.init()\n"
        "print(json.dumps({'driver_initialized': rankserver.driver_initialized(), 'unfit': rankserver.unfit_reason()}))"
    ),
    "the rank server's CUDA check after torch.cuda.is_available()": (
        "import json, torch; from repro.rank import server as rankserver; torch.cuda.is_available()\n"
        "print(json.dumps({'torch_says_initialized': torch.cuda.is_initialized(), "
        "'driver_initialized': rankserver.driver_initialized(), 'unfit': rankserver.unfit_reason()}))"
    ),
    "modules a rank imports after the preload (nvfp4-reload, TP 1, in-process)": (
        "import json, sys, tempfile, time\n"
        "from repro.rank import server as rankserver; rankserver.preload()\n"
        "from repro.run.runner import plan; from repro.run.protocol import TrialSpec; from repro.rank.worker import run_rank\n"
        "before = set(sys.modules)\n"
        "p = plan('nvfp4-reload', None, {'device': 'cuda'}, ['run.steps=2'], 1)\n"
        "tmp = tempfile.mkdtemp(); t = time.perf_counter()\n"
        "code = run_rank(TrialSpec(trial_id='x', config=p.cfg.to_dict(), device='cuda', world_size=1, out_dir=tmp), 0)\n"
        "new = sorted(set(sys.modules) - before)\n"
        "print(json.dumps({'rank_exit': code, 'rank_s': time.perf_counter()-t, 'new_modules': len(new), 'first': new[:40]}))"
    ),
    "first dispatch of a TorchDispatchMode (torch's default)": (
        "import sys, time, json, torch\n"
        "from torch.utils._python_dispatch import TorchDispatchMode\n"
        "class M(TorchDispatchMode):\n"
        "    def __torch_dispatch__(self, func, types, args=(), kwargs=None):\n"
        "        return func(*args, **(kwargs or {}))\n"
        "t=time.perf_counter()\n"
        "with M(): torch.zeros(1).add_(0)\n"
        "print(json.dumps({'first_dispatch_s': time.perf_counter()-t, 'dynamo_imported': 'torch._dynamo' in sys.modules,"
        " 'has_should_skip_dynamo': hasattr(TorchDispatchMode, '_should_skip_dynamo'), 'torch': torch.__version__}))"
    ),
    "first dispatch of the guard's recording mode": (
        "import sys, time, json, torch\n"
        "from repro.diagnose import guard\n"
        "t=time.perf_counter(); guard.warm_up()\n"
        "print(json.dumps({'first_dispatch_s': time.perf_counter()-t, 'dynamo_imported': 'torch._dynamo' in sys.modules}))"
    ),
    "fork after import, child uses CUDA": (
        "import os, sys, time, json, torch\n"
        "threads = len(os.listdir('/proc/self/task'))\n"
        "t=time.perf_counter(); pid = os.fork()\n"
        "if pid == 0:\n"
        "    a = torch.randn(256, 256, device='cuda'); torch.cuda.synchronize(); os._exit(0 if float((a @ a).sum()) == float((a @ a).sum()) else 1)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(json.dumps({'child_exit': os.waitstatus_to_exitcode(status), 'fork_to_child_done_s': time.perf_counter()-t,"
        " 'threads_before_fork': threads, 'parent_cuda_initialized': torch.cuda.is_initialized()}))"
    ),
}


def run_snippet(code: str) -> dict:
    """In the environment the harness gives its ranks (its bytecode cache included)."""
    from repro.run.launch import child_env

    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env())
    wall = time.perf_counter() - t0
    out = {"wall_s": wall, "exit": proc.returncode}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        out.update(json.loads(lines[-1]))
    else:
        out["error"] = (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
    return out


def summarize(samples: list[dict]) -> dict:
    row: dict = {}
    for key in samples[0]:
        values = [s[key] for s in samples if key in s]
        if all(isinstance(v, float) for v in values):
            row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        else:
            row[key] = sorted({json.dumps(v) for v in values})
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--cpu", action="store_true", help="skip the snippets that need a GPU")
    a = ap.parse_args()
    doc = {}
    for name, code in SNIPPETS.items():
        if a.cpu and "cuda" in code.lower():
            continue
        doc[name] = summarize([run_snippet(code) for _ in range(a.runs)])
    emit(doc, a.json)


if __name__ == "__main__":
    main()
