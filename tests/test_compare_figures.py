"""Figures that compare (issue 49): folders compared facet by the key that differs, with no empty panel and
no key shown twice; panels wrap with the fewest empty slots; the per-block figure is a grid of small
multiples with whole-layer ticks and a clear error for a metric the runs did not record; the sampled
scatter shows each point once, its seeds averaged."""

from __future__ import annotations

import itertools

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from conftest import trained_sweep
from typer.testing import CliRunner

from normexp.cli import app
from normexp.compare import load_folders
from normexp.figures import blocks_figure, phase_scatter_figure, sweep_figures
from normexp.figures.blocks import block_ticks
from normexp.figures.facets import Facets, wrap_columns

SWEEP = """name: {name}
base:
  model: {{depth: {depth}, width: 8}}
  schedule: {{kind: linear_warmup}}
  train: {{steps: 3}}
grid:
  norm.placement: {placements}
  optim.lr: [0.01, 0.1]
  schedule.warmup_steps: [0, 2]
seeds: [0]
"""


def folder(tmp_path_factory, depth: int, placements: str = "[post, pre]") -> str:
    name = f"d{depth}{'' if placements == '[post, pre]' else '-' + placements.strip('[]').replace(', ', '')}"
    text = SWEEP.format(name=name, depth=depth, placements=placements)
    return str(trained_sweep(tmp_path_factory, name, text, "--engine", "batched", "--quiet"))


@pytest.fixture(scope="module")
def depths(tmp_path_factory):
    return [folder(tmp_path_factory, depth) for depth in (2, 3, 4)]


def shown(fig) -> list:
    """The panels a figure draws (its colour bars aside)."""
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


def titles(fig) -> list[str]:
    return [ax.get_title() for ax in shown(fig) if ax.get_visible()]


@pytest.mark.parametrize("count", [2, 3])
def test_folders_that_differ_in_depth_draw_every_panel_and_name_the_depth_once(depths, count):
    """`plot A B` where the sweep and the depth vary together drew the two phase panels on the diagonal of a
    2 x 2 grid (two empty panels), and 3 folders a 3 x 3 diagonal; the sweep and the depth each made panels."""
    figures = sweep_figures(load_folders(depths[:count]))
    assert [suffix for suffix, _, _ in figures] == ["", "-phase"]
    for suffix, fig, _ in figures:
        assert all(ax.get_visible() for ax in shown(fig)), (suffix, [ax.get_visible() for ax in shown(fig)])
        for title in titles(fig):  # the depth (panels, or lines), never the folder besides
            assert title.count("depth=") <= 1 and "out" not in title and "sweep" not in title
        plt.close(fig)
    curves = sweep_figures(load_folders(depths[:2]))[0][1]
    assert sorted(titles(curves)) == ["Post depth=2 (n=4)", "Post depth=3 (n=4)", "Pre depth=2 (n=4)",
                                      "Pre depth=3 (n=4)"]
    plt.close(curves)


def test_folders_whose_keys_do_not_cross_list_their_panels(tmp_path_factory, depths):
    """Depth 2 with both placements, depth 5 with Pre-LN only: a depth x placement grid would leave a slot
    empty; the three panels are listed in one row instead."""
    pre_only = folder(tmp_path_factory, 5, "[pre]")
    for suffix, fig, _ in sweep_figures(load_folders([depths[0], pre_only])):
        assert all(ax.get_visible() for ax in shown(fig)) and len(shown(fig)) == 3, suffix
        plt.close(fig)


def test_a_key_is_never_drawn_twice():
    """The comparison figures showed one key as panel columns and as line style: `sweep` and model.depth."""
    from normexp.figures.facets import constants_text

    frame = pd.DataFrame({"sweep": ["a", "a", "b", "b"], "model.depth": [4, 4, 8, 8], "seed": [0, 1, 0, 1],
                          "norm.placement": ["post"] * 4})
    assert constants_text(frame).endswith("sweeps a at depth=4, b at depth=8")


@pytest.mark.parametrize(("count", "across"), [(1, 1), (3, 3), (4, 4), (5, 5), (6, 3), (7, 4), (8, 4), (9, 3),
                                                (10, 5), (12, 4), (24, 4)])
def test_panels_wrap_with_the_fewest_empty_slots(count, across):
    assert wrap_columns(count) == across
    from normexp.figures.facets import panels

    frame = pd.DataFrame({"model.depth": range(count), "x": 0})
    grid, n_rows, n_cols = panels(frame, Facets([], ["model.depth"], []))
    empty = sum(runs is None for line in grid for _, runs in line)
    assert n_cols == across and empty == n_rows * n_cols - count < n_cols


# ----------------------------------------------------------------------------- per-block small multiples


