"""Every engine shape of examples/engine_shapes.py, correct and buggy twin, under `repro watch`:
a correct twin must give no finding, a buggy twin exactly the tensors its bug kills.

    PYTHONPATH=. python3 benchmarks/engine_corpus.py [--out DIR] [--jobs 4] [--only SHAPE,...]

Also runs full and piecewise with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. Prints one
JSON document (every case: findings by name, status, mechanism; verdict) and a table. GPU only
(without CUDA every program says so and captures nothing: the verdicts then say 'no graph').
"""

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROGRAM = REPO / "examples" / "engine_shapes.py"
sys.path.insert(0, str(REPO / "examples"))
from engine_shapes import BUGS  # noqa: E402

EXPANDABLE = "expandable_segments:True"


@dataclass
class Case:
    shape: str
    bug: bool
    alloc_conf: str = ""

    @property
    def name(self) -> str:
        return f"{self.shape}{' bug' if self.bug else ''}{' expandable' if self.alloc_conf else ''}"


@dataclass
class Result:
    case: Case
    findings: list[dict] = field(default_factory=list)  # slot, status, mechanism, graph
    groups: int = 0
    program: dict = field(default_factory=dict)
    exit: int | None = None
    verdict: str = ""
    ok: bool = False
    stderr_tail: str = ""


def cases(only: list[str] | None) -> list[Case]:
    out = [Case(s, b) for s in BUGS for b in (False, True)]
    out += [Case(s, b, EXPANDABLE) for s in ("full", "piecewise") for b in (False, True)]
    return [c for c in out if not only or c.shape in only]


def judge(case: Case, names: list[str], captured: bool) -> tuple[bool, str]:
    """(ok, why): correct twin -> no finding; buggy twin -> every pattern found, nothing else."""
    if not captured:
        return False, "no graph was captured (no CUDA): nothing was checked"
    if not case.bug:
        return (not names), ("0 findings" if not names else f"{len(names)} false findings: {sorted(set(names))[:5]}")
    patterns = BUGS[case.shape]
    stray = sorted({n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in patterns)})
    missing = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if stray or missing:
        return False, f"missing {missing}, unexpected {stray[:5]}"
    return True, f"{len(names)} findings, all of {list(patterns)}"


def run_case(case: Case, out: Path, timeout: float) -> Result:
    tag = case.name.replace(" ", "-")
    report, run_dir = out / f"{tag}.json", out / tag
    cmd = (
        [
            sys.executable,
            "-m",
            "repro",
            "watch",
            "--run-dir",
            str(run_dir),
            "--json",
            str(report),
            "--",
            sys.executable,
            str(PROGRAM),
            case.shape,
        ]
        + (["--bug"] if case.bug else [])
        + (["--alloc-conf", case.alloc_conf] if case.alloc_conf else [])
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    res = Result(case)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        res.verdict = f"timed out after {timeout:.0f} s"
        return res
    res.exit, res.stderr_tail = proc.returncode, proc.stderr[-1500:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    res.program = json.loads(lines[-1]) if lines else {}
    doc = json.loads(report.read_text()) if report.exists() else {}
    for f in doc.get("findings", []):
        inner = f.get("finding", f)
        res.findings.append({k: inner.get(k) for k in ("slot", "status", "mechanism", "graph")})
    res.groups = len(doc.get("groups", []))
    captured = bool(res.program.get("graphs"))
    res.ok, res.verdict = judge(case, [f["slot"] for f in res.findings], captured)
    return res


def table(results: list[Result]) -> str:
    rows = ["| case | graphs | findings | groups | max err | verdict |", "|---|---|---|---|---|---|"]
    for r in results:
        err = r.program.get("max_abs_err")
        rows.append(
            f"| {r.case.name} | {r.program.get('graphs', '-')} | {len(r.findings)} | {r.groups} | "
            f"{'-' if err is None else f'{err:.3g}'} | {'ok' if r.ok else 'FAIL'}: {r.verdict} |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--only", default="", help="comma-separated shapes")
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="engine-corpus-"))
    out.mkdir(parents=True, exist_ok=True)
    chosen = cases([s for s in args.only.split(",") if s] or None)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda c: run_case(c, out, args.timeout), chosen))
    text = table(results)
    (out / "table.md").write_text(text + "\n")
    emit({"results": [asdict(r) for r in results], "all_ok": all(r.ok for r in results)}, None)
    sys.stderr.write(text + "\n")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
