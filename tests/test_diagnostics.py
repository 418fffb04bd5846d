"""Gradients at init (Xiong et al.), at one depth and at each depth of a Transformer grid, the RMSNorm facts,
and the norm speed table."""

from __future__ import annotations

import math
import statistics
import warnings

import numpy as np
import pytest
from typer.testing import CliRunner

from normexp.analysis.gradnorm import branch_gain, fit_slope, summarise_gradnorm
from normexp.cli import app
from normexp.config import ModelConfig, RunConfig
from normexp.diagnostics import gradnorm_at_init, norm_properties, norm_speed
from normexp.engines.reference import train_run

runner = CliRunner()


def cfg(placement: str, depth: int, seed: int = 0, **model) -> RunConfig:
    return RunConfig.model_validate({"model": {"depth": depth, "init": "xavier_normal", **model},
                                     "norm": {"placement": placement}, "seed": seed})


def test_every_norm_fact_passes():
    props = norm_properties()
    assert len(props) >= 12
    failed = [p.name for p in props if not p.passed]
    assert not failed, failed


def test_gradnorm_rows_are_consistent_with_a_training_step():
    rows = gradnorm_at_init(cfg("post", 6))
    assert [r["block"] for r in rows] == list(range(1, 7))
    step0 = train_run(cfg("post", 6)).metrics["grad_norm"][0]  # global norm of every gradient
    fc = math.sqrt(sum(r["fc1_grad"] ** 2 + r["fc2_grad"] ** 2 for r in rows))
    assert 0 < fc <= step0 * (1 + 1e-6)
    assert rows[0]["stream_sq"] == pytest.approx(1.0, abs=0.3)  # X ~ randn: E||x||^2/d = 1


def test_lemma_2_with_the_branch_energy_of_this_init():
    """Pre-LN's stream grows by c per block and Post-LN's norms see 1 + c, c = 2m/(1+m)^2 = 0.32."""
    c = branch_gain(ModelConfig(init="xavier_normal"))
    assert c == pytest.approx(0.32)
    rows = [r for seed in range(4) for r in gradnorm_at_init(cfg("pre", 24, seed))]
    rows += [r for seed in range(4) for r in gradnorm_at_init(cfg("post", 24, seed))]
    summary = summarise_gradnorm(rows, ModelConfig(init="xavier_normal"))
    assert summary.measured_gain("pre") == pytest.approx(c, rel=0.25)
    assert summary.measured_gain("post") == pytest.approx(c, rel=0.25)
    assert summary.stream_sq["post"][-1] == pytest.approx(1.0, abs=0.05)  # after a LayerNorm


def test_last_block_gradient_trend_post_vs_pre():
    """Our own computation of Xiong's Fig. 3: Pre-LN's last-block gradient shrinks with depth, and
    falls below Post-LN's; the fitted slopes come out ordered (Post above Pre)."""
    depths = [2, 8, 32]
    rows = [r for p in ("post", "pre") for d in depths for s in range(4) for r in gradnorm_at_init(cfg(p, d, s))]
    summary = summarise_gradnorm(rows)
    pre = [m for m, _ in summary.last_grad["pre"]]
    post = [m for m, _ in summary.last_grad["post"]]
    assert pre[0] > pre[-1] and summary.slopes["pre"] < 0
    assert post[-1] > pre[-1] and summary.slopes["post"] > summary.slopes["pre"]


def test_fit_slope_recovers_a_power_law():
    depths = [2.0, 4.0, 8.0, 16.0]
    assert fit_slope(depths, [3 * d ** -0.5 for d in depths]) == pytest.approx(-0.5)
    assert fit_slope(depths, [1.0] * 4) == pytest.approx(0.0)


def test_norm_speed_small_shape():
    timings = norm_speed([(8, 32)], repeats=2, compile_rmsnorm=False)
    assert {t.kind for t in timings} >= {"layernorm", "rmsnorm", "rmsnorm_torch", "rmsnorm_llama"}
    assert all(t.forward_ms > 0 and t.backward_ms > 0 for t in timings)


