"""The step at which a run stops early carries its held-out score (issue 47's follow-up).

The held-out split is scored at train.eval_every's steps and the last (`common.evaluates`); a run that
train.stop_when stops between two of them used to end with no val_loss at its last recorded step, so its
final val_loss (what a summary, a figure or the study's verdict reads) was missing or an older step's. The
stopping step is scored too, on every engine: the reference and the batched engine (which hands
Transformer runs to the reference) with the bits the same step has when eval_every schedules it, the fast
engine (uncompiled, and with its compiled Adam step, which updates the weights in place) within its
contract, and only for the runs that stop there.
"""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from normexp.analysis.finals import final_values
from normexp.analysis.realtext import final_val_losses
from normexp.cli import app
from normexp.config import validate_run
from normexp.engines.fast import aot, train_fast
from normexp.engines.fast import compiled as compiling
from normexp.engines.reference import train_run
from normexp.results import load_metrics

# stop_when trained under 4.3 nats (the loss starts at 4.66), patience 1: with these learning rates the runs
# stop at steps 1, 2, 2 and 7 (none a multiple of eval_every 5); at 1e-4 the run never stops
LRS = (0.1, 0.03, 0.01, 0.001, 0.0001)
STOPS = {0.1: 1, 0.03: 2, 0.01: 2, 0.001: 7, 0.0001: None}
STOP = {"stop_when": "trained", "stop_below": 4.3, "stop_patience": 1}


def text_run(lr: float = 0.01, seed: int = 0, steps: int = 12, eval_every: int = 5, **train) -> object:
    return validate_run({"model": {"arch": "transformer", "depth": 1, "width": 16, "n_heads": 2},
                         "data": {"task": "shakespeare_char", "seq_len": 12, "n_val": 7, "batch_size": 3},
                         "optim": {"name": "adam", "lr": lr},
                         "train": {"steps": steps, "threads": 1, "eval_every": eval_every, **train}, "seed": seed})


def scored_steps(metrics: dict[str, list[float]]) -> list[int]:
    return [int(s) for s, v in zip(metrics["step"], metrics["val_loss"]) if not math.isnan(v)]


def test_the_reference_scores_the_step_it_stops_at_with_that_steps_scheduled_bits():
    for lr in LRS[:4]:
        stopped = train_run(text_run(lr, **STOP))
        assert stopped.stopped_at == STOPS[lr], lr
        assert scored_steps(stopped.metrics) == sorted({0, 5, STOPS[lr]} & set(range(STOPS[lr] + 1))), lr
        # scored at every step, the stopping step's score is taken before its forward, as any scheduled one
        every = train_run(text_run(lr, eval_every=1, **STOP))
        for column in ("val_loss", "val_acc"):
            assert repr(stopped.metrics[column][-1]) == repr(every.metrics[column][-1]), (lr, column)
        assert all(repr(stopped.metrics[c]) == repr(every.metrics[c]) for c in ("loss", "acc", "grad_norm"))


def test_a_run_that_does_not_stop_is_scored_where_it_was():
    never = train_run(text_run(LRS[-1], **STOP))
    assert never.stopped_at is None and scored_steps(never.metrics) == [0, 5, 10, 12]
    plain = train_run(text_run(LRS[-1]))
    assert repr(never.metrics) == repr(plain.metrics)


def test_scoring_after_the_stop_leaves_the_steps_blocks_as_they_were():
    """The stopping step is scored after its forward, whose activations train.log_blocks reads: its blocks
    rows are those of the same run scored at every step (the score then comes before the forward)."""
    lr = 0.03
    late = train_run(text_run(lr, log_blocks=True, **STOP))
    early = train_run(text_run(lr, eval_every=1, log_blocks=True, **STOP))
    assert late.stopped_at == early.stopped_at == STOPS[lr]
    assert repr(late.blocks) == repr(early.blocks)
    assert repr(late.metrics["val_loss"][-1]) == repr(early.metrics["val_loss"][-1])


@pytest.mark.parametrize("compiled", [False, True])
def test_fast_scores_each_run_at_its_own_stop_within_its_contract(compiled, monkeypatch):
    """Runs of one batch stop at different steps: each is scored at its own stop, the run that goes on
    only at eval_every's steps, as the reference records them. Compiled (the compiler stood in for by the
    traced graph, as tests/test_fast.py does), the Adam step updates every run's weights in place: the
    stopping runs are scored on their weights before it."""
    if compiled:
        monkeypatch.setattr(aot, "load_or_compile", lambda key, trace, inputs, **_: (trace(), True))
        compiling.reset_cache()
    configs = [text_run(lr, **STOP) for lr in LRS]
    fast = train_fast(configs, compile=compiled)
    for cfg, got in zip(configs, fast):
        want = train_run(cfg)
        assert got.stopped_at == want.stopped_at == STOPS[cfg.optim.lr], cfg.optim.lr
        assert scored_steps(got.metrics) == scored_steps(want.metrics), cfg.optim.lr
        for column in ("val_loss", "val_acc"):
            assert got.metrics[column] == pytest.approx(want.metrics[column], abs=1e-4, nan_ok=True), column
        assert not math.isnan(got.metrics["val_loss"][-1])


