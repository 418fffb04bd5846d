"""The tiny causal Transformer (`model.arch: transformer`) and its sequence tasks.

Shapes and causality for every placement, each placement's formula per sublayer on hand-built inputs,
DeepNet's decoder constants, task determinism and split disjointness, the answer-only loss,
minibatch order, and every bad input of the issue through the CLI (exit 2, key named, nothing written)."""

from __future__ import annotations

import math
from collections import Counter
from typing import get_args

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import (
    DEFAULT_SEQ_LEN,
    SEQUENCE_TASKS,
    NormKind,
    Placement,
    RunConfig,
    build_sweep,
    sequence_shape,
    validate_run,
)
from normexp.data import Task, _distinct_keys, make_task
from normexp.engines.common import batch_order, loss_and_acc, seeded_init
from normexp.engines.reference import train_run
from normexp.folder import run_id
from normexp.models.transformer import Transformer
from normexp.results import load_metrics

PLACEMENTS = list(get_args(Placement))
KINDS = list(get_args(NormKind))


def tiny(placement: str = "pre", kind: str = "layernorm", task: str = "copy", **data) -> RunConfig:
    return validate_run({"model": {"arch": "transformer", "depth": 3, "width": 8, "n_heads": 2},
                         "norm": {"placement": placement, "kind": kind},
                         "data": {"task": task, "n_samples": 16, "n_val": 8, **data}, "train": {"steps": 3}})


def tokens(cfg: RunConfig, n: int = 4, seed: int = 1) -> torch.Tensor:
    length = sequence_shape(cfg.data).seq_len - 1
    return torch.randint(0, cfg.data.vocab, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_logits_have_the_task_shape_for_every_placement(placement):
    cfg = tiny(placement)
    model, task = seeded_init(cfg)
    assert model(task.x).shape == (16, 16, cfg.data.vocab)
    assert task.x.shape == (16, 16) and task.y.shape == (16, 8) and task.val_x.shape == (8, 16)


@settings(max_examples=25, deadline=None)
@given(placement=st.sampled_from(PLACEMENTS), kind=st.sampled_from(KINDS), t=st.integers(0, 15),
       token=st.integers(0, 15))
def test_a_change_at_position_t_never_changes_an_output_before_t(placement, kind, t, token):
    cfg = tiny(placement, kind)
    model, _ = seeded_init(cfg)
    if placement in ("rezero", "admin"):  # their init is the identity branch / profiled: perturb to test
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    x = tokens(cfg)
    changed = x.clone()
    changed[:, t] = (x[:, t] + 1 + token % (cfg.data.vocab - 1)) % cfg.data.vocab
    before, after = model(x), model(changed)
    assert torch.equal(before[:, :t], after[:, :t])
    assert torch.isfinite(before).all()
    assert not torch.equal(before[:, t:], after[:, t:])  # the change does reach position t onward


def _sublayer_inputs(cfg: RunConfig) -> tuple[Transformer, torch.Tensor]:
    model, _ = seeded_init(cfg)
    x = 2 * torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(7)) + 0.5
    return model, x


@pytest.mark.parametrize("placement, formula", [
    ("post", lambda a, f, x: f.norm((h := a.norm(x + a.branch(x))) + f.branch(h))),
    ("pre", lambda a, f, x: (h := x + a.branch(a.norm(x))) + f.branch(f.norm(h))),
    ("sandwich", lambda a, f, x: (h := x + a.norm_out(a.branch(a.norm(x)))) + f.norm_out(f.branch(f.norm(h)))),
    ("none", lambda a, f, x: (h := x + a.branch(x)) + f.branch(h)),
    ("respost", lambda a, f, x: (h := x + a.norm(a.branch(x))) + f.norm(f.branch(h))),
    ("b2t", lambda a, f, x: f.norm(x + (h := a.norm(x + a.branch(x))) + f.branch(h))),
])
def test_each_layer_applies_the_placement_per_sublayer(placement, formula):
    model, x = _sublayer_inputs(tiny(placement))
    layer = model.layers[1]
    assert torch.allclose(layer(x), formula(layer.attn, layer.ffn, x), atol=1e-6)
    if placement == "b2t":  # not Post-LN: the layer input reaches the last norm
        post = layer.ffn.norm((h := layer.attn.norm(x + layer.attn.branch(x))) + layer.ffn.branch(h))
        assert not torch.allclose(layer(x), post, atol=1e-3)


