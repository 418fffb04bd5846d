"""`normexp studies realtext_warmup`: the real-text warmup study is one of the studies, on the fast engine, run
when named (not by `make studies`: its full grid is hours of runs); its --quick set is the depth and learning
rate where Post-LN stays at the unigram floor; its section's verdict is the one normexp/analysis/realtext.py
computes from the folder's last val losses against the text's unigram floor, and its curves draw the floors."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from normexp import corpus
from normexp.analysis.realtext import final_val_losses, verdict
from normexp.cli import app
from normexp.config import PACKAGED_CONFIGS
from normexp.engines.fast import fast_serves
from normexp.results import as_folder
from normexp.studies import run as studies_run
from normexp.studies.verdicts import realtext_warmup_verdict

TINY = """\
name: realtext_warmup
base:
  model: {arch: transformer, depth: 2, width: 16, n_heads: 2}
  data: {task: shakespeare_char, seq_len: 12, n_val: 6, batch_size: 3}
  optim: {name: adam}
  schedule: {kind: linear_warmup}
  train: {steps: 4, threads: 1, eval_every: 2}
grid:
  norm.placement: [post, pre]
  optim.lr: [0.01]
  schedule.warmup_steps: [0, 2]
seeds: [0, 1]
report:
  metric: val_loss
  columns: [norm.placement, model.depth, optim.lr, schedule.warmup_steps]
"""


def test_the_study_is_shipped_among_the_studies_on_the_fast_engine_and_runs_when_named():
    assert (PACKAGED_CONFIGS / "studies" / "realtext_warmup.yaml").is_file()
    assert not (PACKAGED_CONFIGS / "realtext_warmup.yaml").exists()
    study = next(s for s in studies_run.STUDIES if s.name == "realtext_warmup")
    assert study.verdict is realtext_warmup_verdict and study.when_named
    assert "realtext_warmup" in studies_run.FAST_STUDIES
    full = studies_run._spec("realtext_warmup", quick=False)
    assert len(full.runs) == 162 and all(fast_serves(cfg) for cfg in full.runs)


def test_the_quick_set_is_depth_12_at_lr_3e_3_post_and_pre_with_and_without_the_long_warmup_two_seeds():
    runs = studies_run._spec("realtext_warmup", quick=True).runs
    assert {(cfg.model.depth, cfg.optim.lr) for cfg in runs} == {(12, 0.003)}
    assert {cfg.norm.placement for cfg in runs} == {"post", "pre"} and {cfg.seed for cfg in runs} == {0, 1}
    assert {cfg.schedule.warmup_steps for cfg in runs} == {0, 200} and len(runs) == 8
    assert "realtext_warmup" in studies_run.UNCOMPILED_STUDIES


@pytest.mark.process
def test_make_studies_leaves_it_out_and_naming_it_runs_it_alone(tmp_path, monkeypatch):
    """Every study but realtext_warmup by default; `normexp studies realtext_warmup` (here on a tiny grid) writes
    its section: its table, its curves with the floors, and the verdict computed from its folder."""
    chosen: list[str] = []
    monkeypatch.setattr(studies_run, "_sweep", lambda name, spec, out: chosen.append(name) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        studies_run.run_studies(tmp_path / "all")
    assert chosen[0] == "warmup" and "realtext_warmup" not in [s.name for s in studies_run.STUDIES
                                                               if not s.when_named]
    monkeypatch.undo()
    config = tmp_path / "realtext_warmup.yaml"
    config.write_text(TINY)
    monkeypatch.setattr(studies_run, "_config", lambda name: config)
    out = tmp_path / "runs"
    result = CliRunner().invoke(app, ["studies", "realtext_warmup", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = (out / "REPORT.md").read_text()
    assert [line for line in report.splitlines() if line.startswith("## ")] == ["## realtext_warmup"]
    folder = as_folder(out / "realtext_warmup")
    assert set(folder.summary["engine"]) == {"fast"}
    expected = verdict(final_val_losses(folder.metrics(all_config=True)), corpus.floors().unigram)
    assert expected.startswith("Depth 2, lr 0.01: without warmup Post-LN") and expected in report
    assert realtext_warmup_verdict(out / "realtext_warmup") == expected
    assert (out / "realtext_warmup" / "loss.png").is_file() and "realtext_warmup/loss.png" in report


@pytest.mark.process
def test_the_verdict_judges_the_folders_last_sweep_only_as_every_studys_verdict(tmp_path):
    """A run another invocation left in the folder (here 3 steps instead of 4) is not a seed of the study's
    cells: the verdict counts 2 seeds per cell, not 4 (verdicts.py: a study judges its own grid)."""
    config = tmp_path / "realtext_warmup.yaml"
    config.write_text(TINY)
    out = tmp_path / "runs"
    for extra in (["--set", "train.steps=3"], []):
        result = CliRunner().invoke(app, ["sweep", str(config), "--out", str(out), "--engine", "batched", *extra])
        assert result.exit_code == 0, result.output
    assert len(as_folder(out).summary) == 16
    text = realtext_warmup_verdict(out)
    assert "Post-LN stays at the unigram floor (3.33) in " in text and " of 2 seeds" in text
    assert " of 4 seeds" not in text