def test_gradnorm_command(write_yaml, tmp_path):
    config = write_yaml("name: g\nbase: {model: {width: 16, init: xavier_normal}}\n"
                        "grid: {norm.placement: [post, pre], model.depth: [2, 4, 8]}\nseeds: [0, 1]\n")
    result = runner.invoke(app, ["gradnorm", str(config), "--out", str(tmp_path / "g"), "--format", "markdown"])
    assert result.exit_code == 0, result.output
    assert "fitted slope of log ||grad W2_L|| against log L: Post" in result.output
    assert "| 8 |" in result.output
    lines = (tmp_path / "g" / "gradnorm.csv").read_text().splitlines()
    assert len(lines) == 1 + 2 * 2 * (2 + 4 + 8)
    assert (tmp_path / "g" / "gradnorm.png").read_bytes()[:4] == b"\x89PNG"


def test_norms_props_command():
    result = runner.invoke(app, ["norms", "props", "--format", "markdown"])
    assert result.exit_code == 0
    rows = [line for line in result.output.splitlines() if line.startswith("| ") and "check" not in line]
    assert len(rows) >= 12 and all(line.rstrip().endswith("| pass |") for line in rows)


def test_norms_bench_command_small():
    result = runner.invoke(app, ["norms", "bench", "--repeats", "1", "--no-big", "--no-compile",
                                 "--format", "markdown"])
    assert result.exit_code == 0
    assert "| (64, 32) | layernorm |" in result.output and "1.00x" in result.output


@pytest.mark.slow
def test_studies_quick_writes_a_report(tmp_path):
    from normexp.studies.run import run_studies

    report = run_studies(tmp_path, quick=True, log=lambda _: None).read_text()
    for section in ("## warmup", "## lr_warmup", "## depth", "## placements", "## lr_sensitivity", "## gradnorm",
                    "## norms", "## transformer_warmup", "## instabilities", "## warmup_explanations"):
        assert section in report
    assert report.count("**Verdict.**") == 11  # nine sweeps (the Transformer studies among them), gradnorm, norms
    assert "Post-LN without warmup" in report.split("## warmup_explanations")[1]
    assert "qk-norm" in report.split("## instabilities")[1] and "final_loss-lr.png" in report
    assert "B2T trains in every seed in" in report
    assert "Ranking by LR sensitivity without warmup" in report and "LR sensitivity =" in report


def test_the_speed_verdict_ranks_only_shapes_where_a_call_is_more_than_overhead():
    from normexp.diagnostics import Timing
    from normexp.studies.verdicts import speed_verdict

    def timings(shape, ln_ms, rms_ms):
        return [Timing("layernorm", shape, ln_ms, 2 * ln_ms), Timing("rmsnorm_torch", shape, rms_ms, 2 * rms_ms)]

    tiny = speed_verdict(timings((64, 32), 0.04, 0.08))
    assert "no ranking at this shape" in tiny and "nn.RMSNorm is" not in tiny
    big = speed_verdict(timings((8, 512, 4096), 40.0, 110.0))
    assert "nn.RMSNorm is slower than LayerNorm here" in big
    assert "nn.RMSNorm is not slower" in speed_verdict(timings((8, 512, 4096), 40.0, 30.0))


# ----------------------------------------------------------------------------- gradnorm's depths


@pytest.mark.parametrize("depths", ["1", "4", "1,2"])
def test_gradnorm_with_one_depth_or_depth_1(write_yaml, tmp_path, depths):
    config = write_yaml("name: g\nbase: {model: {width: 8}}\ngrid: {norm.placement: [post, pre]}\nseeds: [0, 1]\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", np.exceptions.RankWarning)
        result = runner.invoke(app, ["gradnorm", str(config), "--set", f"model.depth={depths}",
                                     "--out", str(tmp_path / "g")])
    assert result.exit_code == 0, result.output
    assert "+nan" not in result.output
    if "," not in depths:
        assert "needs two depths or more" in result.output


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
