"""Issue 25, the third hostile pass: numbers that were silently wrong, tables that cut or broke, and
options that multiplied runs. Each test checks against an independent computation (plain python)."""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import RunConfig, build_sweep
from normexp.folder import SWEEP_FILE, FinishedRun, run_id, write_run

LRS = [0.001, 0.01, 0.1]


def write_curves(folder: Path, runs: list[tuple], engine: str = "reference") -> Path:
    """A sweep folder written through the store: (placement, lr, seed, losses, status[, warmup]) per run,
    each run's `losses` its whole curve (one recorded step each)."""
    def axis(i: int, default: object = None) -> list:
        return list(dict.fromkeys(r[i] if len(r) > i else default for r in runs))

    steps = max(len(r[3]) for r in runs) - 1
    sweep = build_sweep({"name": "curves", "base": {"schedule": {"kind": "linear_warmup"},
                                                     "train": {"steps": steps, "stop_on_nonfinite": False}},
                         "grid": {"norm.placement": axis(0), "optim.lr": axis(1),
                                  "schedule.warmup_steps": axis(5, 0)}, "seeds": axis(2)})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SWEEP_FILE).write_text(sweep.to_yaml())
    for placement, lr, seed, losses, status, *warmup in runs:
        cfg = RunConfig.model_validate({"norm": {"placement": placement}, "optim": {"lr": lr}, "seed": seed,
                                        "schedule": {"kind": "linear_warmup", "warmup_steps": (warmup or [0])[0]},
                                        "train": {"steps": steps, "stop_on_nonfinite": False}})
        n = len(losses)
        metrics = {"step": list(range(n)), "loss": list(losses), "acc": [0.1] * n, "lr": [lr] * n,
                   "grad_norm": [1.0] * n}
        write_run(folder / run_id(cfg), cfg, FinishedRun(metrics, status, 0.1, 1, engine, "cpu"))
    return folder


# ----------------------------------------------------------------------------- 1. LR sensitivity


def _by_the_definition(runs: list[tuple]) -> dict[str, float]:
    """README: c_r = min(final, loss at init), a diverged run counting as its loss at init; m(lr) the
    seed mean; l* = min m; sensitivity = mean over the lr grid of m(lr) - l*. Plain python."""
    out = {}
    for placement in dict.fromkeys(r[0] for r in runs):
        m = {}
        for lr in LRS:
            cs = []
            for p, rlr, _, losses, status, *_ in runs:
                if p == placement and rlr == lr:
                    diverged = status == "diverged"
                    cs.append(losses[0] if diverged else min(losses[-1], losses[0]))
            m[lr] = sum(cs) / len(cs)
        best = min(m.values())
        out[placement] = sum(v - best for v in m.values()) / len(m)
    return out


NAN, INF = math.nan, math.inf
DIVERGING = [  # curves that end in nan or inf after finite steps, one that recovers after a nan
    ("pre", 0.001, 0, [2.3, 1.0, 0.5, 0.4], "completed"),
    ("pre", 0.01, 0, [2.3, 0.6, 0.2, 0.1], "completed"),
    ("pre", 0.1, 0, [2.3, 1.1, 0.9, NAN], "diverged"),  # GroupBy.last() read 0.9
    ("pre", 0.001, 1, [2.2, 1.2, 0.6, 0.5], "completed"),
    ("pre", 0.01, 1, [2.2, 0.7, 0.3, 0.2], "completed"),
    ("pre", 0.1, 1, [2.2, 0.4, INF, NAN], "diverged"),
    ("none", 0.001, 0, [2.0, 1.9, 1.8, 1.7], "completed"),
    ("none", 0.01, 0, [2.0, 0.3, NAN, NAN], "diverged"),
    ("none", 0.1, 0, [2.0, NAN, 0.05, 0.05], "diverged"),  # met a nan, then finite again: still diverged
]