SWEEP = """\
name: stopped
base:
  model: {arch: transformer, depth: 1, width: 16, n_heads: 2}
  data: {task: shakespeare_char, seq_len: 12, n_val: 7, batch_size: 3}
  optim: {name: adam}
  train: {steps: 12, threads: 1, eval_every: 5, stop_when: trained, stop_below: 4.3, stop_patience: 1}
grid:
  optim.lr: [0.1, 0.03, 0.001, 0.0001]
seeds: [0]
"""


@pytest.mark.equivalence
def test_every_engines_final_val_loss_is_the_stopping_steps(tmp_path):
    """Through `normexp sweep`: the batched engine's metrics.csv is the reference's byte for byte, the fast
    engine's scored at the same steps; what the figures and the study's verdict read as a run's final
    val_loss is its last recorded step's, that step the one it stopped at."""
    config = tmp_path / "stopped.yaml"
    config.write_text(SWEEP)
    outs = {}
    for engine in ("reference", "batched", "fast"):
        outs[engine] = tmp_path / engine
        args = ["sweep", str(config), "--out", str(outs[engine]), "--engine", engine]
        result = CliRunner().invoke(app, [*args, "--no-compile"] if engine == "fast" else args)
        assert result.exit_code == 0, result.output
    runs = sorted(p.name for p in outs["reference"].iterdir() if (p / "done.json").is_file())
    assert len(runs) == 4
    for run in runs:
        written = (outs["batched"] / run / "metrics.csv").read_bytes()
        assert written == (outs["reference"] / run / "metrics.csv").read_bytes(), run
    for engine, out in outs.items():
        metrics = load_metrics(out, all_config=True)
        last = metrics.sort_values("step").groupby("run_id").tail(1).set_index("run_id")
        assert sorted(last["step"].tolist()) == [1, 2, 7, 12], engine
        assert last["val_loss"].notna().all(), engine
        finals = final_values(metrics, "val_loss").set_index("run_id")["final"]
        assert finals.tolist() == last["val_loss"].reindex(finals.index).tolist(), engine
        verdicts = final_val_losses(metrics).set_index("run_id")["val_loss"]
        assert verdicts.tolist() == last["val_loss"].reindex(verdicts.index).tolist(), engine


SEEDS = """\
name: seeds
base:
  model: {arch: transformer, depth: 1, width: 16, n_heads: 2}
  data: {task: shakespeare_char, seq_len: 12, n_val: 7, batch_size: 3}
  optim: {name: adam, lr: 0.001}
  train: {steps: 12, threads: 1, eval_every: 5, stop_when: trained, stop_below: 4.3, stop_patience: 1}
seeds: [0, 1, 2, 3]
"""


def reference_sweep(text: str, out) -> object:
    """`normexp sweep` of the YAML `text` on the reference engine into `out`; its summary's stopping steps."""
    from normexp.results import load_summary

    config = out.with_suffix(".yaml")
    config.write_text(text)
    result = CliRunner().invoke(app, ["sweep", str(config), "--out", str(out), "--engine", "reference"])
    assert result.exit_code == 0, result.output
    return load_summary(out)["stopped_at"]


@pytest.fixture(scope="module")
def seeds_folder(tmp_path_factory):
    """SEEDS swept once: its folder, and the steps its runs stopped at, between two of eval_every's steps."""
    out = tmp_path_factory.mktemp("seeds") / "out"
    stops = {int(s) for s in reference_sweep(SEEDS, out).dropna()}
    assert stops and not stops & {0, 5, 10, 12} and 4 > len(stops)  # some seeds stop between evaluations
    return out, stops


