"""Ranges and sampled search (normexp/config/sample.py): logspace/linspace in grids and --set, and the
`sample:` section, seeded, expanding to the same runs every time and read back from sweep.yaml."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from normexp.config import ConfigError, build_sweep, flatten, load_sweep, parse_set, parse_yaml
from normexp.config.sample import expand_range
from normexp.folder import run_id

BASE = {"train": {"steps": 3}, "schedule": {"kind": "linear_warmup"}}


def sweep(**sections):
    return build_sweep({"name": "s", "base": BASE, **sections})


def values(s, key):
    return [flatten(cfg)[key] for cfg in s.runs]


def test_logspace_is_geometric_with_exact_ends():
    assert expand_range("logspace(1e-4, 1e-1, 4)", "k") == [1e-4, 1e-3, 1e-2, 1e-1]
    got = expand_range("logspace(1e-4,1e-1,7)", "k")
    assert got[0] == 1e-4 and got[-1] == 1e-1 and len(got) == 7
    ratios = [b / a for a, b in zip(got, got[1:])]
    assert all(math.isclose(r, 10 ** 0.5, rel_tol=1e-10) for r in ratios)


def test_linspace_keeps_ints_when_both_ends_are_ints():
    assert expand_range("linspace(0, 100, 5)", "k") == [0, 25, 50, 75, 100]
    assert all(type(v) is int for v in expand_range("linspace(0, 100, 5)", "k"))
    assert expand_range("linspace(0, 1, 3)", "k") == [0, 0.5, 1]
    assert expand_range("linspace(0.0, 1.0, 3)", "k") == [0.0, 0.5, 1.0]


@pytest.mark.parametrize(("text", "expected"), [
    ("linspace(1e308, -1e308, 3)", [1e308, 0.0, -1e308]),
    ("linspace(-1e308, 1e308, 5)", [-1e308, -5e307, 0.0, 5e307, 1e308]),
    ("linspace(-1.7e308, 1.7e308, 2)", [-1.7e308, 1.7e308]),
])
def test_linspace_between_huge_ends_stays_finite(text, expected):
    """b - a overflowed: linspace(1e308, -1e308, 3) had -inf in the middle, and the error named -inf."""
    got = expand_range(text, "k")
    assert got == expected and all(math.isfinite(v) for v in got)
    with pytest.raises(ConfigError, match=r"^grid.optim.lr: must be > 0") as refused:
        sweep(grid={"optim.lr": text})
    assert "inf" not in str(refused.value)  # a value the range holds, never one it does not


def test_ranges_in_the_grid_and_in_set_give_the_same_runs():
    in_file = sweep(grid={"optim.lr": "logspace(1e-3, 1e-1, 3)", "schedule.warmup_steps": "linspace(0, 2, 3)"})
    on_line = build_sweep({"name": "s", "base": BASE},
                          ["optim.lr=logspace(1e-3,1e-1,3)", "schedule.warmup_steps=linspace(0, 2, 3)"])
    assert [run_id(c) for c in in_file.runs] == [run_id(c) for c in on_line.runs]
    assert sorted(set(values(in_file, "optim.lr"))) == [1e-3, 0.01, 0.1]
    assert in_file.grid["optim.lr"] == [1e-3, 0.01, 0.1]  # sweep.yaml records the values
    # a range among listed values is spliced in
    assert parse_set("optim.lr=0.5,logspace(1e-3,1e-1,3)")[1] == [0.5, 1e-3, 0.01, 0.1]


def test_the_docs_range_among_listed_values_works_in_a_yaml_flow_list():
    """docs/configs.md's `schedule.warmup_steps: [0, linspace(10, 100, 4)]` failed: YAML's flow list cuts a
    plain scalar at each comma ([0, 'linspace(10', 100, '4)']), and the error named 'linspace(10'."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "configs.md").read_text()
    line = next(x for x in docs.splitlines() if "[0, linspace(10, 100, 4)]" in x)
    key, _, comment = line.partition("#")
    text = f"name: s\nbase: {{schedule: {{kind: linear_warmup}}}}\ngrid:\n{key}\n"
    s = build_sweep(parse_yaml(text))
    expected = [int(v) for v in comment.split(",")]  # what the docs' comment says
    assert s.grid["schedule.warmup_steps"] == expected == [0, 10, 40, 70, 100]
    assert values(s, "schedule.warmup_steps") == expected
    spliced = build_sweep(parse_yaml("name: s\ngrid:\n  optim.lr: [0.5, logspace(1.0e-3, 1e-1, 3), 0.7]\n"))
    assert spliced.grid["optim.lr"] == [0.5, 1e-3, 0.01, 0.1, 0.7]
    with pytest.raises(ConfigError, match=r"^grid.optim.lr: 'linspace\(1, 2' .*no closing parenthesis"):
        build_sweep(parse_yaml("name: s\ngrid:\n  optim.lr: [0.5, linspace(1, 2]\n"))


