"""Output paths checked before any trial starts: a bad --json after an hour of trials loses the hour.

A path the user gave must name a file in a directory that exists: a missing directory is
refused, never created (a typo in `--json /srv/ci/out/x.json` must not grow a tree at the
filesystem root), and two outputs on one path are refused (one would overwrite the other).
`--artifacts DIR` may name a new DIR in an existing directory. Only the default run folder
under the user's cache is created with its parents: that place is ours. Whether a file can be
created is tried, not inferred from permission bits: root passes every access() check, yet
/proc or a read-only mount refuses the file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from repro.config import ConfigError

DEFAULT_ROOT_HELP = "the default place for run files ($XDG_CACHE_HOME/repro/runs, else ~/.cache/repro/runs)"


def nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def try_create_in(directory: Path) -> str | None:
    """None when a file can be created in directory; else the OS's reason."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".repro-probe-"):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


def check_file(flag: str, value: str | os.PathLike) -> None:
    """A file the run will write (JSON, JUnit, HTML); raises ConfigError naming the flag."""
    path = Path(value).absolute()
    if path.is_dir():
        raise ConfigError(f"{flag} {value}: is a directory; give a file path such as {Path(value) / 'report'}")
    check_parent(flag, value, path.parent)


def check_directory(flag: str, value: str | os.PathLike) -> None:
    """A directory the run will create files under (--artifacts, --run-dir): it may be new,
    its parent must exist."""
    path = Path(value).absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {value}: exists and is not a directory; give a directory path")
    check_parent(flag, value, path if path.is_dir() else path.parent)


def check_parent(flag: str, value: str | os.PathLike, directory: Path) -> None:
    base = nearest_existing(directory)
    if not base.is_dir():
        raise ConfigError(f"{flag} {value}: {base} is a file, not a directory; choose a path outside it")
    if base != directory:
        raise ConfigError(
            f"{flag} {value}: directory {directory} does not exist; create it first (repro does not create it)"
        )
    reason = try_create_in(base)
    if reason:
        raise ConfigError(f"{flag} {value}: cannot create files in {base} ({reason}); choose a writable location")


def check_default_root(root: Path) -> None:
    """The default run folder, created with its parents when first used; named as what it is,
    since the user gave no option for it."""
    base = nearest_existing(root.absolute())
    if not base.is_dir():
        reason = f"{base} is a file, not a directory"
    else:
        denied = try_create_in(base)
        reason = f"cannot create files in {base} ({denied})" if denied else None
    if reason:
        raise ConfigError(
            f"cannot create the run folder {root}, {DEFAULT_ROOT_HELP}: {reason}; "
            "set XDG_CACHE_HOME to a writable directory or pass --artifacts DIR"
        )


def check_distinct(outputs: dict[str, str | os.PathLike | None]) -> None:
    """Two outputs on one path: the later write would silently replace the earlier."""
    seen: dict[str, str] = {}
    for flag, value in outputs.items():
        if not value:
            continue
        key = os.path.realpath(value)
        if key in seen:
            raise ConfigError(f"{seen[key]} and {flag} are the same file {value}; give each its own path")
        seen[key] = flag


def check_outputs(
    json_file: str | None,
    junit: Path | None,
    html: Path | None,
    artifacts: Path | None,
    default_root: Path | None = None,
) -> None:
    """json_file: the file --json writes (None for none, also for `--json -`: stdout; see
    repro/output.py); artifacts: the --artifacts the user gave (None: the run folder goes to
    default_root)."""
    check_distinct({"--json": json_file, "--junit": junit, "--html": html})
    if json_file:
        check_file("--json", json_file)
    if junit:
        check_file("--junit", junit)
    if html:
        check_file("--html", html)
    if artifacts is not None:
        check_directory("--artifacts", artifacts)
    elif default_root is not None:
        check_default_root(default_root)


def refuse_ignored(mode: str, given: dict[str, object]) -> None:
    """A mode that runs nothing (--print-config, --list) with options that only a run uses:
    refused rather than ignored, so nobody waits for a file that never comes."""
    ignored = [flag for flag, value in given.items() if value not in (None, False, [], ())]
    if ignored:
        raise ConfigError(
            f"{mode} runs no trial, so {', '.join(ignored)} would be ignored; "
            f"drop {'it' if len(ignored) == 1 else 'them'} or drop {mode}"
        )
