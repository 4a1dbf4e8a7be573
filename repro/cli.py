"""The `repro` command line: parse, load config, call the runner, render. No scenario logic.

Where each command's words go, its exit codes and its error line: repro/output.py.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import shlex
import shutil
import signal
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional

import typer
from typer.core import TyperGroup

import repro
from repro import noise, report
from repro.run import runs
from repro.env import doctor, gpus, inventory
from repro.config import ConfigError, load_preset, override_sources, preset_names
from repro.run.footprint import needed_bytes
from repro.run.interrupts import Interrupts, Terminated, checkpoint
from repro.run.launch import RankServer, runs_trials
from repro.report.jsonfile import json_text
from repro.outcome import AfterFreeKnob, Device, GuardMode, Outcome, Report, to_jsonable
from repro.output import MATRIX_EXITS, TRIAL_EXITS, WATCH_EXITS, Exit, Output, exit_codes_help
from repro.run.preflight import check_outputs, refuse_ignored
from repro.run.protocol import FAULTS
from repro.run.ray_runner import RayUnavailable
from repro.run.runner import Planned, RunResult, plan, run_planned
from repro.scenarios import SCENARIOS, CpuCost, RunKeySpec, ScenarioSpec
from repro.watch.settings import OnFinding, Record

EXIT_CODES = exit_codes_help(TRIAL_EXITS)
MATRIX_EXIT_CODES = exit_codes_help(MATRIX_EXITS)
WATCH_EXIT_CODES = exit_codes_help(WATCH_EXITS)


def click_exception_modules() -> list[Any]:
    """Typer >= 0.2x vendors its own click; older typers use click itself. Catch both."""
    mods = []
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            mods.append(importlib.import_module(name))
        except ImportError:
            pass
    return mods


CLICK = click_exception_modules()
USAGE_ERRORS = tuple(m.UsageError for m in CLICK)
CLICK_ERRORS = tuple(m.ClickException for m in CLICK)
NO_ARGS = tuple(m.NoArgsIsHelpError for m in CLICK if hasattr(m, "NoArgsIsHelpError"))
ABORTS = tuple(m.Abort for m in CLICK if hasattr(m, "Abort")) + (KeyboardInterrupt,)


TRIAL_COMMANDS = frozenset(SCENARIOS) | {"matrix"}


@dataclass
class Session:
    """What the program's start (repro/__main__.py) hands every command: the rank server it
    started, if any, and the signal flag it installed (repro/run/interrupts.py)."""

    server: RankServer | None = None
    interrupts: Interrupts = field(default_factory=Interrupts)


def interrupted_exit(interrupts: Interrupts) -> Exit:
    if interrupts.signum == signal.SIGTERM:
        Output().note("terminated (SIGTERM)")
        return Exit.TERMINATED
    Output().note("interrupted")
    return Exit.INTERRUPTED


def misplaced_option(group: Any, error: Exception) -> str | None:
    """An option that exists, only not on this command (`nvfp4-reload --tp 2`): say where it
    belongs, rather than click's nearest spellings of something else."""
    name, ctx = getattr(error, "option_name", None), getattr(error, "ctx", None)
    if not name or ctx is None or ctx.command is group:
        return None
    owners = [
        cmd
        for cmd, command in sorted(group.commands.items())
        if any(name in p.opts or name in p.secondary_opts for p in command.params)
    ]
    if not owners:
        return None
    return f"{ctx.command.name} has no {name} option; {name} belongs to {', '.join(owners)}"