def blocks(depth: int, placements=("post", "pre"), lrs=(0.003, 0.01, 0.03), warmups=(0, 2, 5, 10), seeds=(0, 1)):
    rows = []
    for placement, lr, warmup, seed in itertools.product(placements, lrs, warmups, seeds):
        run = f"{placement}-{lr}-{warmup}-s{seed}"
        for step, block in itertools.product(range(0, 20, 5), range(1, depth + 1)):
            rows.append({"run_id": run, "norm.placement": placement, "optim.lr": lr, "schedule.warmup_steps": warmup,
                         "seed": seed, "step": step, "block": block,
                         "fc2_update": lr * (1 + block) / (1 + step) * (1.5 if placement == "post" else 1.0)})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("depth", [4, 32])
def test_the_blocks_figure_is_a_grid_of_small_multiples_with_whole_layer_ticks(depth):
    """24 variants drew one 10,582 px column with titles over each other; a 4-layer model ticked half layers."""
    tidy = blocks(depth)
    fig = blocks_figure(tidy, ["norm.placement", "optim.lr", "schedule.warmup_steps"], "fc2_update")
    fig.canvas.draw()
    panels = [ax for ax in shown(fig) if ax.get_visible()]
    assert len(panels) == 24 and all(ax.collections for ax in panels)
    assert fig.get_figheight() * 110 < 2200 and fig.get_figwidth() / fig.get_figheight() > 0.8  # rows and columns
    for ax in panels:
        ticks = ax.get_yticks()
        assert list(ticks) == block_ticks(depth) and all(float(t).is_integer() for t in ticks)
        assert ticks[0] == 1 and ticks[-1] == depth
    boxes = [ax.title.get_window_extent() for ax in panels]
    assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))  # no title over another
    peak = tidy.groupby(["norm.placement", "optim.lr", "schedule.warmup_steps", "block", "step"])["fc2_update"].mean()
    said = [t.get_text() for ax in panels for t in ax.texts if t.get_text().startswith("max ")]
    assert f"max {peak.max():.3g}" in " ".join(said)  # each panel names its largest value
    plt.close(fig)


@pytest.mark.parametrize(("depth", "ticks"), [(4, [1, 2, 3, 4]), (8, list(range(1, 9))), (12, [1, 2, 4, 6, 8, 10, 12]),
                                               (24, [1, 4, 8, 12, 16, 20, 24]), (32, [1, 8, 16, 24, 32])])
def test_block_ticks_are_whole_layers_first_and_last_included(depth, ticks):
    assert block_ticks(depth) == ticks


def test_an_attention_metric_of_ffn_runs_is_a_clear_error(tmp_path):
    """It was an 89-line KeyError traceback (issue 46, item 15)."""
    config = tmp_path / "b.yaml"
    config.write_text("name: b\nbase: {model: {depth: 2, width: 4}, train: {steps: 2, log_blocks: true}}\n")
    runner = CliRunner()
    assert runner.invoke(app, ["sweep", str(config), "--out", str(tmp_path / "b"), "-q"]).exit_code == 0
    for metric in ("attn_logit_max", "attn_entropy", "log_z"):
        result = runner.invoke(app, ["plot", str(tmp_path / "b"), "--blocks", "--block-metric", metric])
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert f"--block-metric {metric}: recorded by Transformer runs only" in " ".join(result.output.split())
    assert not list((tmp_path / "b").glob("blocks-*"))


# ----------------------------------------------------------------------------- the sampled scatter


def test_the_sampled_scatter_shows_each_point_once_its_seeds_averaged():
    """One marker per seed at the same (lr, warmup) hid the other seed's colour (issue 46, item 17)."""
    rng = np.random.default_rng(0)
    points = [(float(lr), int(w)) for lr, w in zip(np.exp(rng.uniform(-7, -2, 6)), rng.integers(0, 10, 6))]
    rows = [{"run_id": f"r{i}-s{seed}", "optim.lr": lr, "schedule.warmup_steps": w, "seed": seed,
             "status": "completed", "final": 0.1 * (i + 1) * (1 + seed), "trained": seed == 0}
            for i, (lr, w) in enumerate(points) for seed in (0, 1)]
    fig = phase_scatter_figure(pd.DataFrame(rows), "optim.lr", "schedule.warmup_steps", "loss", Facets([], [], []),
                               trained_below=0.2)
    drawn = shown(fig)[0].collections[0]
    assert len(drawn.get_offsets()) == len(points)
    means = sorted(drawn.get_array())
    assert means == pytest.approx(sorted(0.1 * (i + 1) * 1.5 for i in range(len(points))))
    assert "mean over its 2 seeds" in " ".join(fig._suptitle.get_text().split())
    plt.close(fig)

