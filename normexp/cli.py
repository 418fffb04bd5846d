"""The `normexp` command line: parse, load the config, call one core function, print with Rich.

Exit codes: 0 every run finished; 1 some run failed; 2 bad usage, bad config or an output folder in
use; 128 + the signal's number when Ctrl-C (130), SIGTERM (143) or SIGHUP (129) stopped the sweep
(finished runs kept: rerunning the same command resumes).

Standard output that cannot be written (`> /dev/full`, a full disk; normexp/output.py) ends a command with
one `error: cannot write the output: ...` line on stderr and exit 2 (a reader that closed its pipe, as
`| head` does: exit 1, silently, as before). A sweep is the exception: its output is a report on its work,
not the work. It trains on, writes every run folder and summary.csv, then says on stderr that its output
could not be written, with the closing line it would have printed; its exit code is the runs' (0 or 1).

torch and pandas are imported inside the commands that need them, so `normexp --help` stays instant.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, get_args

import typer
from rich.console import Console
from rich.markup import escape

from normexp import output, stopping
from normexp.config import (
    DEFAULT_MAX_RUNS,
    METRICS,
    ConfigError,
    Metric,
    Sweep,
    TooManyRuns,
    load_sweep,
)
from normexp.sweep import Invocation, SweepOptions, SweepOutcome, fast_pool

if TYPE_CHECKING:
    from normexp.report import Report
    from normexp.results import Folder

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_show_locals=False,
    help="Where and which normalization makes a deep residual network trainable without warmup.",
)
# Printed text is taken literally: paths, values and options a user typed must not turn into markup
# ("[x]") or emoji ("local:-1: ..." holds the emoji code ":-1:").
out = Console(highlight=False, markup=False, emoji=False)
err = Console(stderr=True, highlight=False, markup=False, emoji=False)
# Off a terminal (a log, a pipe) a line is never wrapped at 80 columns (or COLUMNS): one progress line
# per run, a path whole on its line. Tables go through `show`.
out.soft_wrap, err.soft_wrap = not out.is_terminal, not err.is_terminal


class Exit:
    OK, FAILED, USAGE, INTERRUPTED = 0, 1, 2, 130


def fail(message: str, code: int = Exit.USAGE) -> typer.Exit:
    """Print `message` to stderr (no traceback) and return the Exit to raise."""
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True, soft_wrap=True)
    return typer.Exit(code)


def _load(config: Path, overrides: list[str], max_runs: int | None = None) -> Sweep:
    """Load a sweep; `max_runs` is given by the commands that have a --max-runs option."""
    try:
        return load_sweep(config, overrides, max_runs or DEFAULT_MAX_RUNS)
    except TooManyRuns as exc:
        raise fail(str(TooManyRuns(exc.total, exc.limit, "--max-runs", exc.distinct) if max_runs else exc)) from None
    except ConfigError as exc:
        raise fail(str(exc)) from None


@app.command()
def sweep(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="Sweep YAML file (see configs/).")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Add or replace a grid axis: KEY=V1,V2.")] = None,
    out_dir: Annotated[str | None, typer.Option("--out", help="Sweep folder [default: runs/<name>].")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the expanded grid; run nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Redo runs that are already finished.")] = False,
    engine: Annotated[str, typer.Option(help="auto | reference | batched | fast.")] = "auto",
    compile_: Annotated[bool | None, typer.Option(
        "--compile/--no-compile", help="--engine fast: compile its step [default: where the grid pays for it].",
        show_default=False)] = None,
    device: Annotated[str, typer.Option(help="cpu | cuda.")] = "cpu",
    fail_fast: Annotated[bool, typer.Option("--fail-fast", help="Stop at the first failed run.")] = False,
    workers: Annotated[int | None, typer.Option(
        help="Local worker processes (1: in this process). Default: in this process, or one single-threaded "
             "worker per core for a compiled fast sweep.", min=1)] = None,
    cluster: Annotated[str | None, typer.Option(help="Dask: local[:N] or tcp://HOST:PORT of a scheduler.")] = None,
    max_runs: Annotated[int, typer.Option(help="Refuse grids of more distinct runs.", min=1)] = DEFAULT_MAX_RUNS,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
    shard: Annotated[str | None, typer.Option(
        help="I/N: train shard I (from 0) of N only, whole batches of the plan (a job array's task).")] = None,
    launcher: Annotated[str | None, typer.Option(
        help="slurm: submit the sweep as a job array of --shards tasks (submitit); local: run it here.")] = None,
    shards: Annotated[int | None, typer.Option(help="--launcher: the array's tasks.", min=1)] = None,
    partition: Annotated[str | None, typer.Option(help="--launcher slurm: the partition.")] = None,
    account: Annotated[str | None, typer.Option(help="--launcher slurm: the account to charge.")] = None,
    qos: Annotated[str | None, typer.Option(help="--launcher slurm: the quality of service.")] = None,
    time_min: Annotated[int, typer.Option("--time", help="--launcher: minutes per task (requeued past it).",
                                          min=1)] = 60,
    cpus: Annotated[int, typer.Option(help="--launcher slurm: CPUs per task.", min=1)] = 1,
    mem: Annotated[str | None, typer.Option(help="--launcher slurm: memory per task, e.g. 8G.")] = None,
    array_parallelism: Annotated[int | None, typer.Option(
        help="--launcher slurm: tasks running at once [default: all].", min=1)] = None,
    setup: Annotated[list[str] | None, typer.Option(
        help="--launcher slurm: a shell line run before each task (module load ...); repeatable.")] = None,
    logs: Annotated[Path | None, typer.Option(help="--launcher: submitit's folder [default: OUT/.submitit].")] = None,
) -> None:
    """Run every run of a sweep (resuming: finished runs are skipped), then print its report."""
    spec = _load(config, set_ or [], max_runs)
    if launcher is not None or shards is not None:
        from normexp.launch import ArraySettings

        if shard is not None:
            raise fail("--shard: each task of --launcher's array takes its own; give one or the other")
        _check_slurm_words(partition=partition, account=account, qos=qos, mem=mem)
        _launch(config, set_ or [], spec, _out_folder(out_dir, spec.name), engine, force, launcher, dry_run,
                ArraySettings(shards or 0, partition, account, qos, time_min, cpus, mem, array_parallelism,
                              tuple(setup or ())), logs)
        return
    shard_of = _shard(shard)
    _check_choice("--engine", engine, ("auto", "reference", "batched", "fast"))
    if compile_ is not None and engine != "fast":
        flag = "--compile" if compile_ else "--no-compile"
        raise fail(f"{flag}: only --engine fast compiles; --engine {engine} runs the reference's kernels")
    _check_choice("--device", device, ("cpu", "cuda"))
    if cluster is not None:
        _check_cluster(cluster)
    target = _out_folder(out_dir, spec.name)
    if dry_run:
        _print_grid(spec, target, engine)
        if shard_of is not None:
            _print_shard(spec, engine, shard_of)
        return
    if device == "cuda":
        _require_cuda()
    options = SweepOptions(engine=engine, device=device, force=force, fail_fast=fail_fast,
                           workers=workers, cluster=cluster, compile=compile_, shard=shard_of)
    outcome = None
    try:  # output that cannot be written ends no sweep (see the module docstring)
        with contextlib.suppress(output.OutputLost):
            if not quiet and out_dir is None:  # the default folder, said before anything is written to it
                out.print(f"writing to {target} (the default for sweep '{spec.name}'; --out DIR to choose)")
        outcome = _run(spec, target, options, quiet, _invocation(config))
        with contextlib.suppress(output.OutputLost):
            _print_outcome(outcome, target, quiet)
    finally:
        _say_if_output_lost(outcome, target)
    if outcome.failed:
        raise typer.Exit(Exit.FAILED)


def _shard(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    from normexp.shard import parse_shard

    try:
        return parse_shard(value)
    except ConfigError as exc:
        raise fail(str(exc)) from None


def _print_shard(spec: Sweep, engine: str, shard: tuple[int, int]) -> None:
    from normexp.folder import run_id
    from normexp.shard import shard_runs

    runs = shard_runs(spec.runs, engine, *shard)
    out.print(f"shard {shard[0]}/{shard[1]} trains {_plural(len(runs), 'run')} of the {len(spec.runs)}: "
              + " ".join(run_id(cfg) for cfg in runs))


def _launch(config: Path, overrides: list[str], spec: Sweep, target: Path, engine: str, force: bool,
            launcher: str | None, dry_run: bool, settings, logs: Path | None) -> None:
    """`sweep --launcher`: submit (or show, with --dry-run) the job array of `settings.shards` shards."""
    from normexp.launch import LAUNCHERS, sbatch_script, submit, task_argv

    if launcher is None or not settings.shards:
        raise fail("--launcher and --shards go together: e.g. --launcher slurm --shards 8")
    _check_choice("--launcher", launcher, LAUNCHERS)
    _check_choice("--engine", engine, ("auto", "reference", "batched", "fast"))
    argv = task_argv(config, overrides, target, engine, force)
    logs = (logs or target / ".submitit").resolve()
    try:
        if dry_run:
            _print_grid(spec, target, engine)
            out.print(f"\n{settings.shards} array tasks, task I running: "
                      + " ".join(shlex.quote(a) for a in ["python", "-m", "normexp", *argv, "--shard", "I/N"]))
            if launcher == "slurm":
                out.print("\n" + sbatch_script(argv, settings, logs))
            return
        jobs = submit(argv, settings, logs, launcher)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - sbatch refused the array, or a local task failed
        last = (str(exc).strip().splitlines() or [""])[-1]
        raise fail(f"--launcher {launcher}: {type(exc).__name__}: {last}") from None
    if launcher == "slurm":
        out.print(f"submitted job array {jobs[0].job_id.split('_')[0]} ({settings.shards} tasks) into {target}; "
                  f"logs in {logs}; `normexp report {target}` when it is done")
    else:
        out.print(f"{settings.shards} shards ran into {target}")
        _print_report(target)


def _say_if_output_lost(outcome: SweepOutcome | None, target: Path) -> None:
    """Say on stderr that the sweep's output could not be written, with the closing line it lost (none
    when the sweep was stopped or failed: its own message says how it ended); its exit code stays."""
    lost = output.take_loss(sys.stdout)
    if lost is not None:
        went_on = f"; the sweep went on: {_closing(outcome, target)}" if outcome is not None else ""
        err.print(f"cannot write the output: {lost.strerror or lost}{went_on}", soft_wrap=True)


def _print_outcome(outcome: SweepOutcome, target: Path, quiet: bool) -> None:
    """What a sweep prints once its runs are done: the report and the closing line (--quiet: the failures)."""
    if quiet and outcome.failed:
        err.print(f"{_plural(outcome.failed, 'run')} failed · see {target / 'summary.csv'}")
    if not quiet:
        _print_report(target)
        out.print(_closing(outcome, target))
        if outcome.held != outcome.total or outcome.invocations > 1:
            out.print(f"{target} now holds {_plural(outcome.held, 'run')} from "
                      f"{_plural(outcome.invocations, 'invocation')} (history.jsonl); report shows all, "
                      f"report --only-last this sweep's {outcome.total}")


def _closing(outcome: SweepOutcome, target: Path) -> str:
    return (f"{outcome.count('completed', 'diverged')} ran, {outcome.count('skipped')} already done, "
            f"{outcome.failed} failed{_integrity_counts(outcome)} · results in {target}")


def _integrity_counts(outcome: SweepOutcome) -> str:
    """', 2 found corrupt and redone' and the like, for the sweep's closing line."""
    parts = [f", {len(outcome.corrupt)} found corrupt and redone" if outcome.corrupt else "",
             f", {outcome.restamped} of an earlier release verified and stamped" if outcome.restamped else ""]
    return "".join(parts)