def test_deepnorm_uses_the_decoder_constants_and_scales_v_out_and_the_ffn_not_q_k():
    deep, plain = seeded_init(tiny("deepnorm"))[0], seeded_init(tiny("post"))[0]
    n = 3
    alpha, beta = (2 * n) ** 0.25, (8 * n) ** -0.25
    assert all(block.alpha == pytest.approx(alpha) for block in deep.sublayers)
    d_attn, p_attn = deep.layers[2].attn.branch, plain.layers[2].attn.branch
    for name in ("q", "k"):
        assert torch.equal(getattr(d_attn, name).weight, getattr(p_attn, name).weight)
    for name in ("v", "out"):
        assert torch.allclose(getattr(d_attn, name).weight, beta * getattr(p_attn, name).weight)
    assert torch.allclose(deep.layers[0].ffn.branch.fc2.weight, beta * plain.layers[0].ffn.branch.fc2.weight)
    _, x = _sublayer_inputs(tiny("deepnorm"))
    a = deep.layers[0].attn
    assert torch.allclose(a(x), a.norm(alpha * x + a.branch(x)))


def test_resdual_streams_pass_through_every_sublayer():
    model, _ = seeded_init(tiny("resdual"))
    x = model.embed(tokens(tiny("resdual")))
    x_a, x_d = x, x  # both start at the embedding (Xie et al.'s `res = x`)
    for block in model.sublayers:
        branch = block.branch(x_a)
        x_a, x_d = block.norm(x_a + branch), x_d + branch
    assert isinstance(model.final_norm, torch.nn.Identity)  # no final norm after x_a + Norm_d(x_d)
    expected = model.head(x_a + model.dual_norm(x_d))
    assert torch.allclose(model(tokens(tiny("resdual"))), expected, atol=1e-6)


def test_admin_profiles_every_sublayer_in_order():
    cfg = tiny("admin")
    cfg = cfg.model_copy(update={"norm": cfg.norm.model_copy(update={"admin_profile": "closed_form"})})
    model, task = seeded_init(cfg)  # normexp's earlier closed form; the measured default: test_fidelity.py
    profiled = [block.omega.weight.detach().clone() for block in model.sublayers]
    h, total = model.embed(task.x), 0.0
    with torch.no_grad():
        for block, omega in zip(model.sublayers, profiled):
            assert torch.allclose(omega, torch.full((8,), math.sqrt(1 + total)))
            block.omega.weight.fill_(1.0)  # the profiling forward runs with every w = 1
            total += block.branch(h).var().item()
            h = block(h)
    assert len(set(w[0].item() for w in profiled)) == len(profiled)  # grows sublayer by sublayer


def test_mixln_is_post_then_pre_per_layer():
    cfg = validate_run({**tiny().model_dump(), "model": {**tiny().model.model_dump(), "depth": 4},
                        "norm": {"placement": "mixln", "mixln_fraction": 0.5}})
    model, _ = seeded_init(cfg)
    assert [b.placement for b in model.sublayers] == ["post"] * 4 + ["pre"] * 4


@pytest.mark.parametrize("task", SEQUENCE_TASKS)
def test_tasks_are_determined_by_the_seed_and_their_splits_disjoint(task):
    cfg = tiny(task=task, vocab=12 if task == "modular_add" else 16)
    first, again, other = (seeded_init(c)[1] for c in (cfg, cfg, cfg.model_copy(update={"seed": 1})))
    assert torch.equal(first.x, again.x) and torch.equal(first.val_y, again.val_y)
    assert not torch.equal(first.x, other.x)
    train = {tuple(r) for r in torch.cat([first.x, first.y], 1).tolist()}
    held = {tuple(r) for r in torch.cat([first.val_x, first.val_y], 1).tolist()}
    assert len(train) == 16 and len(held) == 8 and not train & held


@settings(max_examples=25, deadline=None)
@given(task=st.sampled_from(SEQUENCE_TASKS), n_vals=st.lists(st.integers(1, 40), min_size=2, max_size=2),
       n_samples=st.integers(1, 40), seed=st.integers(0, 2**32))
def test_the_training_split_is_the_same_whatever_n_val(task, n_vals, n_samples, seed):
    first, other = (task_drawn_at(tiny(task=task, vocab=12 if task == "modular_add" else 16,
                                                   n_samples=n_samples, n_val=n_val), seed) for n_val in n_vals)
    assert torch.equal(first.x, other.x) and torch.equal(first.y, other.y)
    assert torch.equal(first.positions, other.positions)
    assert len(first.val_x) == n_vals[0] and len(other.val_x) == n_vals[1]


