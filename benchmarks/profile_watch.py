"""Where `repro watch`'s time goes in one engine-shaped program: cProfile of one watched run.

    PYTHONPATH=. python3 benchmarks/profile_watch.py SHAPE [--sizes 67] [--layers 32] [--out DIR]

Runs examples/engine_shapes.py SHAPE under `repro watch` and cProfile (the watched process
itself) and prints the top of its cumulative- and own-time tables. GPU only.
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_capture import profile_once  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape")
    p.add_argument("--sizes", type=int, default=67)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="profile-watch-"))
    out.mkdir(parents=True, exist_ok=True)
    text = profile_once(args, args.shape, out)
    (out / f"profile-{args.shape}.txt").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