def test_a_diverged_run_counts_as_its_loss_at_init_not_its_last_finite_loss(tmp_path):
    from normexp.analysis.sensitivity import build_sensitivity

    expected = _by_the_definition(DIVERGING)
    # pre: m = [0.45, 0.15, (2.3 + 2.2) / 2], l* = 0.15; none: m = [1.7, 2.0, 2.0] (both diverged), l* = 1.7
    assert expected == pytest.approx({"pre": (0.3 + 0.0 + 2.1) / 3, "none": (0.0 + 0.3 + 0.3) / 3})
    rows = build_sensitivity(write_curves(tmp_path / "s", DIVERGING))
    assert {r.values["norm.placement"]: r.sensitivity for r in rows} == pytest.approx(expected)
    assert [r.diverged for r in rows] == [2, 2]


def test_the_lr_figure_draws_the_same_numbers(tmp_path):
    from normexp.analysis.sensitivity import lr_table
    from normexp.figures import lr_figure

    fig = lr_figure(*lr_table(write_curves(tmp_path / "s", DIVERGING)))
    lines = {line.get_label().split(" ")[0]: list(line.get_ydata()) for line in fig.axes[0].lines}
    assert lines["Pre"] == pytest.approx([(0.4 + 0.5) / 2, (0.1 + 0.2) / 2, (2.3 + 2.2) / 2])
    assert lines["NoNorm"] == pytest.approx([1.7, 2.0, 2.0])


# ----------------------------------------------------------------------------- 16. inert optimizer keys

# A value of each optimizer- or schedule-specific key other than its default.
OTHER_OPTIM_VALUE = {"optim.betas": [0.8, 0.99], "optim.eps": 1e-3, "optim.momentum": 0.5,
                     "optim.v_only_steps": 2, "optim.v0": "grad_sq", "optim.radam_variant": "official",
                     "optim.independent_weight_decay": True,
                     "schedule.min_lr_ratio": 0.3, "schedule.decay_fraction": 0.5, "schedule.decay_shape": "cosine"}


def _deciders() -> list[tuple[str, str, str]]:
    """(dotted key, its deciding key, a value of that decider) for every key of the optimizer's and the
    schedule's tables and every value its decider can take: the matrix comes from the code's lists."""
    from typing import get_args

    from normexp.config import ACTS_ONLY_UNDER_BY_SECTION, OptimName, ScheduleKind

    choices = {"optim": get_args(OptimName), "schedule": get_args(ScheduleKind)}
    return [(f"{section}.{key}", f"{section}.{decider}", value)
            for section in ("optim", "schedule") for key, (decider, _) in ACTS_ONLY_UNDER_BY_SECTION[section].items()
            for value in choices[section]]


def test_every_optimizer_specific_key_has_another_value():
    from normexp.config import ACTS_ONLY_UNDER_BY_SECTION

    assert sorted(OTHER_OPTIM_VALUE) == sorted(f"{s}.{k}" for s in ("optim", "schedule")
                                               for k in ACTS_ONLY_UNDER_BY_SECTION[s])


def _nested(pairs: dict[str, object]) -> dict:
    # RAdam uses eps from step 6; wsd's default decay_fraction 0.1 decays the last int(0.1 * steps) updates
    # (3 of 30: enough for decay_shape to act)
    data: dict = {"model": {"depth": 3, "width": 4}, "train": {"steps": 30}}
    for key, value in pairs.items():
        section, _, leaf = key.partition(".")
        data.setdefault(section, {})[leaf] = value
    return data


