"""End to end through the command line: Typer's CliRunner, and real processes where it matters."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from article_toy import train_losses
from conftest import REPO, SMALL_SWEEP, TINY
from test_config import BAD_FILES, BAD_SETS, GOOD
from typer.testing import CliRunner

from normexp.cli import app
from normexp.engines import reference
from normexp.results import load_metrics, load_summary

runner = CliRunner()


def normexp(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_sweep_writes_the_run_directory_contract(write_yaml, tmp_path):
    out = tmp_path / "out"
    result = normexp("sweep", write_yaml(SMALL_SWEEP), "--out", out)
    assert result.exit_code == 0, result.output
    assert (out / "sweep.yaml").is_file() and (out / "summary.csv").is_file()
    summary = load_summary(out)
    assert len(summary) == 8 and set(summary["status"]) == {"completed"}
    for rid in summary["run_id"]:
        assert {p.name for p in (out / rid).iterdir()} == {"config.yaml", "metrics.csv", "done.json"}
        assert json.loads((out / rid / "done.json").read_text())["threads"] >= 1
    metrics = pd.read_csv(out / summary["run_id"][0] / "metrics.csv")
    assert list(metrics.columns) == ["step", "loss", "acc", "lr", "grad_norm"]
    assert list(metrics["step"]) == [0, 1, 2, 3, 4, 5]
    assert "Post-LN" in result.output and "Pre-RMS" in result.output and "±" in result.output


def test_metrics_read_back_bit_exact(write_yaml, tmp_path):
    out = tmp_path / "out"
    assert normexp("sweep", write_yaml(SMALL_SWEEP), "--out", out, "-q").exit_code == 0
    tidy = load_metrics(out)
    run = tidy[(tidy["norm.placement"] == "pre") & (tidy["norm.kind"] == "layernorm") & (tidy["seed"] == 1)]
    assert list(run["loss"]) == train_losses("Pre", "LN", 4, 8, 5, 0.01, seed=1)


def test_hidden_style_check_other_configs_through_sweep(write_yaml, tmp_path):
    """Other depths, widths, lrs, steps and seeds through `normexp sweep`: identical to the article's code."""
    path = write_yaml("name: other\nbase: {model: {depth: 6, width: 16}, train: {steps: 7}}\n"
                      "grid: {norm.placement: [post, pre], norm.kind: [layernorm, rmsnorm], optim.lr: [0.02, 0.003]}\n"
                      "seeds: [3, 11]\n")
    out = tmp_path / "out"
    assert normexp("sweep", path, "--out", out, "-q").exit_code == 0
    tidy = load_metrics(out)
    for (placement, kind, lr, seed), run in tidy.groupby(["norm.placement", "norm.kind", "optim.lr", "seed"]):
        expected = train_losses(placement.capitalize(), "LN" if kind == "layernorm" else "RMS", 6, 16, 7, lr,
                                seed=seed)
        assert list(run.sort_values("step")["loss"]) == expected


def test_rerun_skips_finished_runs_and_force_redoes(write_yaml, tmp_path):
    path, out = write_yaml(SMALL_SWEEP), tmp_path / "out"
    normexp("sweep", path, "--out", out, "-q")
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/done.json")}
    result = normexp("sweep", path, "--out", out)
    assert result.exit_code == 0 and "0 ran, 8 already done" in result.output
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/done.json")} == stamps
    result = normexp("sweep", path, "--out", out, "--force")
    assert "8 ran, 0 already done" in result.output


def test_changed_config_never_reuses_results(write_yaml, tmp_path):
    path, out = write_yaml(SMALL_SWEEP), tmp_path / "out"
    normexp("sweep", path, "--out", out, "-q")
    result = normexp("sweep", path, "--out", out, "--set", "optim.lr=0.02")
    assert "8 ran, 0 already done" in result.output
    assert set(load_summary(out, only_last=True)["optim.lr"]) == {0.02}
    assert set(load_summary(out)["optim.lr"]) == {0.01, 0.02}  # the folder keeps the first grid's runs


def _verified_ids(out) -> set[str]:
    summary = load_summary(out)
    return set(summary[summary["status"].isin(("completed", "diverged"))]["run_id"])


