"""The 'what mattered' ANOVA against statsmodels' type-II `anova_lm`, and the F tail against scipy's."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest

from normexp.analysis.anova import COLUMNS, RESIDUAL, anova, f_sf

statsmodels_formula = pytest.importorskip("statsmodels.formula.api")
anova_lm = pytest.importorskip("statsmodels.stats.anova").anova_lm


def grid(levels: dict[str, list], seeds: int, rng: np.random.Generator) -> pd.DataFrame:
    """A full factorial grid with `seeds` replicates, a metric with main effects, one interaction and noise."""
    rows = []
    for values in itertools.product(*levels.values()):
        for seed in range(seeds):
            rows.append({**dict(zip(levels, values)), "seed": seed})
    frame = pd.DataFrame(rows)
    effect = sum(frame[key].astype("category").cat.codes * rng.normal() for key in levels)
    first, second = list(levels)[:2]
    effect = effect + (frame[first].astype("category").cat.codes * frame[second].astype("category").cat.codes
                       * rng.normal())
    frame["final_loss"] = 1.0 + effect + rng.normal(scale=0.3, size=len(frame))
    return frame


def statsmodels_table(frame: pd.DataFrame, factors: list[str]) -> pd.DataFrame:
    renamed = frame.rename(columns={key: f"f{i}" for i, key in enumerate(factors)})
    names = [f"f{i}" for i in range(len(factors))]
    terms = [f"C({name})" for name in names] + [f"C({a}):C({b})" for a, b in itertools.combinations(names, 2)]
    fit = statsmodels_formula.ols("final_loss ~ " + " + ".join(terms), data=renamed).fit()
    table = anova_lm(fit, typ=2)
    mapping = {f"f{i}": key for i, key in enumerate(factors)}
    table.index = [RESIDUAL if index == "Residual" else ":".join(mapping[part[2:-1]] for part in index.split(":"))
                   for index in table.index]
    return table


def assert_matches(ours: pd.DataFrame, theirs: pd.DataFrame) -> None:
    ours = ours.set_index("term")
    assert set(ours.index) == set(theirs.index)
    for term in theirs.index:
        for mine, their in (("df", "df"), ("sum_sq", "sum_sq"), ("F", "F"), ("p", "PR(>F)")):
            expected, got = theirs.loc[term, their], ours.loc[term, mine]
            if math.isnan(expected):
                assert math.isnan(got), (term, mine)
            else:
                assert got == pytest.approx(expected, rel=1e-8, abs=1e-300), (term, mine, got, expected)


@pytest.mark.parametrize("levels,seeds", [
    ({"norm.placement": ["post", "pre"], "optim.lr": [1e-3, 1e-2, 1e-1]}, 3),
    ({"norm.placement": ["post", "pre", "peri"], "optim.lr": [1e-3, 1e-2], "model.depth": [4, 8]}, 2),
    ({"a": [1, 2, 3, 4], "b": ["x", "y"], "c": [0.5, 1.5, 2.5]}, 1),  # unreplicated: the 3-way is the residual
])
def test_balanced_grid_equals_statsmodels_type2(levels, seeds):
    frame = grid(levels, seeds, np.random.default_rng(len(levels) * 10 + seeds))
    result = anova(frame, list(levels), "final_loss")
    assert result.balanced and result.replicates == seeds
    assert list(result.table.columns) == list(COLUMNS)
    assert_matches(result.table, statsmodels_table(frame, list(levels)))
    # balanced: the terms and the residual partition the total sum of squares
    assert result.table["share"].sum() == pytest.approx(1.0, rel=1e-10)


def test_unbalanced_grid_equals_statsmodels_and_says_so():
    frame = grid({"a": ["p", "q", "r"], "b": [1, 2]}, 3, np.random.default_rng(7))
    frame = frame.drop(index=[0, 4, 10]).reset_index(drop=True)
    result = anova(frame, ["a", "b"], "final_loss")
    assert not result.balanced
    assert_matches(result.table, statsmodels_table(frame, ["a", "b"]))
    assert any("unbalanced" in note for note in result.notes)


def test_diverged_runs_are_left_out_and_counted():
    frame = grid({"a": ["p", "q"], "b": [1, 2]}, 3, np.random.default_rng(3))
    frame.loc[2, "final_loss"] = float("inf")
    result = anova(frame, ["a", "b"], "final_loss")
    assert result.n_runs == len(frame) - 1 and not result.balanced
    assert any(note.startswith("1 of 12 runs left out") for note in result.notes)


def test_empty_cell_interaction_is_named_not_estimated():
    frame = grid({"a": ["p", "q"], "b": [1, 2]}, 2, np.random.default_rng(5))
    frame = frame[~((frame["a"] == "q") & (frame["b"] == 2))]
    result = anova(frame, ["a", "b"], "final_loss")
    assert "a:b" not in set(result.table["term"])
    assert any(note.startswith("a:b cannot be estimated") for note in result.notes)


def test_unreplicated_two_axes_has_no_test():
    frame = grid({"a": ["p", "q", "r"], "b": [1, 2]}, 1, np.random.default_rng(9))
    result = anova(frame, ["a", "b"], "final_loss")
    residual = result.table.set_index("term").loc[RESIDUAL]
    assert residual["df"] == 0
    assert result.table["F"].isna().all() and result.table["p"].isna().all()
    assert any("no residual degrees of freedom" in note for note in result.notes)


def test_constant_axis_is_named():
    frame = grid({"a": ["p", "q"], "b": [1, 2]}, 2, np.random.default_rng(11))
    frame["c"] = 5
    result = anova(frame, ["a", "b", "c"], "final_loss")
    assert result.factors == ("a", "b")
    assert any("c: one value only" in note for note in result.notes)


@pytest.mark.parametrize("f,df1,df2", [(0.3, 1, 1), (2.5, 3, 12), (40.0, 2, 30), (1e-6, 5, 5), (7.0, 40, 3),
                                       (1e3, 1, 100), (0.99, 200, 250), (12.0, 4, 1000)])
def test_f_tail_equals_scipy(f, df1, df2):
    stats = pytest.importorskip("scipy.stats")
    assert f_sf(f, df1, df2) == pytest.approx(stats.f.sf(f, df1, df2), rel=1e-10, abs=1e-300)


def test_balanced_grids_take_the_sums_of_squares_from_the_means_as_least_squares_does():
    """The balanced path (`_balanced`, linear in the runs) against the least squares of `_type2`."""
    from normexp.analysis.anova import _balanced, _level_code, _levels, _type2

    for seed, (levels, seeds) in enumerate([({"a": [1, 2, 3], "b": ["x", "y"], "c": [0, 1]}, 3),
                                            ({"a": list(range(5)), "b": [0.1, 0.2, 0.3, 0.4]}, 2)]):
        frame = grid(levels, seeds, np.random.default_rng(100 + seed))
        y = frame["final_loss"].to_numpy()
        found = {k: _levels(frame[k]) for k in levels}
        codes = {k: frame[k].map(_level_code(found[k])).to_numpy() for k in levels}
        terms = [(k,) for k in levels] + list(itertools.combinations(levels, 2))
        fast, (fast_ss, fast_df) = _balanced(y, codes, found, terms)
        slow, (slow_ss, slow_df) = _type2(y, codes, found, terms, [])
        assert [(t, df) for t, df, _ in fast] == [(t, df) for t, df, _ in slow] and fast_df == slow_df
        assert [ss for *_, ss in fast] == pytest.approx([ss for *_, ss in slow], rel=1e-9)
        assert fast_ss == pytest.approx(slow_ss, rel=1e-9)


# ----------------------------------------------------------------------------- a sweep folder's "what mattered"

GRID = """name: mattered
base:
  model: {depth: 2, width: 8}
  schedule: {kind: linear_warmup}
  train: {steps: 3}
