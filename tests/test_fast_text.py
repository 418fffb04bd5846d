"""The fast engine on the real-text task (`data.task: shakespeare_char`) and nanoGPT's model keys.

Each run of a batch trains on its own windows, the ones the reference draws for it step by step; the
held-out split is scored at train.eval_every's steps, as the reference scores it; a tied embedding is one
parameter of the stacked step; nanoGPT's GELU, bias-free layers and GPT-2 init start each run from the
reference's weights. A small sweep is within the fast engine's contract of the reference
(docs/fast-contract.md), its held-out losses too.
"""

from __future__ import annotations

import math
import re
import sys
from itertools import islice
from pathlib import Path

import pytest
import torch

from normexp.config import sequence_shape, validate_run
from normexp.engines.common import loss_and_acc, minibatches, seeded_init, z_loss
from normexp.engines.fast import plan_fast, train_fast
from normexp.engines.fast.plan import LOOPED_TOKENS, MAX_CHUNK, chunk_runs, loops_runs
from normexp.engines.fast.starts import on_meta, seeded_start
from normexp.engines.fast.step import batch_model, make_grad_step, stack_runs
from normexp.engines.reference import train_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_fast import compare, contract_holds, run_fast, yardstick  # noqa: E402

NANOGPT = {"activation": "gelu", "bias": False, "tie_embeddings": True, "init": "gpt2"}


def text_run(placement="pre", seed=0, steps=6, lr=0.01, warmup=0, eval_every=1, depth=2, **model):
    return validate_run({"model": {"arch": "transformer", "depth": depth, "width": 16, "n_heads": 2, **model},
                         "norm": {"placement": placement},
                         "data": {"task": "shakespeare_char", "seq_len": 12, "n_val": 7, "batch_size": 3},
                         "optim": {"name": "adam", "lr": lr},
                         "schedule": {"kind": "linear_warmup", "warmup_steps": warmup},
                         "train": {"steps": steps, "threads": 1, "eval_every": eval_every}, "seed": seed})


def test_each_run_of_a_batch_trains_on_the_windows_the_reference_draws_for_it():
    configs = [text_run(seed=seed, steps=5) for seed in (3, 0, 7)]
    batch = stack_runs(configs, "cpu")
    for r, cfg in enumerate(configs):
        _, task = seeded_init(cfg)
        for step, (x, y) in enumerate(islice(minibatches(cfg, task), cfg.train.steps + 1)):
            got_x, got_y = batch.step_data(step)
            assert torch.equal(got_x[r], x) and torch.equal(got_y[r], y), (cfg.seed, step)
    assert not torch.equal(batch.step_data(0)[0][0], batch.step_data(0)[0][1])  # seeds draw their own
    assert batch.x.dim() == 1  # the train split once for the batch, not once per run


def test_the_held_out_split_is_scored_at_eval_every_steps_and_the_last_as_the_reference_scores_it():
    configs = [text_run(seed=seed, steps=7, eval_every=3) for seed in (0, 1)]
    for cfg, fast in zip(configs, train_fast(configs, compile=False)):
        reference = train_run(cfg)
        scored = [not math.isnan(v) for v in fast.metrics["val_loss"]]
        assert scored == [not math.isnan(v) for v in reference.metrics["val_loss"]]
        assert [s for s, v in zip(fast.metrics["step"], scored) if v] == [0, 3, 6, 7]
        for column in ("val_loss", "val_acc"):
            for got, want in zip(fast.metrics[column], reference.metrics[column]):
                assert got == pytest.approx(want, abs=1e-4, nan_ok=True), column


def test_a_tied_embedding_is_one_parameter_of_the_stacked_step_and_of_its_meta_model():
    cfg = text_run(**NANOGPT)
    batch = stack_runs([cfg, text_run(seed=1, **NANOGPT)], "cpu")
    assert "token.weight" in batch.params and "head.weight" not in batch.params
    net, _ = seeded_init(cfg)
    meta = on_meta(net)
    assert meta.token.weight is meta.head.weight and meta.token.weight.device.type == "meta"


@pytest.mark.parametrize("model", [NANOGPT, {"activation": "gelu"}, {"bias": False}, {"tie_embeddings": True}],
                         ids=["nanogpt", "gelu", "bias-free", "tied"])
def test_nanogpts_keys_start_from_the_references_weights(model):
    cfg = text_run(seed=5, **model)
    net, _ = seeded_init(cfg)
    for seed_cfg in (cfg, cfg):  # a structure's first run is built, the next replayed
        params, _ = seeded_start(seed_cfg)
        assert list(params) == [name for name, _ in net.named_parameters()]
        assert all(torch.equal(params[name], p) for name, p in net.named_parameters())


