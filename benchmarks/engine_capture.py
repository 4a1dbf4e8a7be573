"""What `repro watch` costs an engine-shaped program, at the scale engines capture: side by side
in one run, plain vs watched, on one GPU.

    PYTHONPATH=. python3 benchmarks/engine_capture.py [--cases full,piecewise] [--sizes 67]
        [--layers 32] [--hidden 1024] [--repeats 3] [--step-rounds 20] [--out DIR] [--profile]

--repeats 0 measures the step inside one process alone (no capture pairs). The table and the
JSON are written after each pair and each step measure, so a time limit loses only what it cut.

Each case runs examples/engine_shapes.py SHAPE (67 batch sizes, 32 layers, hidden 1024, one
shared pool: 67 full graphs, or 67 x 33 = 2,211 piecewise graphs) in fresh processes,
alternating plain and `repro watch` runs. From the program's own JSON line: capture seconds
(the capture loop only; warm-ups excluded, in both), the first round (every graph's first
replay: where watch's deep checks run), the steady decode step (median over rounds), and
max |graph - eager|. From watch's records: findings (a correct program must have none), the
hooks' own time per part (recording, census, checks) and the watched process's peak RSS,
against the plain process's. Ratios are of medians. The step across processes moves by +-15%
between fresh processes of the same program, so the step is also measured inside one watched
process, with and without the replay hook round by round (benchmarks/engine_step.py,
--step-rounds; 0 skips it), beside the same measure in a plain process (an A/A run: its
ratio is the noise floor). --profile also runs one watched process per case under cProfile
(top functions by cumulative time, in --out). GPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROGRAM = REPO / "examples" / "engine_shapes.py"


def env_with_repo() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPRO_WATCH")}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def dims_args(args) -> list[str]:
    """The engine's dimensions, as examples/engine_shapes.py and engine_step.py both take them."""
    return ["--sizes", str(args.sizes), "--layers", str(args.layers), "--hidden", str(args.hidden)]


def program_args(args, shape: str) -> list[str]:
    return [str(PROGRAM), shape, *dims_args(args), "--steps", str(args.steps)]


def maxrss_cmd(cmd: list[str]) -> list[str]:
    """Run cmd under a tiny wrapper that prints the child's peak RSS (KiB) to stderr last."""
    wrapper = (
        "import resource,subprocess,sys;r=subprocess.call(sys.argv[1:]);"
        "sys.stderr.write('maxrss_kb=%d\\n'%resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss);"
        "sys.exit(r)"
    )
    return [sys.executable, "-c", wrapper] + cmd


def last_json(text: str) -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON line in the program's output:\n{text[-2000:]}")


def maxrss(stderr: str) -> int | None:
    for line in reversed(stderr.splitlines()):
        if line.startswith("maxrss_kb="):
            return int(line.split("=")[1])
    return None


def watch_records(run_dir: Path) -> dict:
    """Findings and the hooks' exit counters from one watched run's record files."""
    findings, exits, names = 0, [], {}
    for path in run_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("kind") == "finding":
                findings += 1
                slot = r.get("finding", {}).get("slot", "?")
                names[slot] = names.get(slot, 0) + 1
            elif r.get("kind") == "exit":
                exits.append(r)
    top = sorted(names.items(), key=lambda kv: -kv[1])[:5]
    return {
        "findings": findings,
        "top_names": top,
        "hooks": exits[0].get("seconds") if exits else None,
        "census_reads": exits[0].get("census_reads") if exits else None,
        "counters": exits[0].get("counters") if exits else None,
    }


def run_once(args, shape: str, watched: bool, workdir: Path, tag: str) -> dict:
    cmd = [sys.executable] + program_args(args, shape)
    result: dict = {"watched": watched}
    if watched:
        run_dir = workdir / f"watch-{shape}-{tag}"
        cmd = [sys.executable, "-m", "repro", "watch", "--run-dir", str(run_dir), "--"] + cmd
    proc = subprocess.run(maxrss_cmd(cmd), env=env_with_repo(), capture_output=True, text=True, timeout=args.timeout)
    result.update(last_json(proc.stdout))
    result["maxrss_kb"] = maxrss(proc.stderr)
    result["exit"] = proc.returncode
    if watched:
        result.update(watch_records(run_dir))
    return result


