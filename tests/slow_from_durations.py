"""Write tests/slow.txt from a pytest --durations report: every test whose setup, call and
teardown together took at least SECONDS, so that `-m "not slow"` stays a quick check.

    python3 -m pytest -q -p no:cacheprovider --durations=0 --durations-min=0.05 > durations.log
    python3 tests/slow_from_durations.py durations.log [--seconds 0.5] > tests/slow.txt
    # then the same for -m "not slow" (a module's fixture moves to its first test left), again:
    python3 -m pytest -q -p no:cacheprovider -m "not slow and not gpu and not multi_gpu and not vllm" \
        --durations=0 --durations-min=0.05 > quick.log
    python3 tests/slow_from_durations.py durations.log quick.log > tests/slow.txt

Times differ by machine and load; the list is a cost class, not a measurement. A test missing
from the list is not slow; one that no longer exists is ignored (conftest.py marks by node id).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict

LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(.+?)\s*$")  # ids may hold spaces


def totals(text: str) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            seconds[m.group(3)] += float(m.group(1))
    return dict(seconds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", help="one or more --durations reports (a test's time: its largest)")
    p.add_argument("--seconds", type=float, default=0.5)
    args = p.parse_args(argv)
    seconds: dict[str, float] = {}
    for log in args.logs:
        with open(log, encoding="utf-8", errors="replace") as f:
            for n, s in totals(f.read()).items():
                seconds[n] = max(s, seconds.get(n, 0.0))
    slow = sorted(n for n, s in seconds.items() if s >= args.seconds)
    quick = sum(s for n, s in seconds.items() if s < args.seconds)
    sys.stdout.write(
        f"# tests taking >= {args.seconds} s (setup + call + teardown) in --durations runs;\n"
        f"# the {len(seconds) - len(slow)} others listed there took {quick:.0f} s together. "
        "Regenerate: tests/slow_from_durations.py\n"
    )
    sys.stdout.write("".join(f"{n}\n" for n in slow))
    return 0


if __name__ == "__main__":
    sys.exit(main())
