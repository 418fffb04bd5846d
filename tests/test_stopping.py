"""Opt-in early stopping (train.stop_when): each rule stops where the recorded losses say, the engines stop
alike (the exact ones bit for bit), the stop is recorded in the run's files, and it is never on by default."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import STOP_REASONS, RunConfig, chance_classes, trained_threshold
from normexp.engines.batched import train_batch
from normexp.engines.fast import train_fast
from normexp.engines.reference import train_run
from normexp.folder import run_id
from normexp.results import load_summary

LRS = (0.003, 0.03, 0.1, 1.0, 3.0)  # on this toy: slow, trains, trains, stalls around 3-10, blows up (> 10x)


def config(lr: float, seed: int = 3, steps: int = 40, **train) -> RunConfig:
    return RunConfig.model_validate({"model": {"depth": 2, "width": 8}, "optim": {"lr": lr},
                                     "train": {"steps": steps, **train}, "seed": seed})


def expected_stop(losses: list[float], when: str, patience: int, below: float) -> int | None:
    """The step at which `when` fires, recomputed from a full run's losses (written apart from EarlyStop)."""
    streak, best = 0, None
    for step, loss in enumerate(losses):
        if when == "trained":
            holds = loss < below
        elif when == "diverged":
            holds = not (math.isfinite(loss) and loss <= 10 * losses[0])
        else:  # stalled: no improvement of more than a relative 1e-3 on the best improvement so far
            improved = math.isfinite(loss) and (best is None or loss < best * (1 - 1e-3))
            best = loss if improved else best
            holds = not improved
        streak = streak + 1 if holds else 0
        if streak >= patience and step < len(losses) - 1:  # at the last step the run ends anyway
            return step
    return None


def exact(metrics: dict[str, list[float]]) -> dict[str, list[str]]:
    return {k: [repr(v) for v in values] for k, values in metrics.items()}


CASES = [("trained", {"stop_below": 0.5}), ("trained", {}), ("stalled", {}), ("diverged", {})]


@pytest.mark.parametrize(("when", "extra"), CASES)
def test_each_rule_stops_where_the_full_runs_losses_say(when, extra):
    fired = 0
    for lr in LRS:
        full = train_run(config(lr))
        cfg = config(lr, stop_when=when, stop_patience=3, **extra)
        below = extra.get("stop_below", trained_threshold(chance_classes(cfg)))
        step = expected_stop(full.losses, when, 3, below)
        stopped = train_run(cfg)
        assert stopped.stopped_at == step, (when, lr)
        length = len(full.losses) if step is None else step + 1
        # stopping changes nothing before the stop: the stopped run's metrics are the full run's, cut
        assert exact(stopped.metrics) == exact({k: v[:length] for k, v in full.metrics.items()})
        assert stopped.stop_reason == (when if step is not None else None)
        assert stopped.status == ("diverged" if step is not None and when == "diverged" else full.status)
        fired += step is not None and step < 40
    assert fired  # the rule fires somewhere on this grid, before the last step


@pytest.mark.equivalence
def test_batched_equals_reference_bit_for_bit_with_runs_stopping_at_different_steps():
    for when in STOP_REASONS:
        configs = [config(lr, seed=3 + i % 2, stop_when=when, stop_patience=2) for i, lr in enumerate(LRS)]
        results = train_batch(configs)
        for cfg, result in zip(configs, results):
            expected = train_run(cfg)
            assert exact(result.metrics) == exact(expected.metrics), (when, cfg.optim.lr)
            assert (result.stopped_at, result.stop_reason, result.status) == \
                (expected.stopped_at, expected.stop_reason, expected.status)
        if when == "stalled":  # batch-mates stop alone, at their own steps, while others go on
            assert len({r.stopped_at for r in results}) >= 3


