"""Tables as a user reads them: a number short and whole, a markdown cell that reads back whole (its `|`,
backslashes and line breaks escaped), every table of every command whole through a pipe (a Slurm log,
`| cat`), and a cell on a narrow terminal folded onto more lines, never cut to "…"."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import build_sweep
from normexp.folder import run_id
from normexp.results import load_metrics
from normexp.tables import number

runner = CliRunner()


# ----------------------------------------------------------------------------- numbers


@given(st.floats(-1e300, 1e300))
def test_a_table_number_stays_short_and_keeps_its_value(value):
    text = number(value)
    assert len(text) <= 12
    assert math.isclose(float(text), value, rel_tol=1e-4, abs_tol=1e-4)


def test_a_diverging_loss_is_shown_whole(write_yaml, tmp_path):
    config = write_yaml("name: d\nbase: {model: {depth: 2, width: 8}, norm: {placement: none}, "
                        "optim: {name: sgd}, train: {steps: 8, stop_on_nonfinite: false}}\n"
                        "grid: {optim.lr: [10.0, 10.5, 11.0, 11.5, 12.0]}\nreport: {steps: [0, 5, 8]}\n")
    out = tmp_path / "out"
    result = runner.invoke(app, ["sweep", str(config), "--out", str(out), "--engine", "reference"])
    assert result.exit_code == 0
    assert max(abs(v) for v in load_metrics(out)["loss"] if math.isfinite(v)) >= 1e6, "no large loss to show"
    assert "…" not in result.output


# ----------------------------------------------------------------------------- markdown cells


def _rendered_rows(lines: list[str]) -> list[list[str]]:
    """The rows of a markdown table as a GFM renderer reads them (markdown-it-py, rich's own markdown
    parser, with tables on): each cell's text, escapes undone, `<br>` read as a line break."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").enable("table").parse("\n".join(lines) + "\n")
    rows, row = [], None
    for token in tokens:
        if token.type == "tr_open":
            row = []
        elif token.type == "tr_close":
            rows.append(row)
        elif token.type == "inline" and row is not None:
            row.append("".join("\n" if c.type == "html_inline" and c.content == "<br>" else c.content
                               for c in token.children or []))
    return rows


# the table's own syntax (`|`, backslashes, line breaks, `-` and `:` of the rule); emphasis, code and
# autolinks (`*`, backquotes, `<a:b>`) are markdown a normexp cell does not hold
_cell_text = st.text(st.sampled_from("ab |\\\n-:.="), max_size=12).map(str.strip)


@settings(deadline=None)
@given(st.lists(st.lists(_cell_text, min_size=3, max_size=3), min_size=1, max_size=4))
def test_every_markdown_cell_reads_back_whole(rows):
    from normexp.tables import markdown_table

    header, *body = rows
    lines = markdown_table(header, body, "lrl")
    assert len(lines) == len(rows) + 1 and not any("\n" in line for line in lines)
    assert _rendered_rows(lines) == rows


def test_the_properties_table_keeps_its_pass_column():
    result = CliRunner().invoke(app, ["norms", "props", "--format", "markdown"])
    assert result.exit_code == 0, result.output
    header, *rows = _rendered_rows(result.stdout.splitlines())
    assert header[-1] == "result" and len(rows) > 5
    # a renderer pads or cuts a row to the header's width: a `|` left in a cell shifts the row and its
    # last cell is then not the result
    assert all(row[-1] in ("pass", "FAIL") for row in rows), rows
    assert any("max |diff|" in row[0] for row in rows)


# ----------------------------------------------------------------------------- through a pipe


WIDE_SWEEP = """\
name: wide
base: {model: {depth: 2, width: 4}, train: {steps: 3}, schedule: {kind: cosine}}
grid:
  norm.placement: [pre, post]
  optim.lr: [0.001, 0.01, 100000.0]
  schedule.warmup_steps: [0, 1]
  schedule.min_lr_ratio: [0.0, 0.5]
"""