def _invocation(config: Path) -> Invocation:
    """The command line and the sweep file's text as given, for the folder's history."""
    try:
        source = config.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        source = ""
    return Invocation(" ".join(shlex.quote(a) for a in ["normexp", *sys.argv[1:]]), source)


def _run(spec: Sweep, target: Path, options: SweepOptions, quiet: bool,
         invocation: Invocation | None = None) -> SweepOutcome:
    stopping.received = None
    previous = stopping.on_stop_signals(_exit_at_once)  # nothing is written yet: a signal simply ends the process
    from normexp.executors import ExecutorError
    from normexp.folder import StoreError
    from normexp.sweep import SweepInterrupted, run_sweep

    pool = fast_pool(spec, options)
    _import_engines(options, pool)
    stopping.on_stop_signals(stopping.stop_cleanly)
    try:
        with _progress(len(spec.runs), quiet) as on_event:
            return run_sweep(spec, target, options, on_event, invocation or Invocation(), pool)
    except (StoreError, ExecutorError) as exc:
        raise fail(str(exc)) from None
    except SweepInterrupted as exc:
        done = exc.outcome.count("completed", "diverged", "skipped")
        resume = " ".join(shlex.quote(a) for a in ["normexp", *sys.argv[1:]])
        name = stopping.signal_name(stopping.received)
        err.print(f"{name}: {done} of {exc.outcome.total} runs finished and kept in {target}.\n"
                  f"Resume with: {resume}", soft_wrap=True)  # one line each, to copy whole
        raise typer.Exit(128 + (stopping.received or signal.SIGINT)) from None
    except KeyboardInterrupt:  # while the executor started, before the folder was touched
        name = stopping.signal_name(stopping.received)
        err.print(f"{name} before any run started: nothing was written", soft_wrap=True)
        raise typer.Exit(128 + (stopping.received or signal.SIGINT)) from None
    finally:
        if stopping.received is None:  # else the handlers stay till the process ends: a second signal exits at once
            stopping.on_stop_signals(previous)


