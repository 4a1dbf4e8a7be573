"""Where a run's files go: one folder per run under a root, and ROOT/latest pointing at the newest.

The default root is the user's cache (`$XDG_CACHE_HOME/repro/runs`, else `~/.cache/repro/runs`),
not the current directory: a day of runs must not litter whatever directory the user is in.
"""

from __future__ import annotations

import os
from pathlib import Path

LATEST = "latest"


def cache_root(env: dict[str, str]) -> Path:
    """The user's cache for repro: run folders and the workers' bytecode cache live under it."""
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "repro"


def default_root(env: dict[str, str]) -> Path:
    return cache_root(env) / "runs"


def point_latest(run_dir: Path) -> Path | None:
    """Make run_dir.parent/latest a relative symlink to run_dir; None if run_dir was never made
    (every trial UNSUPPORTED) or the filesystem has no symlinks. Replaced atomically, so a
    concurrent run sees the old link or the new one."""
    if not run_dir.is_dir():
        return None
    link = run_dir.parent / LATEST
    tmp = run_dir.parent / f".{LATEST}.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_dir.name, target_is_directory=True)
        os.replace(tmp, link)
    except OSError:
        tmp.unlink(missing_ok=True)
        return None
    return link
