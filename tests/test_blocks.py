"""Per-block logging (`train.log_blocks`): the rows are what they say, both exact engines write the same
bits on every placement, a run that does not log is untouched (metrics and run id), and a panel of
`plot --blocks` with nothing to draw says so, as wide as the others."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, SMALL_SWEEP
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batched import ALL_KINDS, ALL_PLACEMENTS, exact, runs
from test_run_ids import PLACEMENT_IDS, WARMUP_IDS
from typer.testing import CliRunner

from normexp.blocklog import BLOCK_COLUMNS
from normexp.cli import app
from normexp.config import ConfigError, RunConfig, load_sweep
from normexp.engines import reference
from normexp.engines.batched import plan_batches, train_batch
from normexp.engines.common import seeded_init
from normexp.engines.reference import train_run
from normexp.figures import BLOCK_METRIC_LABELS
from normexp.folder import run_id
from normexp.folder.ids import config_hash
from normexp.results import _EXACT, ResultsError, load_blocks, load_metrics

runner = CliRunner()


def logging(cfg: RunConfig, every: int = 1) -> RunConfig:
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"log_blocks": True, "log_every": every})})


def small(placement="pre", kind="layernorm", optim="adam", steps=4, depth=3, width=4, seed=0, **train_keys):
    return RunConfig.model_validate({
        "model": {"depth": depth, "width": width}, "norm": {"placement": placement, "kind": kind},
        "optim": {"name": optim, "lr": 0.01}, "train": {"steps": steps, **train_keys}, "seed": seed})


configs = st.builds(
    small, placement=st.sampled_from(ALL_PLACEMENTS), kind=st.sampled_from(ALL_KINDS),
    optim=st.sampled_from(["adam", "adamw", "sgd", "radam"]), steps=st.integers(0, 5), depth=st.integers(1, 4),
    width=st.integers(2, 6), seed=st.integers(0, 1000))


# ----------------------------------------------------------------------------- logging off changes nothing


@settings(max_examples=25, deadline=None)
@given(cfg=configs, every=st.integers(1, 4))
def test_logging_changes_no_bit_of_any_metric(cfg, every):
    plain, logged = train_run(cfg), train_run(logging(cfg, every))
    assert plain.blocks is None and logged.blocks is not None
    assert exact(plain.metrics) == exact(logged.metrics)


def test_a_run_that_does_not_log_keeps_its_id():
    for placement, golden in PLACEMENT_IDS.items():
        cfg = RunConfig.model_validate({"norm": {"placement": placement}, "model": {"depth": 4, "width": 8},
                                        "train": {"steps": 5, "log_blocks": False, "log_every": 1}})
        assert run_id(cfg) == golden
    sweep = load_sweep(REPO / "configs" / "warmup.yaml", ["train.log_blocks=false"])
    assert [run_id(cfg) for cfg in sweep.runs] == WARMUP_IDS


def test_a_run_that_logs_has_its_own_id():
    """Logging writes another file: a logged run never reuses an unlogged run's folder, nor the reverse."""
    cfg = small()
    assert len({config_hash(cfg), config_hash(logging(cfg)), config_hash(logging(cfg, 2))}) == 3


# ----------------------------------------------------------------------------- the rows


def test_one_row_per_logged_step_and_block():
    steps, every, depth = 7, 3, 4
    rows = pd.DataFrame(train_run(logging(small(steps=steps, depth=depth), every)).blocks)
    assert list(rows.columns) == list(BLOCK_COLUMNS)
    assert list(rows["step"]) == [s for s in (0, 3, 6) for _ in range(depth)]
    assert list(rows["block"]) == [1, 2, 3, 4] * 3
    measured = rows.drop(columns=["norm_out_rms"])  # pre-LN has no branch-output norm
    assert measured.notna().all().all() and (measured.drop(columns=["step", "block"]) > 0).all().all()
    assert rows["norm_out_rms"].isna().all()


