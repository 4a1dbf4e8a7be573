"""The `repro` command (console script and `python -m repro`).

Its first act is to take over Ctrl-C and SIGTERM (repro/run/interrupts.py): from then on a signal
at any moment ends the run with its report. Commands that run trials get their rank server
started next, before the CLI imports Typer, Rich and the report code: the server's torch
import (seconds) overlaps the parent's own start-up, planning and NVML queries
(repro/run/launch.py).
"""

import sys


def main() -> None:
    from repro.run.interrupts import Interrupts, checkpoint

    interrupts = Interrupts()
    interrupts.install()
    checkpoint("start")
    from repro.run.launch import prestart
    from repro.scenarios import SCENARIOS

    server = prestart(sys.argv[1:], frozenset(SCENARIOS) | {"matrix"})
    checkpoint("server")
    try:
        from repro.cli import main as cli_main

        cli_main(server, interrupts)
    finally:
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()