def _exit_at_once(signum: int, frame: object) -> None:
    """A stop signal while modules load: exit now. Raising there could be swallowed by an import that
    catches too much, and leave a half-imported numpy behind."""
    os.write(2, f"{stopping.signal_name(signum)} before any run started: nothing was written\n".encode())
    os._exit(128 + signum)


def _import_engines(options: SweepOptions, pool: int) -> None:
    """Load what the sweep will need (seconds for torch, and for Dask), while a signal simply exits. A sweep
    that trains in a pool of `pool` worker processes (`fast_pool`) starts them first and imports torch beside
    them (`run_sweep`), stop signals held until it has loaded."""
    if pool:
        return
    import torch  # noqa: F401

    import normexp.engines.batched  # noqa: F401
    import normexp.engines.reference  # noqa: F401

    if options.cluster:
        try:
            import distributed  # noqa: F401
        except ImportError:
            pass  # the executor says how to install it


def _progress(total: int, quiet: bool):
    from normexp.progress import sweep_progress

    return sweep_progress(err if quiet else out, total, quiet, notices=err)


def show(renderable: object) -> None:
    """Print a table (or a group of tables and lines) to stdout without cutting a cell. On a terminal a
    cell too wide for it wraps (`rich_table` folds, never "…"), down to the table's narrowest whole
    layout (each column as wide as its longest word: past that the terminal itself wraps the lines);
    anywhere else (a pipe, a file, a Slurm log: Rich would assume 80 columns, or COLUMNS) at the table's
    own width, every identifier and number on one line."""
    from rich.measure import Measurement

    probe = Console(highlight=False, markup=False, emoji=False, width=UNBOUNDED)
    fit = Measurement.get(probe, probe.options, renderable)
    width = max(out.width, fit.minimum) if out.is_terminal else fit.maximum
    if out.is_terminal and width == out.width:
        out.print(renderable)
        return
    # stdout (read when it prints), as wide as the table; a terminal keeps its styles
    Console(highlight=False, markup=False, emoji=False, width=max(1, width),
            force_terminal=out.is_terminal or None).print(renderable)