@pytest.mark.parametrize(("text", "message"), [
    ("logspace(0, 1, 3)", "grid.optim.lr: logspace's ends must be > 0"),
    ("logspace(1e-3, 1e-1)", "grid.optim.lr: logspace(a, b, n) takes three numbers"),
    ("linspace(0, 1, 1)", "grid.optim.lr: linspace's n must be an integer >= 2"),
    ("linspace(0, 1, 2.5)", "grid.optim.lr: linspace's n must be an integer >= 2"),
    ("linspace(a, 1, 3)", "grid.optim.lr: linspace's a: 'a' is not a number"),
    ("linspace(0, inf, 3)", "grid.optim.lr: linspace's b: 'inf' is not a finite number"),
])
def test_bad_ranges_name_the_key(text, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        sweep(grid={"optim.lr": text})


def test_bad_range_in_set_names_the_option():
    with pytest.raises(ConfigError, match=r"^--set optim.lr: logspace's ends must be > 0"):
        build_sweep({"name": "s", "base": BASE}, ["optim.lr=logspace(-1,1,3)"])


SAMPLE = {"n": 8, "seed": 3, "optim.lr": {"loguniform": [1e-4, 1e-1]},
          "schedule.warmup_steps": {"uniform": [0, 2]}, "norm.placement": {"choice": ["pre", "post"]}}


@pytest.mark.parametrize("method", ["random", "sobol"])
def test_a_seeded_sample_expands_to_the_same_runs_twice(method):
    if method == "sobol":
        pytest.importorskip("scipy")
    first, second = (sweep(sample={**SAMPLE, "method": method}) for _ in range(2))
    ids = [run_id(c) for c in first.runs]
    assert ids == [run_id(c) for c in second.runs] and len(set(ids)) == 8
    lrs = values(first, "optim.lr")
    assert all(1e-4 <= lr <= 1e-1 for lr in lrs)
    assert set(values(first, "schedule.warmup_steps")) <= {0, 1, 2}
    assert set(values(first, "norm.placement")) <= {"pre", "post"}
    assert first.varying_keys[:1] == ["optim.lr"]
    other = sweep(sample={**SAMPLE, "method": method, "seed": 4})
    assert [run_id(c) for c in other.runs] != ids


def test_sweep_yaml_records_the_points_and_reads_back_to_the_same_runs():
    first = sweep(grid={"norm.kind": ["layernorm", "rmsnorm"]}, sample={**SAMPLE, "n": 4}, seeds=[0, 1])
    assert len(first.runs) == 2 * 4 * 2
    again = build_sweep(parse_yaml(first.to_yaml()))
    assert [run_id(c) for c in again.runs] == [run_id(c) for c in first.runs]
    assert again.sample["points"] == first.sample["points"]
    # points listed by hand are used as they are
    listed = sweep(sample={"optim.lr": {"loguniform": [1e-4, 1e-1]}, "points": [{"optim.lr": 0.003}]})
    assert values(listed, "optim.lr") == [0.003]


def test_sobol_points_fill_the_unit_square_evenly():
    pytest.importorskip("scipy")
    s = sweep(sample={"n": 16, "method": "sobol", "optim.lr": {"uniform": [0.0, 1.0]},
                      "optim.eps": {"uniform": [0.0, 1.0]}})
    points = [(flatten(c)["optim.lr"], flatten(c)["optim.eps"]) for c in s.runs]
    for axis in (0, 1):  # a (t, m, s)-net: each quarter of each axis holds exactly 4 of 16 points
        assert sorted(sum(1 for p in points if q / 4 <= p[axis] < (q + 1) / 4) for q in range(4)) == [4] * 4


@pytest.mark.parametrize(("section", "message"), [
    ({"seed": 0, "optim.lr": {"uniform": [0.1, 1]}}, r"sample.n: must be an integer from 1"),
    ({"n": 2, "method": "grid", "optim.lr": {"uniform": [0.1, 1]}}, r"sample.method: must be one of random, sobol"),
    ({"n": 2, "optim.lr": {"normal": [0, 1]}}, r"sample.optim.lr: must be one of \{loguniform"),
    ({"n": 2, "optim.lr": {"loguniform": [0, 1]}}, r"sample.optim.lr.loguniform: lo must be > 0"),
    ({"n": 2, "optim.lr": {"uniform": [1, 0.5]}}, r"sample.optim.lr.uniform: lo must be < hi"),
    ({"n": 2, "optim.lrr": {"uniform": [0.1, 1]}}, r"sample.optim.lrr: unknown key \(did you mean 'optim.lr'"),
    ({"n": 2}, r"sample: names no axis"),
    ({"n": 2, "optim.lr": {"uniform": [-1.0, -0.5]}}, r"^sample.optim.lr: must be > 0"),
    # points that are no list gave a TypeError; none gave a sweep of 0 runs; n beside them was ignored
    ({"optim.lr": {"uniform": [0.1, 1]}, "points": 3}, r"^sample.points: must be a list of 1 to"),
    ({"optim.lr": {"uniform": [0.1, 1]}, "points": []}, r"^sample.points: must be a list of 1 to"),
    ({"n": 3, "optim.lr": {"uniform": [0.1, 1]}, "points": [{"optim.lr": 0.5}]}, r"^sample.n: 3, but sample.points"),
])
def test_bad_sample_sections_name_the_key(section, message):
    with pytest.raises(ConfigError, match=message):
        sweep(sample=section)


def test_many_draws_of_few_runs_cost_the_distinct_runs_and_past_the_limit_nothing(monkeypatch):
    """`n: 1000000` over one `choice` axis: minutes at 100% CPU in `validate`, resolving a run per draw.
    Now a draw of values drawn before is not resolved again, and an n past the run limit is refused before
    any point is drawn."""
    import normexp.config.sample as sample
    from normexp.config import RunConfig

    real, resolved = RunConfig.model_validate, []
    monkeypatch.setattr(RunConfig, "model_validate", staticmethod(lambda data, *a, **k: (resolved.append(1),
                                                                                         real(data, *a, **k))[1]))
    drawn = sample._unit_points
    draws = []
    monkeypatch.setattr(sample, "_unit_points", lambda n, *a: (draws.append(n), drawn(n, *a))[1])
    s = build_sweep({"name": "s", "base": BASE, "grid": {"optim.lr": [0.1, 0.01]}, "seeds": [0, 1],
                     "sample": {"n": 100_000, "norm.placement": {"choice": ["pre", "post"]}}})
    assert draws == [100_000] and len(s.runs) == 8
    assert len(resolved) <= 8  # 2 lrs x 2 placements (and the base): not 200,000
    with pytest.raises(ConfigError, match=r"^sample.n: must be an integer from 1 to 100000"):
        build_sweep({"name": "s", "base": BASE, "sample": {"n": 100_001, "norm.placement": {"choice": ["pre"]}}})
    assert draws == [100_000]  # refused before drawing


def test_repeated_draws_give_the_runs_every_draw_resolved_would():
    """The same runs, in the same order, as resolving each (grid point, draw, seed) and keeping the first."""
    section = {"n": 40, "seed": 5, "norm.placement": {"choice": ["pre", "post", "peri"]},
               "schedule.warmup_steps": {"uniform": [0, 3]}}
    s = build_sweep({"name": "s", "base": BASE, "grid": {"optim.lr": [0.1, 0.01]}, "seeds": [2, 1],
                     "sample": section})
    expected = {}
    for lr in (0.1, 0.01):
        for point in s.sample["points"]:
            for seed in (2, 1):
                cfg = build_sweep({"name": "s", "base": BASE, "grid": {"optim.lr": [lr], **{
                    k: [v] for k, v in point.items()}}, "seeds": [seed]}).runs[0]
                expected.setdefault(run_id(cfg), None)
    assert [run_id(c) for c in s.runs] == list(expected) and len(expected) == 2 * 3 * 4 * 2


@pytest.mark.parametrize(("base", "key", "spec"), [
    ({"optim": {"name": "adam"}}, "optim.momentum", {"uniform": [0.5, 0.99]}),
    ({"norm": {"placement": "pre"}}, "norm.mixln_fraction", {"uniform": [0.1, 0.9]}),
    ({"schedule": {"kind": "linear_warmup"}}, "schedule.min_lr_ratio", {"choice": [0.1, 0.2]}),
    ({"model": {"arch": "transformer"}, "data": {"task": "copy"}}, "model.qk_norm_scope", {"choice": ["head", "full"]}),
])
def test_a_sampled_key_no_run_uses_is_refused_by_the_grids_rule(base, key, spec):
    """A sample over optim.momentum under Adam drew 8 values that all went back to the default: 1 run, no
    word. It is refused as the same grid axis is, in the same words."""
    values = spec.get("choice") or spec["uniform"]
    with pytest.raises(ConfigError) as as_grid:
        build_sweep({"name": "s", "base": base, "grid": {key: values}})
    with pytest.raises(ConfigError) as as_sample:
        build_sweep({"name": "s", "base": base, "sample": {"n": 8, key: spec}})
    assert str(as_sample.value) == str(as_grid.value).replace(f"grid.{key}", f"sample.{key}")
    assert str(as_sample.value).startswith(f"sample.{key}: has no effect: only ")


def test_a_sampled_key_some_run_uses_is_kept():
    s = build_sweep({"name": "s", "base": BASE, "grid": {"optim.name": ["sgd", "adam"]},
                     "sample": {"n": 4, "optim.momentum": {"uniform": [0.5, 0.99]}}})
    assert len(s.runs) == 5  # 4 sgd runs, one per momentum; the adam runs are one


def test_a_key_both_sampled_and_in_the_grid_is_refused():
    with pytest.raises(ConfigError, match=r"sample.optim.lr: also a grid axis"):
        sweep(grid={"optim.lr": [0.1]}, sample={"n": 2, "optim.lr": {"uniform": [0.1, 1]}})
    with pytest.raises(ConfigError, match=r"sample.optim.lr: also a grid axis"):
        build_sweep({"name": "s", "base": BASE, "sample": {"n": 2, "optim.lr": {"uniform": [0.1, 1]}}},
                    ["optim.lr=0.1"])


def test_sobol_without_scipy_names_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_scipy(name, *args, **kwargs):
        if name.startswith("scipy"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_scipy)
    with pytest.raises(ConfigError, match=r"sample.method: sobol needs scipy.*normexp\[sobol\]"):
        sweep(sample={"n": 2, "method": "sobol", "optim.lr": {"uniform": [0.1, 1]}})


@settings(max_examples=40, deadline=None)
@given(lo=st.floats(1e-6, 1.0), span=st.floats(1.01, 1e4), n=st.integers(2, 40))
def test_logspace_property(lo, span, n):
    hi = lo * span
    got = expand_range(f"logspace({lo!r}, {hi!r}, {n})", "k")
    assert len(got) == n and got[0] == lo and got[-1] == hi
    assert all(a < b for a, b in zip(got, got[1:]))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 20))
