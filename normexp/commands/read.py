"""The commands that read a sweep's folder: `report`, `plot`, `verify`, `export`, and `merge`, which
copies the verified runs of several folders into one."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, get_args

import typer

from normexp.commands.console import (
    Exit,
    check_choice,
    check_trained_below,
    emit,
    err,
    fail,
    folder_argument,
    listed,
    out,
    plural,
    show,
)
from normexp.config import METRICS, ConfigError, Metric

if TYPE_CHECKING:
    from normexp.report import Report
    from normexp.results import Folder


def report(
    run_dirs: Annotated[list[Path], typer.Argument(
        metavar="RUN_DIR...", help="A sweep's output folder; several: compared side by side (a `sweep` key).",
        parser=folder_argument)],
    steps: Annotated[str | None, typer.Option(help="Comma-separated steps [default: the sweep's].")] = None,
    metric: Annotated[str | None, typer.Option(help=f"{' | '.join(METRICS)} [default: the sweep's].")] = None,
    by: Annotated[str | None, typer.Option(help="Comma-separated column keys [default: varying keys].")] = None,
    pivot: Annotated[str | None, typer.Option(help="ROW_KEY,COL_KEY: a final-loss pivot instead.")] = None,
    lr_sensitivity: Annotated[bool, typer.Option(
        "--lr-sensitivity", help="Per variant: LR sensitivity over an optim.lr axis of >= 3 values instead.")] = False,
    anova: Annotated[bool, typer.Option(
        "--anova", help="What mattered: an ANOVA of the final metric on the grid's axes, seeds as "
                        "replicates.")] = False,
    fmt: Annotated[str, typer.Option(
        "--format", help="table | markdown | csv | html (one self-contained interactive page, written to "
                         "DIR/report.html unless -o names another file).")] = "table",
    output: Annotated[Path | None, typer.Option(
        "-o", "--output", help="Write markdown, csv or html to this file [default: print it; html: "
                               "DIR/report.html].")] = None,
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
    from normexp.report import build_report, fit_report, to_csv, to_markdown, to_rich
    from normexp.results import ResultsError

    if metric is not None:
        check_choice("--metric", metric, get_args(Metric))
    check_choice("--format", fmt, ("table", "markdown", "csv", "html"))
    check_choice("--verdicts", verdicts, ("counts", "full"))
    if output is not None and fmt == "table":
        raise fail("-o: write markdown, csv or html (--format); a table is for the terminal")
    if fmt == "html" and (pivot is not None or lr_sensitivity):
        raise fail("--format html: the step table's page; --pivot and --lr-sensitivity print markdown or csv")
    check_trained_below(trained_below)
    if pivot is not None and lr_sensitivity:
        raise fail("--pivot and --lr-sensitivity: choose one")
    if anova:
        given = [option for option, on in (("--pivot", pivot is not None), ("--lr-sensitivity", lr_sensitivity),
                                           ("--steps", steps is not None), ("--by", by is not None),
                                           ("--format html", fmt == "html")) if on]
        if given:  # the page holds the ANOVA already; the others are other tables
            raise fail(f"--anova and {given[0]}: --anova prints its own table (the html page already holds it)")
        folder = _load_folder(run_dirs)
        _print_anova(folder, metric, only_last, trained_below, fmt, output)
        _exit_if_runs_missing(folder, shown=False)
        return
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
    step_items, keys = listed("--steps", steps), listed("--by", by)
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
        _write_report(table, folder, fmt, output, full, only_last)
    else:
        if fmt == "table" and step_list is None and out.is_terminal:  # off a terminal nothing is ever cut
            table = fit_report(table, out.width)
        emit(fmt, lambda: to_rich(table, full), lambda: to_markdown(table, full), lambda: to_csv(table))
    _say_engines(table.engines, fmt)
    _exit_if_runs_missing(folder, shown=fmt in ("table", "markdown") and output is None)


def _write_report(table: Report, folder: Folder, fmt: str, output: Path | None, full: bool,
                  only_last: bool) -> None:
    """The report as a file: -o, or for --format html DIR/report.html (a comparison's page in the current
    folder); an HTML page is never printed to the terminal."""
    from normexp.report import to_csv, to_markdown

    if fmt == "html":
        from normexp.page import page_path, report_page
        from normexp.results import ResultsError

        try:
            text = report_page(table, folder, only_last=only_last)
        except ResultsError as exc:
            raise fail(str(exc)) from None
        output = output if output is not None else page_path(folder)
    else:
        text = to_markdown(table, full) if fmt == "markdown" else to_csv(table)
    if output is None:
        sys.stdout.write(text)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise fail(f"cannot write {output}: {exc.strerror}") from None
    if fmt == "html":
        out.print(f"wrote {output}")


def _print_anova(folder: Folder, metric: str | None, only_last: bool, trained_below: float | None, fmt: str,
                 output: Path | None) -> None:
    """`report --anova`: what mattered, as a table, markdown or CSV (the CSV exactly the ANOVA's columns;
    what it cannot estimate said on stderr)."""
    from normexp.analysis.anova import what_mattered
    from normexp.results import ResultsError
    from normexp.tables import anova_to_csv, anova_to_markdown, anova_to_rich

    try:
        result = what_mattered(folder, metric, only_last, trained_below)
    except ResultsError as exc:
        raise fail(str(exc)) from None
    if fmt == "html":
        raise fail("--anova and --format html: the html page already holds the ANOVA")
    if output is not None:
        text = anova_to_markdown(result) if fmt == "markdown" else anova_to_csv(result)
        try:
            output.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise fail(f"cannot write {output}: {exc.strerror}") from None
    else:
        emit(fmt, lambda: anova_to_rich(result), lambda: anova_to_markdown(result), lambda: anova_to_csv(result))
    if fmt == "csv":
        for note in result.notes:
            err.print(note, soft_wrap=True)


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
    emit(fmt, lambda: pivot_to_rich(table), lambda: pivot_to_markdown(table), lambda: pivot_to_csv(table))
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
    emit(fmt, lambda: sensitivity_to_rich(rows, engines), lambda: sensitivity_to_markdown(rows, engines),
          lambda: sensitivity_to_csv(rows))
    _say_engines(engines, fmt)


def plot(
    run_dirs: Annotated[list[Path], typer.Argument(
        metavar="RUN_DIR...", help="A sweep's output folder; several: compared side by side (a `sweep` key).",
        parser=folder_argument)],
    output: Annotated[Path | None, typer.Option(
        "-o", "--output", help="Figure file, .png | .pdf | .svg [default: RUN_DIR/<metric>.<format>; several "
                               "RUN_DIRs: ./compare-<metric>.<format>].")] = None,
    metric: Annotated[str | None, typer.Option(help=f"{' | '.join(METRICS)} [default: the sweep's].")] = None,
    blocks: Annotated[bool, typer.Option("--blocks", help="Per-block dynamics of runs with train.log_blocks.")] = False,
    sharpness: Annotated[bool, typer.Option(
        "--sharpness", help="Only the sharpness figure of runs with train.log_sharpness (drawn with the others "
                            "by default where runs measured it).")] = False,
    block_metric: Annotated[str | None, typer.Option(
        help="With --blocks: fc1_grad | fc2_grad | fc1_update | fc2_update | stream_rms | norm_rms | norm_out_rms; "
             "a Transformer's also attn_logit_max | attn_entropy | log_z [default: fc2_update].")] = None,
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
    middle and last block over steps. With --sharpness (and after the others where runs measured it):
    per variant, lambda_max and Adam's preconditioned one against their thresholds."""
    from normexp.figures import BLOCK_METRIC_LABELS, save_blocks_plot, save_plots, save_sharpness_plot
    from normexp.results import ResultsError

    if metric is not None:
        check_choice("--metric", metric, get_args(Metric))
    if fmt is not None:
        check_choice("--format", fmt, FIGURE_FORMATS)
    check_trained_below(trained_below)
    if block_metric is not None:
        if not blocks:
            raise fail("--block-metric: only with --blocks")
        check_choice("--block-metric", block_metric, tuple(BLOCK_METRIC_LABELS))
    if output is not None and output.suffix.lower().lstrip(".") not in FIGURE_FORMATS:
        raise fail(f"-o {output}: the file name must end in .png, .pdf or .svg")
    if output is not None and fmt is not None and output.suffix.lower() != f".{fmt}":
        raise fail(f"-o {output} and --format {fmt}: the file name must end in .{fmt}")
    if blocks and sharpness:
        raise fail("--blocks and --sharpness: one at a time")
    if (blocks or sharpness) and (row or col or hue):
        raise fail(f"--row, --col, --hue: not with --{'blocks' if blocks else 'sharpness'} (its panels are fixed)")
    facets = {name: listed(f"--{name}", value) for name, value in (("row", row), ("col", col), ("hue", hue))}
    folder = _load_folder(run_dirs)
    if output is None and len(run_dirs) > 1:  # a comparison belongs to no one folder: into the current one
        name = f"blocks-{block_metric or 'fc2_update'}" if blocks else "sharpness" if sharpness else \
            metric or folder.sweep.report.metric
        output = Path(f"compare-{name}.{'png' if blocks else fmt or 'png'}")
    try:
        if blocks:
            if output is None and fmt is not None:
                output = folder.path / f"blocks-{block_metric or 'fc2_update'}.{fmt}"
            paths = [save_blocks_plot(folder, output, block_metric or "fc2_update")]
        elif sharpness:
            paths = [save_sharpness_plot(folder, output or folder.path / f"sharpness.{fmt or 'png'}")]
        else:
            paths = save_plots(folder, output, metric, fmt, dpi, trained_below=trained_below, **facets)
            if output is None and folder.has_sharpness():
                paths.append(save_sharpness_plot(folder, folder.path / f"sharpness.{fmt or 'png'}"))
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
    from normexp.folder import HISTORY_DAMAGE_EFFECT, HISTORY_FILE, history_damage
    from normexp.results import missing_note

    damage = False
    for _, one in getattr(folder, "folders", None) or [("", folder)]:  # each folder of a comparison
        lines = history_damage(one.path)
        if lines:  # an invocation it lost: its unfinished runs would be missing, uncounted
            err.print(f"{one.path / HISTORY_FILE}: damaged ({'; '.join(lines)}): {HISTORY_DAMAGE_EFFECT}",
                      soft_wrap=True)
            damage = True
    note = missing_note(folder.summary, folder.path)
    if damage and not note:
        raise typer.Exit(Exit.FAILED)
    if note:
        if not shown:
            err.print(note, soft_wrap=True)
        raise typer.Exit(Exit.FAILED)