def task_drawn_at(cfg: RunConfig, seed: int) -> Task:
    torch.manual_seed(seed)
    return make_task(cfg.data, cfg.model)


@pytest.mark.parametrize("task", ["assoc_recall", "copy"])
def test_no_draw_is_larger_than_the_sequences_it_makes(task, monkeypatch):
    """A large vocabulary costs no memory: each random draw is at most n x seq_len numbers."""
    cfg, sizes = tiny(task=task, vocab=65536), []

    def spy(draw):
        def measured(*args, **kwargs):
            out = draw(*args, **kwargs)
            sizes.append(out.numel())
            return out
        return measured

    for name in ("rand", "randint", "randperm"):
        monkeypatch.setattr(torch, name, spy(getattr(torch, name)))
    task_drawn_at(cfg, 0)
    assert sizes and max(sizes) <= 24 * sequence_shape(cfg.data).seq_len


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 20), pairs=st.integers(1, 6), spare=st.integers(0, 6), seed=st.integers(0, 2**32))
def test_recall_keys_are_distinct_in_range_and_seeded(n, pairs, spare, seed):
    keys = pairs + spare
    torch.manual_seed(seed)
    drawn = _distinct_keys(n, pairs, keys)
    torch.manual_seed(seed)
    assert torch.equal(drawn, _distinct_keys(n, pairs, keys))
    assert drawn.shape == (n, pairs) and 0 <= drawn.min() and drawn.max() < keys
    assert all(len(set(row)) == pairs for row in drawn.tolist())


def test_recall_keys_are_uniform_over_ordered_choices():
    torch.manual_seed(0)
    counts = Counter(map(tuple, _distinct_keys(24_000, 2, 4).tolist()))  # 12 ordered pairs, 2000 each expected
    assert len(counts) == 12 and all(1800 < c < 2200 for c in counts.values())


@pytest.mark.parametrize("task", SEQUENCE_TASKS)
def test_the_default_seq_len_written_out_is_the_same_run_as_left_unset(task):
    vocab = 12 if task == "modular_add" else 16
    unset, written = tiny(task=task, vocab=vocab), tiny(task=task, vocab=vocab, seq_len=DEFAULT_SEQ_LEN[task])
    assert unset == written and run_id(unset) == run_id(written)
    sweep = build_sweep({"name": "t", "base": unset.model_dump(mode="json"),
                         "grid": {"data.seq_len": [None, DEFAULT_SEQ_LEN[task]]}})
    assert len(sweep.runs) == 1


def test_the_answers_are_the_task_rule():
    for task in SEQUENCE_TASKS:
        cfg = tiny(task=task, vocab=12 if task == "modular_add" else 16)
        t = make_task(cfg.data, cfg.model)
        if task == "copy":
            assert torch.equal(t.y, t.x[:, :8])
        elif task == "modular_add":
            assert torch.equal(t.y[:, 0], (t.x[:, 0] + t.x[:, 2]) % 10)
        else:  # the value stored after the queried key
            for row, answers in zip(t.x.tolist(), t.y.tolist()):
                stored = dict(zip(row[0:8:2], row[1:8:2]))
                assert [stored[row[p]] for p in t.positions.tolist()] == answers


def test_the_loss_reads_the_answer_positions_only():
    logits = torch.zeros(2, 5, 4)
    logits[:, 3, 1] = 10.0  # right at the answer position; position 4 is wrong but ignored
    logits[:, 4, 2] = 10.0
    y = torch.tensor([[1], [1]])
    loss, acc = loss_and_acc(logits, y, torch.tensor([3]))
    assert acc.item() == 1.0 and loss.item() < 1e-3


def test_minibatches_cover_each_epoch_once_in_a_seeded_order():
    order = batch_order(10, 3, seed=5, steps=6)
    assert len(order) == 7 and all(len(b) == 3 for b in order)
    first_epoch = torch.cat(order[:3]).tolist()
    assert len(set(first_epoch)) == 9
    assert all(torch.equal(a, b) for a, b in zip(order, batch_order(10, 3, seed=5, steps=6)))
    assert not all(torch.equal(a, b) for a, b in zip(order, batch_order(10, 3, seed=6, steps=6)))


@pytest.mark.equivalence
def test_a_run_records_val_columns_and_repeats_bit_for_bit():
    cfg = tiny("post", task="assoc_recall", batch_size=8)
    a, b = train_run(cfg), train_run(cfg)
    assert list(a.metrics) == ["step", "loss", "acc", "lr", "grad_norm", "val_loss", "val_acc"]
    assert a.metrics == b.metrics and len(a.metrics["val_acc"]) == 4
    assert all(0 <= v <= 1 for v in a.metrics["val_acc"])


