"""The commands that run no sweep of the user's: `gradnorm` (gradients at initialisation), `norms props`
and `norms bench` (seed 001's facts and speed table), `studies` (every study shipped with normexp), and
`doctor` (this installation, for a bug report)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from normexp import stopping
from normexp.commands.console import Exit, check_choice, config_file, emit, err, fail, load, out, out_folder
from normexp.config import ConfigError


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

    check_choice("--format", fmt, ("table", "markdown"))
    spec = load(config_file(config), set_ or [])
    target = out_folder(out_dir, spec.name)
    try:
        summary = gradnorm_study(spec, target)
        save_gradnorm_plot(summary, target / "gradnorm.png")
    except OSError as exc:
        raise fail(f"cannot write {exc.filename}: {exc.strerror}") from None
    emit(fmt, lambda: gradnorm_to_rich(summary), lambda: gradnorm_to_markdown(summary))
    out.print(f"wrote {target / 'gradnorm.csv'} and {target / 'gradnorm.png'}")


norms_app = typer.Typer(no_args_is_help=True, help="Seed 001's numerical facts and speed table, measured here.")


@norms_app.command("props")
def norms_props(
    fmt: Annotated[str, typer.Option("--format", help="table | markdown.")] = "table",
) -> None:
    """RMSNorm's invariances, parameter counts, fp16 overflow, eps defaults, Gemma weights: each checked."""
    from normexp.diagnostics import norm_properties
    from normexp.tables import properties_to_markdown, properties_to_rich

    check_choice("--format", fmt, ("table", "markdown"))
    props = norm_properties()
    emit(fmt, lambda: properties_to_rich(props), lambda: properties_to_markdown(props))
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

    check_choice("--format", fmt, ("table", "markdown"))
    shapes = [(64, 32)] + ([(64, 512, 4096)] if big else [])
    timings = norm_speed(shapes, repeats, compile_)
    emit(fmt, lambda: speed_to_rich(timings), lambda: speed_to_markdown(timings))


def studies(
    names: Annotated[list[str] | None, typer.Argument(
        metavar="NAME", help="Only these studies (--list names them) [default: every study].",
        show_default=False)] = None,
    out_dir: Annotated[str, typer.Option("--out", help="Folder for every study's runs and REPORT.md.")] = "runs",
    quick: Annotated[bool, typer.Option(
        "--quick", help="A smoke test: 2 seeds per sweep (the article's table its 1, instabilities 1 at 4 lrs, "
                        "gradnorm 3, realtext_warmup 8 runs at depth 12), no big-shape speed table.")] = False,
    list_: Annotated[bool, typer.Option("--list", help="Name every study, with what it asks; run nothing.")] = False,
) -> None:
    """Run the studies shipped with normexp (configs/studies), every one or the NAMEs given, and write
    OUT/REPORT.md, each verdict computed from its numbers. A rerun resumes; Ctrl-C stops cleanly and keeps
    every finished run."""
    from normexp.executors import ExecutorError
    from normexp.folder import StoreError
    from normexp.studies.run import NAMES, STUDIES, run_studies  # pandas and the sweep: loaded while a stop
    from normexp.sweep import SweepInterrupted  # signal still exits at once

    for name in names or ():
        check_choice("NAME", name, NAMES)
    if list_:
        width = max(len(name) for name in NAMES)
        for study in STUDIES:
            if not names or study.name in names:
                out.print(f"{study.name:<{width}}  {study.about}")
        return
    folder = _studies_folder(out_dir)
    stopping.on_stop_signals(stopping.stop_cleanly)  # a first Ctrl-C or SIGTERM stops cleanly, runs kept
    try:
        run_studies(folder, quick, names=names or None)
    except (StoreError, ExecutorError, ConfigError) as exc:  # a folder in use or full, an edited study config
        raise fail(str(exc)) from None
    except OSError as exc:  # a folder that cannot be written, a full disk: say which file
        where = f" ({exc.filename})" if exc.filename else ""
        raise fail(f"--out {folder}: cannot write the studies{where}: {exc.strerror or exc}") from None
    except (SweepInterrupted, KeyboardInterrupt):
        signum = stopping.received or signal.SIGINT
        kept = f"every finished run is kept in {folder}" if folder.is_dir() else "nothing was written yet"
        err.print(f"{signal.Signals(signum).name}: studies stopped; {kept}. Run the same command again to resume.",
                  soft_wrap=True)
        stopping.exit_stopped(128 + signum)


def _studies_folder(option: str) -> Path:
    """--out must name a folder, or a path where one can be made: as `normexp sweep` checks its --out."""
    if not option.strip():  # Path("") is the current folder: every study would land there
        raise fail("--out: empty; name a folder for the studies (the default is runs)")
    from normexp.folder import out_folder_problem

    out = Path(option)
    problem = out_folder_problem(out)  # as `normexp sweep` checks its --out (else mkdir says "File exists")
    if problem is not None:
        raise fail(f"--out {out}: {problem}")
    return out


def doctor() -> None:
    """Print this installation's versions, torch build, threads and devices, for a bug report."""
    from normexp.environment import describe

    if sys.stdout is not None:  # None: closed when the process started (`>&-`), nowhere to print
        sys.stdout.write(describe().as_text())
        from normexp.engines.auto import auto_summary

        sys.stdout.write(f"engine auto: {auto_summary()}\n")
        from normexp.engines.fast import MklPathError, workers_summary

        try:
            workers = workers_summary()
        except MklPathError as exc:
            workers = str(exc)
        sys.stdout.write(f"fast workers' MKL path: {workers}\n")