def test_no_update_follows_the_last_step():
    rows = pd.DataFrame(train_run(logging(small(steps=4), 2)).blocks)
    last = rows[rows["step"] == 4]
    assert last[["fc1_update", "fc2_update"]].isna().all().all()
    assert last[["fc1_grad", "fc2_grad", "stream_rms", "norm_rms"]].notna().all().all()


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_norm_columns_follow_the_placement(placement):
    rows = pd.DataFrame(train_run(logging(small(placement, steps=1))).blocks)
    assert rows["norm_rms"].isna().all() == (placement in ("none", "rezero"))  # the two without a block norm
    assert rows["norm_out_rms"].notna().all() == (placement in ("sandwich", "peri"))
    if placement == "post":  # the block's output is its norm's output
        assert list(rows["norm_rms"]) == list(rows["stream_rms"])


def test_activation_rms_is_read_from_the_model_itself():
    """Step 0's stream RMS equals a forward pass of the seeded model, block by block."""
    cfg = small("sandwich", "rmsnorm", depth=3, width=5)
    rows = pd.DataFrame(train_run(logging(cfg)).blocks)
    model, task = seeded_init(cfg)
    x = model.input_norm(task.x)
    for block in model.blocks:
        x = block(x)
        expected = x.pow(2).mean().sqrt().item()
        assert rows[(rows.step == 0)].stream_rms.iloc[block_index(model, block)] == expected


def block_index(model, block) -> int:
    return list(model.blocks).index(block)


# ----------------------------------------------------------------------------- gradients and updates


