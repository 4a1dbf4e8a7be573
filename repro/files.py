"""Atomic file writing for every artifact (reports, doctor and audit JSON).

A reader (CI uploading artifacts, a watcher) must see the old file or the new one, never half
of one, even if the harness is killed mid-write.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["write_text_atomic"]


def write_text_atomic(path: str | os.PathLike, data: str) -> Path:
    """Write via a temp file in the same directory + fsync + os.replace.

    The temp file is created with mode 0o666 so the process umask decides the final
    permissions, as with a plain open() (mkstemp's 0o600 would hide artifacts from CI).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_directory(target.parent)
    return target


def sync_directory(directory: Path) -> None:
    # The rename itself is durable only once the directory entry is flushed; best effort.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