def test_a_folder_accumulates_every_invocations_runs_and_reports_them_all(write_yaml, tmp_path, monkeypatch):
    """The README's first examples run into one folder: another depth, more seeds, a narrower grid.
    No verified run ever disappears from report, plot's data, verify or summary.csv; the axes that
    vary across invocations become columns; the history names each invocation."""
    path, out = write_yaml(SMALL_SWEEP), tmp_path / "out"
    normexp("sweep", path, "--out", out, "-q")
    first = _verified_ids(out)
    deeper_args = ["sweep", str(path), "--out", str(out), "--set", "model.depth=3", "--set", "seeds=0,1,2"]
    monkeypatch.setattr(sys, "argv", ["normexp", *deeper_args])  # what the history records
    deeper = normexp(*deeper_args)
    monkeypatch.undo()
    assert deeper.exit_code == 0, deeper.output
    assert f"now holds {len(first) + 12} runs from 2 invocations" in " ".join(deeper.output.split())
    narrower = normexp("sweep", path, "--out", out, "--set", "norm.placement=pre", "-q")
    assert narrower.exit_code == 0, narrower.output
    held = _verified_ids(out)
    assert first < held and len(held) == len(first) + 12
    report = normexp("report", out, "--format", "csv")
    assert report.exit_code == 0, report.output
    assert "depth=3" in normexp("report", out, "--format", "markdown").output  # the new axis is a column
    assert set(pd.read_csv(io.StringIO(summary_text := (out / "summary.csv").read_text()))["run_id"]) == held, \
        summary_text
    verified = normexp("verify", out)
    said = " ".join(verified.output.split())
    assert verified.exit_code == 0 and f"{len(held)} of {len(held)} runs verified" in said, said
    assert normexp("verify", out, "--fix").exit_code == 0 and _verified_ids(out) == held
    assert set(load_summary(out, only_last=True)["norm.placement"]) == {"pre"}
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [h["runs_to_train"] for h in history] == [8, 12, 0]
    assert all(h["sweep_file"] == path.read_text() for h in history)
    assert "--set model.depth=3" in history[1]["command"] and history[1]["grid"]["model.depth"] == [3]


def test_a_sweep_file_s_notes_and_tags_reach_sweep_yaml_and_the_report(write_yaml, tmp_path):
    text = SMALL_SWEEP + "notes: the first try, before warmup\ntags: [baseline, cpu]\n"
    out = tmp_path / "out"
    assert normexp("sweep", write_yaml(text), "--out", out, "-q").exit_code == 0
    resolved = yaml.safe_load((out / "sweep.yaml").read_text())
    assert resolved["notes"] == "the first try, before warmup" and resolved["tags"] == ["baseline", "cpu"]
    shown = normexp("report", out, "--format", "markdown").output
    assert "tags: baseline, cpu" in shown and "the first try, before warmup" in shown
    summary = load_summary(out)
    assert not any(column.startswith(("notes", "tags")) for column in summary.columns)  # no run's config