UNBOUNDED = 1_000_000  # columns: wide enough that no table is measured against it


def _emit(fmt: str, table: Callable[[], object], markdown: Callable[[], str],
          csv: Callable[[], str] | None = None) -> None:
    """Print one result in the chosen --format: a Rich renderable, or markdown / CSV text."""
    if fmt == "table":
        show(table())
    else:
        sys.stdout.write(markdown() if fmt == "markdown" or csv is None else csv())


def _check_choice(option: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise fail(f"{option}: must be one of {', '.join(choices)}, got {value!r}")


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _out_folder(value: str | None, name: str) -> Path:
    """The output folder: --out, or runs/<name>. It may not exist yet; it must not be a file."""
    if value is None:
        return Path("runs") / name
    if not value.strip():
        raise fail("--out: empty; name a folder (or leave --out out for runs/<name>)")
    from normexp.folder import out_folder_problem

    option = Path(value)
    problem = out_folder_problem(option)
    if problem is not None:
        raise fail(f"--out {option}: {problem}")
    return option


def _check_cluster(address: str) -> None:
    from normexp.executors import ExecutorError, check_cluster_address

    try:
        check_cluster_address(address)
    except ExecutorError as exc:
        raise fail(str(exc)) from None


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise fail("--device cuda: no CUDA device is available to this torch build")


DRY_RUN_TABLE_RUNS = 200  # a larger grid's dry run summarises each axis instead of listing every run


def _print_grid(spec: Sweep, target: Path, engine: str) -> None:
    """The expanded grid: every run (a small grid), or each axis's values (a large one); then how many
    runs the folder holds already and an estimate of the time the rest take."""
    from normexp.engines.cost import estimated_seconds
    from normexp.folder import run_id

    keys = spec.varying_keys
    ids = [run_id(cfg) for cfg in spec.runs]
    flats = spec.flat_runs  # each key's value as the run's config.yaml writes it
    if len(spec.runs) <= DRY_RUN_TABLE_RUNS:
        from normexp.tables import rich_table  # pandas: a large grid's summary needs none

        rows = [[rid, *(str(flat[k]) for k in keys)] for rid, flat in zip(ids, flats)]
        show(rich_table(["run_id", *keys], rows, "l" * (len(keys) + 1),
                         title=f"{spec.name}: {_plural(len(spec.runs), 'run')}"))
    else:
        out.print(f"{spec.name}: {_plural(len(spec.runs), 'run')}", markup=False)
        for key in keys:
            values = list(dict.fromkeys(flat[key] for flat in flats))
            shown = ", ".join(map(str, values)) if len(values) <= 8 else \
                f"{', '.join(map(str, values[:3]))}, ..., {', '.join(map(str, values[-2:]))}"
            out.print(f"  {key}: {_plural(len(values), 'value')} ({shown})", markup=False)
    folder = str(target)  # os.path, not pathlib: 10,000 runs
    todo = [cfg for rid, cfg in zip(ids, spec.runs) if not os.path.isfile(os.path.join(folder, rid, "done.json"))]
    done = len(ids) - len(todo)  # a done.json present; `normexp verify` checks what it says
    estimate = ", ".join(f"~{_minutes(estimated_seconds(todo, e))} on --engine {e}" for e in ("fast", "reference"))
    out.print(f"{done} already done, {len(todo)} to run in {target}; estimated {estimate} "
              f"(from the runs' FLOPs at rates measured on 2 CPU cores: docs/performance.md)", markup=False)


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _print_report(run_dir: Path) -> None:
    from normexp.report import build_report, to_rich
    from normexp.results import ResultsError

    try:
        show(to_rich(build_report(run_dir)))
    except ResultsError as exc:
        err.print(str(exc))


def _check_slurm_words(**options: str | None) -> None:
    """--partition, --account, --qos, --mem: one word each, as sbatch reads them (an empty or multi-line one
    made a broken #SBATCH line); --mem a size (8G, 500M, 16000)."""
    for name, value in options.items():
        if value is not None and not re.fullmatch(r"[\w.,:+@%-]+", value):
            raise fail(f"--{name} {value!r}: one word of letters, digits and . , : + @ % - _ (as sbatch reads it)")
    mem = options.get("mem")
    if mem is not None and not re.fullmatch(r"\d+[KMGT]?", mem, re.IGNORECASE):
        raise fail(f"--mem {mem}: a size as sbatch reads it: a number of megabytes, or with K, M, G or T (8G)")


def _folder(value: str) -> Path:
    """A folder argument; an empty one would mean the current folder, so it is refused."""
    if not value.strip():
        raise typer.BadParameter("empty; name a sweep's output folder")
    return Path(value)


def _listed(option: str, value: str | None) -> list[str] | None:
    """A comma-separated option's items; given but empty is refused (it would silently mean the default)."""
    if value is None:
        return None
    items = [item.strip() for item in value.split(",")]
    if not all(items):
        raise fail(f"{option} {value!r}: empty item; give comma-separated values, or leave {option} out")
    return items


@app.command()
def report(
    run_dirs: Annotated[list[Path], typer.Argument(
        metavar="RUN_DIR...", help="A sweep's output folder; several: compared side by side (a `sweep` key).",
        parser=_folder)],
    steps: Annotated[str | None, typer.Option(help="Comma-separated steps [default: the sweep's].")] = None,
    metric: Annotated[str | None, typer.Option(help=f"{' | '.join(METRICS)} [default: the sweep's].")] = None,
    by: Annotated[str | None, typer.Option(help="Comma-separated column keys [default: varying keys].")] = None,
    pivot: Annotated[str | None, typer.Option(help="ROW_KEY,COL_KEY: a final-loss pivot instead.")] = None,
    lr_sensitivity: Annotated[bool, typer.Option(
        "--lr-sensitivity", help="Per variant: LR sensitivity over an optim.lr axis of >= 3 values instead.")] = False,
    fmt: Annotated[str, typer.Option(
        "--format", help="table | markdown | csv | html (one self-contained page with the figures).")] = "table",
    output: Annotated[Path | None, typer.Option(
        "-o", "--output", help="Write markdown, csv or html to this file [default: print it].")] = None,
    only_last: Annotated[bool, typer.Option(
        "--only-last", help="Only the latest sweep's grid [default: every verified run the folder holds].")] = False,
    trained_below: Annotated[float | None, typer.Option(
        "--trained-below", help="Trained rule: final loss under this [default: report.trained_below, else "
                                "ln(C)/10].")] = None,
    verdicts: Annotated[str, typer.Option(
        "--verdicts", help="counts (per group, past 6 columns) | full (name every column).")] = "counts",
) -> None:
    """Print the article-style table (mean ± std over seeds) of a sweep from disk, or a final-loss pivot,
    or each variant's learning-rate sensitivity."""
    from normexp.report import build_report, to_csv, to_markdown, to_rich
    from normexp.results import ResultsError

    if metric is not None:
        _check_choice("--metric", metric, get_args(Metric))
    _check_choice("--format", fmt, ("table", "markdown", "csv", "html"))
    _check_choice("--verdicts", verdicts, ("counts", "full"))
    if output is not None and fmt == "table":
        raise fail("-o: write markdown, csv or html (--format); a table is for the terminal")
    if fmt == "html" and (pivot is not None or lr_sensitivity):
        raise fail("--format html: the step table's page; --pivot and --lr-sensitivity print markdown or csv")
    _check_trained_below(trained_below)
    if pivot is not None and lr_sensitivity:
        raise fail("--pivot and --lr-sensitivity: choose one")
    for mode, on, table_only in (("--pivot", pivot is not None, {"--metric": metric, "--steps": steps, "--by": by}),
                                 ("--lr-sensitivity", lr_sensitivity, {"--metric": metric})):
        given = [option for option, value in table_only.items() if on and value is not None]
        if given:  # the pivot and the sensitivity are of the final loss, over every varying key
            raise fail(f"{given[0]} and {mode}: {given[0]} applies to the step table only")
    if pivot is not None:
        folder = _load_folder(run_dirs)
        _print_pivot(folder, pivot, fmt)
        _exit_if_runs_missing(folder, shown=fmt != "csv")
        return
    if lr_sensitivity:
        folder = _load_folder(run_dirs)
        _print_sensitivity(folder, fmt)
        _exit_if_runs_missing(folder, shown=False)
        return
    step_items, keys = _listed("--steps", steps), _listed("--by", by)
    try:
        step_list = [int(s) for s in step_items] if step_items else None
    except ValueError:
        raise fail(f"--steps: expected comma-separated integers, got {steps!r}") from None
    folder = _load_folder(run_dirs)
    try:
        table = build_report(folder, step_list, metric, keys, only_last, trained_below)
    except ResultsError as exc:
        raise fail(str(exc)) from None
    full = verdicts == "full"
    if fmt == "html" or output is not None:
        _write_report(table, folder, fmt, output, full, trained_below)
    else:
        _emit(fmt, lambda: to_rich(table, full), lambda: to_markdown(table, full), lambda: to_csv(table))
    _say_engines(table.engines, fmt)
    _exit_if_runs_missing(folder, shown=fmt in ("table", "markdown") and output is None)


def _write_report(table: Report, folder: Folder, fmt: str, output: Path | None, full: bool,
                  trained_below: float | None) -> None:
    """The report as a file (-o), or an HTML page on stdout; the HTML page draws the sweep's figures."""
    from normexp.report import to_csv, to_markdown

    if fmt == "html":
        from normexp.figures import sweep_figures
        from normexp.htmlpage import report_page
        from normexp.results import ResultsError

        try:
            figures = sweep_figures(folder, table.metric, trained_below=trained_below)
        except ResultsError as exc:
            raise fail(str(exc)) from None
        text = report_page(table, folder, figures)
    else:
        text = to_markdown(table, full) if fmt == "markdown" else to_csv(table)
    if output is None:
        sys.stdout.write(text)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise fail(f"cannot write {output}: {exc.strerror}") from None
    out.print(f"wrote {output}")


def _check_trained_below(value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise fail(f"--trained-below {value}: must be a finite loss > 0")


def _load_folder(run_dirs: Path | list[Path]) -> Folder:
    """The sweep folder, read and verified once for the whole command (normexp/results.py); several
    stacked into one, with a `sweep` key (normexp/compare.py)."""
    from normexp.compare import load_folders
    from normexp.results import ResultsError

    try:
        return load_folders(run_dirs if isinstance(run_dirs, list) else [run_dirs])
    except ResultsError as exc:
        raise fail(str(exc)) from None


def _say_engines(note: str, fmt: str) -> None:
    """A CSV has no line under its table: the note that it averages engines goes to stderr."""
    if note and fmt == "csv":
        err.print(note, soft_wrap=True)


def _print_pivot(folder: Folder, option: str, fmt: str) -> None:
    from normexp.report import build_pivot, pivot_to_csv, pivot_to_markdown, pivot_to_rich
    from normexp.results import ResultsError

    keys = [k.strip() for k in option.split(",")]
    if len(keys) != 2 or not all(keys):
        raise fail(f"--pivot: expected ROW_KEY,COL_KEY, e.g. optim.lr,schedule.warmup_steps; got {option!r}")
    if keys[0] == keys[1]:
        raise fail(f"--pivot {option}: the row key and the column key must differ")
    try:
        table = build_pivot(folder, *keys)
    except ResultsError as exc:
        raise fail(str(exc)) from None
    _emit(fmt, lambda: pivot_to_rich(table), lambda: pivot_to_markdown(table), lambda: pivot_to_csv(table))
    _say_engines(table.engines, fmt)


def _print_sensitivity(folder: Folder, fmt: str) -> None:
    from normexp.analysis.sensitivity import build_sensitivity, sensitivity_engines
    from normexp.results import ResultsError
    from normexp.tables import sensitivity_to_csv, sensitivity_to_markdown, sensitivity_to_rich

    try:
        rows = build_sensitivity(folder)
    except ResultsError as exc:
        raise fail(str(exc)) from None
    engines = sensitivity_engines(folder)
    _emit(fmt, lambda: sensitivity_to_rich(rows, engines), lambda: sensitivity_to_markdown(rows, engines),
          lambda: sensitivity_to_csv(rows))
    _say_engines(engines, fmt)


@app.command()
def plot(
    run_dirs: Annotated[list[Path], typer.Argument(
        metavar="RUN_DIR...", help="A sweep's output folder; several: compared side by side (a `sweep` key).",
        parser=_folder)],
    output: Annotated[Path | None, typer.Option(
        "-o", "--output", help="Figure file, .png | .pdf | .svg [default: RUN_DIR/<metric>.<format>].")] = None,
    metric: Annotated[str | None, typer.Option(help=f"{' | '.join(METRICS)} [default: the sweep's].")] = None,
    blocks: Annotated[bool, typer.Option("--blocks", help="Per-block dynamics of runs with train.log_blocks.")] = False,
    block_metric: Annotated[str | None, typer.Option(
        help="With --blocks: fc1_grad | fc2_grad | fc1_update | fc2_update | stream_rms | norm_rms | norm_out_rms "
             "[default: fc2_update].")] = None,
    row: Annotated[str | None, typer.Option(help="Comma-separated keys whose values make the rows of panels.")] = None,
    col: Annotated[str | None, typer.Option(
        help="Comma-separated keys whose values make the columns of panels [default: norm.placement, else the "
             "slowest-varying key].")] = None,
    hue: Annotated[str | None, typer.Option(
        help="Comma-separated keys whose values make the lines of a panel [default: the fastest-varying key].")] = None,
    fmt: Annotated[str | None, typer.Option(
        "--format", help="png | pdf | svg [default: -o's suffix, else png].")] = None,
    dpi: Annotated[int, typer.Option(help="Dots per inch of a PNG.", min=30, max=1200)] = 150,
    trained_below: Annotated[float | None, typer.Option(
        "--trained-below", help="Trained rule: final loss under this [default: report.trained_below, else "
                                "ln(C)/10].")] = None,
) -> None:
    """Curves per variant (mean and min–max over seeds); a phase diagram when two numeric axes vary.
    With --blocks: per variant, a heatmap of one per-block quantity over (block, step) and its first,
    middle and last block over steps."""
    from normexp.figures import BLOCK_METRIC_LABELS, save_blocks_plot, save_plots
    from normexp.results import ResultsError

    if metric is not None:
        _check_choice("--metric", metric, get_args(Metric))
    if fmt is not None:
        _check_choice("--format", fmt, FIGURE_FORMATS)
    _check_trained_below(trained_below)
    if block_metric is not None:
        if not blocks:
            raise fail("--block-metric: only with --blocks")
        _check_choice("--block-metric", block_metric, tuple(BLOCK_METRIC_LABELS))
    if output is not None and output.suffix.lower().lstrip(".") not in FIGURE_FORMATS:
        raise fail(f"-o {output}: the file name must end in .png, .pdf or .svg")
    if output is not None and fmt is not None and output.suffix.lower() != f".{fmt}":
        raise fail(f"-o {output} and --format {fmt}: the file name must end in .{fmt}")
    if blocks and (row or col or hue):
        raise fail("--row, --col, --hue: not with --blocks (its panels are fixed: placements across)")
    facets = {name: _listed(f"--{name}", value) for name, value in (("row", row), ("col", col), ("hue", hue))}
    folder = _load_folder(run_dirs)
    if output is None and len(run_dirs) > 1:  # into the first folder, named so that no sweep's own figure is replaced
        name = f"blocks-{block_metric or 'fc2_update'}" if blocks else metric or folder.sweep.report.metric
        output = run_dirs[0] / f"compare-{name}.{'png' if blocks else fmt or 'png'}"
    try:
        if blocks:
            if output is None and fmt is not None:
                output = folder.path / f"blocks-{block_metric or 'fc2_update'}.{fmt}"
            paths = [save_blocks_plot(folder, output, block_metric or "fc2_update")]
        else:
            paths = save_plots(folder, output, metric, fmt, dpi, trained_below=trained_below, **facets)
    except ResultsError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"cannot write {exc.filename}: {exc.strerror}") from None
    for path in paths:
        out.print(f"wrote {path}")
    _exit_if_runs_missing(folder, shown=False)


FIGURE_FORMATS = ("png", "pdf", "svg")


def _exit_if_runs_missing(folder: Folder, shown: bool) -> None:
    """Runs of the sweep missing, failed or corrupt: what exists was printed; name them (unless the
    output did) and exit 1, so that a script notices."""
    from normexp.results import missing_note

    note = missing_note(folder.summary, folder.path)
    if note:
        if not shown:
            err.print(note, soft_wrap=True)
        raise typer.Exit(Exit.FAILED)


@app.command()
def verify(
    run_dir: Annotated[Path, typer.Argument(metavar="DIR", help="A sweep's output folder.", parser=_folder)],
    fix: Annotated[bool, typer.Option("--fix", help="Remove what can be redone, stamp old runs, rebuild "
                                                    "summary.csv.")] = False,
) -> None:
    """Check a sweep folder: checksums, row counts, config vs run id, stray files, summary, other sweeps' runs.
    Exit 0 if clean, 1 if not; nothing is changed without --fix."""
    from normexp.folder import StoreError
    from normexp.tables import verification_to_rich
    from normexp.verify import verify_sweep

    try:
        result = verify_sweep(run_dir, fix)
    except StoreError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"{run_dir}: cannot {'repair' if fix else 'read'} {exc.filename}: {exc.strerror}") from None
    show(verification_to_rich(result))
    if not result.clean:
        raise typer.Exit(Exit.FAILED)