def _piped(*args: str, cwd: Path | None = None) -> str:
    """normexp's stdout through a pipe (not a terminal, as in a Slurm log or `| cat`), at COLUMNS=40."""
    env = {**os.environ, "COLUMNS": "40", "PYTHONPATH": str(REPO)}
    env.pop("FORCE_COLOR", None)
    result = subprocess.run([sys.executable, "-m", "normexp", *args], capture_output=True, text=True, env=env,
                            cwd=cwd or REPO, timeout=300)
    assert result.returncode in (0, 1), result.stdout + result.stderr
    assert "…" not in result.stdout, result.stdout
    return result.stdout


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wide")
    (folder / "wide.yaml").write_text(WIDE_SWEEP)
    text = _piped("sweep", str(folder / "wide.yaml"), "--out", str(folder / "out"))
    from normexp.report import build_report, grid_cells

    header, rows = grid_cells(build_report(folder / "out"))
    for cell in [*header, *(c for row in rows for c in row)]:  # the sweep's closing table, every cell whole
        assert cell in text, cell
    return folder / "out"


def _whole(text: str, cells) -> None:
    missing = [c for c in cells if c not in text]
    assert not missing, (missing, text)


@pytest.mark.process
def test_report_tables_through_a_pipe_keep_every_cell_whole(wide):
    from normexp.analysis.sensitivity import build_sensitivity
    from normexp.report import _pivot_cells, build_pivot, build_report, grid_cells
    from normexp.tables import _sensitivity_rows

    header, rows = grid_cells(build_report(wide))
    _whole(_piped("report", str(wide)), [*header, *(c for r in rows for c in r)])
    by = build_report(wide, by=["schedule.min_lr_ratio", "optim.lr"])
    header, rows = grid_cells(by)
    _whole(_piped("report", str(wide), "--by", "schedule.min_lr_ratio,optim.lr"),
           [*header, *(c for r in rows for c in r)])
    pivot = build_pivot(wide, "optim.lr", "schedule.warmup_steps")
    text = _piped("report", str(wide), "--pivot", "optim.lr,schedule.warmup_steps")
    for i in range(len(pivot.panels)):
        header, rows, _ = _pivot_cells(pivot, "lr \\ warmup_steps", i)
        _whole(text, [*header, *(c for r in rows for c in r)])
    text = _piped("report", str(wide), "--lr-sensitivity")
    _whole(text, ["LR sensitivity", "l* (best seed-mean)", *(c for r in _sensitivity_rows(build_sensitivity(wide))
                                                               for c in r)])


@pytest.mark.process
def test_dry_run_and_verify_through_a_pipe_keep_ids_and_paths_whole(wide, tmp_path):
    (tmp_path / "wide.yaml").write_text(WIDE_SWEEP)
    text = _piped("sweep", str(tmp_path / "wide.yaml"), "--dry-run")
    _whole(text, [run_id(cfg) for cfg in build_sweep(__import__("yaml").safe_load(WIDE_SWEEP)).runs])
    _whole(text, ["schedule.warmup_steps", "schedule.min_lr_ratio", "100000.0"])
    import shutil

    first = next(p for p in sorted(wide.iterdir()) if (p / "done.json").exists())
    stray = wide / "rezero-rmsnorm_gemma-s12345-0123456789"  # a run of no run id of this sweep
    shutil.copytree(first, stray)
    (stray / "done.json").unlink()
    try:
        text = _piped("verify", str(wide))
        _whole(text, [stray.name])
    finally:
        shutil.rmtree(stray)


@pytest.mark.process
def test_diagnostics_tables_through_a_pipe_keep_every_cell_whole(tmp_path):
    from normexp.diagnostics import norm_properties

    _whole(_piped("norms", "props"), [p.name for p in norm_properties()])
    _whole(_piped("norms", "bench", "--no-big", "--no-compile", "--repeats", "1"),
           ["rmsnorm_llama", "rmsnorm_gemma", "vs LayerNorm", "fwd+bwd ms"])
    text = _piped("gradnorm", str(REPO / "configs" / "studies" / "gradnorm.yaml"), "--set", "model.depth=2,4",
                  "--set", "model.width=8", "--out", str(tmp_path / "g"))
    assert "||grad W2_L||" in text


# ----------------------------------------------------------------------------- on a narrow terminal


def test_on_a_narrow_terminal_a_cell_wraps_instead_of_being_cut():
    from rich.console import Console

    from normexp.tables import rich_table

    console = Console(force_terminal=True, width=30, record=True, color_system=None)
    console.print(rich_table(["schedule.min_lr_ratio", "value"], [["post-layernorm-s0-4cc00c4527", "8.7400e+07"]],
                             "lr"))
    text = console.export_text()
    assert "…" not in text
    body = [line.split("│") for line in text.splitlines() if line.startswith("│")]
    assert "".join(cells[1].strip() for cells in body) == "post-layernorm-s0-4cc00c4527"  # folded, whole
    assert "8.7400e+07" in text