class ReproGroup(TyperGroup):
    """Usage errors become one line and exit 2; Ctrl-C exits 130, SIGTERM 143; never a traceback."""

    def main(
        self,
        args: Any = None,
        prog_name: Any = None,
        complete_var: Any = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        # SIGTERM takes Ctrl-C's path (workers killed, partial report written). A command that
        # runs trials only flags a signal (the runner polls it and the report is still
        # written); any other gets Python's raising behaviour back once its name is known.
        # Only the main thread may install handlers; those installed here are undone after.
        session = extra.pop("obj", None) or Session()
        interrupts = session.interrupts
        own = threading.current_thread() is threading.main_thread() and not interrupts.installed
        if own:
            interrupts.install()
        argv = list(sys.argv[1:] if args is None else args)
        try:
            if not runs_trials(argv, TRIAL_COMMANDS):
                interrupts.immediate()
            rv = super().main(
                args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, obj=session, **extra
            )
        except NO_ARGS as e:  # bare `repro`: the help itself, not an error line around it
            sys.stderr.write(e.format_message() + "\n")
            sys.exit(Exit.USAGE)
        except CLICK_ERRORS as e:
            # Choice checks go through pydantic, which prefixes "Value error, ": not ours to show.
            message = misplaced_option(self, e) or e.format_message().replace("Value error, ", "")
            sys.exit(Output().error(message))
        except ABORTS as e:
            # click turns a KeyboardInterrupt (Terminated is one) into Abort, keeping the cause.
            if isinstance(e, Terminated) or isinstance(e.__cause__, Terminated):
                interrupts.signum = interrupts.signum or signal.SIGTERM
            sys.exit(interrupted_exit(interrupts))
        finally:
            if own:
                interrupts.restore()
        if interrupts.pending():
            # A signal before the command got as far as a report (bad input, --print-config).
            sys.exit(interrupted_exit(interrupts))
        sys.exit(rv if isinstance(rv, int) else Exit.OK)


app = typer.Typer(
    cls=ReproGroup,
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Reproduce and diagnose CUDA-graph memory-lifetime bugs in LLM inference engines.",
    epilog=EXIT_CODES,
)


def show_version(value: bool) -> None:
    if value:
        Output().write(f"repro {repro.__version__}\n")
        raise typer.Exit(Exit.OK)


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=show_version, help="Print the version and exit.")
    ] = False,
) -> None:
    """Reproduce and diagnose CUDA-graph memory-lifetime bugs in LLM inference engines."""


def cpu_warnings(planned: list[Planned]) -> list[str]:
    """Options that cannot act on CPU, said before the run rather than silently ignored."""
    on_cpu = [p for p in planned if p.device == Device.CPU]
    found = []
    if any(p.cfg.run.guard == GuardMode.OFF for p in on_cpu):
        found.append(
            "--guard off on CPU: no CUDA graph is replayed there, so with the guard off a "
            "stale capture cannot be detected (use --guard warn, or run on a GPU)"
        )
    if any(p.cfg.run.forensics for p in on_cpu):
        found.append("--forensics is ignored on CPU: CUDA memory history exists only on a GPU")
    if any(p.cfg.run.share_gpu for p in on_cpu):
        found.append(
            "--share-gpu has no effect on CPU (no GPU here): the ranks share the host over gloo as every CPU run does"
        )
    found += [slow_warning(p, cost) for p in on_cpu if (cost := slow_on_cpu(p)) is not None]
    return list(dict.fromkeys(found))  # a matrix of like trials: each sentence once


def slow_on_cpu(p: Planned) -> CpuCost | None:
    """The CPU timing that applies to a CPU trial: its scenario's real-dims preset's, when the
    trial's model is at least half that size (by the memory lower bound: a copy of the preset,
    or its bigger sibling gemma4-e4b, is as slow)."""
    cost = SCENARIOS[p.cfg.scenario].cpu_cost
    if cost is None:
        return None
    measured = needed_bytes(load_preset(cost.preset))
    return cost if needed_bytes(p.cfg) * 2 >= measured else None


def slow_warning(p: Planned, cost: CpuCost) -> str:
    steps, deadline = p.cfg.run.steps, p.cfg.run.deadline_s
    low, high = cost.estimate(steps)
    if high <= deadline:
        fits = f"within its {deadline:g} s deadline"
    elif low > deadline:
        fits = f"past its {deadline:g} s deadline (DEADLINE: no verdict)"
    else:
        fits = f"maybe past its {deadline:g} s deadline (DEADLINE: no verdict)"
    text = (
        f"{p.cfg.preset} on CPU: real model dimensions, slow here: about {fmt_span(low, high)} for "
        f"{steps} step{'s' if steps != 1 else ''}, {fits} ({cost.preset} measured on a shared 2-core CPU: set-up "
        f"{cost.setup_s[0]:g}-{cost.setup_s[1]:g} s, {cost.step_s[0]:g}-{cost.step_s[1]:g} s a step); "
        f"{SCENARIOS[p.cfg.scenario].cpu_preset} is the CPU-sized preset"
    )
    # A budget in whole minutes that covers the slow end of the estimate.
    return text + (f", --deadline {math.ceil(high / 60) * 60} gives it the time" if high > deadline else "")


def fmt_span(low: float, high: float) -> str:
    """'26-90 s' / '1-8 min': both ends in one unit."""
    if high < 120:
        return f"{low:.0f}-{high:.0f} s"
    return f"{max(1, round(low / 60))}-{math.ceil(high / 60)} min"


def with_default(text: str, default: str) -> str:
    """Help text ending in the default a flag left out resolves to (the preset or the scenario
    decides it, so the option itself defaults to None: 'not given')."""
    return f"{text}  [default: {default}]"