def step_once(args, shape: str, watched: bool, workdir: Path) -> dict:
    """benchmarks/engine_step.py in one process: decode rounds with and without the replay
    hook, alternating (watched), or the same replay twice (plain: the noise floor)."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "engine_step.py"), shape, *dims_args(args)]
    cmd += ["--rounds", str(args.step_rounds)]
    if watched:
        cmd = [sys.executable, "-m", "repro", "watch", "--run-dir", str(workdir / f"step-{shape}"), "--"] + cmd
    proc = subprocess.run(cmd, env=env_with_repo(), capture_output=True, text=True, timeout=args.timeout)
    return last_json(proc.stdout)


def profile_once(args, shape: str, workdir: Path) -> str:
    """One watched process under cProfile; the top of its cumulative-time table."""
    prof = workdir / f"{shape}.prof"
    inner = [sys.executable, "-m", "cProfile", "-o", str(prof)] + program_args(args, shape)
    cmd = [sys.executable, "-m", "repro", "watch", "--run-dir", str(workdir / f"prof-{shape}"), "--"] + inner
    subprocess.run(cmd, env=env_with_repo(), capture_output=True, text=True, timeout=args.timeout)
    import io
    import pstats

    out = io.StringIO()
    stats = pstats.Stats(str(prof), stream=out)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(25)
    return out.getvalue()


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(shape: str, plain: list[dict], watched: list[dict]) -> dict:
    row = {"shape": shape, "graphs": plain[0].get("graphs"), "runs": len(plain)}
    for key in ("capture_s", "first_round_s", "step_us", "host_us", "maxrss_kb"):
        p, w = median(plain, key), median(watched, key)
        row[key] = {"plain": p, "watch": w, "ratio": (w / p) if p and w else None}
    # The host of one machine runs the same capture at two speeds, from process to process and
    # within one (docs/PERFORMANCE.md, ninth series: plain captures 3.8-5.5 s): beside the ratio
    # of medians, each alternated pair's ratio and the ratio of the fastest of each side.
    pairs = [
        w["capture_s"] / p["capture_s"] for p, w in zip(plain, watched) if p.get("capture_s") and w.get("capture_s")
    ]
    row["capture_pair_ratios"] = [round(x, 3) for x in pairs]
    fastest = [min((r["capture_s"] for r in rows if r.get("capture_s")), default=None) for rows in (plain, watched)]
    row["capture_min_ratio"] = round(fastest[1] / fastest[0], 3) if all(fastest) else None
    row["findings"] = [w.get("findings") for w in watched]
    row["top_names"] = watched[-1].get("top_names")
    row["max_abs_err"] = {"plain": median(plain, "max_abs_err"), "watch": median(watched, "max_abs_err")}
    row["hooks"] = watched[-1].get("hooks")
    row["census_reads"] = watched[-1].get("census_reads")
    graphs = row["graphs"] or 1
    rss = row["maxrss_kb"]
    if rss["plain"] and rss["watch"]:
        row["watch_kib_per_graph"] = (rss["watch"] - rss["plain"]) / graphs
    return row


def host_part(h: dict | None) -> str:
    """ "; host P / W": the step's host part plain / watched, where the program reported it."""
    if not h or h.get("plain") is None or h.get("watch") is None:
        return ""
    return f"; host {h['plain']:.0f} / {h['watch']:.0f}"


def side_by_side(m: dict, fmt: str, unit: str, digits: int, more: str = "") -> str:
    """ "P / W unit (R x more)" of a summarized measure; "-" where a side did not report it
    (a process that died, a program that does not measure it)."""
    if m.get("plain") is None or m.get("watch") is None:
        return "-"
    return f"{m['plain']:{fmt}} / {m['watch']:{fmt}}{unit} ({m['ratio']:.{digits}f}x{more})"


