"""`normexp sweep`: run a sweep here (resuming), or launch it as a job array (--launcher); and `normexp
validate`, which checks a sweep file without running anything."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from normexp import output, stopping
from normexp.commands.console import (
    Exit,
    check_choice,
    config_file,
    err,
    fail,
    load,
    out,
    out_folder,
    plural,
    show,
)
from normexp.config import DEFAULT_MAX_RUNS, ConfigError, Sweep
from normexp.sweep import Invocation, SweepOptions, SweepOutcome, fast_pool

# The sections of `normexp sweep --help` (console.SectionedCommand); its other options come first.
ENGINE, WHERE, ARRAY = "Engine", "Where it runs", "Job array (--launcher slurm | local)"


def sweep(
    config: Annotated[Path, typer.Argument(
        metavar="CONFIG", help="Sweep YAML file, or the name of one shipped (warmup, depth, ...).")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Add or replace a grid axis: KEY=V1,V2.")] = None,
    out_dir: Annotated[str | None, typer.Option("--out", help="Sweep folder [default: runs/<name>].")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the expanded grid; run nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Redo runs that are already finished.")] = False,
    fail_fast: Annotated[bool, typer.Option("--fail-fast", help="Stop at the first failed run.")] = False,
    max_runs: Annotated[int, typer.Option(help="Refuse grids of more distinct runs.", min=1)] = DEFAULT_MAX_RUNS,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
    # Engine
    engine: Annotated[str, typer.Option(help="auto | reference | batched | fast.", rich_help_panel=ENGINE)] = "auto",
    compile_: Annotated[bool | None, typer.Option(
        "--compile/--no-compile", help="--engine fast: compile its step [default: where the grid pays for it].",
        show_default=False, rich_help_panel=ENGINE)] = None,
    device: Annotated[str, typer.Option(help="cpu | cuda.", rich_help_panel=ENGINE)] = "cpu",
    # Where it runs
    workers: Annotated[int | None, typer.Option(
        help="Local worker processes (1: in this process). Default: in this process, or one single-threaded "
             "worker per core for a compiled fast sweep.", min=1, rich_help_panel=WHERE)] = None,
    cluster: Annotated[str | None, typer.Option(
        help="Dask: local[:N] or tcp://HOST:PORT of a scheduler.", rich_help_panel=WHERE)] = None,
    shard: Annotated[str | None, typer.Option(
        help="I/N: train shard I (from 0) of N only, whole batches of the plan (a job array's task).",
        rich_help_panel=WHERE)] = None,
    # Job array: 11 options, Slurm's (submitit's) and the local launcher's
    launcher: Annotated[str | None, typer.Option(
        help="slurm: submit the sweep as a job array of --shards tasks (submitit); local: run it here.",
        rich_help_panel=ARRAY)] = None,
    shards: Annotated[int | None, typer.Option(
        help="--launcher: the array's tasks.", min=1, rich_help_panel=ARRAY)] = None,
    partition: Annotated[str | None, typer.Option(
        help="--launcher slurm: the partition.", rich_help_panel=ARRAY)] = None,
    account: Annotated[str | None, typer.Option(
        help="--launcher slurm: the account to charge.", rich_help_panel=ARRAY)] = None,
    qos: Annotated[str | None, typer.Option(
        help="--launcher slurm: the quality of service.", rich_help_panel=ARRAY)] = None,
    time_min: Annotated[int, typer.Option(
        "--time", help="--launcher: minutes per task (requeued past it).", min=1, rich_help_panel=ARRAY)] = 60,
    cpus: Annotated[int, typer.Option(help="--launcher slurm: CPUs per task.", min=1, rich_help_panel=ARRAY)] = 1,
    mem: Annotated[str | None, typer.Option(
        help="--launcher slurm: memory per task, e.g. 8G.", rich_help_panel=ARRAY)] = None,
    array_parallelism: Annotated[int | None, typer.Option(
        help="--launcher slurm: tasks running at once [default: all].", min=1, rich_help_panel=ARRAY)] = None,
    setup: Annotated[list[str] | None, typer.Option(
        help="--launcher slurm: a shell line run before each task (module load ...); repeatable.",
        rich_help_panel=ARRAY)] = None,
    logs: Annotated[Path | None, typer.Option(
        help="--launcher: submitit's folder [default: OUT/.submitit].", rich_help_panel=ARRAY)] = None,
) -> None:
    """Run every run of a sweep (resuming: finished runs are skipped), then print its report."""
    config = config_file(config)
    spec = load(config, set_ or [], max_runs)
    check_choice("--engine", engine, ("auto", "reference", "batched", "fast"))
    if compile_ is not None and engine != "fast":
        flag = "--compile" if compile_ else "--no-compile"
        raise fail(f"{flag}: only --engine fast compiles; --engine {engine} runs the reference's kernels")
    check_choice("--device", device, ("cpu", "cuda"))
    if cluster is not None:
        _check_cluster(cluster)
    if launcher is not None or shards is not None:
        from normexp.launch import ArraySettings, sweep_options

        if shard is not None:
            raise fail("--shard: each task of --launcher's array takes its own; give one or the other")
        _check_slurm_words(partition=partition, account=account, qos=qos, mem=mem)
        passed = tuple(sweep_options(device, compile_, workers, cluster,  # each task runs as this command asked
                                     None if max_runs == DEFAULT_MAX_RUNS else max_runs, fail_fast))
        _launch(config, set_ or [], spec, out_folder(out_dir, spec.name), engine, force, launcher, dry_run,
                ArraySettings(shards or 0, spec.name, partition, account, qos, time_min, cpus, mem,
                              array_parallelism, tuple(setup or ())), logs, passed, (compile_, device))
        return
    shard_of = _shard(shard)
    target = out_folder(out_dir, spec.name)
    if dry_run:
        _print_grid(spec, target, engine)
        if shard_of is not None:
            _print_shard(spec, engine, shard_of, compile_)
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
            if not quiet and engine == "fast" and fast_declined(spec.runs):
                out.print(fast_declined(spec.runs))
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


def _print_shard(spec: Sweep, engine: str, shard: tuple[int, int], compile_: bool | None = None) -> None:
    from normexp.folder import run_id
    from normexp.shard import shard_runs

    runs = shard_runs(spec.runs, engine, *shard, compile=compile_)
    out.print(f"shard {shard[0]}/{shard[1]} trains {plural(len(runs), 'run')} of the {len(spec.runs)}: "
              + " ".join(run_id(cfg) for cfg in runs))


def _launch(config: Path, overrides: list[str], spec: Sweep, target: Path, engine: str, force: bool,
            launcher: str | None, dry_run: bool, settings, logs: Path | None, passed: tuple[str, ...] = (),
            compile_device: tuple[bool | None, str] = (None, "cpu")) -> None:
    """`sweep --launcher`: submit (or show, with --dry-run) the job array of `settings.shards` shards; under
    Slurm, only the shards with runs left. A --time too short for a task is refused or warned first."""
    from normexp.launch import LAUNCHERS, check_time, plan_array, run_local, sbatch_script, settle, submit, task_argv

    if launcher is None or not settings.shards:
        raise fail("--launcher and --shards go together: e.g. --launcher slurm --shards 8")
    check_choice("--launcher", launcher, LAUNCHERS)
    check_choice("--engine", engine, ("auto", "reference", "batched", "fast"))
    argv = task_argv(config, overrides, target, engine, force, passed)
    logs = (logs or target / ".submitit").resolve()
    plan = plan_array(spec.runs, engine, settings.shards, target, compile_device[0], force, compile_device[1])
    refusal, warning = check_time(settings.time_min, plan, launcher)
    if refusal:
        raise fail(refusal)
    if warning:
        err.print(warning, soft_wrap=True)
    if launcher == "slurm":
        settings = settle(settings, plan)
    try:
        if dry_run:
            _print_grid(spec, target, engine)
            out.print(f"\n{settings.shards} array tasks, task I running: "
                      + " ".join(shlex.quote(a) for a in ["python", "-m", "normexp", *argv, "--shard", "I/N"]))
            if launcher == "slurm":
                out.print(_shards_left(plan.todo, settings.shards, target))
                if plan.todo:
                    out.print("\n" + sbatch_script(argv, settings, logs))
            return
        if launcher == "local":
            done = run_local(argv, settings, logs, target, spec.runs, lambda line: err.print(line, soft_wrap=True))
        elif not plan.todo:
            out.print(_shards_left(plan.todo, settings.shards, target))
            return
        else:
            jobs = submit(argv, settings, logs, plan.todo)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - sbatch refused the array, or the local executor could not start
        last = (str(exc).strip().splitlines() or [""])[-1]
        raise fail(f"--launcher {launcher}: {type(exc).__name__}: {last}") from None
    if launcher == "slurm":
        out.print(f"submitted job array {jobs[0].job_id.split('_')[0]} '{settings.name}' "
                  f"({plural(len(plan.todo), 'task')}) into {target}; logs in {logs}; `normexp report {target}` "
                  "when it is done", soft_wrap=True)
        out.print(f"{_shards_left(plan.todo, settings.shards, target)}; past --time {settings.time_min}, a task is "
                  f"requeued and resumes, at most {settings.requeues} times", soft_wrap=True)
        return
    if done.stopped is not None:  # as a sweep stopped so says: what is kept, and the command that resumes
        resume = " ".join(shlex.quote(a) for a in ["normexp", *sys.argv[1:]])
        err.print(f"{stopping.signal_name(done.stopped)}: the array's tasks stopped; {done.finished} of {done.total} "
                  f"runs finished and kept in {target}.\nResume with: {resume}", soft_wrap=True)
        raise typer.Exit(128 + done.stopped)
    out.print(f"{settings.shards} shards ran into {target}")
    _print_report(target)
    for line in done.problems():
        err.print(line, soft_wrap=True)
    if not done.ok:  # failed runs (or tasks): the sweep's exit code for them
        err.print(f"{done.finished} of {done.total} runs finished, {plural(len(done.failed), 'run')} failed "
                  f"(normexp verify {shlex.quote(str(target))})", soft_wrap=True)
        raise typer.Exit(Exit.FAILED)


def _shards_left(todo: tuple[int, ...], shards: int, target: Path) -> str:
    """Which shards the array runs: those with runs left in `target` (finished runs verified there)."""
    if not todo:
        return f"every run of the {shards} shards is finished in {target} (verified): no task to submit"
    if len(todo) == shards:
        return f"all {shards} shards have runs left: task K runs shard K"
    return (f"{len(todo)} of the {shards} shards {'has' if len(todo) == 1 else 'have'} runs left "
            f"({', '.join(map(str, todo))}; the others have none left in {target}, verified): task K runs the K-th "
            "of them")


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
        err.print(f"{plural(outcome.failed, 'run')} failed · see {target / 'summary.csv'}")
    if not quiet:
        _print_report(target)
        out.print(_closing(outcome, target))
        if outcome.held != outcome.total or outcome.invocations > 1:
            out.print(f"{target} now holds {plural(outcome.held, 'run')} from "
                      f"{plural(outcome.invocations, 'invocation')} (history.jsonl); report shows all, "
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
    from normexp.engines.fast import MklPathError, requested
    from normexp.executors import ExecutorError
    from normexp.folder import StoreError
    from normexp.sweep import SweepInterrupted, run_sweep

    try:
        requested()  # NORMEXP_MKL_PATH: a value it cannot mean ends the sweep before anything starts
    except MklPathError as exc:
        raise fail(str(exc)) from None
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
                         title=f"{spec.name}: {plural(len(spec.runs), 'run')}"))
    else:
        out.print(f"{spec.name}: {plural(len(spec.runs), 'run')}", markup=False)
        for key in keys:
            values = list(dict.fromkeys(str(flat[key]) for flat in flats))  # str: a list value (optim.betas)
            shown = ", ".join(values) if len(values) <= 8 else \
                f"{', '.join(values[:3])}, ..., {', '.join(values[-2:])}"
            out.print(f"  {key}: {plural(len(values), 'value')} ({shown})", markup=False)
    folder = str(target)  # os.path, not pathlib: 10,000 runs
    todo = [cfg for rid, cfg in zip(ids, spec.runs) if not os.path.isfile(os.path.join(folder, rid, "done.json"))]
    done = len(ids) - len(todo)  # a done.json present; `normexp verify` checks what it says
    from normexp.engines.fast import fast_serves

    served = [cfg for cfg in todo if fast_serves(cfg)]  # the rest train on the exact engines under --engine fast
    fast = estimated_seconds(served, "fast") + estimated_seconds([c for c in todo if not fast_serves(c)], "batched")
    reference = estimated_seconds(todo, "reference")
    estimate = f"~{_minutes(fast)} on --engine fast, ~{_minutes(reference)} on --engine reference"
    out.print(f"{done} already done, {len(todo)} to run in {target}; estimated {estimate} "
              f"(from the runs' FLOPs at rates measured on 2 CPU cores: docs/performance.md)", markup=False)
    note = fast_declined(spec.runs)
    if note and engine == "fast":
        out.print(note, markup=False)


def fast_declined(runs: list) -> str:
    """What `--engine fast` does with the runs it does not serve (`fast_serves`), in one line, or ""."""
    from collections import Counter

    from normexp.engines.fast import fast_unserved

    unserved = [fast_unserved(cfg) for cfg in runs]
    declined = sum(map(bool, unserved))
    if not declined:
        return ""
    keys = ", ".join(key for key, _ in Counter(key for keys in unserved for key in keys).most_common())
    return (f"--engine fast: {declined} of {plural(len(runs), 'run')} set {keys}, which the fast engine does not "
            "serve: they train on the exact engines instead (batched where they batch, else the reference)")


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _print_report(run_dir: Path) -> None:
    """The table of the grid the sweep ran (`sweep_report`: its own runs, whatever else the folder holds),
    fitted to the terminal's width on a terminal."""
    from normexp.report import fit_report, sweep_report, to_rich
    from normexp.results import ResultsError

    try:
        table = sweep_report(run_dir)
        show(to_rich(fit_report(table, out.width) if out.is_terminal else table))
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


def validate(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="Sweep YAML file.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Add or replace a grid axis: KEY=V1,V2.")] = None,
) -> None:
    """Check a sweep file (and --set values) without running anything."""
    config = config_file(config)
    spec = load(config, set_ or [])
    out.print(f"{config}: ok · sweep '{spec.name}' · {plural(len(spec.runs), 'run')}")


