"""What every command shares: the two consoles, `fail`, `show`, and the checks of the options that
several commands take.

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

import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand

from normexp.config import DEFAULT_MAX_RUNS, ConfigError, Sweep, TooManyRuns, load_sweep

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


def config_file(config: Path) -> Path:
    """The sweep file CONFIG names: the path itself, or where no such file is, the one shipped with
    normexp of that name (`normexp sweep warmup`: normexp/configs/warmup.yaml), said on stderr."""
    if config.exists() or len(config.parts) != 1:
        return config
    from normexp.config import packaged_config

    shipped = packaged_config(config.name)
    if shipped is None:
        return config
    err.print(f"{config}: no such file here; using the config shipped with normexp, {shipped}")
    return shipped


def load(config: Path, overrides: list[str], max_runs: int | None = None) -> Sweep:
    """Load a sweep; `max_runs` is given by the commands that have a --max-runs option."""
    try:
        return load_sweep(config, overrides, max_runs or DEFAULT_MAX_RUNS)
    except TooManyRuns as exc:
        raise fail(str(TooManyRuns(exc.total, exc.limit, "--max-runs", exc.distinct) if max_runs else exc)) from None
    except ConfigError as exc:
        raise fail(str(exc)) from None


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


def emit(fmt: str, table: Callable[[], object], markdown: Callable[[], str],
         csv: Callable[[], str] | None = None) -> None:
    """Print one result in the chosen --format: a Rich renderable, or markdown / CSV text."""
    if fmt == "table":
        show(table())
    else:
        sys.stdout.write(markdown() if fmt == "markdown" or csv is None else csv())


def check_choice(option: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise fail(f"{option}: must be one of {', '.join(choices)}, got {value!r}")


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def out_folder(value: str | None, name: str) -> Path:
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


def folder_argument(value: str) -> Path:
    """A folder argument; an empty one would mean the current folder, so it is refused."""
    if not value.strip():
        raise typer.BadParameter("empty; name a sweep's output folder")
    return Path(value)


def listed(option: str, value: str | None) -> list[str] | None:
    """A comma-separated option's items; given but empty is refused (it would silently mean the default)."""
    if value is None:
        return None
    items = [item.strip() for item in value.split(",")]
    if not all(items):
        raise fail(f"{option} {value!r}: empty item; give comma-separated values, or leave {option} out")
    return items


def check_trained_below(value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise fail(f"--trained-below {value}: must be a finite loss > 0")
HELP_TERM_WIDTH = 30  # click's own limit: a longer option's help starts on the next line


USAGE_ERROR = typer.BadParameter.__mro__[1]  # click's UsageError, from the click that Typer carries
HYDRA_ARGUMENT = re.compile(r"\+{0,2}[A-Za-z_][\w.]*=.*")  # optim.lr=0.1, Hydra's +key=value too


class OverridingCommand(TyperCommand):
    """A command with a --set option: a Hydra-style `key=value` argument, which click refuses as an
    extra argument, is answered with the `--set key=value` it meant (exit 2, as click's own refusal)."""

    def parse_args(self, ctx, args):
        given = list(args)  # the parser consumes `args`
        try:
            return super().parse_args(ctx, args)
        except USAGE_ERROR:
            meant = [arg for before, arg in zip(["", *given], given)
                     if HYDRA_ARGUMENT.fullmatch(arg) and before != "--set"]
            if not meant:
                raise
        sets = " ".join(f"--set {arg.lstrip('+')}" for arg in meant)
        ctx.fail(f"unexpected argument {meant[0]!r}: settings are given with --set (did you mean `{sets}`?)")


class SectionedCommand(OverridingCommand):
    """A command whose --help lists its options in sections, one per `rich_help_panel` (Typer's way to
    group options, which Typer itself draws only in its Rich help: normexp's help is plain text, whole
    in a log or a pipe). The options without one come first, under "Options"; every section's help
    starts in the same column."""

    def format_options(self, ctx, formatter) -> None:
        from click.formatting import term_len

        arguments, sections = [], {"Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                arguments.append(record)
            else:
                sections.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        if arguments:
            with formatter.section("Arguments"):
                formatter.write_dl(arguments)
        width = min(max(term_len(term) for rows in sections.values() for term, _ in rows), HELP_TERM_WIDTH)
        for title, rows in sections.items():
            with formatter.section(title):
                formatter.write_dl([(term.ljust(width), text) for term, text in rows], col_max=HELP_TERM_WIDTH)