def test_a_held_stopped_run_has_no_held_out_score_where_its_schedule_scores_none(seeds_folder):
    """A per-step mean holds a stopped run at its last row for the later steps (`finals.hold_stopped`). That
    row now carries the stopping step's held-out score, and held at every later step it made the only
    val_loss at steps that eval_every does not score: the table's cells and the figure's "mean over seeds"
    there were the stopped seeds' alone (here 8 and 11: two and three of four seeds, between the full
    means at 5, 10 and 12). A held row has no score where a run still running was not scored; it keeps it
    where every run was scored (10, 12), and where none is still running (every seed stopped, at 1 or 2:
    the table's last row covers the four)."""
    from normexp.figures import sweep_figures
    from normexp.report import build_report
    from normexp.results import load_folder

    out, stops = seeds_folder
    between = [s for s in range(13) if s % 5 and s != 12 and s > min(stops) and s not in stops]
    assert between  # steps after a stop that no run scored
    report = build_report(out, steps=list(range(13)), metric="val_loss")
    (column,) = report.columns
    for step in between:
        assert step not in column.cells or column.cells[step][2] == 0, (step, column.cells[step])
    for step in (10, 12):  # every seed: the stopped ones at their stopping step's score
        assert column.cells[step][2:] == (4, 4), step
    ((_, fig, _),) = [f for f in sweep_figures(load_folder(out), "val_loss") if f[0] == ""]
    (line,) = [ln for ln in fig.axes[0].get_lines() if len(ln.get_xdata()) > 2]  # the mean (not a floor)
    assert not set(line.get_xdata()) & set(between), list(line.get_xdata())


def test_a_stopping_steps_score_counts_in_no_per_step_mean_where_running_runs_were_not_scored(seeds_folder,
                                                                                              tmp_path):
    """The step at which a run stops between two of eval_every's steps carries its score, which no run still
    running has there: the figure's "mean over seeds" at 6, 7 and 9 was one stopped seed's score (its band a
    point), a curve between the full means at 5 and 10 drawn from single seeds. Per step that score counts
    from the next step that scored the runs still running (held there); the run's own final value keeps it."""
    from normexp.figures import sweep_figures
    from normexp.report import build_report
    from normexp.results import load_folder

    out, stops = seeds_folder
    report = build_report(out, steps=list(range(13)), metric="val_loss")
    (column,) = report.columns
    for step in stops:
        assert step not in column.cells or column.cells[step][2] == 0, (step, column.cells[step])
    ((_, fig, _),) = [f for f in sweep_figures(load_folder(out), "val_loss") if f[0] == ""]
    (line,) = [ln for ln in fig.axes[0].get_lines() if len(ln.get_xdata()) > 2]  # the mean (not a floor)
    assert sorted(line.get_xdata()) == [0, 5, 10, 12]
    finals = final_values(load_metrics(out, all_config=True), "val_loss")
    assert finals["final"].notna().all() and set(finals["step"]) >= stops

    out = tmp_path / "early"
    stops = reference_sweep(SEEDS.replace("lr: 0.001", "lr: 0.03"), out)
    assert stops.notna().all() and stops.nunique() > 1 and stops.max() < 5
    report = build_report(out, metric="val_loss")
    (column,) = report.columns
    assert column.cells[max(report.steps)][2:] == (4, 4)


@pytest.mark.parametrize(("train", "copies"), [({"eval_every": 1, **STOP}, False),
                                               ({"eval_every": 5, "stop_on_nonfinite": False}, False),
                                               ({"eval_every": 5, **STOP}, True)])
def test_a_compiled_adam_batch_keeps_its_weights_only_where_a_run_can_stop_unscored(train, copies, monkeypatch):
    """The compiled Adam step updates the weights in place, so the fast engine scores a run's stopping step
    on a copy of the batch's weights taken before each step the schedule does not score. With eval_every 1
    (the default) every step is scored before its update, and without train.stop_when or stop_on_nonfinite
    no run stops: the copy, one more set of the batch's parameters (10 ms a step for 8 runs of 3.2M on one
    core), was allocated for nothing in the first, and made at every step in the second."""
    import sys

    import torch

    from normexp.engines.fast import train as fast_train

    monkeypatch.setattr(aot, "load_or_compile", lambda key, trace, inputs, **_: (trace(), True))
    compiling.reset_cache()
    made = []
    empty_like, foreach_copy = torch.empty_like, torch._foreach_copy_

    def counted_empty_like(tensor, *args, **kwargs):
        if sys._getframe(1).f_code.co_filename == fast_train.__file__:  # the loop's own, not the optimizer's
            made.append(tuple(tensor.shape))
        return empty_like(tensor, *args, **kwargs)

    def counted_copy(dst, src, *args, **kwargs):
        made.append(len(dst))
        return foreach_copy(dst, src, *args, **kwargs)

    monkeypatch.setattr(torch, "empty_like", counted_empty_like)
    monkeypatch.setattr(torch, "_foreach_copy_", counted_copy)
    configs = [text_run(lr, **train) for lr in LRS]
    fast = train_fast(configs, compile=True)
    assert bool(made) == copies, made
    for cfg, got in zip(configs, fast):  # and each run recorded as the reference records it
        want = train_run(cfg)
        assert scored_steps(got.metrics) == scored_steps(want.metrics), cfg.optim.lr
        assert got.metrics["val_loss"] == pytest.approx(want.metrics["val_loss"], abs=1e-4, nan_ok=True)