def choices(values: Iterable[str]) -> Any:
    """A Literal over the values (an enum's: their plain strings), so --help lists them and a
    wrong one is a usage error."""
    return Literal[tuple(str(v) for v in values)]  # type: ignore[valid-type]


# Options declared once, reused by every scenario command. Choices come from config.py, the
# scenario-specific ones (--mode, --steps, --after-free default) from each scenario's spec.
ConfigOpt = Annotated[
    Optional[str],
    typer.Option(
        "--config",
        "-c",
        metavar="PRESET|FILE",
        help=with_default(
            "Preset name (`repro presets` lists them) or a TOML file.",
            "the scenario's real-dims preset on GPU, its tiny preset on CPU",
        ),
    ),
]
TpOpt = Annotated[
    Optional[int],
    typer.Option(
        "--tp", metavar="N", help=with_default("Tensor-parallel size (one process per rank).", "the preset's run.tp")
    ),
]
ShareGpuOpt = Annotated[
    Optional[bool],
    typer.Option(
        "--share-gpu/--no-share-gpu",
        help=with_default(
            "Let the TP ranks share one GPU, over gloo instead of NCCL (which refuses two ranks on one GPU): real CUDA graphs, slower collectives.",
            "--no-share-gpu",
        ),
    ),
]
SeedOpt = Annotated[
    Optional[int],
    typer.Option(
        "--seed",
        metavar="N",
        help=with_default("Seed of the weights and inputs; the same seed gives the same trial.", "0"),
    ),
]
GuardOpt = Annotated[
    Optional[choices(GuardMode)],
    typer.Option(
        "--guard",
        help=with_default(
            "Stale-capture guard: off; warn records findings and keeps going; raise stops at the first.", "warn"
        ),
    ),
]
DeviceOpt = Annotated[
    Optional[choices(Device)],
    typer.Option(
        "--device", help=with_default("auto: GPU if NVML sees one; cuda; cpu: gloo, no graphs, guard verdicts.", "auto")
    ),
]
DeadlineOpt = Annotated[
    Optional[float],
    typer.Option(
        "--deadline",
        metavar="SECONDS",
        help=with_default(
            "The whole trial's budget: past it the group is killed; DEADLINE if it was still progressing, HANG if stuck.",
            "the preset's run.deadline_s",
        ),
    ),
]
StallOpt = Annotated[
    Optional[float],
    typer.Option(
        "--stall",
        metavar="SECONDS",
        help=with_default(
            "Progress watchdog: no record from any rank for this long (or for twice the longest pause the steps have shown, if longer) is a HANG (the stuck rank is blamed).",
            "the preset's run.stall_s, 60",
        ),
    ),
]
ForensicsOpt = Annotated[
    Optional[bool],
    typer.Option(
        "--forensics/--no-forensics",
        help=with_default(
            "Record CUDA memory history; map stale addresses to alloc/free stacks; write snapshots.", "off"
        ),
    ),
]
ExpectOpt = Annotated[
    Optional[str],
    typer.Option(
        "--expect",
        metavar="clean|reproduced|OUTCOME[,OUTCOME]",
        help=with_default(
            "The outcome that counts as met.",
            "the trial's documented outcome: mostly unfixed -> reproduced, fixed -> clean; `repro matrix --list` shows them",
        ),
    ),
]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--set",
        metavar="SECTION.KEY=VALUE",
        help="Override any preset key, repeatable: --set run.steps=3 --set model.hidden_size=128.",
    ),
]
JsonOpt = Annotated[
    Optional[str], typer.Option("--json", metavar="PATH|-", help="Write the JSON report to PATH ('-' for stdout).")
]
JunitOpt = Annotated[
    Optional[Path], typer.Option("--junit", metavar="PATH", help="Write JUnit XML (one testcase per trial).")
]
HtmlOpt = Annotated[Optional[Path], typer.Option("--html", metavar="PATH", help="Write a self-contained HTML report.")]
ArtifactsOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--artifacts",
        metavar="DIR",
        help=with_default(
            "Where each run gets its folder of per-trial records, logs and snapshots, and DIR/latest points at the newest.",
            "$XDG_CACHE_HOME/repro/runs, else ~/.cache/repro/runs",
        ),
    ),
]
PrintConfigOpt = Annotated[bool, typer.Option("--print-config", help="Print the resolved config as JSON and exit.")]
FaultOpt = Annotated[Optional[str], typer.Option("--inject-fault", hidden=True, help="Test hook: KIND@RANK:STEP.")]


def mode_opt(spec: ScenarioSpec) -> Any:
    return Annotated[
        Optional[choices(spec.mode_names)],
        typer.Option("--mode", help=with_default(spec.mode_help(), spec.mode_names[0])),
    ]