def verify(
    run_dir: Annotated[Path, typer.Argument(metavar="DIR", help="A sweep's output folder.", parser=folder_argument)],
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


def export(
    run_dir: Annotated[Path, typer.Argument(metavar="DIR", help="A sweep's output folder.", parser=folder_argument)],
    dest: Annotated[str, typer.Argument(metavar="DEST", help="tensorboard: a log folder; mlflow: a tracking URI "
                                                               "(sqlite:///mlflow.db); wandb: a folder for offline "
                                                               "runs; parquet: a folder for the tables.")],
    to: Annotated[str, typer.Option("--to", help="tensorboard | mlflow | wandb | parquet.")] = "tensorboard",
    experiment: Annotated[str | None, typer.Option(help="--to mlflow: the experiment [default: the sweep's "
                                                          "name].")] = None,
    run_name: Annotated[str | None, typer.Option("--run-name", help="Name runs by a template of config keys, "
                                                 "e.g. '{norm.placement}-d{model.depth}-s{seed}' [default: the "
                                                 "keys that vary].")] = None,
    block_scalars: Annotated[bool, typer.Option("--block-scalars", help="--to tensorboard: also one scalar chart "
                                                "per block and column of blocks.csv (histograms over blocks "
                                                "always).")] = False,
) -> None:
    """Export a sweep's verified runs to TensorBoard (scalars per step, HParams), MLflow (one run per run),
    W&B offline runs (for `wandb sync`) or Parquet tables (runs.parquet, steps.parquet)."""
    from normexp.export import TARGETS
    from normexp.export.mlflow import to_mlflow
    from normexp.export.parquet import RUNS_FILE, STEPS_FILE, to_parquet
    from normexp.export.tensorboard import to_tensorboard
    from normexp.export.wandb import to_wandb
    from normexp.folder import StoreError

    check_choice("--to", to, TARGETS)
    if not dest.strip():  # an empty DEST would mean the current folder (or MLflow's ./mlruns)
        raise fail("DEST: empty; name a folder (--to tensorboard, wandb, parquet) or a tracking URI (--to mlflow)")
    if experiment is not None and to != "mlflow":
        raise fail("--experiment: only --to mlflow has experiments (a TensorBoard log folder is DEST)")
    if block_scalars and to != "tensorboard":
        raise fail(f"--block-scalars: only --to tensorboard draws blocks.csv as histograms, not --to {to}")
    try:
        if to == "tensorboard":
            done = to_tensorboard(run_dir, Path(dest), run_name=run_name, block_scalars=block_scalars)
            out.print(f"{plural(len(done.exported), 'run')} exported to {dest} · tensorboard --logdir "
                      f"{shlex.quote(dest)}", soft_wrap=True)
        elif to == "mlflow":
            done = to_mlflow(run_dir, dest, experiment, run_name)
            out.print(f"{plural(len(done.exported), 'run')} exported to {dest}, {done.kept} already there · "
                      f"{done.viewer(dest)}", soft_wrap=True)
        elif to == "wandb":
            done = to_wandb(run_dir, Path(dest), run_name)
            out.print(f"{plural(len(done.exported), 'run')} exported to {dest}, {done.kept} already there · "
                      f"wandb sync {shlex.quote(str(Path(dest) / 'wandb'))}", soft_wrap=True)
        else:
            done = to_parquet(run_dir, Path(dest), run_name)
            out.print(f"{plural(len(done.exported), 'run')} exported to {Path(dest) / RUNS_FILE} and {STEPS_FILE}",
                      soft_wrap=True)
    except (ConfigError, StoreError) as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"{dest}: cannot write {exc.filename}: {exc.strerror}") from None
    for line in done.notes(run_dir):
        out.print(line, soft_wrap=True)
    if done.left:  # as report does: what exists went out; the runs that did not are named, exit 1
        err.print(f"{plural(len(done.left), 'run')} of the sweep not exported: missing, failed or corrupt "
                  f"(normexp verify {shlex.quote(str(run_dir))})", soft_wrap=True)
        raise typer.Exit(Exit.FAILED)


def merge(
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="The folder to merge into (made if missing).",
                                            parser=folder_argument)],
    sources: Annotated[list[Path], typer.Argument(metavar="DIR...", help="Sweep folders (shards) to merge.",
                                                  parser=folder_argument)],
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
    out.print(f"{plural(len(outcome.copied), 'run')} copied, {outcome.kept} already there, "
              f"{outcome.unfinished} unfinished in the folders (not copied) · {out_dir}")
    show(verification_to_rich(outcome.verification))
    if not outcome.verification.clean:
        raise typer.Exit(Exit.FAILED)


