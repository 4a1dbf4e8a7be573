"""Markdown rows (mode, TP, after-free, lifecycle, outcome, acceptance, accepted length, lossless,
tokens/s, trial s) from gemma4-mtp JSON reports, for docs/RESULTS.md.
Usage: python3 benchmarks/specdec_table.py REPORT.json [REPORT.json ...]
"""

import json
import sys

HEAD = (
    "| mode | TP | after-free | lifecycle | outcome | acceptance | mean accepted length | lossless "
    "| tokens/s | first failure | trial s |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def row(t: dict) -> str:
    run = t["config"]["run"]
    tp = f"{run['tp']}" + (" (shared GPU, gloo)" if run.get("share_gpu") and run["tp"] > 1 else "")
    life = "drafter reload" if run.get("reload_drafter") else "-"
    lossless = "-" if t.get("lossless") is None else ("yes" if t["lossless"] else "NO")
    ff = t.get("first_failure") or {}
    where = f"step {ff['step']}: " if ff.get("step") is not None else ""
    failure = (where + ff.get("detail", ""))[:70] if ff else "-"
    return (
        f"| {t['mode']} | {tp} | {run['after_free']} | {life} | {t['outcome']} | {fmt(t.get('acceptance_rate'), '.1%')} "
        f"| {fmt(t.get('mean_accepted_length'), '.2f')} | {lossless} | {fmt(t.get('tokens_per_s'), '.0f')} "
        f"| {failure} | {t['timings'].get('total', 0):.1f} |"
    )


def main() -> None:
    print(HEAD)
    for path in sys.argv[1:]:
        for trial in json.load(open(path))["trials"]:
            print(row(trial))


if __name__ == "__main__":
    main()