@pytest.mark.equivalence
@pytest.mark.parametrize("model", [NANOGPT, {}], ids=["nanogpt", "default"])
def test_a_batch_with_nanogpts_keys_follows_the_reference_over_a_few_steps(model):
    configs = [text_run(seed=seed, lr=lr, **model) for seed, lr in ((0, 0.01), (1, 0.003), (2, 0.001))]
    for cfg, fast in zip(configs, train_fast(configs, compile=False)):
        reference = train_run(cfg)
        assert fast.engine == "fast" and fast.metrics["step"] == reference.metrics["step"]
        for column in ("loss", "val_loss"):
            for got, want in zip(fast.metrics[column], reference.metrics[column]):
                assert got == pytest.approx(want, abs=1e-4), column


@pytest.mark.equivalence
@pytest.mark.parametrize("windows", [(3, 12), (8, 64)], ids=["vmapped", "run-by-run"])
def test_a_small_sweep_is_within_the_fast_engines_contract_of_the_reference(windows):
    """Post-LN and Pre-LN x lr x warmup x 2 seeds, 12 steps: F (fast vs reference) against S (the reference
    with each step's windows in another order), and the held-out losses within rounding of the reference's;
    3 windows of 12 characters a step (vmapped), or 8 of 64 (LOOPED_TOKENS: run by run)."""
    batch_size, seq_len = windows
    configs = [validate_run({**cfg.model_dump(), "data": {**cfg.data.model_dump(), "batch_size": batch_size,
                                                           "seq_len": seq_len}})
               for cfg in (text_run(placement, seed, steps=12, lr=lr, warmup=warmup, eval_every=4, **NANOGPT)
                           for placement in ("post", "pre") for lr in (0.003, 0.03) for warmup in (0, 6)
                           for seed in (0, 1))]
    assert {loops_runs(cfg) for cfg in configs} == {batch_size * seq_len >= LOOPED_TOKENS}
    reference = [train_run(cfg) for cfg in configs]
    fast = run_fast(configs)
    f = compare(configs, fast, reference)
    assert contract_holds(f, yardstick(configs, reference)), f
    for got, want in zip(fast, reference):
        pairs = list(zip(got.metrics["val_loss"], want.metrics["val_loss"]))
        assert all(math.isnan(a) == math.isnan(b) for a, b in pairs)
        assert max(abs(a - b) for a, b in pairs if not math.isnan(b)) < 1e-2