def test_random_sample_property(seed, n):
    section = {"n": n, "seed": seed, "optim.lr": {"loguniform": [1e-4, 1e-1]}}
    first, second = sweep(sample=section), sweep(sample=section)
    assert [run_id(c) for c in first.runs] == [run_id(c) for c in second.runs]
    assert all(1e-4 <= lr <= 1e-1 for lr in values(first, "optim.lr"))


def test_a_sample_file_loads(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nbase: {train: {steps: 3}}\nsample:\n  n: 3\n  seed: 0\n"
                    "  optim.lr: {loguniform: [1.0e-4, 1.0e-1]}\n")
    assert [run_id(c) for c in load_sweep(path).runs] == [run_id(c) for c in load_sweep(path).runs]


def _summary(s, loss=lambda flat: flat["optim.lr"]):
    import json

    import pandas as pd

    rows = [{"run_id": run_id(c), **{k: json.dumps(v) if isinstance(v, list) else v for k, v in flatten(c).items()},
             "status": "completed", "final_loss": loss(flatten(c))} for c in s.runs]
    return pd.DataFrame(rows)


def test_the_phase_diagram_of_sampled_points_is_a_labelled_scatter():
    from normexp.analysis.finals import is_sampled
    from normexp.figures import phase_figure

    sampled = _summary(sweep(sample={"n": 16, "optim.lr": {"loguniform": [1e-4, 1e-1]},
                                     "schedule.warmup_steps": {"uniform": [0, 2]}}))
    gridded = _summary(sweep(grid={"optim.lr": "logspace(1e-4, 1e-1, 4)", "schedule.warmup_steps": [0, 1, 2]}))
    assert is_sampled(sampled, "optim.lr", "schedule.warmup_steps")
    assert not is_sampled(gridded, "optim.lr", "schedule.warmup_steps")
    scatter = phase_figure(sampled, "optim.lr", "schedule.warmup_steps")
    assert "a scatter, not interpolated" in " ".join(scatter._suptitle.get_text().split())
    ax = scatter.axes[0]
    assert len(ax.collections[0].get_offsets()) == 16 and ax.get_xscale() == "log"
    assert "scatter" not in phase_figure(gridded, "optim.lr", "schedule.warmup_steps")._suptitle.get_text()