def rest_of_the_model(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Every parameter but the blocks' fc weight matrices."""
    matrices = {id(getattr(block.branch, name).weight) for block in model.blocks for name in ("fc1", "fc2")}
    return [p for p in model.parameters() if id(p) not in matrices]


def capture_model(monkeypatch) -> list[torch.nn.Module]:
    models = []

    def init(cfg):
        model, task = seeded_init(cfg)
        models.append(model)
        return model, task

    monkeypatch.setattr(reference, "seeded_init", init)
    return models


@settings(max_examples=20, deadline=None)
@given(cfg=configs, every=st.integers(1, 3))
def test_block_gradients_sum_in_squares_to_the_global_grad_norm(cfg, every):
    """grad_norm^2 = sum over blocks of fc1_grad^2 + fc2_grad^2, plus the rest of the model (biases,
    norms, head), whose gradients this test reads from the model at each step."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        models = capture_model(monkeypatch)
        rest: dict[int, float] = {}
        result = train_run(logging(cfg, every), on_step=lambda step, loss: rest.__setitem__(
            step, sum(p.grad.double().pow(2).sum().item() for p in rest_of_the_model(models[0]))))
    rows = pd.DataFrame(result.blocks)
    metrics = pd.DataFrame(result.metrics).set_index("step")
    for step, at_step in rows.groupby("step"):
        blocks = (at_step["fc1_grad"] ** 2 + at_step["fc2_grad"] ** 2).sum()
        total = metrics.loc[step, "grad_norm"] ** 2
        if not math.isfinite(total):  # a diverged step: its parts cannot all be finite either (a run that
            # stops there takes no backward and calls no on_step: its blocks' gradients are nan)
            assert not math.isfinite(blocks + rest.get(step, 0.0))
            continue
        assert blocks + rest[step] == pytest.approx(total, rel=1e-5, abs=1e-12)


def test_update_ratio_matches_a_hand_computed_adam_step(monkeypatch):
    """Adam by hand in float64 from the gradients the run saw: m, v, bias corrections, then
    ||lr * m_hat / (sqrt(v_hat) + eps)|| / ||W|| for each fc matrix at each step."""
    cfg = small("post", "layernorm", steps=4, depth=2, width=6)
    lr, (beta1, beta2), eps = cfg.optim.lr, cfg.optim.betas, cfg.optim.eps
    models = capture_model(monkeypatch)
    seen: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []

    def on_step(step, loss):
        seen.append({f"{i + 1}.{name}": (getattr(b.branch, name).weight.detach().double().clone(),
                                         getattr(b.branch, name).weight.grad.double().clone())
                     for i, b in enumerate(models[0].blocks) for name in ("fc1", "fc2")})

    rows = pd.DataFrame(train_run(logging(cfg), on_step=on_step).blocks).set_index(["step", "block"])
    m = {k: torch.zeros_like(g) for k, (_, g) in seen[0].items()}
    v = {k: torch.zeros_like(g) for k, (_, g) in seen[0].items()}
    for step in range(cfg.train.steps):
        t = step + 1
        for key, (weight, grad) in seen[step].items():
            m[key] = beta1 * m[key] + (1 - beta1) * grad
            v[key] = beta2 * v[key] + (1 - beta2) * grad * grad
            update = lr * (m[key] / (1 - beta1 ** t)) / ((v[key] / (1 - beta2 ** t)).sqrt() + eps)
            block, name = key.split(".")
            logged = rows.loc[(step, int(block)), f"{name}_update"]
            assert logged == pytest.approx((update.norm() / weight.norm()).item(), rel=1e-5), (step, key)
    weight = seen[0]["1.fc1"][0]  # Adam's first step moves every weight by about lr: ||dW|| ~ lr * sqrt(numel)
    assert rows.loc[(0, 1), "fc1_update"] == pytest.approx(lr * math.sqrt(weight.numel()) / weight.norm().item(),
                                                           rel=1e-3)


def test_update_ratio_of_plain_sgd_is_lr_times_gradient_over_weight():
    """SGD without momentum moves W by lr * grad: the update column follows from the grad column."""
    cfg = small("pre", "rmsnorm", "sgd", steps=1, depth=2, width=6)
    cfg = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"momentum": 0.0, "lr": 0.5})})
    rows = pd.DataFrame(train_run(logging(cfg)).blocks)
    model, _ = seeded_init(cfg)
    first = rows[rows.step == 0]
    for name in ("fc1", "fc2"):
        weights = [getattr(b.branch, name).weight.norm().item() for b in model.blocks]
        expected = [0.5 * g / w for g, w in zip(first[f"{name}_grad"], weights)]
        assert list(first[f"{name}_update"]) == pytest.approx(expected, rel=1e-5)


# ----------------------------------------------------------------------------- the batched engine


def assert_blocks_match_reference(configs):
    for cfg, result in zip(configs, train_batch(configs)):
        expected = train_run(cfg)
        assert exact(result.blocks) == exact(expected.blocks), (cfg.norm.placement, cfg.norm.kind, cfg.optim.name)
        assert exact(result.metrics) == exact(expected.metrics)


@pytest.mark.equivalence
@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "rmsnorm_torch", "scalenorm"])
def test_batched_blocks_are_the_references_bits(placement, kind):
    assert_blocks_match_reference([logging(c, 2) for c in runs(placement, kind, n=3, steps=6)])


@pytest.mark.equivalence
@pytest.mark.parametrize("optim", ["adamw", "sgd", "radam"])
def test_batched_blocks_bit_for_bit_for_each_optimizer(optim):
    configs = [logging(c) for c in runs("post", "rmsnorm_llama", optim, n=3, steps=5)]
    if optim == "radam":  # RAdam batches runs that share their settings: seeds
        configs = [configs[0].model_copy(update={"seed": s}) for s in range(3)]
    assert_blocks_match_reference(configs)


@pytest.mark.parametrize("stop", [True, False])
def test_batched_blocks_of_a_diverging_run(stop):
    configs = [logging(c) for c in runs("none", "layernorm", "sgd", n=3, steps=6, stop_on_nonfinite=stop)]
    configs[1] = configs[1].model_copy(update={"optim": configs[1].optim.model_copy(update={"lr": 1e4})})
    assert_blocks_match_reference(configs)


@pytest.mark.equivalence
def test_article_model_blocks_bit_for_bit():
    configs = [logging(RunConfig.model_validate({"norm": {"placement": p}, "train": {"steps": 10}, "seed": s}), 3)
               for p in ("post", "pre") for s in (0, 1)]
    for placement in range(2):
        assert_blocks_match_reference(configs[2 * placement:2 * placement + 2])


def test_logging_runs_batch_apart_from_the_others():
    configs = runs("pre", "layernorm", n=4)
    batches, alone = plan_batches(configs[:2] + [logging(c) for c in configs[2:]])
    assert sorted(sorted(c.train.log_blocks for c in b) for b in batches) == [[False, False], [True, True]]
    assert not alone


# ----------------------------------------------------------------------------- files, loading, plotting


def test_sweep_writes_blocks_csv_only_for_runs_that_log(write_yaml, tmp_path):
    out = tmp_path / "out"
    path = write_yaml(SMALL_SWEEP)
    result = runner.invoke(app, ["sweep", str(path), "--out", str(out), "-q", "--set", "train.log_blocks=false,true"])
    assert result.exit_code == 0, result.output
    blocks = load_blocks(out)
    metrics = load_metrics(out)
    logged = set(blocks["run_id"])
    assert len(logged) == 8 and logged < set(metrics["run_id"])
    for rid in set(metrics["run_id"]):
        assert (out / rid / "blocks.csv").is_file() == (rid in logged)
    assert set(blocks["block"]) == {1, 2, 3, 4} and set(blocks["step"]) == set(range(6))
    assert {"norm.placement", "norm.kind", "seed", "status"} <= set(blocks.columns)
    one = blocks[blocks.run_id == blocks.run_id.iloc[0]][list(BLOCK_COLUMNS)].reset_index(drop=True)
    reread = pd.read_csv(out / blocks.run_id.iloc[0] / "blocks.csv", **_EXACT)
    pd.testing.assert_frame_equal(one, reread)


@pytest.mark.equivalence
def test_blocks_csv_round_trips_the_engines_bits(write_yaml, tmp_path):
    out = tmp_path / "out"
    path = write_yaml(SMALL_SWEEP.replace("train: {steps: 5}", "train: {steps: 5, log_blocks: true}"))
    assert runner.invoke(app, ["sweep", str(path), "--out", str(out), "-q", "--engine", "batched"]).exit_code == 0
    blocks = load_blocks(out, all_config=True)
    for rid, written in blocks.groupby("run_id"):
        cfg = RunConfig.model_validate({k: v for k, v in _config(out / rid).items()})
        expected = pd.DataFrame(train_run(cfg).blocks)
        assert exact(written[list(BLOCK_COLUMNS)].to_dict("list")) == exact(expected.to_dict("list"))


def _config(run_dir):
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())


def test_load_blocks_says_when_no_run_logged(write_yaml, tmp_path):
    out = tmp_path / "out"
    runner.invoke(app, ["sweep", str(write_yaml(SMALL_SWEEP)), "--out", str(out), "-q"])
    with pytest.raises(ResultsError, match="train.log_blocks"):
        load_blocks(out)
    result = runner.invoke(app, ["plot", str(out), "--blocks"])
    assert result.exit_code == 2 and "train.log_blocks" in result.output and not list(out.glob("blocks*.png"))


def test_load_blocks_never_reads_a_missing_file_as_no_rows(write_yaml, tmp_path):
    out = tmp_path / "out"
    path = write_yaml(SMALL_SWEEP.replace("train: {steps: 5}", "train: {steps: 5, log_blocks: true}"))
    runner.invoke(app, ["sweep", str(path), "--out", str(out), "-q"])
    victim = next(out.glob("*/blocks.csv"))
    victim.unlink()
    blocks = load_blocks(out)  # done.json vouches for blocks.csv: the run is corrupt, left out and named
    assert victim.parent.name not in set(blocks["run_id"]) and blocks["run_id"].nunique() == 7
    assert blocks.attrs["unfinished"] == {victim.parent.name: "corrupt"}


def test_plot_blocks_writes_one_png(write_yaml, tmp_path):
    out = tmp_path / "out"
    path = write_yaml(SMALL_SWEEP.replace("train: {steps: 5}", "train: {steps: 5, log_blocks: true}"))
    runner.invoke(app, ["sweep", str(path), "--out", str(out), "-q"])
    result = runner.invoke(app, ["plot", str(out), "--blocks"])
    assert result.exit_code == 0, result.output
    assert (out / "blocks-fc2_update.png").stat().st_size > 10_000
    result = runner.invoke(app, ["plot", str(out), "--blocks", "--block-metric", "stream_rms", "-o",
                                 str(tmp_path / "s.png")])
    assert result.exit_code == 0 and (tmp_path / "s.png").is_file()


def test_plot_metrics_are_the_logged_columns():
    from normexp.blocklog import TRANSFORMER_BLOCK_COLUMNS

    assert tuple(BLOCK_METRIC_LABELS) == TRANSFORMER_BLOCK_COLUMNS[2:]  # the FFN's columns, then the Transformer's
    assert TRANSFORMER_BLOCK_COLUMNS[:len(BLOCK_COLUMNS)] == BLOCK_COLUMNS


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("train_keys, expected", [
    ("{log_blocks: true, log_every: 0}", "base.train.log_every: must be >= 1, got 0"),
    ("{log_blocks: true, log_every: -3}", "base.train.log_every: must be >= 1, got -3"),
    ("{log_blocks: true, log_every: 1.5}", "base.train.log_every: must be an integer, got 1.5"),
    ("{log_blocks: true, log_every: '2'}", "base.train.log_every: must be an integer, got '2'"),
    ("{log_blocks: true, log_every: true}", "base.train.log_every: must be an integer, got True"),
    ("{log_blocks: yes please}", "base.train.log_blocks: must be true or false"),
    ("{log_every: 5}", "base.train.log_every: thins blocks.csv, so it needs log_blocks: true"),
    ("{log_block: true}", "base.train.log_block: unknown key (did you mean 'log_blocks'?)"),
])
def test_bad_logging_keys_exit_2_naming_the_key(write_yaml, tmp_path, train_keys, expected):
    path = write_yaml(f"name: b\nbase: {{train: {train_keys}}}\n")
    result = runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and expected in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_bad_logging_values_through_set_name_the_grid_key(write_yaml, tmp_path):
    path = write_yaml(SMALL_SWEEP)
    for option, expected in [("train.log_every=0", "grid.train.log_every: must be >= 1, got 0"),
                             ("train.log_every=4", "grid.train.log_every: thins blocks.csv")]:
        result = runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "out"), "--set", option])
        assert result.exit_code == 2 and expected in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_a_model_without_blocks_cannot_be_asked_to_log_them(write_yaml, tmp_path):
    """depth 0 (no blocks) is refused for every run, naming the key that asks for it."""
    path = write_yaml("name: b\nbase: {model: {depth: 0}, train: {log_blocks: true}}\n")
    result = runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "base.model.depth: must be >= 1, got 0" in result.output
    with pytest.raises(ConfigError):
        load_sweep(path)


def test_bad_plot_options_exit_2(write_yaml, tmp_path):
    out = tmp_path / "out"
    path = write_yaml(SMALL_SWEEP.replace("train: {steps: 5}", "train: {steps: 5, log_blocks: true}"))
    runner.invoke(app, ["sweep", str(path), "--out", str(out), "-q"])
    for args, expected in [(["--blocks", "--block-metric", "fc3_grad"], "--block-metric: must be one of"),
                           (["--block-metric", "fc1_grad"], "--block-metric: only with --blocks"),
                           (["--blocks", "-o", str(tmp_path / "x.jpg")], "must end in .png, .pdf or .svg")]:
        result = runner.invoke(app, ["plot", str(out), *args])
        assert result.exit_code == 2 and expected in result.output, (args, result.output)
    assert not list(out.glob("blocks*.png"))


def test_cross_entropy_is_what_the_rows_were_taken_from():
    """Step 0's fc2 gradient of the last block equals a direct backward of the seeded model."""
    cfg = small("post", "rmsnorm", depth=3, width=4)
    rows = pd.DataFrame(train_run(logging(cfg)).blocks)
    model, task = seeded_init(cfg)
    F.cross_entropy(model(task.x), task.y).backward()
    expected = torch.linalg.vector_norm(model.blocks[-1].branch.fc2.weight.grad).item()
    assert rows[(rows.step == 0) & (rows.block == 3)].fc2_grad.item() == expected


@pytest.mark.process
@pytest.mark.slow
def test_worker_processes_write_the_same_blocks_csv(write_yaml, tmp_path):
    """blocks.csv travels back from a worker process with the metrics: the same bytes as in process."""
    path = write_yaml(SMALL_SWEEP.replace("train: {steps: 5}", "train: {steps: 5, log_blocks: true}"))
    outs = {workers: tmp_path / f"w{workers}" for workers in (1, 2)}
    for workers, out in outs.items():
        result = runner.invoke(app, ["sweep", str(path), "--out", str(out), "-q", "--workers", str(workers)])
        assert result.exit_code == 0, result.output
    files = sorted(p.relative_to(outs[1]) for p in outs[1].glob("*/blocks.csv"))
    assert len(files) == 8
    assert all((outs[1] / f).read_bytes() == (outs[2] / f).read_bytes() for f in files)


def test_the_fast_engine_hands_logging_runs_to_the_exact_engines():
    """blocks.csv is the reference's bits: under --engine fast, logging runs train on the batched engine."""
    from normexp.units import plan_units

    configs = runs("pre", "layernorm", n=4)
    units = plan_units(configs[:2] + [logging(c) for c in configs[2:]], "fast", "cpu", 1)
    by_logging = {unit.runs[0].train.log_blocks: unit for unit in units}
    assert len(units) == 2 and by_logging[True].engine == "batched" and by_logging[False].engine == "fast"


def test_done_json_vouches_for_blocks_csv(write_yaml, tmp_path):
    """A byte changed in blocks.csv makes its run corrupt: the next sweep redoes that run, and only it."""
    out = tmp_path / "out"
    path = write_yaml(SMALL_SWEEP.replace("train: {steps: 5}", "train: {steps: 5, log_blocks: true}"))
    assert runner.invoke(app, ["sweep", str(path), "--out", str(out), "-q"]).exit_code == 0
    victim = sorted(out.glob("*/blocks.csv"))[0]
    original = victim.read_bytes()
    victim.write_bytes(original.replace(b"1", b"2", 1))
    result = runner.invoke(app, ["sweep", str(path), "--out", str(out)])
    assert result.exit_code == 0 and "1 ran, 7 already done" in result.output, result.output
    assert victim.read_bytes() == original


# ----------------------------------------------------------------------------- every placement


def _ffn_placements() -> list[str]:
    from typing import get_args

    from normexp.config import Placement

    return [p for p in get_args(Placement) if p != "b2t"]  # b2t needs the Transformer's two sublayers


@pytest.mark.equivalence
@pytest.mark.parametrize("placement", _ffn_placements())
def test_log_blocks_works_on_every_placement_and_both_exact_engines_agree(placement):
    from normexp.engines.reference import train_run

    result = train_run(logging(small(placement, steps=2)))
    assert result.blocks is not None and set(result.blocks["block"]) == {1, 2, 3}
    assert all(math.isfinite(v) for v in result.blocks["stream_rms"])
    assert_blocks_match_reference([logging(c, 2) for c in runs(placement, "rmsnorm", n=2, steps=3)])


def test_resdual_logs_the_normed_stream_x_a():
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


# ----------------------------------------------------------------------------- a panel with nothing to draw


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
