"""Static audit: which upstream CUDA-graph lifetime fixes does a vLLM source carry?

vLLM is never imported: importing it initialises CUDA, logging and plugins, and the audit
must also work on wheels for other Python versions and on machines without a GPU. This module
reads the source as text -- from the installed package (located with
``importlib.util.find_spec``, which for a top-level name only consults the path finders and
executes nothing), from a directory, or member by member from a .whl/.zip/sdist archive --
and hands each file to repro.audit.rules, which knows the fixes and judges them.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path
from typing import Any, Literal

from repro.audit.rules import (  # noqa: F401  (FIXES, FixCheck, find_fix: the audit's public API)
    ABSENT,
    FIXES,
    NOT_APPLICABLE,
    PRESENT,
    UNKNOWN,
    UNPARSABLE,
    AuditError,
    FixCheck,
    find_fix,
    judge_all,
    normalize_fix_id,
)

Kind = Literal["installed", "directory", "archive"]

# A source file bigger than this is not a Python module we care about; the cap keeps a
# hostile or corrupt archive from making us inflate gigabytes into memory.
MAX_MEMBER_BYTES = 8 * 1024 * 1024


class VllmNotInstalled(AuditError):
    """No vLLM in this Python environment: a fact of the environment, not a usage error."""


@dataclass
class AuditResult:
    source: str  # what was audited: a directory or an archive path
    kind: Kind
    version: str | None
    checks: list[FixCheck] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "kind": self.kind,
            "version": self.version,
            "checks": [c.to_dict() for c in self.checks],
        }

    def check(self, fix_id: str) -> FixCheck:
        wanted = normalize_fix_id(fix_id)
        for c in self.checks:
            if c.fix_id == wanted:
                return c
        raise KeyError(fix_id)


# --------------------------------------------------------------------------- versions

ARCHIVE_VERSION = re.compile(r"^vllm-(\d[^-]*?)(?:-|\.tar\.gz$|\.tgz$|\.tar$|\.zip$|\.whl$)", re.IGNORECASE)


def version_from_metadata(text: str | None) -> str | None:
    """Version: of a METADATA / PKG-INFO text (RFC 822 headers), if its Name: is vllm."""
    if not text:
        return None
    headers = HeaderParser().parsestr(text, headersonly=True)  # the body may quote "Version:"
    if (headers.get("Name") or "").strip().lower() != "vllm":
        return None
    version = (headers.get("Version") or "").strip()
    return version or None


def version_from_module(text: str | None) -> str | None:
    """`__version__ = version = '0.33.0'` at module level of _version.py / version.py.

    Only top-level literals count: vllm/version.py assigns a "dev" fallback inside an
    `except` block, which is not the version."""
    if not text:
        return None
    try:
        tree = ast.parse(text)
    except UNPARSABLE:
        m = re.search(r"^__version__\s*=\s*(?:\w+\s*=\s*)*['\"]([^'\"]+)['\"]", text, re.M)
        return m.group(1) if m else None
    for stmt in tree.body:
        if (
            isinstance(stmt, ast.Assign)
            and isinstance(stmt.value, ast.Constant)
            and isinstance(stmt.value.value, str)
            and any(isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in stmt.targets)
        ):
            return stmt.value.value
    return None


def version_from_archive_name(path: Path) -> str | None:
    m = ARCHIVE_VERSION.match(path.name)
    return m.group(1) if m else None


def first_version(candidates: Iterable[Callable[[], str | None]]) -> str | None:
    for candidate in candidates:
        found = candidate()
        if found:
            return found
    return None


# --------------------------------------------------------------------------- sources


def read_text_file(path: Path) -> str | None:
    try:
        if not path.is_file() or path.stat().st_size > MAX_MEMBER_BYTES:
            return None
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return None


def package_dir_in(path: Path) -> Path | None:
    """The vllm/ package for a repo root / site-packages (DIR/vllm) or the package itself."""

    def looks_like_package(p: Path) -> bool:
        return p.is_dir() and ((p / "__init__.py").is_file() or (p / "model_executor").is_dir())

    if looks_like_package(path / "vllm"):
        return path / "vllm"
    if path.name == "vllm" and looks_like_package(path):
        return path
    return None


def directory_version(package: Path) -> str | None:
    root = package.parent

    def dist_info() -> str | None:
        for meta in sorted(root.glob("vllm-*.dist-info/METADATA")):
            found = version_from_metadata(read_text_file(meta))
            if found:
                return found
        return None

    return first_version(
        [
            dist_info,
            lambda: version_from_metadata(read_text_file(root / "PKG-INFO")),
            lambda: version_from_module(read_text_file(package / "_version.py")),
            lambda: version_from_module(read_text_file(package / "version.py")),
        ]
    )


def audit_package_dir(package: Path, source: str, kind: Kind, version: str | None = None) -> AuditResult:
    def read(rel: str) -> str | None:
        # Fix paths are "vllm/..."; the package folder may be named otherwise (a vendored
        # copy), so resolve the part after the first component under it.
        return read_text_file(package / rel.split("/", 1)[1])

    return AuditResult(source=source, kind=kind, version=version or directory_version(package), checks=judge_all(read))


def audit_directory(path: str | Path) -> AuditResult:
    p = Path(path).expanduser()
    if not p.exists():
        raise AuditError(f"{p} does not exist; pass --path a vLLM checkout or its vllm/ package folder.")
    if not p.is_dir():
        raise AuditError(
            f"{p} is not a directory; use --wheel for an archive or pass --path a "
            "vLLM checkout or its vllm/ package folder."
        )
    package = package_dir_in(p)
    if package is None:
        raise AuditError(
            f"No vllm package found in {p} (looked for {p / 'vllm'} and for {p} "
            "itself being vllm/); pass --path a vLLM checkout or its vllm/ folder."
        )
    return audit_package_dir(package, str(p), "directory")


def installed_package_dir() -> Path:
    # find_spec on a top-level name asks the path finders only; no vllm code runs.
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        raise VllmNotInstalled(
            "vllm is not installed in this Python environment "
            "(importlib.util.find_spec('vllm') found nothing); install it, or "
            "audit a checkout with --path DIR or an archive with --wheel FILE."
        )
    if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
        return Path(spec.origin).parent
    locations = list(spec.submodule_search_locations or [])
    if not locations:
        raise AuditError(
            "vllm is importable but has no file location (origin "
            f"{spec.origin!r}); audit its source with --path DIR instead."
        )
    return Path(locations[0])


def installed_version(package: Path) -> str | None:
    # Ask only the distributions installed next to the package we audit, so a second
    # vllm elsewhere on sys.path cannot lend its version.
    for dist in importlib.metadata.distributions(path=[str(package.parent)]):
        if (dist.metadata["Name"] or "").lower() == "vllm":
            return dist.version
    return None


def audit_installed() -> AuditResult:
    package = installed_package_dir()
    return audit_package_dir(package, str(package), "installed", installed_version(package))


# -- archives: read member by member, never extract ------------------------------------

VERSION_MEMBERS = ("vllm/_version.py", "vllm/version.py")


def wanted_members() -> tuple[str, ...]:
    sources = {f.file for f in FIXES} | {file for f in FIXES for file in f.also}
    return tuple(sorted(sources | set(VERSION_MEMBERS)))


def split_member(name: str, wanted: tuple[str, ...]) -> tuple[str, str] | None:
    """'pkg-1.0/vllm/x.py' -> ('pkg-1.0/', 'vllm/x.py') when it is a wanted path."""
    name = name[2:] if name.startswith("./") else name
    for rel in wanted:
        if name == rel:
            return "", rel
        if name.endswith("/" + rel):
            return name[: -len(rel)], rel
    return None


def package_prefix(names: Iterable[str]) -> str | None:
    """Archive prefix of the top-most vllm package (shortest path to vllm/__init__.py)."""
    prefixes = []
    for name in names:
        name = name[2:] if name.startswith("./") else name
        if name == "vllm/__init__.py" or name.endswith("/vllm/__init__.py"):
            prefixes.append(name[: -len("vllm/__init__.py")])
    return min(prefixes, key=len) if prefixes else None


@dataclass
class ArchiveScan:
    """What one pass over an archive collected: candidate files and metadata texts."""

    names: list[str] = field(default_factory=list)
    files: dict[tuple[str, str], str] = field(default_factory=dict)  # (prefix, rel) -> text
    metadata: list[str] = field(default_factory=list)  # METADATA / PKG-INFO


def is_metadata_member(name: str) -> bool:
    parts = name.strip("/").split("/")
    if len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] == "METADATA":
        return True
    return len(parts) <= 2 and parts[-1] == "PKG-INFO"


def scan_zip(path: Path) -> ArchiveScan:
    scan = ArchiveScan()
    wanted = wanted_members()
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            scan.names.append(info.filename)
            hit = split_member(info.filename, wanted)
            meta = is_metadata_member(info.filename)
            if (hit or meta) and info.file_size <= MAX_MEMBER_BYTES:
                keep_member(scan, hit, archive.read(info))
    return scan


def keep_member(scan: ArchiveScan, hit: str | None, data: bytes) -> None:
    """A wanted source file goes under its package path; anything else read is metadata."""
    text = data.decode("utf-8", errors="replace")
    if hit:
        scan.files[hit] = text
    else:
        scan.metadata.append(text)


def scan_tar(path: Path) -> ArchiveScan:
    scan = ArchiveScan()
    wanted = wanted_members()
    # Stream mode: one sequential pass over the compressed file, nothing written to disk.
    with tarfile.open(path, mode="r|*") as archive:
        for member in archive:
            name = member.name[2:] if member.name.startswith("./") else member.name
            scan.names.append(name)
            if not member.isfile() or member.size > MAX_MEMBER_BYTES:
                continue
            hit = split_member(name, wanted)
            if hit or is_metadata_member(name):
                handle = archive.extractfile(member)
                keep_member(scan, hit, handle.read() if handle else b"")
    return scan


def scan_archive(path: Path) -> ArchiveScan:
    try:
        if zipfile.is_zipfile(path):
            return scan_zip(path)
        return scan_tar(path)
    except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError, ValueError, zlib.error) as exc:
        raise AuditError(
            f"Cannot read {path} as a .whl/.zip or .tar.gz archive ({exc}); "
            "re-download it or pass a valid vLLM wheel or sdist."
        ) from exc


def audit_archive(path: str | Path) -> AuditResult:
    p = Path(path).expanduser()
    if not p.is_file():
        raise AuditError(f"{p} does not exist or is not a file; pass --wheel an existing vLLM .whl, .zip or .tar.gz.")
    scan = scan_archive(p)
    prefix = package_prefix(scan.names)
    if prefix is None:
        raise AuditError(f"No vllm package (vllm/__init__.py) inside {p}; pass --wheel a vLLM wheel or sdist.")

    def read(rel: str) -> str | None:
        return scan.files.get((prefix, rel))

    version = first_version(
        [
            *[(lambda t=t: version_from_metadata(t)) for t in scan.metadata],
            lambda: version_from_module(read("vllm/_version.py")),
            lambda: version_from_module(read("vllm/version.py")),
            lambda: version_from_archive_name(p),
        ]
    )
    return AuditResult(source=str(p), kind="archive", version=version, checks=judge_all(read))


# --------------------------------------------------------------------------- verdicts


def missing_required(result: AuditResult, required_ids: Iterable[str]) -> list[str]:
    """Required fixes the audited source does not carry, in the order asked.

    Anything not "present" is missing -- including "not-applicable": the user named the fix,
    and a version without the file the fix lives in cannot be carrying it -- and "unknown": a
    rule that cannot judge the source must not let a gate pass. Fixes the user
    did not ask for never count, whatever their state. Unknown ids raise AuditError so a
    typo cannot make a gate pass.
    """
    missing: list[str] = []
    for fix_id in required_ids:
        fix = find_fix(fix_id)
        try:
            state = result.check(fix.fix_id).state
        except KeyError:
            state = NOT_APPLICABLE
        if state != PRESENT and fix.fix_id not in missing:
            missing.append(fix.fix_id)
    return missing


# --------------------------------------------------------------------------- rendering

STATE_STYLE = {PRESENT: "green", ABSENT: "bold red", NOT_APPLICABLE: "dim", UNKNOWN: "yellow"}


def render(result: AuditResult, console: Any) -> None:
    """Render the audit as a rich table on the given rich Console."""
    # rich is needed only to show results, not to compute them.
    from rich.table import Table
    from rich.text import Text

    version = result.version or "unknown version"
    table = Table(title=f"vLLM {version} ({result.kind}: {result.source})", show_lines=False)
    table.add_column("fix", no_wrap=True)
    table.add_column("title")
    table.add_column("state", no_wrap=True)
    table.add_column("file:line", overflow="fold")
    table.add_column("evidence")
    for c in result.checks:
        where = f"{c.file}:{c.line}" if c.line is not None else c.file
        style = STATE_STYLE.get(c.state, "")
        # Text cells, not markup: evidence quotes code such as `w[: n]`, which rich would
        # otherwise read as style tags.
        table.add_row(Text(f"#{c.fix_id}"), Text(c.title), Text(c.state, style=style), Text(where), Text(c.evidence))
    console.print(table)
