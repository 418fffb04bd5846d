"""What each command prints, run as a user runs it (`python -m normexp`): off a terminal (a pipe, a log) every
report view, the sweep's closing table, its dry run, verify, `norms props` and gradnorm hold every cell whole
(never "…") and each line of a sweep is one line; on a narrow terminal a cell wraps and is never cut."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.process  # each test runs `python -m normexp` (its module's folder too)

ELLIPSIS = "…"


WIDE = """\
name: wide_labels
base:
  model: {depth: 2, width: 4}
  train: {steps: 2}
  schedule: {kind: cosine}
grid:
  optim.lr: [0.001, 0.01, 0.1]
  schedule.warmup_steps: [0, 1]
  schedule.min_lr_ratio: [0.0, 0.1]
seeds: [0, 1]
"""


def normexp(*args: str, terminal: bool = False, columns: int = 40) -> subprocess.CompletedProcess:
    """`python -m normexp ARGS` with stdout a real pipe (not a terminal) and COLUMNS narrow; with
    `terminal`, Rich is told stdout is a terminal of that width (TTY_COMPATIBLE, rich >= 14)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": str(columns), "NO_COLOR": "1"}
    env.pop("TTY_COMPATIBLE", None)
    if terminal:
        env["TTY_COMPATIBLE"] = "1"
    return subprocess.run([sys.executable, "-m", "normexp", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    folder = tmp_path_factory.mktemp("wide")
    (folder / "wide.yaml").write_text(WIDE)
    swept = normexp("sweep", str(folder / "wide.yaml"), "--out", str(folder / "out"))
    assert swept.returncode == 0, swept.stderr
    return folder, swept


def _markdown_cells(text: str) -> list[str]:
    """Every cell of every markdown table in `text` (escapes undone), the rule lines aside."""
    cells = []
    for line in text.splitlines():
        if line.startswith("| "):
            cells += [re.sub(r"\\([\\|])", r"\1", c.strip()) for c in re.split(r"(?<!\\)\|", line[2:-2])]
    return [c for c in cells if c]


def _whole(table: str, markdown: str) -> None:
    """`table` (Rich, off a terminal) holds no "…" and every cell of the same result's markdown whole."""
    assert ELLIPSIS not in table, table
    lines = table.splitlines()
    cells = [c for c in _markdown_cells(markdown) if " \\ " not in c]  # a pivot's corner: full keys in markdown only
    missing = [c for c in cells if not any(c in line for line in lines)]
    assert not missing, (missing, table)


@pytest.mark.parametrize("view", [[], ["--by", "schedule.warmup_steps,schedule.min_lr_ratio"],
                                  ["--pivot", "schedule.warmup_steps,schedule.min_lr_ratio"], ["--lr-sensitivity"]],
                         ids=["report", "by", "pivot", "lr-sensitivity"])
def test_every_report_view_is_whole_off_a_terminal(wide, view):
    folder, _ = wide
    table = normexp("report", str(folder / "out"), *view)
    markdown = normexp("report", str(folder / "out"), *view, "--format", "markdown")
    assert table.returncode == markdown.returncode == 0, table.stderr + markdown.stderr
    _whole(table.stdout, markdown.stdout)
    for key in ("warmup_steps", "min_lr_ratio"):
        assert key in table.stdout


def test_the_sweeps_end_report_dry_run_and_verify_name_every_run_whole(wide):
    folder, swept = wide
    ids = sorted(p.name for p in (folder / "out").iterdir() if (p / "done.json").exists())
    assert len(ids) == 24
    assert ELLIPSIS not in swept.stdout
    assert all(label in swept.stdout for label in ("warmup_steps=1 min_lr_ratio=0.1", "lr=0.001"))
    dry = normexp("sweep", str(folder / "wide.yaml"), "--out", str(folder / "dry"), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert ELLIPSIS not in dry.stdout
    assert all(any(run in line for line in dry.stdout.splitlines()) for run in ids), dry.stdout
    assert "schedule.min_lr_ratio" in dry.stdout
    shutil.copytree(folder / "out", folder / "broken")
    (folder / "broken" / ids[0] / "done.json").unlink()  # a finding, so that verify prints its table
    checked = normexp("verify", str(folder / "broken"))
    assert checked.returncode == 1 and ELLIPSIS not in checked.stdout
    assert any(ids[0] in line for line in checked.stdout.splitlines()), checked.stdout


def test_norms_props_and_gradnorm_are_whole_off_a_terminal(tmp_path):
    props = normexp("norms", "props")
    assert props.returncode == 0, props.stderr
    _whole(props.stdout, normexp("norms", "props", "--format", "markdown").stdout)
    (tmp_path / "g.yaml").write_text("name: g\nbase: {model: {width: 4}}\n"
                                     "grid: {norm.placement: [post, pre], model.depth: [2, 4], optim.lr: [0.01, "
                                     "0.1]}\n")
    table = normexp("gradnorm", str(tmp_path / "g.yaml"), "--out", str(tmp_path / "g"))
    markdown = normexp("gradnorm", str(tmp_path / "g.yaml"), "--out", str(tmp_path / "g2"), "--format", "markdown")
    assert table.returncode == markdown.returncode == 0, table.stderr + markdown.stderr
    _whole(table.stdout, markdown.stdout)


@pytest.mark.parametrize("columns", [30, 60])
def test_on_a_narrow_terminal_a_cell_wraps_and_is_never_cut(wide, columns):
    folder, _ = wide
    for view in ([], ["--lr-sensitivity"], ["--pivot", "schedule.warmup_steps,schedule.min_lr_ratio"]):
        shown = normexp("report", str(folder / "out"), *view, terminal=True, columns=columns)
        assert shown.returncode == 0, shown.stderr
        text = re.sub(r"\x1b\[[0-9;]*m", "", shown.stdout)  # styles (bold) aside
        assert ELLIPSIS not in text, text
        if columns >= 60 and not view:  # wide enough for each column's longest word: it fits the terminal
            assert max(len(line) for line in text.splitlines()) <= columns
        # folded, not cut: the first column's text, read down the table, holds every variant label whole
        first = "".join(re.split("[│┃]", line)[1] for line in text.splitlines() if line[:1] in "│┃")
        first = re.sub(r"\s", "", first)
        labels_kept = view != ["--pivot", "schedule.warmup_steps,schedule.min_lr_ratio"]
        for label in ("min_lr_ratio=0.1", "warmup_steps=1") if labels_kept else ():
            assert label in first, (label, text)


def test_off_a_terminal_each_line_of_a_sweep_is_one_line(wide):
    """'one plain line per run otherwise (logs, CI)' (normexp/progress.py): Rich wrapped each at COLUMNS,
    and split the results path of the closing line onto a line of its own."""
    folder, swept = wide
    lines = swept.stdout.splitlines()
    progress = [line for line in lines if line.startswith("[")]
    assert len(progress) == 24 and all(" completed final loss " in line for line in progress), lines
    assert any(line.endswith(f"results in {folder / 'out'}") for line in lines), lines