SWEEP = """\
name: tf
base:
  model: {arch: transformer, depth: 2, width: 8, n_heads: 2}
  data: {task: copy, n_samples: 16, n_val: 8}
  train: {steps: 3}
grid:
  norm.placement: [post, b2t]
seeds: [0]
"""


def test_cli_sweep_report_and_load_metrics(tmp_path):
    config, out = tmp_path / "tf.yaml", tmp_path / "out"
    config.write_text(SWEEP)
    result = CliRunner().invoke(app, ["sweep", str(config), "--out", str(out), "--engine", "reference"])
    assert result.exit_code == 0, result.output
    metrics = load_metrics(out)
    assert {"val_loss", "val_acc"} <= set(metrics) and len(metrics) == 8
    assert metrics["val_acc"].between(0, 1).all()
    report = CliRunner().invoke(app, ["report", str(out), "--metric", "val_acc"])
    assert report.exit_code == 0, report.output
    assert CliRunner().invoke(app, ["verify", str(out)]).exit_code == 0
    plotted = CliRunner().invoke(app, ["plot", str(out), "-o", str(tmp_path / "val.png"), "--metric", "val_acc"])
    assert plotted.exit_code == 0 and (tmp_path / "val.png").is_file(), plotted.output


def test_held_out_metrics_of_an_ffn_sweep_are_refused_by_name(tmp_path):
    config, out = tmp_path / "ffn.yaml", tmp_path / "out"
    config.write_text("name: ffn\nbase:\n  model: {depth: 2, width: 8}\n  train: {steps: 2}\n")
    assert CliRunner().invoke(app, ["sweep", str(config), "--out", str(out)]).exit_code == 0
    result = CliRunner().invoke(app, ["report", str(out), "--metric", "val_acc"])
    assert result.exit_code == 2 and "val_acc: not recorded" in result.output


BAD = {
    "transformer key with ffn": ("model: {n_heads: 2}", "base.model.n_heads"),
    "sequence task with ffn": ("data: {task: copy}", "base.data.task"),
    "ffn task with transformer": ("model: {arch: transformer}", "base.data.task"),
    "sequence key with random_labels": ("data: {seq_len: 9}", "base.data.seq_len"),
    "n_classes with transformer": ("model: {arch: transformer, n_classes: 5}\n  data: {task: copy}",
                                   "base.model.n_classes"),
    "b2t on the ffn": ("norm: {placement: b2t}", "base.norm.placement"),
    "heads not dividing width": ("model: {arch: transformer, width: 10, n_heads: 4}\n  data: {task: copy}",
                                 "base.model.n_heads"),
    "copy too short": ("model: {arch: transformer}\n  data: {task: copy, seq_len: 3}", "base.data.seq_len"),
    "recall too short": ("model: {arch: transformer}\n  data: {task: assoc_recall, seq_len: 4}", "base.data.seq_len"),
    "recall vocab": ("model: {arch: transformer}\n  data: {task: assoc_recall, seq_len: 32, vocab: 12}",
                     "base.data.vocab"),
    "add vocab": ("model: {arch: transformer}\n  data: {task: modular_add, vocab: 8}", "base.data.vocab"),
    "add vocab too large": ("model: {arch: transformer}\n  data: {task: modular_add, vocab: 65536}", "base.data.vocab"),
    "batch larger than the data": ("model: {arch: transformer}\n  data: {task: copy, batch_size: 100}",
                                   "base.data.batch_size"),
    "qk_norm on the ffn": ("model: {qk_norm: true}", "base.model.qk_norm"),
    "z_loss on the ffn": ("train: {z_loss: 0.0001}", "base.train.z_loss"),
    "negative z_loss": ("model: {arch: transformer}\n  data: {task: copy}\n  train: {z_loss: -1.0}",
                        "base.train.z_loss"),
    "qk_norm_scope unknown": ("model: {arch: transformer, qk_norm: true, qk_norm_scope: all}\n  data: {task: copy}",
                              "base.model.qk_norm_scope"),
}