@app.command()
def gradnorm(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="Sweep YAML: grid over placement and depth.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Add or replace a grid axis: KEY=V1,V2.")] = None,
    out_dir: Annotated[str | None, typer.Option("--out", help="Output folder [default: runs/<name>].")] = None,
    fmt: Annotated[str, typer.Option("--format", help="table | markdown.")] = "table",
) -> None:
    """Per-block gradient norms and hidden-state norms at initialisation (Xiong et al. 2020, Fig. 3)."""
    from normexp.diagnostics import gradnorm_study
    from normexp.figures import save_gradnorm_plot
    from normexp.tables import gradnorm_to_markdown, gradnorm_to_rich

    _check_choice("--format", fmt, ("table", "markdown"))
    spec = _load(config, set_ or [])
    target = _out_folder(out_dir, spec.name)
    try:
        summary = gradnorm_study(spec, target)
        save_gradnorm_plot(summary, target / "gradnorm.png")
    except OSError as exc:
        raise fail(f"cannot write {exc.filename}: {exc.strerror}") from None
    _emit(fmt, lambda: gradnorm_to_rich(summary), lambda: gradnorm_to_markdown(summary))
    out.print(f"wrote {target / 'gradnorm.csv'} and {target / 'gradnorm.png'}")


norms_app = typer.Typer(no_args_is_help=True, help="Seed 001's numerical facts and speed table, measured here.")
app.add_typer(norms_app, name="norms")


