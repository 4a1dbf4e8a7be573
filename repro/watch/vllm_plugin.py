"""vLLM general plugin: `repro watch`'s hooks inside every vLLM process, only when asked.

vLLM calls every ``vllm.general_plugins`` entry point in each process it creates (API server,
engine core, workers), before work starts, and may call it more than once per process. This
plugin does nothing unless REPRO_WATCH is set (installing repro must never change vLLM), and
otherwise starts the same hooks as `repro watch` (idempotent). It imports neither vLLM nor
torch: the hooks wait for torch's CUDAGraph, or patch it at once if torch is already imported.
"""

from __future__ import annotations

import os
import sys


def register() -> None:
    if os.environ.get("REPRO_WATCH", "").strip() in ("", "0"):
        return
    try:
        from repro.watch import hooks as watch_hooks

        watch_hooks.activate_from_env(watch_hooks.Origin.VLLM_PLUGIN)
    except Exception as e:  # a diagnostic must never stop the engine
        sys.stderr.write(
            f"repro watch: vLLM plugin could not start the hooks in pid {os.getpid()}: {type(e).__name__}: {e}\n"
        )