def test_logspace_between_integers_gives_integers_as_linspace_does():
    """`model.depth: logspace(2, 16, 4)` is depths 2, 4, 8, 16 (it was refused: 'must be an integer, got 4.0')."""
    assert expand_range("logspace(2, 16, 4)", "k") == [2, 4, 8, 16]
    assert all(type(v) is int for v in expand_range("logspace(2, 16, 4)", "k"))
    assert expand_range("logspace(1, 10, 3)", "k") == [1, 3.16227766017, 10]  # not every value one: as written
    assert values(sweep(grid={"model.depth": "logspace(2, 16, 4)"}), "model.depth") == [2, 4, 8, 16]
    lr = sweep(grid={"optim.lr": "logspace(1, 100, 3)"}).runs
    assert [run_id(c) for c in lr] == [run_id(c) for c in sweep(grid={"optim.lr": [1.0, 10.0, 100.0]}).runs]


def test_the_lr_sensitivity_of_a_sampled_lr_says_it_was_not_run_at_every_lr():
    """A variant of a sampled lr x warmup runs one lr of the four: its row read '— (an lr has no finished
    run)' with 0 missing, as if runs had failed."""
    from normexp.analysis.sensitivity import Sensitivity
    from normexp.tables import _sensitivity_value

    row = dict(label="Pre warmup=2", values={}, sensitivity=math.nan, spread=math.nan, best_lr=0.01, best_loss=1.6,
               lrs=1, grid_lrs=4, seeds=1, runs=1, diverged=0)
    assert _sensitivity_value(Sensitivity(**row, missing=0)) == "— (not run at every lr of the grid)"
    assert _sensitivity_value(Sensitivity(**row, missing=3)) == "— (an lr has no finished run)"
