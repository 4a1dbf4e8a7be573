"""What every command says and how it ends: the exit codes, the one error line, where results go.

One table of exit codes (Exit) for every command and for `repro watch`; the README's
exit-code table says the same. One Output per command: results (the report, doctor's and
the audit's tables, a preset's TOML) go to stdout; progress, warnings and errors to stderr;
`--json PATH` writes the JSON to PATH, `--json -` puts it on stdout alone and moves the
human results to stderr (the JSON mode). An error is one line, `repro: error: ...`, never a
traceback.

The CLI layer: the only place that writes to the terminal. Torch-free.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import IntEnum

from rich.console import Console

from repro.files import write_text_atomic
from repro.report import output_console

STDOUT = "-"  # `--json -`: the JSON on stdout


class Exit(IntEnum):
    OK = 0
    FAILED = 1  # some trial did not meet its expectation
    FINDINGS = 1  # repro watch: some process recorded a finding (FAILED's alias)
    USAGE = 2  # usage or config error: one line on stderr
    ENV = 3  # the environment cannot run what was asked (UNSUPPORTED, no vLLM, no Ray)
    INTERRUPTED = 130  # Ctrl-C
    TERMINATED = 143  # SIGTERM, e.g. a CI cancel


# A command's help lists its exit codes: (code, meaning) rows. repro watch also passes
# CMD's own exit code through, a row of its own ("0..").
TRIAL_EXITS: list[tuple[Exit | str, str]] = [
    (Exit.OK, "every trial met its expectation (unfixed -> reproduced, fixed -> CLEAN; see --expect)"),
    (Exit.FAILED, "some trial did not meet its expectation"),
    (Exit.USAGE, "usage or config error (one line on stderr)"),
    (Exit.ENV, "the environment cannot run what was asked (e.g. --tp 2 with one GPU): UNSUPPORTED"),
    (Exit.INTERRUPTED, "interrupted (Ctrl-C); records produced so far are kept and reported"),
    (Exit.TERMINATED, "terminated (SIGTERM, e.g. a CI cancel); handled like Ctrl-C"),
]
# matrix has no --expect: each trial's expectation is in the matrix file.
MATRIX_EXITS = [(Exit.OK, "every trial met its expectation (the matrix file's expect; see --list)"), *TRIAL_EXITS[1:]]
WATCH_EXITS: list[tuple[Exit | str, str]] = [
    ("0..", "CMD's own exit code when no finding was recorded"),
    (Exit.FINDINGS, "some process recorded a finding"),
    (Exit.USAGE, "usage error (one line on stderr)"),
    (Exit.INTERRUPTED, "interrupted (Ctrl-C, forwarded to CMD's process group); the report follows"),
]


def exit_codes_help(rows: list[tuple[Exit | str, str]]) -> str:
    """The epilog of a command's --help; \\b keeps click from re-wrapping the rows."""
    lines = [f"  {str(int(code)) if isinstance(code, Exit) else code:<4} {meaning}" for code, meaning in rows]
    return "\b\nExit codes:\n" + "\n".join(lines)


def error_line(message: object) -> str:
    return f"repro: error: {message}"


@dataclass(frozen=True)
class Output:
    """Where one command's words go. json_path: its --json as given (None, a file, or '-')."""

    json_path: str | None = None

    @property
    def json_mode(self) -> bool:
        """stdout carries the JSON alone."""
        return self.json_path == STDOUT

    @property
    def json_file(self) -> str | None:
        """The file --json writes, None when it writes none (not given, or stdout)."""
        return None if self.json_mode else self.json_path

    def results(self) -> Console:
        """The console of the human results: stdout, unless the JSON holds it."""
        return output_console(stderr=self.json_mode)

    def progress(self) -> Console:
        return output_console(stderr=True)

    def write(self, text: str) -> None:
        """Plain results (a preset's TOML, a listing, the resolved config) on stdout."""
        sys.stdout.write(text)

    def write_json(self, text: str) -> None:
        """The JSON document to where --json said (callers build it only when json_path is
        set). On stdout it comes after everything else written there (repro watch: CMD's own
        output), flushed before the command exits."""
        if self.json_mode:
            sys.stdout.write(text)
            sys.stdout.flush()
        elif self.json_path:
            write_text_atomic(self.json_path, text)

    def error(self, message: object, code: Exit = Exit.USAGE) -> Exit:
        """The one error line; the exit code the command returns with it."""
        sys.stderr.write(error_line(message) + "\n")
        return code

    def warn(self, text: str) -> None:
        sys.stderr.write(f"repro: warning: {text}\n")

    def note(self, text: str) -> None:
        """A line about the run itself (where its files are, how it ended)."""
        sys.stderr.write(f"repro: {text}\n")
