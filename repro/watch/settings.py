"""What a watched process is told through its environment: the REPRO_WATCH_* variables.

Both sides read this module: `repro watch` (repro/watch/command.py), the pytest plugin and the
Ray hook set the variables; the hooks in every watched process (repro/watch/hooks/) read them
back into a WatchSettings. Plain data only: no torch, nothing of the hooks.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

ENV_ON = "REPRO_WATCH"  # "1": hooks on (the vLLM plugin's switch too)
ENV_DIR = "REPRO_WATCH_DIR"  # run directory for the per-process records
ENV_ON_FINDING = "REPRO_WATCH_ON_FINDING"  # an OnFinding
ENV_SITE = "REPRO_WATCH_SITE"  # the sitecustomize directory `repro watch` prepended
ENV_RECORD = "REPRO_WATCH_RECORD"  # a Record
ENV_STACKS = "REPRO_WATCH_STACKS"  # "1": the allocator records each allocation's Python stack
ENV_VARS = (ENV_ON, ENV_DIR, ENV_ON_FINDING, ENV_SITE, ENV_RECORD, ENV_STACKS)
ENV_OWNER = "REPRO_WATCH_OWNER"  # set by the pytest plugin: the record file (stem) of the
# test process whose test started this process
DEFAULT_DIR = "repro-watch"

E = TypeVar("E", bound=StrEnum)


class OnFinding(StrEnum):
    """What a finding does to the replay that would read the dead memory."""

    WARN = "warn"  # recorded; the replay runs
    RAISE = "raise"  # recorded; the replay raises StaleCaptureError before the launch


class Record(StrEnum):
    """How the hooks learn what a capture holds."""

    # Where the census runs, read from the graph after it (cost per node); elsewhere every op
    # is recorded at the dispatcher.
    GRAPH = "graph"
    # Every op is recorded at the dispatcher as well (cost per op: tensors behind pointer
    # tables in device memory, which no node holds, get names and drop sites too).
    OPS = "ops"


class Origin(StrEnum):
    """What started the hooks in a process."""

    SITECUSTOMIZE = "sitecustomize"  # `repro watch` (every Python process of the command)
    VLLM_PLUGIN = "vllm-plugin"  # vLLM's plugin entry point, with REPRO_WATCH set
    PYTEST = "pytest"  # the pytest plugin (repro.pytest.watch)
    RAY = "ray"  # a Ray worker (repro.watch.ray)
    API = "api"  # the program itself (activate)


@dataclass(frozen=True)
class WatchSettings:
    run_dir: str
    on_finding: OnFinding
    origin: Origin
    record: Record = Record.GRAPH
    # The allocator records each allocation's Python stack from CUDA's initialisation on, so a
    # storage the census hands to the guard gets its "created at" (a cost per allocation).
    stacks: bool = False


def settings_from_env(environ: dict[str, str], origin: Origin) -> WatchSettings | None:
    """None unless REPRO_WATCH is set to something other than 0/empty."""
    if environ.get(ENV_ON, "").strip() in ("", "0"):
        return None
    return WatchSettings(
        run_dir=os.path.abspath(environ.get(ENV_DIR) or DEFAULT_DIR),
        on_finding=choice_from_env(environ, ENV_ON_FINDING, OnFinding.WARN),
        origin=origin,
        record=choice_from_env(environ, ENV_RECORD, Record.GRAPH),
        stacks=flag_from_env(environ, ENV_STACKS),
    )


def flag_from_env(environ: dict[str, str], key: str) -> bool:
    """On when set to anything but 0 or empty (as REPRO_WATCH itself)."""
    return environ.get(key, "").strip() not in ("", "0")


def choice_from_env(environ: dict[str, str], key: str, default: E) -> E:
    """The member of default's enum that environ[key] names; default (said on stderr) for
    any other value, default (silently) when unset or empty."""
    text = environ.get(key, "").strip()
    if not text:
        return default
    kind = type(default)
    try:
        return kind(text)
    except ValueError:
        sys.stderr.write(f"repro watch: {key}={text!r} is not one of {', '.join(kind)}; using {default}\n")
        return default