@pytest.mark.parametrize(("key", "decider", "value"), _deciders())
def test_an_inert_optimizer_key_is_one_run_and_a_grid_over_it_is_refused(key, decider, value):
    from normexp.config import ConfigError, inert_keys, validate_run
    from normexp.engines.reference import train_run

    section, _, leaf = key.partition(".")
    base = {decider: value, **({"schedule.warmup_steps": 1} if value != "constant" and section == "schedule" else {})}
    plain = validate_run(_nested(base))
    other = validate_run(_nested({**base, key: OTHER_OPTIM_VALUE[key]}))
    literal = validate_run(_nested({**base, key: OTHER_OPTIM_VALUE[key]}), keep_inert=True)
    if leaf in inert_keys(getattr(plain, section)):
        assert other == plain and run_id(other) == run_id(plain)
        # the key truly changes nothing: the run with the value kept trains bit for bit as the default's
        assert [repr(v) for v in train_run(literal).losses] == [repr(v) for v in train_run(plain).losses]
        sweep = {"name": "alike", "base": _nested(base), "grid": {key: [OTHER_OPTIM_VALUE[key]]}}
        with pytest.raises(ConfigError, match=f"grid.{key}: has no effect"):
            build_sweep(sweep)
        with pytest.raises(ConfigError, match=f"base.{key}: has no effect"):
            build_sweep({"name": "alike", "base": _nested({**base, key: OTHER_OPTIM_VALUE[key]})})
    else:
        assert run_id(other) != run_id(plain)
        assert [repr(v) for v in train_run(literal).losses] != [repr(v) for v in train_run(plain).losses]


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd", "radam"])
def test_negative_zero_is_zero(name):
    from normexp.config import validate_run

    zero = validate_run(_nested({"optim.name": name, "optim.weight_decay": 0.0, "optim.momentum": 0.0}))
    negative = validate_run(_nested({"optim.name": name, "optim.weight_decay": -0.0, "optim.momentum": -0.0}))
    assert run_id(zero) == run_id(negative)
    sweep = build_sweep({"name": "z", "base": _nested({"optim.name": name}),
                         "grid": {"optim.weight_decay": [0.0, -0.0]}})
    assert len(sweep.runs) == 1


def test_a_mixed_grid_folds_only_where_the_key_is_inert():
    sweep = build_sweep({"name": "mix", "base": _nested({}),
                         "grid": {"optim.name": ["adam", "sgd"], "optim.momentum": [0.5, 0.9]}})
    assert [(r.optim.name, r.optim.momentum) for r in sweep.runs] == [("adam", 0.9), ("sgd", 0.5), ("sgd", 0.9)]


# ----------------------------------------------------------------------------- 3. an undefined std


ONE_SEED = [  # one run per cell, and a cell (none, 0.1) whose only run diverged: no std is defined anywhere
    ("pre", 0.001, 0, [2.3, 1.0, 0.5, 0.4], "completed"),
    ("pre", 0.01, 0, [2.3, 0.6, 0.2, 0.1], "completed"),
    ("pre", 0.1, 0, [2.3, 1.1, 0.9, 0.8], "completed"),
    ("none", 0.001, 0, [2.0, 1.9, 1.8, 1.7], "completed"),
    ("none", 0.01, 0, [2.0, 0.3, 0.2, 0.2], "completed"),
    ("none", 0.1, 0, [2.0, 0.5, NAN, NAN], "diverged"),
]
TWO_SEEDS = [*ONE_SEED, ("pre", 0.01, 1, [2.3, 0.6, 0.2, 0.3], "completed")]


def _csv(args: list[str]) -> list[dict]:
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 1), result.output  # 1: the sweep has missing runs (seed 1 of most cells)
    return list(csv.DictReader(result.stdout.splitlines()))


def test_a_std_over_fewer_than_two_runs_is_empty_in_every_csv(tmp_path):
    folder = write_curves(tmp_path / "s", TWO_SEEDS)
    rows = _csv(["report", str(folder), "--format", "csv"])
    assert {int(r["n"]) for r in rows} >= {0, 1, 2}
    for r in rows:  # a cell with n < 2 finite runs has no std: empty, never 0.0
        if int(r["n"]) < 2:
            assert r["loss_std"] == "", r
        else:
            assert float(r["loss_std"]) >= 0, r  # a true spread (0 at step 0, where both seeds start at 2.3)
    # the one cell with two runs at its final step: std of (0.1, 0.3), by hand
    pivot = _csv(["report", str(folder), "--pivot", "optim.lr,norm.placement", "--format", "csv"])
    by_cell = {(r["optim.lr"], r["norm.placement"]): r for r in pivot}
    assert float(by_cell[("0.01", "pre")]["final_loss_std"]) == pytest.approx(statistics.stdev([0.1, 0.3]))
    for r in pivot:
        if int(r["n"]) < 2:
            assert r["final_loss_std"] == "", r
            if int(r["n"]) == 0:
                assert r["final_loss_mean"] == "", r
    assert by_cell[("0.1", "none")]["n"] == "0"