def steps_opt(spec: ScenarioSpec) -> Any:
    return Annotated[
        Optional[int],
        typer.Option("--steps", metavar="N", help=with_default(spec.steps_help, "the preset's run.steps")),
    ]


def after_free_opt(spec: ScenarioSpec) -> Any:
    return Annotated[
        Optional[choices(AfterFreeKnob)],
        typer.Option(
            "--after-free",
            help=with_default(
                "What freed captured memory holds before replay: keep (latent), release (driver: error 700), "
                "reuse (plausible garbage), poison (NaN bytes).",
                spec.default_after_free,
            ),
        ),
    ]


def run_key_opt(key: RunKeySpec) -> Any:
    if key.type is bool:
        return Annotated[Optional[bool], typer.Option(key.flag, help=with_default(key.help, key.flag.split("/")[-1]))]
    return Annotated[Optional[key.type], typer.Option(key.flag, metavar="N", help=with_default(key.help, key.default))]


def parse_fault(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        kind, where = text.split("@")
        rank, step = where.split(":")
        fault = {"kind": kind, "rank": int(rank), "step": int(step)}
    except ValueError:
        raise ConfigError(f"--inject-fault {text!r}: expected KIND@RANK:STEP, e.g. segv@0:1") from None
    if kind not in FAULTS:
        raise ConfigError(f"--inject-fault {text!r}: kind {kind!r} is not one of {', '.join(FAULTS)}")
    return fault


def write_artifacts(rep: Report, out: Output, junit: Path | None, html: Path | None) -> None:
    if out.json_path:
        out.write_json(report.report_json(rep))
    if junit:
        report.write_junit(rep, junit)
    if html:
        report.write_html(rep, html)


def exit_code(result: RunResult, allow_unsupported: bool = False) -> Exit:
    if result.interrupted:
        return Exit.TERMINATED if result.report.interrupted_by == "SIGTERM" else Exit.INTERRUPTED
    trials = result.report.trials
    unsupported = [t for t in trials if t.outcome == Outcome.UNSUPPORTED]
    if any(not t.met for t in trials if t.outcome != Outcome.UNSUPPORTED):
        return Exit.FAILED
    if unsupported and not allow_unsupported:
        return Exit.ENV
    return Exit.OK


def execute(
    planned: list[Planned],
    artifacts: Path | None,
    out: Output,
    junit: Path | None,
    html: Path | None,
    summary_only: bool = False,
    allow_unsupported: bool = False,
    jobs: int = 1,
    server: RankServer | None = None,
    interrupts: Interrupts | None = None,
    shard: dict[str, Any] | None = None,
    run: Callable[..., RunResult] = run_planned,
) -> int:
    """run: the runner (run_planned here; repro/run/ray_runner.py's for --ray); shard: the
    report's shard record under --shard."""
    interrupts = interrupts or Interrupts()
    for text in cpu_warnings(planned):
        out.warn(text)
    started: set[str] = set()  # a trial that cannot run here is not shown as started

    def on_start(tid: str, p: Planned) -> None:
        if p.device is not None:
            started.add(tid)
            progress.add(tid, tid, p.cfg.run.steps)

    with report.Progress(out.progress()) as progress:
        result = run(
            planned,
            artifacts or runs.default_root(dict(os.environ)),
            on_start=on_start,
            on_tick=lambda tid, n: progress.update(tid, n),
            on_done=lambda t: t.id in started and progress.finish(t.id, t.outcome),
            jobs=jobs,
            server=server,
            interrupts=interrupts,
        )
    result.report.shard = shard
    checkpoint("report")
    mark_interrupted(result, interrupts)
    console = out.results()
    if summary_only:
        report.render_summary(result.report, console)
        console.print(report.summary_line(result.report))
    else:
        report.render_report(result.report, console)
    write_artifacts(result.report, out, junit, html)
    # From here a signal changes nothing: the report and its files say how the run ended.
    interrupts.settled = True
    checkpoint("written")
    if result.run_dir is not None and runs.point_latest(result.run_dir):
        out.note(f"trial files in {result.run_dir} (also {result.run_dir.parent / runs.LATEST})")
    return exit_code(result, allow_unsupported)


def mark_interrupted(result: RunResult, interrupts: Interrupts) -> None:
    """A signal after the last trial ended but before the report is rendered still counts:
    the run was cut short of its report, and the report says so."""
    if interrupts.signum is not None and not result.interrupted:
        result.interrupted = True
        result.report.interrupted = True
        result.report.interrupted_by = interrupts.name


def run_scenario(
    scenario: str,
    config: str | None,
    run: dict[str, Any],
    sets: list[str] | None,
    json_path: str | None,
    junit: Path | None,
    html: Path | None,
    artifacts: Path | None,
    print_config: bool,
    fault: str | None = None,
    session: Session | None = None,
) -> int:
    checkpoint("parsed")
    out = Output(json_path)
    try:
        p = plan(scenario, config, run, sets or [], gpus.gpu_count(), override_sources(run, sets or []))
        p.fault = parse_fault(fault)
        if print_config:
            refuse_ignored(
                "--print-config",
                {
                    "--json": json_path,
                    "--junit": junit,
                    "--html": html,
                    "--artifacts": artifacts,
                    "--inject-fault": fault,
                },
            )
        else:
            check_outputs(out.json_file, junit, html, artifacts, runs.default_root(dict(os.environ)))
    except ConfigError as e:
        return out.error(e)
    if print_config:
        resolved = {**p.cfg.to_dict(), "device": p.device or f"UNSUPPORTED: {p.reason}"}
        out.write(json.dumps(resolved, indent=2, allow_nan=False) + "\n")
        return Exit.OK
    checkpoint("planned")
    session = session or Session()
    return execute([p], artifacts, out, junit, html, server=session.server, interrupts=session.interrupts)


def run_options(spec: ScenarioSpec) -> list[tuple[str, str, Any]]:
    """(parameter, [run] key, option) of the common [run] keys the scenario's command offers,
    in --help order: all but those its code never reads, and --tp/--share-gpu only with ranks."""
    options = [
        ("mode", "mode", mode_opt(spec)),
        ("tp", "tp", TpOpt),
        ("steps", "steps", steps_opt(spec)),
        ("seed", "seed", SeedOpt),
        ("after_free", "after_free", after_free_opt(spec)),
        ("guard", "guard", GuardOpt),
        ("device", "device", DeviceOpt),
        ("deadline", "deadline_s", DeadlineOpt),
        ("stall", "stall_s", StallOpt),
        ("forensics", "forensics", ForensicsOpt),
        ("share_gpu", "share_gpu", ShareGpuOpt),
    ]
    left_off = set(spec.unused_run_keys) | (set() if spec.tensor_parallel else {"tp", "share_gpu"})
    return [o for o in options if o[1] not in left_off]


def scenario_command(spec: ScenarioSpec) -> Callable[..., int]:
    """The command of one scenario: the shared options, --mode and the scenario's own run keys.

    Typer reads a command's options from its signature, so the signature is built from the
    registry entry: a new scenario gets its command without code here.
    """
    offered = run_options(spec)
    options: list[tuple[str, Any, Any]] = [("ctx", typer.Context, inspect.Parameter.empty), ("config", ConfigOpt, None)]
    options += [(name, option, None) for name, _, option in offered]
    options += [(k.name, run_key_opt(k), None) for k in spec.run_keys]
    options += [
        ("expect", ExpectOpt, None),
        ("set_", SetOpt, None),
        ("json_path", JsonOpt, None),
        ("junit", JunitOpt, None),
        ("html", HtmlOpt, None),
        ("artifacts", ArtifactsOpt, None),
        ("print_config", PrintConfigOpt, False),
        ("inject_fault", FaultOpt, None),
    ]

    def command(**kw: Any) -> int:
        run = {key: kw[name] for name, key, _ in offered}
        run.update({k: kw[k] for k in spec.run_key_names}, expect=kw["expect"])
        return run_scenario(
            spec.name,
            kw["config"],
            run,
            kw["set_"],
            kw["json_path"],
            kw["junit"],
            kw["html"],
            kw["artifacts"],
            kw["print_config"],
            kw["inject_fault"],
            kw["ctx"].obj,
        )

    command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=ann, default=default)
            for name, ann, default in options
        ],
        return_annotation=int,
    )
    command.__name__ = spec.name.replace("-", "_")
    command.__doc__ = spec.help
    return command