@norms_app.command("props")
def norms_props(
    fmt: Annotated[str, typer.Option("--format", help="table | markdown.")] = "table",
) -> None:
    """RMSNorm's invariances, parameter counts, fp16 overflow, eps defaults, Gemma weights: each checked."""
    from normexp.diagnostics import norm_properties
    from normexp.tables import properties_to_markdown, properties_to_rich

    _check_choice("--format", fmt, ("table", "markdown"))
    props = norm_properties()
    _emit(fmt, lambda: properties_to_rich(props), lambda: properties_to_markdown(props))
    if not all(p.passed for p in props):
        raise typer.Exit(Exit.FAILED)


@norms_app.command("bench")
def norms_bench(
    repeats: Annotated[int, typer.Option(help="Timed repeats per measurement (median).", min=1)] = 5,
    big: Annotated[bool, typer.Option(help="Include the article's (64, 512, 4096) shape (0.5 GB a tensor).")] = True,
    compile_: Annotated[bool, typer.Option("--compile/--no-compile", help="Also time a compiled RMSNorm.")] = True,
    fmt: Annotated[str, typer.Option("--format", help="table | markdown.")] = "table",
) -> None:
    """Forward and forward+backward time of LayerNorm and each RMSNorm kind (median of repeats)."""
    from normexp.diagnostics import norm_speed
    from normexp.tables import speed_to_markdown, speed_to_rich

    _check_choice("--format", fmt, ("table", "markdown"))
    shapes = [(64, 32)] + ([(64, 512, 4096)] if big else [])
    timings = norm_speed(shapes, repeats, compile_)
    _emit(fmt, lambda: speed_to_rich(timings), lambda: speed_to_markdown(timings))