def test_fast_stops_at_the_references_step_on_a_stable_grid():
    """Within the fast contract the losses differ in the last bits; on these runs no loss sits within
    those bits of a rule's threshold, so the stop step is the reference's."""
    configs = [config(lr, stop_when="stalled", stop_patience=3) for lr in (0.003, 1.0)] + \
        [config(lr, stop_when="trained", stop_patience=3, stop_below=1.0) for lr in (0.03, 0.1)]
    for cfgs in (configs[:2], configs[2:]):
        for cfg, result in zip(cfgs, train_fast(cfgs, compile=False)):
            expected = train_run(cfg)
            assert result.stopped_at == expected.stopped_at, cfg.optim.lr
            assert len(result.losses) == len(expected.losses)


def test_never_on_by_default():
    cfg = config(0.03)
    assert cfg.train.stop_when is None
    result = train_run(cfg)
    assert result.losses[-1] < trained_threshold(chance_classes(cfg))  # a run that trained runs on
    assert (len(result.losses), result.stopped_at, result.stop_reason) == (41, None, None)


def test_run_ids_unchanged_by_the_keys_at_their_defaults():
    plain = config(0.01)
    spelled = config(0.01, stop_when=None, stop_patience=10, stop_below=None)
    assert run_id(plain) == run_id(spelled)
    assert run_id(config(0.01, stop_when="stalled")) != run_id(plain)
    # a key the run's stop_when leaves unused goes back to its default: one run, one id
    assert config(0.01, stop_when="stalled", stop_below=0.5) == config(0.01, stop_when="stalled")


@pytest.mark.parametrize(("sets", "key"), [
    (["train.stop_when=sometimes"], "train.stop_when"),
    (["train.stop_when=stalled", "train.stop_patience=0"], "train.stop_patience"),
    (["train.stop_when=trained", "train.stop_below=-1"], "train.stop_below"),
    (["train.stop_patience=3"], "train.stop_patience"),
    (["train.stop_when=stalled", "train.stop_below=0.5"], "train.stop_below"),
])
def test_bad_values_exit_2_naming_the_key(tmp_path, sets, key):
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nbase: {model: {depth: 2, width: 8}, train: {steps: 4}}\n")
    args = ["sweep", str(sweep), "--out", str(tmp_path / "out")]
    for item in sets:
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert key in result.output
    assert not (tmp_path / "out").exists()