def table(rows: list[dict]) -> str:
    lines = [
        "| shape | graphs | capture plain / watch (x) | first round plain / watch (x) | "
        "step plain / watch us (x; its host part) | findings | watch host KiB/graph |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "capture_s" not in r:  # --repeats 0: the step in one process alone
            continue
        c, f, s = r["capture_s"], r["first_round_s"], r["step_us"]
        pairs = r.get("capture_pair_ratios") or []
        spread = f"; pairs {min(pairs):.2f}-{max(pairs):.2f}x, fastest {r['capture_min_ratio']:.2f}x" if pairs else ""
        lines.append(
            f"| {r['shape']} | {r['graphs']} | {side_by_side(c, '.2f', ' s', 2, spread)} | "
            f"{side_by_side(f, '.2f', ' s', 2)} | "
            f"{side_by_side(s, '.0f', '', 3, host_part(r.get('host_us')))} | {r['findings']} | "
            f"{r.get('watch_kib_per_graph', float('nan')):.1f} |"
        )
    steps = [r for r in rows if r.get("step_in_process")]
    if steps:
        lines += [
            "",
            "| shape | step in one process: the class's replay under watch / torch's own, synced us (x) | "
            "host part of that step us (x) | pipelined us (x) | watch's wrapper itself, synced (x) | "
            "same process without watch, A/A (x) | resident memory grown over the rounds, watch / plain KiB |",
            "|---|---|---|---|---|---|---|",
        ]
    for r in steps:
        w, aa = r["step_in_process"]["watch"], r["step_in_process"]["plain_aa"]
        s, h, q = w["step_us"], w.get("host_us"), w["pipelined_us"]
        host = f"{h['hooked']:.1f} / {h['bare']:.1f} ({h['ratio']:.3f}x)" if h else "-"
        wrapper = f"{s['wrapper_ratio']:.4f}x" if "wrapper_ratio" in s else "-"
        lines.append(
            f"| {r['shape']} ({w.get('class_replay', '?')}) | {s['hooked']:.0f} / {s['bare']:.0f} ({s['ratio']:.4f}x) | "
            f"{host} | {q['hooked']:.0f} / {q['bare']:.0f} ({q['ratio']:.4f}x) | {wrapper} | "
            f"synced {aa['step_us']['ratio']:.4f}x, pipelined {aa['pipelined_us']['ratio']:.4f}x | "
            f"{w.get('rss_grown_kib', '-')} / {aa.get('rss_grown_kib', '-')} over "
            f"{w.get('replays_per_variant', '?')} replays |"
        )
    return "\n".join(lines)


def save(out: Path, args, rows: list[dict], raw: dict) -> None:
    """The table and the JSON as they stand (the JSON also on stdout)."""
    (out / "table.md").write_text(table(rows) + "\n")
    emit({"config": vars(args), "rows": rows, "raw": raw}, str(out / "engine_capture.json"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="full,piecewise")
    p.add_argument("--sizes", type=int, default=67)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=None, help="folder for the JSON, the table and profiles")
    p.add_argument(
        "--step-rounds", type=int, default=20, help="rounds per variant of the in-process step measure (0: skip it)"
    )
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-cases", default="", help="profile only these shapes (comma-separated)")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="engine-capture-"))
    out.mkdir(parents=True, exist_ok=True)
    rows, raw = [], {}
    for shape in args.cases.split(","):
        plain, watched = [], []
        raw[shape] = {"plain": plain, "watch": watched}
        rows.append({"shape": shape})
        for i in range(args.repeats):  # interleaved: drift hits both alike
            plain.append(run_once(args, shape, False, out, str(i)))
            watched.append(run_once(args, shape, True, out, str(i)))
            sys.stderr.write(
                f"{shape} {i}: plain {plain[-1].get('capture_s')} s, "
                f"watch {watched[-1].get('capture_s')} s, findings {watched[-1].get('findings')}\n"
            )
            rows[-1] = summarize(shape, plain, watched)
            save(out, args, rows, raw)  # after each pair: a time limit loses only the pair it cut
        if args.step_rounds:
            rows[-1]["step_in_process"] = {
                "watch": step_once(args, shape, True, out),
                "plain_aa": step_once(args, shape, False, out),
            }
            save(out, args, rows, raw)
        if args.profile and (not args.profile_cases or shape in args.profile_cases.split(",")):
            (out / f"profile-{shape}.txt").write_text(profile_once(args, shape, out))
    sys.stderr.write(table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