@app.command()
def studies(
    out_dir: Annotated[str, typer.Option("--out", help="Folder for every study's runs and REPORT.md.")] = "runs",
    quick: Annotated[bool, typer.Option("--quick", help="A smoke test: 2 seeds per sweep, no big-shape speed table.")]
    = False,
) -> None:
    """Run every study shipped with normexp (configs/studies) and write OUT/REPORT.md, each verdict computed
    from its numbers. A rerun resumes; Ctrl-C stops cleanly and keeps every finished run."""
    from normexp.studies import run_command

    run_command(out_dir, quick)


@app.command()
def validate(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="Sweep YAML file.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Add or replace a grid axis: KEY=V1,V2.")] = None,
) -> None:
    """Check a sweep file (and --set values) without running anything."""
    spec = _load(config, set_ or [])
    out.print(f"{config}: ok · sweep '{spec.name}' · {_plural(len(spec.runs), 'run')}")


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(metavar="DIR", help="A sweep's output folder.", parser=_folder)],
    dest: Annotated[str, typer.Argument(metavar="DEST", help="tensorboard: a log folder; mlflow: a tracking URI "
                                                               "(sqlite:///mlflow.db).")],
    to: Annotated[str, typer.Option("--to", help="tensorboard | mlflow.")] = "tensorboard",
    experiment: Annotated[str | None, typer.Option(help="--to mlflow: the experiment [default: the sweep's "
                                                          "name].")] = None,
) -> None:
    """Export a sweep's verified runs to TensorBoard (scalars per step, HParams) or MLflow (one run per run)."""
    from normexp.export import TARGETS, to_mlflow, to_tensorboard
    from normexp.folder import StoreError

    _check_choice("--to", to, TARGETS)
    if not dest.strip():  # an empty DEST would mean the current folder (or MLflow's ./mlruns)
        raise fail("DEST: empty; name a log folder (--to tensorboard) or a tracking URI (--to mlflow)")
    from normexp.folder import folder_runs, read_sweep

    try:
        kept = 0
        if to == "tensorboard":
            ids = to_tensorboard(run_dir, Path(dest))
            out.print(f"{_plural(len(ids), 'run')} exported to {dest} · tensorboard --logdir {dest}")
        else:
            ids, kept = to_mlflow(run_dir, dest, experiment)
            out.print(f"{_plural(len(ids), 'run')} exported to {dest}, {kept} already there · "
                      f"mlflow ui --backend-store-uri {dest}")
        left = len(folder_runs(run_dir, read_sweep(run_dir))) - len(ids) - kept
    except (ConfigError, StoreError) as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"{dest}: cannot write {exc.filename}: {exc.strerror}") from None
    if left > 0:  # as report does: what exists went out; the runs that did not are named, exit 1
        err.print(f"{_plural(left, 'run')} of the sweep not exported: missing, failed or corrupt "
                  f"(normexp verify {shlex.quote(str(run_dir))})", soft_wrap=True)
        raise typer.Exit(Exit.FAILED)


