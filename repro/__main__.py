"""The `repro` command (console script and `python -m repro`).

Commands that run trials get their rank server started here, before the CLI imports Typer,
Rich and the report code: the server's torch import (seconds) overlaps the parent's own
start-up, planning and NVML queries (repro/launch.py).
"""
import sys


def main() -> None:
    from repro.launch import prestart
    from repro.scenarios import SCENARIOS
    server = prestart(sys.argv[1:], frozenset(SCENARIOS) | {"matrix"})
    try:
        from repro.cli import main as cli_main
        cli_main(server)
    finally:
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()
