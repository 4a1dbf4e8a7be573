"""Output paths checked before any trial starts: a bad --json after an hour of trials loses the hour.

The writers create missing parent directories, so a path can be written when it is not an
existing directory and its nearest existing ancestor is a directory this process may create
files in. That last part is tried, not inferred from permission bits: root passes every
access() check, yet /proc or a read-only mount refuses the file.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from repro.config import ConfigError


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
    """A directory the run will create files under (--artifacts)."""
    path = Path(value).absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {value}: exists and is not a directory; give a directory path")
    check_parent(flag, value, path)


def check_parent(flag: str, value: str | os.PathLike, directory: Path) -> None:
    base = nearest_existing(directory)
    if not base.is_dir():
        raise ConfigError(f"{flag} {value}: {base} is a file, not a directory; choose a path outside it")
    reason = try_create_in(base)
    if reason:
        raise ConfigError(f"{flag} {value}: cannot create files in {base} ({reason}); choose a writable location")


def check_outputs(json_path: str | None, junit: Path | None, html: Path | None, artifacts: Path | None) -> None:
    if json_path and json_path != "-":
        check_file("--json", json_path)
    if junit:
        check_file("--junit", junit)
    if html:
        check_file("--html", html)
    if artifacts is not None:
        check_directory("--artifacts", artifacts)
