"""Issue 25, the third hostile pass: what a user sees. Tables read whole off a terminal and wrap (never
"…") on one; block logs for every placement; `plot --blocks` where a variant has nothing to draw."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": str(columns), "NO_COLOR": "1"}
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


# ----------------------------------------------------------------------------- 1. the LR-sensitivity verdict


def _sweep_of(folder: Path, grid: dict, final: dict, skip: set = frozenset()) -> Path:
    """A sweep folder over `grid` (seeds 0, 1) written through the store: each run's loss goes 2.3 ->
    final[(kind, lr, warmup)] + 0.01 * seed; a run whose (kind, lr, warmup, seed) is in `skip` is missing."""
    from normexp.config import build_sweep
    from normexp.folder import SWEEP_FILE, FinishedRun, run_id, write_run

    base = {"schedule": {"kind": "linear_warmup"}, "train": {"steps": 1}}
    sweep = build_sweep({"name": "v", "base": base, "grid": grid, "seeds": [0, 1]})
    folder.mkdir(parents=True)
    (folder / SWEEP_FILE).write_text(sweep.to_yaml())
    for cfg in sweep.runs:
        key = (cfg.norm.kind, cfg.optim.lr, cfg.schedule.warmup_steps)
        if (*key, cfg.seed) in skip:
            continue
        metrics = {"step": [0, 1], "loss": [2.3, final[key] + 0.01 * cfg.seed], "acc": [0.1] * 2,
                   "lr": [cfg.optim.lr] * 2, "grad_norm": [1.0] * 2}
        write_run(folder / run_id(cfg), cfg, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu"))
    return folder


def test_the_sensitivity_verdict_keeps_each_variant_and_names_the_undefined(tmp_path):
    """Two kinds of one placement were one key (placement, warmup): the second overwrote the first in
    the ranking and the warmup comparison. A variant with an lr that has no finished run was dropped
    from the verdict without a word."""
    from normexp.studies.verdicts import lr_sensitivity_verdict

    lrs = [0.001, 0.01, 0.1]
    finals = {("layernorm", 0): [2.0, 1.0, 2.2], ("layernorm", 12): [0.6, 0.5, 0.7],  # 0.7333 -> 0.1
              ("rmsnorm", 0): [0.6, 0.5, 0.9], ("rmsnorm", 12): [0.6, 0.5, 0.9]}    # 0.1667 both
    final = {(k, lr, w): v for (k, w), vs in finals.items() for lr, v in zip(lrs, vs)}
    grid = {"norm.placement": ["pre"], "norm.kind": ["layernorm", "rmsnorm"], "optim.lr": lrs,
            "schedule.warmup_steps": [0, 12]}
    text = lr_sensitivity_verdict(_sweep_of(tmp_path / "k", grid, final))
    assert "without warmup (least sensitive first): RMS 0.167, LN 0.733" in text, text
    assert "lowers the sensitivity of LN 0.733 -> 0.100" in text and "spread of the two for RMS 0.167" in text
    # every seed of (rmsnorm, lr 0.1, warmup 12) missing: that variant's sensitivity is undefined, and said so
    gone = {("rmsnorm", 0.1, 12, s) for s in (0, 1)}
    text = lr_sensitivity_verdict(_sweep_of(tmp_path / "m", grid, final, gone))
    assert "No LR sensitivity (an lr of the grid has no finished run) for RMS" in text, text


def test_the_blocks_verdict_means_over_every_seed_or_leaves_the_step_out(tmp_path):
    """groupby().mean() skipped a diverged seed's nan: Post-LN's 'peak, mean over 2 seeds' was one seed's."""
    from normexp.config import build_sweep
    from normexp.folder import SWEEP_FILE, FinishedRun, run_id, write_run
    from normexp.studies.verdicts import blocks_verdict

    nan = float("nan")
    last_update = {("post", 0): [0.1, 0.3, 0.8, nan], ("post", 1): [0.1, 0.3, nan, nan],  # seed 1 diverged
                   ("pre", 0): [0.05, 0.1, 0.1, nan], ("pre", 1): [0.05, 0.1, 0.1, nan]}
    sweep = build_sweep({"name": "b", "base": {"model": {"depth": 2, "width": 4}, "schedule": {"kind": "linear_warmup"},
                                               "train": {"steps": 3, "log_blocks": True}},
                         "grid": {"norm.placement": ["post", "pre"]}, "seeds": [0, 1]})
    folder = tmp_path / "b"
    folder.mkdir()
    (folder / SWEEP_FILE).write_text(sweep.to_yaml())
    for cfg in sweep.runs:
        updates = last_update[(cfg.norm.placement, cfg.seed)]
        blocks = {"step": [s for s in range(4) for _ in (1, 2)], "block": [1, 2] * 4}
        blocks["fc2_update"] = [v for u in updates for v in (0.01, u)]
        blocks["fc2_grad"] = [1.0] * 8
        for column in ("fc1_grad", "fc1_update", "stream_rms", "norm_rms", "norm_out_rms"):
            blocks[column] = [1.0] * 8
        metrics = {"step": [0, 1, 2, 3], "loss": [2.3, 2.0, 1.5, 1.0], "acc": [0.1] * 4, "lr": [0.01] * 4,
                   "grad_norm": [1.0] * 4}
        write_run(folder / run_id(cfg), cfg, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu", blocks))
    text = blocks_verdict(folder)
    # by hand: the steps where both seeds of both placements are finite are 0 and 1; Post's peak is step 1
    assert "peaks after step 1 at 0.3 (mean over 2 seeds), 3.0x Pre-LN's at that step (0.1" in text, text
    assert "by step 1 Post-LN's is 0.3" in text, text


def test_off_a_terminal_each_line_of_a_sweep_is_one_line(wide):
    """'one plain line per run otherwise (logs, CI)' (normexp/progress.py): Rich wrapped each at COLUMNS,
    and split the results path of the closing line onto a line of its own."""
    folder, swept = wide
    lines = swept.stdout.splitlines()
    progress = [line for line in lines if line.startswith("[")]
    assert len(progress) == 24 and all(" completed final loss " in line for line in progress), lines
    assert any(line.endswith(f"results in {folder / 'out'}") for line in lines), lines


# ----------------------------------------------------------------------------- 12. plot --blocks, legible


def test_an_empty_blocks_panel_is_as_wide_as_a_drawn_one_and_its_text_stays_inside(tmp_path):
    """The reason's one long line made constrained layout squeeze the empty panel to a sliver and run
    its text across the neighbouring panels."""
    from normexp.config import build_sweep
    from normexp.figures import blocks_figure
    from normexp.folder import SWEEP_FILE, FinishedRun, run_id, write_run
    from normexp.results import load_blocks

    nan = float("nan")
    sweep = build_sweep({"name": "e", "base": {"model": {"depth": 2, "width": 4},
                                              "train": {"steps": 2, "log_blocks": True}},
                         "grid": {"norm.placement": ["post", "sandwich"]}})
    folder = tmp_path / "e"
    folder.mkdir()
    (folder / SWEEP_FILE).write_text(sweep.to_yaml())
    for cfg in sweep.runs:
        blocks = {"step": [0, 0, 1, 1, 2, 2], "block": [1, 2] * 3}
        for column in ("fc1_grad", "fc2_grad", "fc1_update", "fc2_update", "stream_rms", "norm_rms"):
            blocks[column] = [1.0] * 6
        blocks["norm_out_rms"] = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5] if cfg.norm.placement == "sandwich" else [nan] * 6
        metrics = {"step": [0, 1, 2], "loss": [2.3, 2.0, 1.5], "acc": [0.1] * 3, "lr": [0.01] * 3,
                   "grad_norm": [1.0] * 3}
        write_run(folder / run_id(cfg), cfg, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu", blocks))
    fig = blocks_figure(load_blocks(folder, all_config=True), ["norm.placement"], "norm_out_rms")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    empty, drawn = fig.axes[0], fig.axes[1]  # row 0: Post (nothing to draw), Sandwich
    assert "branch-output norm" in " ".join(t.get_text() for t in empty.texts)
    assert empty.get_position().width > 0.6 * drawn.get_position().width
    box = empty.get_window_extent(renderer)
    for text in empty.texts:
        inside = text.get_window_extent(renderer)
        assert box.x0 <= inside.x0 and inside.x1 <= box.x1, (inside, box)