def test_an_uncompiled_text_batch_holds_as_many_runs_as_its_activations_allow():
    deep = validate_run({**text_run().model_dump(), "model": {"arch": "transformer", "depth": 12, "width": 64,
                                                              "n_heads": 4},
                         "data": {"task": "shakespeare_char", "seq_len": 64, "batch_size": 32, "n_val": 8}})
    assert chunk_runs(text_run(), compiled=False) == MAX_CHUNK
    size = chunk_runs(deep, compiled=False)
    assert 1 < size < 16 and chunk_runs(deep, compiled=True) == 8
    runs = [deep.model_copy(update={"seed": seed}) for seed in range(20)]
    assert [len(batch) for batch in plan_fast(runs)] == [size] * (20 // size) + ([20 % size] if 20 % size else [])


def big_text_run(seed=0, steps=3, z=0.0, **model):
    """A text run of LOOPED_TOKENS tokens a step (8 windows of 64 characters), small otherwise."""
    cfg = text_run(seed=seed, steps=steps, eval_every=2, depth=2, **model)
    return validate_run({**cfg.model_dump(), "data": {**cfg.data.model_dump(), "seq_len": 64, "batch_size": 8},
                         "train": {**cfg.train.model_dump(), "z_loss": z}})


def test_a_text_step_of_many_tokens_goes_run_by_run_and_only_that():
    big = big_text_run()
    assert big.data.batch_size * len(sequence_shape(big.data).positions) == LOOPED_TOKENS and loops_runs(big)
    smaller = validate_run({**big.model_dump(), "data": {**big.data.model_dump(), "batch_size": 7}})
    assert not loops_runs(smaller) and not loops_runs(text_run())
    assert not loops_runs(validate_run({"model": {"arch": "transformer"}, "data": {"task": "copy"}}))


@pytest.mark.parametrize("z", [0.0, 1e-2], ids=["plain", "z-loss"])
@pytest.mark.parametrize("model", [NANOGPT, {}], ids=["nanogpt", "default"])
def test_a_run_by_run_step_gives_each_run_the_references_gradient_bit_for_bit_whatever_its_batch_mates(model, z):
    configs = [big_text_run(seed=seed, z=z, **model) for seed in (0, 1, 2)]
    batch = stack_runs(configs, "cpu")
    step = make_grad_step(batch_model(configs[0]), batch.positions, z, looped=True)
    grads, metrics = step(batch.params, *batch.step_data(0))
    alone, _ = step({name: p[1:] for name, p in batch.params.items()}, *(t[1:] for t in batch.step_data(0)))
    for r, cfg in enumerate(configs):
        net, task = seeded_init(cfg)
        x, y = next(minibatches(cfg, task))
        logits = net(x)
        loss, acc = loss_and_acc(logits, y, task.positions)
        (loss + z_loss(logits, task.positions, z) if z else loss).backward()
        assert metrics[0, r].item() == loss.item() and metrics[1, r].item() == acc.item()
        for name, param in net.named_parameters():
            assert torch.equal(grads[name][r], param.grad), (cfg.seed, name)
            if r:  # the same run batched with fewer others: the same bits
                assert torch.equal(alone[name][r - 1], grads[name][r]), (cfg.seed, name)
    assert metrics.shape == (4 if z else 3, 3)


@pytest.mark.parametrize("z", [0.0, 1e-2], ids=["plain", "z-loss"])
def test_a_run_by_run_step_keeps_no_runs_graph_past_its_gradient(z):
    """What a run-by-run step hands back holds no autograd graph (nothing requires grad): a loss or a z term
    that kept its run's graph would keep every run's activations alive through the batch's metrics until the
    next step, the memory that going run by run saves; the batch's parameters stay plain tensors."""
    configs = [big_text_run(seed=seed, z=z) for seed in (0, 1)]
    batch = stack_runs(configs, "cpu")
    grads, metrics = make_grad_step(batch_model(configs[0]), batch.positions, z, looped=True)(
        batch.params, *batch.step_data(0))
    assert metrics.grad_fn is None and not metrics.requires_grad
    assert not any(g.requires_grad or g.grad_fn is not None for g in grads.values())
    assert not any(p.requires_grad for p in batch.params.values())


@pytest.mark.equivalence
@pytest.mark.parametrize("z", [0.0, 1e-2], ids=["plain", "z-loss"])
def test_a_run_by_run_batch_follows_the_reference_over_a_few_steps(z):
    configs = [big_text_run(seed=seed, z=z, **NANOGPT) for seed in (0, 1)]
    for cfg, fast in zip(configs, train_fast(configs, compile=False)):
        reference = train_run(cfg)
        assert fast.metrics["step"] == reference.metrics["step"]
        for column in ("loss", "val_loss", *(["z_loss"] if z else [])):
            assert fast.metrics[column] == pytest.approx(reference.metrics[column], abs=1e-4, nan_ok=True), column


def test_the_benchmark_times_the_real_text_studys_shape_and_prints_its_own_ratio():
    from bench_fast import text_grid, text_ratio

    runs = text_grid(2, steps=1)
    assert {(c.model.depth, c.model.width, c.data.batch_size, c.data.task, c.train.steps) for c in runs} == {
        (12, 64, 32, "shakespeare_char", 1)} and len(runs) == 2
    tiny = text_grid(2, steps=1, **{"model.depth": 1, "model.width": 8, "model.n_heads": 2, "data.batch_size": 2})
    line = text_ratio(tiny, repeats=1)
    assert re.search(r"real text \(2 runs, depth 1, width 8, 2 windows a step\): reference +[\d.]+ ms, "
                     r"fast eager +[\d.]+ ms +[\d.]+x$", line), line


@pytest.mark.slow
@pytest.mark.equivalence
def test_a_compiled_text_step_trains_each_run_on_its_own_windows_as_the_eager_one(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path))
    configs = [text_run(seed=seed, steps=4, eval_every=2, depth=1, **NANOGPT) for seed in range(3)]
    compiled, eager = train_fast(configs, compile=True), train_fast(configs, compile=False)
    for got, want in zip(compiled, eager):
        assert got.metrics["step"] == want.metrics["step"]
        for column in ("loss", "val_loss"):
            assert got.metrics[column] == pytest.approx(want.metrics[column], abs=1e-4, nan_ok=True), column