for _spec in SCENARIOS.values():
    if _spec.command:
        app.command(_spec.name, epilog=EXIT_CODES)(scenario_command(_spec))


@app.command("matrix", epilog=MATRIX_EXIT_CODES)
def matrix(
    ctx: typer.Context,
    config: Annotated[
        str,
        typer.Option("--config", "-c", metavar="NAME|FILE", help="Matrix file or name: ci-smoke (CPU), gpu-1, gpu-2."),
    ] = "ci-smoke",
    allow_unsupported: Annotated[
        bool, typer.Option("--allow-unsupported", help="UNSUPPORTED trials do not fail the run (they never pass).")
    ] = False,
    json_path: JsonOpt = None,
    junit: JunitOpt = None,
    html: HtmlOpt = None,
    artifacts: ArtifactsOpt = None,
    only: Annotated[
        Optional[list[str]],
        typer.Option(
            "--only",
            metavar="PATTERN",
            help="Run only the trials whose id contains PATTERN (a shell glob: 'reload-safe', 'nvfp4*identity', '07-'); repeatable. `--list` shows the ids.",
        ),
    ] = None,
    list_: Annotated[
        bool, typer.Option("--list", help="List the trials (id, expectation, device) and exit without running them.")
    ] = False,
    jobs: Annotated[
        int,
        typer.Option(
            "--jobs",
            "-j",
            metavar="N",
            help="Trials run at once. Each trial still gets its own processes; concurrent trials share the GPUs (TP=1 trials are spread over them), so per-trial timings are not those of a --jobs 1 run.",
        ),
    ] = 1,
    shard: ShardOpt = None,
    balance: BalanceOpt = None,
    ray: RayOpt = None,
    retries: RetriesOpt = 0,
) -> int:
    """CI smoke check: every scenario x mode with its expected outcome; exit 0 only if all hold."""
    from repro.run.matrix import listing, load_matrix, select

    cluster = None
    checkpoint("parsed")
    out = Output(json_path)
    try:
        if jobs < 1:
            raise ConfigError(f"--jobs {jobs}: must be >= 1 (1 runs the trials one after another)")
        check_past_one_host(shard, balance, ray, retries)
        if ray:
            from repro.run import ray_runner

            cluster = ray_runner.connect(ray)
        _, planned = load_matrix(config, cluster.largest_gpus() if cluster else gpus.gpu_count())
        planned = select(planned, only or [], config)
        record = None
        if shard:
            from repro.run.shard import select_shard

            planned, record = select_shard(planned, shard, balance, dict(os.environ))
        if list_:
            refuse_ignored(
                "--list",
                {
                    "--json": json_path,
                    "--junit": junit,
                    "--html": html,
                    "--artifacts": artifacts,
                    "--allow-unsupported": allow_unsupported,
                },
            )
        else:
            check_outputs(out.json_file, junit, html, artifacts, runs.default_root(dict(os.environ)))
    except ConfigError as e:
        return out.error(e)
    except RayUnavailable as e:  # no Ray installed, no cluster reached: exit 3
        return out.error(e, Exit.ENV)
    if list_:
        out.write("".join(line + "\n" for line in listing(planned)))
        return Exit.OK
    reasons = sorted({p.reason for p in planned if p.device is None})
    if reasons and all(p.device is None for p in planned) and not cluster:
        hint = "; without a GPU, `repro matrix` runs the CPU matrix (ci-smoke)" if gpus.gpu_count() == 0 else ""
        out.warn(f"no trial of {config} can run here ({'; '.join(reasons)}){hint}")
    checkpoint("planned")
    run = run_planned
    if cluster:
        refusal = cluster.refusal(planned)
        if refusal:
            return out.error(refusal, Exit.ENV)
        run = cluster.runner(retries)
    return execute(
        planned,
        artifacts,
        out,
        junit,
        html,
        summary_only=True,
        allow_unsupported=allow_unsupported,
        jobs=jobs,
        server=ctx.obj.server,
        interrupts=ctx.obj.interrupts,
        shard=record.to_dict() if record else None,
        run=run,
    )