grid:
  norm.placement: [post, pre]
  optim.lr: [0.01, 0.1, 1.0]
  schedule.warmup_steps: [0, 2]
seeds: [0, 1]
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from conftest import trained_sweep

    return trained_sweep(tmp_path_factory, "mattered", GRID, "--engine", "batched", "--quiet")


def test_a_folders_csv_equals_statsmodels_on_its_final_losses(folder):
    """`anova_to_csv(what_mattered(DIR))`, what `report --anova --format csv` prints: exactly the columns term,
    df, sum_sq, mean_sq, F, p, share, equal to anova_lm (typ=2) of summary.csv's final losses to 1e-8."""
    import csv
    import io

    from normexp.analysis.anova import what_mattered
    from normexp.results import load_summary
    from normexp.tables import anova_to_csv

    rows = list(csv.DictReader(io.StringIO(anova_to_csv(what_mattered(folder)))))
    assert list(rows[0]) == list(COLUMNS)
    summary = load_summary(folder)
    keys = ["norm.placement", "optim.lr", "schedule.warmup_steps"]
    theirs = statsmodels_table(summary, keys)
    ours = pd.DataFrame([{k: (v if k == "term" else float(v) if v else math.nan) for k, v in row.items()}
                         for row in rows])
    assert_matches(ours, theirs)
    total = ((summary["final_loss"] - summary["final_loss"].mean()) ** 2).sum()
    assert ours.set_index("term")["share"].to_numpy() == pytest.approx(theirs["sum_sq"].to_numpy() / total, rel=1e-8)


def test_keys_that_vary_together_are_one_factor_named_by_the_config_key():
    """Folders compared, each at its own depth: `sweep` and model.depth split the runs alike; one factor
    (an ANOVA of both would estimate neither), named by what differs: the depth."""
    from normexp.analysis.variants import distinct_keys

    frame = pd.DataFrame({"sweep": ["a", "a", "b", "b"], "model.depth": [4, 4, 8, 8],
                          "norm.placement": ["post", "pre", "post", "pre"]})
    assert distinct_keys(frame, ["sweep", "model.depth", "norm.placement"]) == (
        ["model.depth", "norm.placement"], {"model.depth": ["sweep"]})
    frame["model.depth"] = [4, 8, 4, 8]  # crossed with the sweep, not aliased: both stay
    assert distinct_keys(frame, ["sweep", "model.depth"]) == (["sweep", "model.depth"], {})


def test_sampled_points_get_no_anova_but_a_reason(tmp_path):
    from typer.testing import CliRunner

    from normexp.analysis.anova import what_mattered
    from normexp.cli import app
    from normexp.results import ResultsError

    text = GRID.replace("  optim.lr: [0.01, 0.1, 1.0]\n  schedule.warmup_steps: [0, 2]\n", "").replace(
        "seeds: [0, 1]", "seeds: [0]\nsample: {n: 4, seed: 0, optim.lr: {loguniform: [0.001, 0.1]}}")
    (tmp_path / "s.yaml").write_text(text)
    result = CliRunner().invoke(app, ["sweep", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "s"), "-q"])
    assert result.exit_code == 0, result.output
    with pytest.raises(ResultsError, match="sampled points, not a factorial grid"):
        what_mattered(tmp_path / "s")