@app.command()
def merge(
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="The folder to merge into (made if missing).",
                                            parser=_folder)],
    sources: Annotated[list[Path], typer.Argument(metavar="DIR...", help="Sweep folders (shards) to merge.",
                                                  parser=_folder)],
) -> None:
    """Copy the verified runs of sweep folders (the shards of one sweep) into OUT, refusing conflicting runs;
    rebuild OUT's summary.csv and verify it. Exit 0 if OUT verifies clean, 1 if not, 2 if refused."""
    from normexp.folder import StoreError, out_folder_problem
    from normexp.merge import merge_folders
    from normexp.tables import verification_to_rich

    problem = out_folder_problem(out_dir)
    if problem is not None:
        raise fail(f"{out_dir}: {problem}")
    try:
        outcome = merge_folders(out_dir, sources, " ".join(shlex.quote(a) for a in ["normexp", *sys.argv[1:]]))
    except StoreError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"{out_dir}: cannot write {exc.filename}: {exc.strerror}") from None
    out.print(f"{_plural(len(outcome.copied), 'run')} copied, {outcome.kept} already there, "
              f"{outcome.unfinished} unfinished in the folders (not copied) · {out_dir}")
    show(verification_to_rich(outcome.verification))
    if not outcome.verification.clean:
        raise typer.Exit(Exit.FAILED)


@app.command()
def doctor() -> None:
    """Print this installation's versions, torch build, threads and devices, for a bug report."""
    from normexp.environment import describe

    if sys.stdout is not None:  # None: closed when the process started (`>&-`), nowhere to print
        sys.stdout.write(describe().as_text())
        from normexp.engines.auto import auto_summary

        sys.stdout.write(f"engine auto: {auto_summary()}\n")


def main() -> None:
    """Run the command line (normexp/__main__.py calls this once its Ctrl-C handler is in place). Output
    that cannot be written ends it as the module docstring says; the last of it is flushed here, while
    that can still be said."""
    output.guard_streams()
    try:
        app()
    except output.OutputLost:
        pass  # the command ends here; said below
    finally:
        _exit_if_output_lost()


def _exit_if_output_lost() -> None:
    """Flush standard output; if it could not be written (now or before) and no command said so, end
    with one `error:` line and exit 2, or silently with 1 for a reader that closed its pipe on purpose
    (`| head`), as before."""
    with contextlib.suppress(output.OutputLost):
        if sys.stdout is not None:
            sys.stdout.flush()
    lost = output.take_loss(sys.stdout)
    if lost is None:
        return
    if lost.errno == errno.EPIPE:
        sys.exit(Exit.FAILED)
    fail(f"cannot write the output: {lost.strerror or lost}")
    sys.exit(Exit.USAGE)