# Past one host (repro/run/shard.py, repro/run/merge.py, repro/run/ray_runner.py): options of `repro matrix`
# and the `repro merge` command, kept together here.
ShardOpt = Annotated[
    Optional[str],
    typer.Option(
        "--shard",
        metavar="K/N|auto",
        help="Run shard K of N (1 <= K <= N): a stable 1/N of the trials by trial id, the same on every machine. auto: from Buildkite's BUILDKITE_PARALLEL_JOB / BUILDKITE_PARALLEL_JOB_COUNT, else REPRO_SHARD=K/N. Join the shards' --json reports with `repro merge`.",
    ),
]
BalanceOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--balance",
        metavar="PREVIOUS.json",
        help="With --shard: split by the trial durations a previous JSON report recorded (longest first onto the least loaded shard), still the same on every machine.",
    ),
]
RayOpt = Annotated[
    Optional[str],
    typer.Option(
        "--ray",
        metavar="ADDRESS|auto|local",
        help="Run every trial as Ray work on a cluster, placed by its GPU count (all ranks of a trial on one node): a cluster address (host:port, ray://...), auto (the running cluster, $RAY_ADDRESS) or local (a cluster of this machine). Needs `pip install 'repro[ray]'`.",
    ),
]
RetriesOpt = Annotated[
    int,
    typer.Option(
        "--retries",
        metavar="N",
        help="With --ray: run a trial whose node was lost up to N more times (0: it is CRASH naming the node).",
    ),
]