def test_recorded_in_the_run_folder_and_resume_retrains_nothing(tmp_path):
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nbase: {model: {depth: 2, width: 8}, train: {steps: 30, stop_when: diverged, "
                     "stop_patience: 2}}\ngrid: {optim.lr: [0.01, 3.0]}\nseeds: [3]\n")
    out = tmp_path / "out"
    first = CliRunner().invoke(app, ["sweep", str(sweep), "--out", str(out)])
    assert first.exit_code == 0, first.output
    summary = load_summary(out).set_index("optim.lr")
    blown = summary.loc[3.0]
    done = json.loads((out / blown["run_id"] / "done.json").read_text())
    assert (done["stop_reason"], done["stopped_at"], done["status"]) == ("diverged", blown["steps_done"], "diverged")
    assert int(blown["stopped_at"]) == done["stopped_at"] and not blown["trained"]
    calm = summary.loc[0.01]
    assert math.isnan(calm["stopped_at"]) and calm["steps_done"] == 30
    assert "stopped_at" not in json.loads((out / calm["run_id"] / "done.json").read_text())
    again = CliRunner().invoke(app, ["sweep", str(sweep), "--out", str(out)])
    assert again.exit_code == 0 and "0 ran, 2 already done" in again.output, again.output
    check = CliRunner().invoke(app, ["verify", str(out)])
    assert check.exit_code == 0, check.output


def test_report_says_which_runs_stopped_early_and_why(tmp_path):
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nbase: {model: {depth: 2, width: 8}, train: {steps: 20, stop_when: stalled, "
                     "stop_patience: 3}}\ngrid: {optim.lr: [0.003, 1.0]}\nseeds: [3]\n")
    out = tmp_path / "out"
    assert CliRunner().invoke(app, ["sweep", str(sweep), "--out", str(out)]).exit_code == 0
    summary = load_summary(out).set_index("optim.lr")
    step = int(summary.loc[1.0, "stopped_at"])
    assert math.isnan(summary.loc[0.003, "stopped_at"])
    report = CliRunner().invoke(app, ["report", str(out)])
    assert report.exit_code == 0, report.output
    assert f"Stopped early (train.stop_when), 1 of 2 runs: {summary.loc[1.0, 'run_id']} at step {step} (stalled)" \
        in " ".join(report.output.split())


def test_the_phase_diagram_marks_the_cells_with_a_run_stopped_early(tmp_path):
    import matplotlib.pyplot as plt

    from normexp.analysis.finals import final_values
    from normexp.figures import STOPPED_MARKER, phase_figure
    from normexp.results import load_metrics

    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nbase: {model: {depth: 2, width: 8}, schedule: {kind: linear_warmup}, train: "
                     "{steps: 12, stop_when: stalled, stop_patience: 3}}\n"
                     "grid: {optim.lr: [0.003, 3.0], schedule.warmup_steps: [0, 2]}\nseeds: [3]\n")
    out = tmp_path / "out"
    assert CliRunner().invoke(app, ["sweep", str(sweep), "--out", str(out)]).exit_code == 0
    summary = load_summary(out)
    stopped = dict(zip(summary["run_id"], summary["stopped_at"].notna()))
    assert 0 < sum(stopped.values()) < len(stopped)
    for source in (load_metrics(out, all_config=True), summary):
        table = final_values(source, "loss")
        assert dict(zip(table["run_id"], table["stopped"])) == stopped
        fig = phase_figure(source, "optim.lr", "schedule.warmup_steps")
        marks = [line for ax in fig.axes for line in ax.lines if line.get_marker() == STOPPED_MARKER]
        assert len(marks) == sum(stopped.values())  # one mark per cell here (one seed per cell)
        assert any("stopped early" in text.get_text() for legend in fig.legends for text in legend.get_texts())
        plt.close(fig)


@pytest.mark.equivalence
def test_batched_blocks_equal_the_references_for_a_run_stopped_early():
    """blocks.csv of a run stopped at step k: step k's gradients recorded (it ran backward), as the reference."""
    configs = [config(lr, stop_when="stalled", stop_patience=2, steps=12, log_blocks=True) for lr in (0.003, 3.0)]
    results = train_batch(configs)
    assert results[1].stopped_at is not None and results[0].stopped_at is None
    for cfg, result in zip(configs, results):
        assert exact(result.blocks) == exact(train_run(cfg).blocks)


@pytest.mark.parametrize(("field", "change"), [("stopped_at", -1), ("stop_reason", "stalled"),
                                               ("stopped_at", None)])
def test_a_done_json_whose_stop_disagrees_with_its_run_is_corrupt(tmp_path, field, change):
    from normexp.folder import inspect_run
    from normexp.folder.layout import encode_done

    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nbase: {model: {depth: 2, width: 8}, optim: {lr: 3.0}, train: {steps: 20, "
                     "stop_when: diverged, stop_patience: 2}}\nseeds: [3]\n")
    out = tmp_path / "out"
    assert CliRunner().invoke(app, ["sweep", str(sweep), "--out", str(out)]).exit_code == 0
    (run,) = [p for p in out.iterdir() if (p / "done.json").exists()]
    assert inspect_run(run).kind == "finished"
    done = json.loads((run / "done.json").read_text())
    if change is None:  # a stopped run whose done.json does not say so
        del done["stopped_at"], done["stop_reason"]
    else:
        done[field] = done[field] + change if isinstance(change, int) else change
    (run / "done.json").write_text(encode_done(done))
    assert inspect_run(run).kind == "corrupt"


STOPPING = """name: stops
base: {model: {depth: 2, width: 8}, train: {steps: 4, stop_when: trained, stop_below: 0.5, stop_patience: 1}}
seeds: [0, 1, 2, 3]
"""
LOSSES = {0: [2.7, 0.4], 1: [2.7, 1.0, 0.45], 2: [2.7, 1.0, 0.9, 0.8, 0.7], 3: [2.7, 1.2, 1.0, 0.6, 0.55]}


def stopped_folder(tmp_path):
    """Four seeds written through the store: seeds 0 and 1 trained and were stopped at steps 1 and 2,
    seeds 2 and 3 ran every step, every loss falling."""
    from normexp.config import build_sweep, parse_yaml
    from normexp.folder import FinishedRun, atomic_write, write_run, write_summary

    sweep = build_sweep(parse_yaml(STOPPING))
    out = tmp_path / "out"
    out.mkdir()
    atomic_write(out / "sweep.yaml", sweep.to_yaml())
    for cfg in sweep.runs:
        loss = LOSSES[cfg.seed]
        n = len(loss)
        metrics = {"step": list(range(n)), "loss": loss, "acc": [0.1] * n, "lr": [cfg.optim.lr] * n,
                   "grad_norm": [1.0] * n}
        stop = (n - 1, "trained") if n < 5 else (None, None)
        write_run(out / run_id(cfg), cfg, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu", None, *stop))
    write_summary(out, sweep.runs)
    return out


def test_a_per_step_mean_holds_a_stopped_run_at_its_last_value(tmp_path):
    """After early stops a per-step mean averaged only the seeds still running (here it would rise from
    0.575 to 0.625 while every loss falls), and the table called the stopped seeds "diverged or missing".
    A stopped run holds its last value: the mean covers every seed, in the table, the CSV and the figure."""
    from normexp.figures import sweep_figures
    from normexp.report import PARTIAL_NOTE, build_report, to_csv
    from normexp.results import load_folder

    out = stopped_folder(tmp_path)
    report = build_report(out)
    (column,) = report.columns
    held = {step: sum(LOSSES[s][min(step, len(LOSSES[s]) - 1)] for s in LOSSES) / 4 for step in range(5)}
    for step in report.steps:
        mean, _, finite, reached = column.cells[step]
        assert (finite, reached) == (4, 4) and mean == pytest.approx(held[step])
        assert "of 4" not in report.cell(column, step)
    assert "diverged or missing" not in report.stopped and "holds" in report.stopped
    assert "stopped early by train.stop_when) counts in no cell" not in PARTIAL_NOTE
    csv = to_csv(report)
    assert f"{held[4]:.4g}"[:4] in csv and "0.625" not in csv
    ((_, fig, _),) = [f for f in sweep_figures(load_folder(out)) if f[0] == ""]
    (line,) = [ln for ln in fig.axes[0].get_lines() if len(ln.get_xdata()) == 5]
    assert list(line.get_ydata()) == pytest.approx([held[s] for s in range(5)])
    result = CliRunner().invoke(app, ["report", str(out)])
    assert result.exit_code == 0 and "(2 of 4)" not in result.output, result.output


def test_a_trained_stop_under_its_own_stop_below_is_not_called_trained_when_the_rule_says_not(tmp_path):
    """`stop_when: trained` with a stop_below above the trained rule's threshold: the report said a run
    stopped "(trained)" beside a verdict that it did not train. The stop is named by the condition it met."""
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nbase: {model: {depth: 2, width: 8}, optim: {lr: 0.01}, train: {steps: 12, "
                     "stop_when: trained, stop_below: 2.45, stop_patience: 1}}\nseeds: [0]\n")
    out = tmp_path / "out"
    assert CliRunner().invoke(app, ["sweep", str(sweep), "--out", str(out)]).exit_code == 0
    summary = load_summary(out)
    assert summary["stopped_at"].notna().all() and not summary["trained"].astype(bool).any()
    said = " ".join(CliRunner().invoke(app, ["report", str(out)]).output.split())
    assert "(trained)" not in said and "loss < 2.45 (train.stop_below), not trained by the trained rule" in said, said
    assert "Did not train" in said