def test_the_default_folder_is_named_before_the_sweep_writes_to_it(write_yaml, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = normexp("sweep", write_yaml(SMALL_SWEEP))
    assert result.exit_code == 0 and result.output.startswith(f"writing to {Path('runs') / 'small'}"), result.output


def test_dry_run_prints_the_grid_and_writes_nothing(write_yaml, tmp_path):
    out = tmp_path / "out"
    result = normexp("sweep", write_yaml(SMALL_SWEEP), "--out", out, "--dry-run", "--set", "optim.lr=0.1,0.2")
    assert result.exit_code == 0
    assert "16 runs" in result.output and "optim.lr" in result.output and "norm.kind" in result.output
    assert not out.exists()


def test_dry_run_lists_a_list_valued_axis(write_yaml, tmp_path, monkeypatch):
    """optim.betas takes lists: the summary of a large grid keys each axis's values by their text."""
    from normexp.commands import sweep

    sweep_yaml = write_yaml("name: betas\nbase: {train: {steps: 2}}\n"
                            "grid: {optim.betas: [[0.9, 0.95], [0.9, 0.999]], model.width: [16, 32]}\n")
    for table_runs in (200, 2):  # the table of every run, and the per-axis summary of a larger grid
        monkeypatch.setattr(sweep, "DRY_RUN_TABLE_RUNS", table_runs)
        result = normexp("sweep", sweep_yaml, "--out", tmp_path / "out", "--dry-run")
        assert result.exit_code == 0, result.output
        assert "[0.9, 0.95]" in result.output and "[0.9, 0.999]" in result.output
    assert "optim.betas: 2 values" in result.output
    assert not (tmp_path / "out").exists()


def test_report_from_disk_in_three_formats(write_yaml, tmp_path):
    out = tmp_path / "out"
    normexp("sweep", write_yaml(SMALL_SWEEP), "--out", out, "-q")
    table = normexp("report", out)
    assert table.exit_code == 0 and "Post-LN" in table.output
    markdown = normexp("report", out, "--format", "markdown", "--steps", "0,5")
    lines = markdown.output.splitlines()
    assert "| step | Post-LN | Post-RMS | Pre-LN | Pre-RMS |" in lines
    assert sum(line.startswith("| 0 |") or line.startswith("| 5 |") for line in lines) == 2
    csv_out = normexp("report", out, "--format", "csv")
    assert csv_out.output.splitlines()[0] == ("norm.placement,norm.kind,variant,step,loss_mean,loss_std,n,runs,trained,"
                                              "diverged,verdict,threshold,pooled_over")


def test_validate(write_yaml):
    assert "ok" in normexp("validate", write_yaml(SMALL_SWEEP)).output
    result = normexp("validate", write_yaml("name: t\nbase: {optim: {lr: -1}}\n"))
    assert result.exit_code == 2 and "base.optim.lr: must be > 0" in result.output


def test_bad_config_exit_2_no_traceback_nothing_written(write_yaml, tmp_path):
    out = tmp_path / "out"
    result = normexp("sweep", write_yaml("name: t\nbase: {optim: {lrr: 0.1}}\n"), "--out", out)
    assert result.exit_code == 2
    assert "base.optim.lrr: unknown key (did you mean 'lr'?)" in result.output
    assert "Traceback" not in result.output and not out.exists()


def test_bad_options_exit_2(write_yaml, tmp_path):
    path = write_yaml(SMALL_SWEEP)
    assert normexp("sweep", path, "--engine", "turbo").exit_code == 2
    assert normexp("sweep", path, "--set", "optim.lr").exit_code == 2
    assert normexp("report", tmp_path).exit_code == 2
    assert normexp("sweep", tmp_path / "missing.yaml").exit_code == 2


@pytest.mark.process
def test_python_dash_m_and_help_are_instant():
    """`python -m normexp --help` works and never imports torch or pandas."""
    code = ("import sys, runpy; sys.argv = ['normexp', '--help']\n"
            "try:\n    runpy.run_module('normexp', run_name='__main__')\nexcept SystemExit: pass\n"
            "assert 'torch' not in sys.modules and 'pandas' not in sys.modules, 'heavy import'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "sweep" in result.stdout and "report" in result.stdout


@pytest.mark.process
def test_python_dash_m_runs_the_sweep(write_yaml, tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "normexp", "sweep", str(write_yaml(SMALL_SWEEP)),
                             "--out", str(out), "--set", "norm.kind=rmsnorm"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "[1/4]" in result.stdout  # plain progress lines when not a terminal
    assert len(list(Path(out).glob("*/done.json"))) == 4


def test_every_bad_file_exits_2_naming_the_key_and_writes_nothing(tmp_path):
    for case, (text, expected) in BAD_FILES.items():
        config, out = tmp_path / f"{len(case)}.yaml", tmp_path / "out"
        config.write_text(text)
        result = normexp("sweep", config, "--out", out)
        assert result.exit_code == 2, case
        assert expected in result.output and "Traceback" not in result.output, case
        assert not out.exists(), case


def test_every_bad_set_exits_2_naming_the_key_and_writes_nothing(write_yaml, tmp_path):
    config, out = write_yaml(GOOD), tmp_path / "out"
    for case, (option, expected) in BAD_SETS.items():
        result = normexp("sweep", config, "--out", out, "--set", option)
        assert result.exit_code == 2 and expected in result.output and not out.exists(), case


def test_max_runs_option(write_yaml, tmp_path):
    result = normexp("sweep", write_yaml(SMALL_SWEEP), "--out", tmp_path / "o", "--max-runs", "4")
    assert result.exit_code == 2 and "expands to 8 runs, more than --max-runs 4" in result.output


def test_out_that_is_a_file(write_yaml, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = normexp("sweep", write_yaml(SMALL_SWEEP), "--out", blocker / "sub")
    assert result.exit_code == 2 and "cannot use as the output folder" in result.output


def test_progress_bar_on_a_terminal_and_plain_lines_elsewhere():
    import io

    from rich.console import Console

    from normexp.progress import sweep_progress
    from normexp.sweep import SweepEvent

    events = [SweepEvent("skipped", "a", 1, 3), SweepEvent("finished", "b", 2, 3, "completed", 0.5),
              SweepEvent("failed", "c", 3, 3, "failed", error="RuntimeError: boom")]
    terminal = Console(file=io.StringIO(), force_terminal=True, width=100)
    with sweep_progress(terminal, 3, quiet=False) as on_event:
        for event in events:
            on_event(event)
    shown = terminal.file.getvalue()
    assert "runs" in shown and "3/3" in shown and "RuntimeError: boom" in shown
    plain = Console(file=io.StringIO(), force_terminal=False, width=100)
    with sweep_progress(plain, 3, quiet=False) as on_event:
        for event in events:
            on_event(event)
    assert plain.file.getvalue().splitlines() == [
        "[2/3] b completed final loss 0.5000", "[3/3] c failed: RuntimeError: boom"]
    quiet = Console(file=io.StringIO(), force_terminal=True, width=100, highlight=False)
    with sweep_progress(quiet, 3, quiet=True) as on_event:
        for event in events:
            on_event(event)
    assert quiet.file.getvalue().splitlines() == ["[3/3] c failed: RuntimeError: boom"]  # errors only


def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the error path cannot be reached")
    result = normexp("sweep", REPO / "configs" / "warmup.yaml", "--device", "cuda", "--out", tmp_path / "o")
    assert result.exit_code == 2 and "no CUDA device" in result.output and not (tmp_path / "o").exists()


def test_a_report_over_invocations_of_the_fast_and_an_exact_engine_says_so(write_yaml, tmp_path):
    """The exact engines give the same bits (`--engine auto` trains one sweep on both): no mix; the fast
    engine's runs beside theirs are."""
    path, out = write_yaml(SMALL_SWEEP), tmp_path / "out"
    assert normexp("sweep", path, "--out", out, "--engine", "batched", "-q").exit_code == 0
    assert normexp("sweep", path, "--out", out, "--engine", "reference", "--set", "optim.lr=0.02", "-q").exit_code == 0
    assert "mixed engine" not in normexp("report", out, "--format", "markdown").output
    assert normexp("sweep", path, "--out", out, "--engine", "fast", "--set", "optim.lr=0.03", "-q").exit_code == 0
    assert "mixed engine: batched, fast, reference" in normexp("report", out, "--format", "markdown").output
    assert "mixed engine" not in normexp("report", out, "--only-last", "--format", "markdown").output



def _help_sections(text: str) -> tuple[dict[str, list[str]], set[int]]:
    """A plain --help's sections (a line `Title:` at column 0) with the options each lists, and the
    columns where the help of an option starts on its own line."""
    sections, columns, current = {}, set(), None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            current = sections.setdefault(line[:-1], [])
        elif current is not None and line.startswith("  -"):
            term, *rest = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            current.extend(word.rstrip(",") for word in term.split() if word.startswith("--"))
            if rest:
                columns.add(len(line) - len(rest[0]))
    return sections, columns


@pytest.mark.process
@pytest.mark.parametrize("columns", ["100", "120"])
def test_sweep_help_reads_in_sections(columns):
    """`normexp sweep --help`, piped: its 25 options in four sections, the job array's 11 (Slurm's) in their
    own; every option once, every section's help in one column; the other commands keep one list."""
    env = {"COLUMNS": columns}
    sections, starts = _help_sections(runner.invoke(app, ["sweep", "--help"], env=env).stdout)
    array = ["--launcher", "--shards", "--partition", "--account", "--qos", "--time", "--cpus", "--mem",
             "--array-parallelism", "--setup", "--logs"]
    assert list(sections) == ["Arguments", "Options", "Engine", "Where it runs", "Job array (--launcher slurm | local)"]
    assert sections["Engine"] == ["--engine", "--compile", "--no-compile", "--device"]
    assert sections["Where it runs"] == ["--workers", "--cluster", "--shard"]
    assert sections["Job array (--launcher slurm | local)"] == array
    every = [option for options in sections.values() for option in options]
    assert len(every) == len(set(every)) == 25 + 1  # --compile / --no-compile: one option, two flags
    assert len(starts) == 1, starts
    assert list(_help_sections(runner.invoke(app, ["report", "--help"], env=env).stdout)[0]) == ["Arguments", "Options"]


# ----------------------------------------------------------------------------- a sweep's output, a run's own config


def test_quiet_still_prints_failed_runs(write_yaml, tmp_path, monkeypatch):
    real = reference.train_run

    def train_run(cfg, **kwargs):
        if cfg.seed == 1:
            raise RuntimeError("boom")
        return real(cfg, **kwargs)

    monkeypatch.setattr(reference, "train_run", train_run)
    config = write_yaml(TINY + "seeds: [0, 1]\n")
    result = runner.invoke(app, ["sweep", str(config), "--out", str(tmp_path / "out"), "-q", "--engine", "reference"])
    assert result.exit_code == 1
    assert "failed: RuntimeError: boom" in result.output and "1 run failed" in result.output
    assert "completed" not in result.output  # quiet otherwise


def test_one_run_is_not_1_runs(write_yaml):
    result = runner.invoke(app, ["validate", str(write_yaml(TINY))])
    assert result.exit_code == 0 and "· 1 run\n" in result.output


def test_a_run_folders_config_reruns_that_run_alone(finished, tmp_path):
    _, out = finished
    run = sorted(p for p in out.iterdir() if (p / "done.json").exists())[1]
    again = tmp_path / "again"
    result = runner.invoke(app, ["sweep", str(run / "config.yaml"), "--out", str(again), "-q"])
    assert result.exit_code == 0, result.output
    assert [p.name for p in again.glob("*/done.json")] == ["done.json"]
    assert (again / run.name / "metrics.csv").read_text() == (run / "metrics.csv").read_text()