def check_past_one_host(shard: str | None, balance: Path | None, ray: str | None, retries: int) -> None:
    if balance and not shard:
        raise ConfigError(f"--balance {balance}: only splits shards; add --shard K/N (or --shard auto)")
    if retries and not ray:
        raise ConfigError(f"--retries {retries}: only retries trials on a Ray cluster; add --ray ADDRESS")
    if retries < 0:
        raise ConfigError(f"--retries {retries}: must be >= 0")


@app.command("merge", epilog=EXIT_CODES)
def merge_cmd(
    reports: Annotated[
        list[Path],
        typer.Argument(
            metavar="REPORT.json",
            help="The JSON reports of every shard of one split (`repro matrix --shard K/N --json PATH`).",
        ),
    ],
    json_path: JsonOpt = None,
    junit: JunitOpt = None,
    html: HtmlOpt = None,
    allow_unsupported: Annotated[
        bool, typer.Option("--allow-unsupported", help="UNSUPPORTED trials do not fail the run (they never pass).")
    ] = False,
) -> int:
    """One report over the shard reports of one matrix, exit code as if it had been one run; a missing or duplicated shard fails it."""
    from repro.run.merge import merge

    out = Output(json_path)
    try:
        check_outputs(out.json_file, junit, html, None)
        merged = merge(reports)
    except ConfigError as e:
        return out.error(e)
    merged.command = shlex.join(sys.argv)
    console = out.results()
    report.render_summary(merged, console)
    console.print(report.summary_line(merged))
    write_artifacts(merged, out, junit, html)
    code = exit_code(RunResult(report=merged, interrupted=merged.interrupted), allow_unsupported)
    return Exit.FAILED if merged.shard_problems() and code in (Exit.OK, Exit.ENV) else code


@app.command("presets")
def presets_cmd(
    name: Annotated[
        Optional[choices(tuple(preset_names())) if preset_names() else str],
        typer.Argument(metavar="NAME", help="Print this preset's TOML to stdout (copy, edit, pass --config FILE)."),
    ] = None,
) -> int:
    """The presets and matrices shipped with repro, and the folder they are in."""
    from repro.config import CONFIG_DIR, describe_presets, resolve_preset_path

    out = Output()
    try:
        if name:
            out.write(resolve_preset_path(name).read_text())
            return Exit.OK
        names = max(len(n) for n in preset_names())
        # The terminal's width (COLUMNS where set); 80 in a pipe.
        columns = shutil.get_terminal_size((80, 24)).columns
        rows = describe_presets(limit=max(20, columns - names - 18))
    except ConfigError as e:
        return out.error(e)
    out.write(f"presets in {CONFIG_DIR}:\n")
    out.write("".join(f"  {n:<{names}}  {kind:<12}  {text}".rstrip() + "\n" for n, kind, text in rows))
    return Exit.OK


@app.command("doctor")
def doctor_cmd(
    json_path: JsonOpt = None,
    vllm: Annotated[bool, typer.Option("--vllm", help="Also locate an installed vLLM (never imported).")] = False,
) -> int:
    """The environment: GPUs (NVML), topology, torch, CUDA, NCCL, vLLM. Exit 0 also without a GPU."""
    out = Output(json_path)
    try:
        check_outputs(out.json_file, None, None, None)
    except ConfigError as e:
        return out.error(e)
    env = inventory.collect(include_vllm=vllm)
    doctor.render(env, out.results())
    if out.json_path:
        out.write_json(json_text(to_jsonable(env)))
    return Exit.OK


@app.command("vllm-audit")
def vllm_audit(
    path: Annotated[
        Optional[Path],
        typer.Option("--path", metavar="DIR", help="A vLLM source tree (repo root or the vllm/ package)."),
    ] = None,
    wheel: Annotated[
        Optional[Path], typer.Option("--wheel", metavar="FILE", help="A vLLM wheel or sdist archive.")
    ] = None,
    require: Annotated[
        Optional[list[str]],
        typer.Option("--require", metavar="FIX_ID", help="Fix id that must be present (e.g. 43909); exit 1 if not."),
    ] = None,
    json_path: JsonOpt = None,
) -> int:
    """Does a vLLM (installed, a directory or an archive) carry the upstream fixes? Never imports vLLM."""
    from repro.audit import scan as audit

    out = Output(json_path)
    if path and wheel:
        return out.error("give --path or --wheel, not both")
    try:
        check_outputs(out.json_file, None, None, None)
        for fix_id in require or []:
            audit.find_fix(fix_id)
        result = (
            audit.audit_directory(path) if path else audit.audit_archive(wheel) if wheel else audit.audit_installed()
        )
    except audit.VllmNotInstalled as e:  # nothing wrong with the command: this environment lacks vLLM
        return out.error(e, Exit.ENV)
    except (audit.AuditError, ConfigError, KeyError, ValueError) as e:
        return out.error(e)
    audit.render(result, out.results())
    if out.json_path:
        out.write_json(json_text(result.to_dict()))
    missing = audit.missing_required(result, require or [])
    if missing:
        out.note(f"required fixes not present: {', '.join(missing)}")
        return Exit.FAILED
    return Exit.OK


WatchJunitOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--junit", metavar="PATH", help="Write JUnit XML (one testcase per watched process, a failure per finding)."
    ),
]
WatchHtmlOpt = Annotated[
    Optional[Path],
    typer.Option("--html", metavar="PATH", help="Write a self-contained HTML report of the processes and findings."),
]


@app.command(
    "watch",
    epilog=WATCH_EXIT_CODES,
    options_metavar="[OPTIONS] -- CMD [ARGS...]",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False},
)
def watch_cmd(
    ctx: typer.Context,
    on_finding: Annotated[
        choices(OnFinding),
        typer.Option(
            "--on-finding",
            help="warn: record and let the replay run; raise: the replay raises StaleCaptureError naming the tensor, before the launch.",
        ),
    ] = "warn",
    run_dir: Annotated[
        Optional[Path],
        typer.Option(
            "--run-dir",
            metavar="DIR",
            help=with_default(
                "Directory for the per-process records.",
                "a new folder $XDG_CACHE_HOME/repro/runs/watch-DATE-TIME-XXXXXXXX (else under ~/.cache), its own for each run",
            ),
        ),
    ] = None,
    record: Annotated[
        choices(Record),
        typer.Option(
            "--record",
            help="graph: where the graph census runs (CUDA), read what each capture holds from the graph after it, with no per-op hook (capture cost per node); ops: also record every op at the dispatcher (cost per op; names and drop sites for tensors only pointer tables in device memory reach). Without the census every op is recorded either way.",
        ),
    ] = "graph",
    stacks: Annotated[
        bool,
        typer.Option(
            "--stacks",
            help="The allocator records every allocation's Python stack (from CUDA's initialisation on), so findings of the graph census say where the tensor was created (created at). Costs each allocation a stack walk; off by default.",
        ),
    ] = False,
    json_path: JsonOpt = None,
    junit: WatchJunitOpt = None,
    html: WatchHtmlOpt = None,
) -> int:
    """Run CMD unchanged with the stale-capture hooks in every Python process it starts: repro watch -- CMD [ARGS...]."""
    from repro.watch import command as watch

    return report_watch(
        lambda: watch.watch(list(ctx.args), run_dir, on_finding, record, stacks), json_path, junit, html
    )


@app.command("watch-report", epilog=WATCH_EXIT_CODES)
def watch_report_cmd(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(metavar="DIR", help="Run directories of `repro watch` (one per node), merged into one report."),
    ],
    json_path: JsonOpt = None,
    junit: WatchJunitOpt = None,
    html: WatchHtmlOpt = None,
) -> int:
    """One report over the records of one or more `repro watch` runs (exit 1 if any finding)."""
    from repro.watch import command as watch

    return report_watch(lambda: watch.merge(run_dirs), json_path, junit, html)


def report_watch(make_report, json_path, junit, html) -> int:
    """Build a watch report (running or merging), render it, write its files; its exit code.

    The human report goes to stderr also without --json: stdout is CMD's own (repro watch),
    and watch-report reads the same as the run it merges."""
    from repro.watch import command as watch, report as watch_report

    out = Output(json_path)
    try:
        check_outputs(out.json_file, junit, html, None)
        rep = make_report()
    except (ConfigError, watch.WatchUsageError) as e:
        return out.error(e)
    watch_report.render(rep, out.progress())
    if out.json_path:
        out.write_json(watch_report.report_json(rep))
    watch_report.write_artifacts(rep, junit and str(junit), html and str(html))
    return rep.exit


def main(server: RankServer | None = None, interrupts: Interrupts | None = None) -> None:
    """server: a rank server already started for this command line; interrupts: the signal
    flag already installed (both by repro/__main__.py)."""
    noise.silence_known_warnings()
    app(obj=Session(server, interrupts or Interrupts()))


if __name__ == "__main__":
    main()