# ----------------------------------------------------------------------------- 19. column labels


def test_every_run_key_has_its_own_label_that_names_what_varies():
    from normexp.config import GENERIC_LEAVES, key_label, run_keys

    labels = {key: key_label(key) for key in run_keys()}
    # no two keys share a label, and no label is a bare generic leaf (`name`, `kind`) that names no section
    assert len(set(labels.values())) == len(labels), labels
    assert not set(labels.values()) & set(GENERIC_LEAVES)
    assert labels["optim.name"] == "optim" and labels["schedule.kind"] == "schedule"
    assert labels["optim.eps"] == "optim.eps" and labels["norm.eps"] == "norm.eps"  # two sections share `eps`


def test_a_grid_over_the_optimizer_reads_optim_equals_in_the_report(tmp_path):
    from normexp.analysis.variants import variant_label
    from normexp.report import build_report, to_markdown

    assert variant_label({"optim.name": "adam", "schedule.kind": "cosine"}) == "optim=adam schedule=cosine"
    folder = tmp_path / "o"
    sweep = build_sweep({"name": "o", "base": {"model": {"depth": 2, "width": 4}, "train": {"steps": 2}},
                         "grid": {"optim.name": ["adam", "sgd"]}})
    folder.mkdir()
    (folder / SWEEP_FILE).write_text(sweep.to_yaml())
    for cfg in sweep.runs:
        metrics = {"step": [0, 1, 2], "loss": [2.0, 1.0, 0.5], "acc": [0.1] * 3, "lr": [0.01] * 3,
                   "grad_norm": [1.0] * 3}
        write_run(folder / run_id(cfg), cfg, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu"))
    text = to_markdown(build_report(folder))
    assert "optim=adam" in text and "optim=sgd" in text and "name=" not in text


# ----------------------------------------------------------------------------- 4. markdown cells


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


# ----------------------------------------------------------------------------- 10. tables off a terminal

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
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


def test_diagnostics_tables_through_a_pipe_keep_every_cell_whole(tmp_path):
    from normexp.diagnostics import norm_properties

    _whole(_piped("norms", "props"), [p.name for p in norm_properties()])
    _whole(_piped("norms", "bench", "--no-big", "--no-compile", "--repeats", "1"),
           ["rmsnorm_llama", "rmsnorm_gemma", "vs LayerNorm", "fwd+bwd ms"])
    text = _piped("gradnorm", str(REPO / "configs" / "studies" / "gradnorm.yaml"), "--set", "model.depth=2,4",
                  "--set", "model.width=8", "--out", str(tmp_path / "g"))
    assert "||grad W2_L||" in text


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


# ----------------------------------------------------------------------------- 11. log_blocks on every placement


def _ffn_placements() -> list[str]:
    from typing import get_args

    from normexp.config import Placement

    return [p for p in get_args(Placement) if p != "b2t"]  # b2t needs the Transformer's two sublayers


@pytest.mark.parametrize("placement", _ffn_placements())
def test_log_blocks_works_on_every_placement_and_both_exact_engines_agree(placement):
    from test_batched import runs
    from test_blocks import assert_blocks_match_reference, logging, small

    from normexp.engines.reference import train_run

    result = train_run(logging(small(placement, steps=2)))
    assert result.blocks is not None and set(result.blocks["block"]) == {1, 2, 3}
    assert all(math.isfinite(v) for v in result.blocks["stream_rms"])
    assert_blocks_match_reference([logging(c, 2) for c in runs(placement, "rmsnorm", n=2, steps=3)])


def test_resdual_logs_the_normed_stream_x_a():
    from test_blocks import logging, small

    from normexp.engines.common import seeded_init
    from normexp.engines.reference import train_run

    cfg = small("resdual", "layernorm", depth=3, width=5)
    rows = train_run(logging(cfg)).blocks
    model, task = seeded_init(cfg)
    x = (model.input_norm(task.x), None)
    x = (x[0], x[0] * 0)
    at_init = [r for r, step in zip(rows["stream_rms"], rows["step"]) if step == 0]
    for i, block in enumerate(model.blocks):
        x = block(x)
        assert at_init[i] == x[0].pow(2).mean().sqrt().item()


# ----------------------------------------------------------------------------- 18. Transformer gradnorm depths

TF_GRADNORM = """\
name: tfg
base:
  model: {arch: transformer, width: 8, n_heads: 2}
  data: {task: copy, n_samples: 16, n_val: 8}
  train: {steps: 3}
grid:
  norm.placement: [post, pre]
  model.depth: [2, 3]
seeds: [0, 1]
"""


def test_transformer_gradnorm_shows_every_depth(tmp_path):
    from normexp.config import build_sweep as build
    from normexp.diagnostics import gradnorm_study, layer_gradnorm_at_init
    from normexp.tables import gradnorm_tables

    spec = build(__import__("yaml").safe_load(TF_GRADNORM))
    summary = gradnorm_study(spec, tmp_path / "g")
    assert sorted(summary.grads) == ["post L=2", "post L=3", "pre L=2", "pre L=3"]
    header, rows, lines = gradnorm_tables(summary)
    assert [r[0] for r in rows] == ["1", "2", "3"]
    # the shallow model's layer 3 is no cell; its layers 1-2 are its own seeds' means, computed here
    shallow = header.index("Post L=2: attention out")
    assert rows[2][shallow] == "—"
    values = [layer_gradnorm_at_init(c)[1]["attn_out_grad"] for c in spec.runs
              if c.norm.placement == "post" and c.model.depth == 2]
    assert rows[1][shallow] == f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"
    assert any("depths 2, 3" in line for line in lines)
    assert any(line.startswith("Post L=2: last/first layer") for line in lines)
    # its ratio is its own last layer (2) over its first, not a layer it does not have
    assert summary.ratio("post L=2", "attn_out_grad") == pytest.approx(
        summary.grads["post L=2"]["attn_out_grad"][1][0] / summary.grads["post L=2"]["attn_out_grad"][0][0])
    (tmp_path / "tfg.yaml").write_text(TF_GRADNORM)
    markdown = CliRunner().invoke(app, ["gradnorm", str(tmp_path / "tfg.yaml"), "--out", str(tmp_path / "cli"),
                                        "--format", "markdown"])
    assert markdown.exit_code == 0 and "Pre L=3: FFN fc2" in markdown.output


# ----------------------------------------------------------------------------- 17. mixed engines


def _mixed_folder(tmp_path: Path) -> Path:
    """DIVERGING's sweep trained by the batched engine, but seed 1 of pre at lr 0.01 by the fast engine
    (as a fast sweep resumed over exact runs keeps them): the cell (pre, 0.01) averages both."""
    folder = write_curves(tmp_path / "mixed", DIVERGING, engine="batched")
    for placement, lr, seed, losses, status, *_ in DIVERGING:
        if (placement, lr, seed) == ("pre", 0.01, 1):
            cfg = RunConfig.model_validate({"norm": {"placement": placement}, "optim": {"lr": lr}, "seed": seed,
                                            "schedule": {"kind": "linear_warmup", "warmup_steps": 0},
                                            "train": {"steps": 3, "stop_on_nonfinite": False}})
            n = len(losses)
            metrics = {"step": list(range(n)), "loss": list(losses), "acc": [0.1] * n, "lr": [lr] * n,
                       "grad_norm": [1.0] * n}
            import shutil

            shutil.rmtree(folder / run_id(cfg))
            write_run(folder / run_id(cfg), cfg, FinishedRun(metrics, status, 0.1, 1, "fast", "cpu"))
    return folder


def test_a_folder_of_two_engines_says_so_wherever_its_numbers_are_shown(tmp_path):
    folder = _mixed_folder(tmp_path)
    runner = CliRunner()
    for args in ([], ["--format", "markdown"], ["--pivot", "optim.lr,norm.placement"],
                 ["--pivot", "optim.lr,norm.placement", "--format", "markdown"], ["--lr-sensitivity"],
                 ["--lr-sensitivity", "--format", "markdown"], ["--by", "norm.placement"]):
        result = runner.invoke(app, ["report", str(folder), *args])
        assert result.exit_code == 1, result.output  # printed; 1: DIVERGING leaves NoNorm's seed 1 missing
        text = " ".join(result.stdout.split())
        assert "Engines mixed: 1 of 9 runs by the fast engine" in text, (args, text)
        assert "--engine batched" in text
    table = " ".join(runner.invoke(app, ["report", str(folder)]).stdout.split())
    assert "cells that average both: Pre lr=0.01 (1 fast, 1 batched)" in table
    by = " ".join(runner.invoke(app, ["report", str(folder), "--by", "norm.placement"]).stdout.split())
    assert "Pre (1 fast, 5 batched)" in by
    for args in (["--format", "csv"], ["--pivot", "optim.lr,norm.placement", "--format", "csv"],
                 ["--lr-sensitivity", "--format", "csv"]):
        result = runner.invoke(app, ["report", str(folder), *args])
        assert result.exit_code == 1 and "Engines mixed" in result.stderr and "Engines" not in result.stdout
    checked = runner.invoke(app, ["verify", str(folder)])
    assert checked.exit_code == 1, checked.output  # the missing runs; the engines are a note
    assert "note: runs of two engines" in " ".join(checked.stdout.split())
    assert "runs of two engines: 1 of 9 by the fast engine" in " ".join(checked.stdout.split())
    assert runner.invoke(app, ["plot", str(folder)]).exit_code == 1 and (folder / "loss-lr.png").is_file()


def test_one_engine_says_nothing(tmp_path):
    from normexp.analysis.variants import engine_note
    from normexp.report import build_report
    from normexp.results import load_summary

    folder = write_curves(tmp_path / "one", DIVERGING, engine="fast")
    assert engine_note(load_summary(folder), ["norm.placement"]) == "" and build_report(folder).engines == ""
    assert "engines" not in CliRunner().invoke(app, ["verify", str(folder)]).stdout


# ----------------------------------------------------------------------------- 12. plot --blocks, nothing to draw


@pytest.mark.parametrize(("steps", "metric"), [(2, "norm_out_rms"), (2, "norm_rms"), (0, "fc2_update"),
                                               (0, "fc1_update"), (2, "fc2_update")])
def test_plot_blocks_where_a_variant_has_no_values_draws_an_empty_panel(write_yaml, tmp_path, steps, metric):
    import matplotlib.pyplot as plt

    from normexp.figures import blocks_figure
    from normexp.results import load_blocks

    config = write_yaml(f"name: b\nbase: "
                        f"{{model: {{depth: 2, width: 4}}, train: {{steps: {steps}, log_blocks: true}}}}\n"
                        "grid: {norm.placement: [post, pre, none, rezero, sandwich]}\n")
    out = tmp_path / "out"
    runner = CliRunner()
    assert runner.invoke(app, ["sweep", str(config), "--out", str(out), "--quiet"]).exit_code == 0
    result = runner.invoke(app, ["plot", str(out), "--blocks", "--block-metric", metric])
    assert result.exit_code == 0, result.output
    assert (out / f"blocks-{metric}.png").stat().st_size > 0 and "Traceback" not in result.output
    tidy = load_blocks(out, all_config=True)
    fig = blocks_figure(tidy, ["norm.placement"], metric)
    said = {ax.get_title().split(" (")[0]: " ".join(t.get_text() for t in ax.texts)
            for ax in fig.axes if ax.get_title()}
    plt.close(fig)
    for label, placement in (("Post", "post"), ("Pre", "pre"), ("NoNorm", "none"), ("ReZero", "rezero"),
                             ("Sandwich", "sandwich")):
        values = tidy.loc[tidy["norm.placement"] == placement, metric].astype(float)
        empty = not ((values > 0) & values.map(math.isfinite)).any()
        assert (f"no {metric}" in said[label]) == empty, (label, said)