@pytest.mark.parametrize("case", BAD)
def test_every_bad_input_exits_2_naming_the_key_and_writes_nothing(tmp_path, case):
    base, key = BAD[case]
    config, out = tmp_path / "bad.yaml", tmp_path / "out"
    config.write_text(f"name: bad\nbase:\n  {base}\n")
    result = CliRunner().invoke(app, ["sweep", str(config), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert key in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_a_bad_grid_value_is_blamed_on_the_grid_key(tmp_path):
    config, out = tmp_path / "bad.yaml", tmp_path / "out"
    config.write_text(SWEEP.replace("norm.placement: [post, b2t]", "model.n_heads: [2, 3]"))
    result = CliRunner().invoke(app, ["sweep", str(config), "--out", str(out)])
    assert result.exit_code == 2 and "grid.model.n_heads" in result.output and not out.exists()


GRID_BREAKS_BASE = {  # a grid value that makes a base key invalid: (grid line, what the error must name)
    "width": ("model.width: [8, 6]", "grid.model.width = 6 makes base.model.n_heads"),
    "n_samples": ("data.n_samples: [16, 100]", "grid.data.n_samples = 100 makes base.data.vocab"),
    "arch": ("model.arch: [transformer, ffn]", "grid.model.arch = 'ffn' makes base.data.task"),
}


@pytest.mark.parametrize("case", GRID_BREAKS_BASE)
def test_a_grid_value_that_breaks_a_base_key_is_named(tmp_path, case):
    grid, named = GRID_BREAKS_BASE[case]
    config, out = tmp_path / "bad.yaml", tmp_path / "out"
    sweep = SWEEP.replace("n_heads: 2", "n_heads: 4").replace("task: copy", "task: modular_add, vocab: 12"
                                                             if case == "n_samples" else "task: copy")
    config.write_text(sweep.replace("norm.placement: [post, b2t]", grid))
    result = CliRunner().invoke(app, ["sweep", str(config), "--out", str(out)])
    assert result.exit_code == 2 and named in result.output, result.output
    assert "Traceback" not in result.output and not out.exists()


@pytest.mark.parametrize("placement", ["post", "b2t", "resdual", "admin"])
@pytest.mark.parametrize("batch_size", [None, 8])
def test_the_fast_engine_trains_a_batch_of_seeds_as_the_reference_does(placement, batch_size):
    """Stacked runs of several seeds (vmap's position-embedding gradient comes back strided: the fused
    Adam step must still read it right), within the reference's own 1- vs 2-thread spread (~1e-6 here)."""
    from normexp.engines.fast import train_fast

    runs = [tiny(placement, task="assoc_recall", batch_size=batch_size).model_copy(update={"seed": s})
            for s in (0, 1, 2)]
    runs = [validate_run({**cfg.model_dump(), "train": {"steps": 8, "threads": 1}}) for cfg in runs]
    for fast, cfg in zip(train_fast(runs, compile=False), runs):
        reference = train_run(cfg)
        assert list(fast.metrics) == list(reference.metrics) and fast.engine == "fast"
        for column in ("loss", "acc", "val_loss", "val_acc"):
            assert fast.metrics[column] == pytest.approx(reference.metrics[column], abs=1e-4), column


def test_the_batched_engine_hands_transformer_runs_to_the_reference():
    from normexp.engines.batched import plan_batches

    runs = [tiny("post").model_copy(update={"seed": s}) for s in (0, 1)]
    assert plan_batches(runs) == ([], runs)


def test_gradnorm_on_the_transformer_measures_each_sublayers_output_projection(tmp_path):
    from normexp.analysis.gradnorm import growth_verdict
    from normexp.diagnostics import layer_gradnorm_at_init

    cfg = tiny("post", task="assoc_recall")
    rows = layer_gradnorm_at_init(cfg)
    model, task = seeded_init(cfg)
    loss_and_acc(model(task.x), task.y, task.positions)[0].backward()
    assert [r["layer"] for r in rows] == [1, 2, 3]
    assert rows[2]["attn_out_grad"] == model.layers[2].attn.branch.out.weight.grad.norm().item()
    assert rows[0]["ffn_out_grad"] == model.layers[0].ffn.branch.fc2.weight.grad.norm().item()
    assert [growth_verdict(r) for r in (2.0, 1.0, 0.5, math.nan)] == ["grows", "flat", "shrinks", "undefined"]
    config = tmp_path / "gn.yaml"
    config.write_text(SWEEP.replace("[post, b2t]", "[post, pre]").replace("seeds: [0]", "seeds: [0, 1]"))
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["gradnorm", str(config), "--out", str(tmp_path / "gn"),
                                                            "--format", "markdown"])
    assert result.exit_code == 0, result.output
    assert "Post: last/first layer attention out" in result.output and (tmp_path / "gn" / "gradnorm.png").is_file()
