"""The real-text task, `data.task: shakespeare_char`: its keys, its windows, its held-out set and its engines.

The config resolves the text's vocabulary and a batch size and refuses the keys that do not apply; each
step's windows come from the run's own seeded generator and lie in the train split; the held-out windows
lie in the val split and are the same for every seed; `train.eval_every` thins val_loss; the batched
engine gives the reference's bits on a small sweep, and the fast engine trains it (its contract:
tests/test_fast_text.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from normexp import corpus
from normexp.analysis.realtext import final_val_losses, verdict
from normexp.cli import app
from normexp.config import TEXT_BATCH_SIZE, build_sweep, sequence_shape, validate_run
from normexp.data import VAL_SEED, make_task
from normexp.engines.common import minibatches, seeded_init
from normexp.engines.cost import model_step_flops
from normexp.engines.fast import fast_serves
from normexp.engines.reference import train_run
from normexp.folder import run_id
from normexp.results import load_metrics, load_summary
from normexp.units import plan_units


def text_run(placement: str = "pre", seed: int = 0, steps: int = 4, **data) -> object:
    return validate_run({"model": {"arch": "transformer", "depth": 2, "width": 16, "n_heads": 2},
                         "norm": {"placement": placement},
                         "data": {"task": "shakespeare_char", "seq_len": 12, "n_val": 6, "batch_size": 3, **data},
                         "train": {"steps": steps, "threads": 1}, "seed": seed})


def chars(tokens: torch.Tensor) -> str:
    return corpus.decode(tokens.tolist())


# ----------------------------------------------------------------------------- the keys


def test_the_vocabulary_batch_and_context_resolve_per_task():
    cfg = validate_run({"model": {"arch": "transformer"}, "data": {"task": "shakespeare_char"}})
    assert (cfg.data.vocab, cfg.data.batch_size, cfg.data.seq_len) == (84, TEXT_BATCH_SIZE, None)
    assert sequence_shape(cfg.data).seq_len - 1 == 64  # the context: 64 characters read, each scored
    written = validate_run({"model": {"arch": "transformer"},
                            "data": {"task": "shakespeare_char", "seq_len": 64, "vocab": 84, "batch_size": 32}})
    assert run_id(written) == run_id(cfg)


def test_a_grid_over_the_task_resolves_each_runs_vocabulary_and_batch():
    sweep = build_sweep({"name": "t", "base": {"model": {"arch": "transformer", "depth": 1, "width": 8, "n_heads": 2},
                                              "data": {"task": "shakespeare_char"}},
                         "grid": {"data.task": ["copy", "shakespeare_char"]}})
    copy, text = sweep.runs
    assert (copy.data.vocab, copy.data.batch_size) == (16, None)
    assert (text.data.vocab, text.data.batch_size) == (84, TEXT_BATCH_SIZE)


BAD = {
    "n_samples": ("data: {task: shakespeare_char, n_samples: 100}", "base.data.n_samples"),
    "vocab": ("data: {task: shakespeare_char, vocab: 65}", "base.data.vocab"),
    "ffn": ("model: {arch: ffn}\n  data: {task: shakespeare_char}", "base.data.task"),
    "eval_every on ffn": ("model: {arch: ffn}\n  train: {eval_every: 10}", "base.train.eval_every"),
    "gelu on ffn": ("model: {arch: ffn, activation: gelu}", "base.model.activation"),
    "gpt2 on ffn": ("model: {arch: ffn, init: gpt2}", "base.model.init"),
    "tied on ffn": ("model: {arch: ffn, tie_embeddings: true}", "base.model.tie_embeddings"),
    "eval_every 0": ("data: {task: shakespeare_char}\n  train: {eval_every: 0}", "base.train.eval_every"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_every_bad_key_exits_2_naming_it_and_writes_nothing(tmp_path, case):
    body, named = BAD[case]
    if "arch" not in body:
        body = "model: {arch: transformer}\n  " + body
    config, out = tmp_path / "bad.yaml", tmp_path / "out"
    config.write_text(f"name: bad\nbase:\n  {body}\n")
    result = CliRunner().invoke(app, ["sweep", str(config), "--out", str(out)])
    assert result.exit_code == 2 and named in result.output, result.output
    assert "Traceback" not in result.output and not out.exists()


# ----------------------------------------------------------------------------- the windows


def test_each_steps_windows_are_the_train_split_read_on_by_one():
    cfg = text_run()
    _, task = seeded_init(cfg)
    train = corpus.text()[:len(corpus.load().train)]
    for _, (x, y) in zip(range(3), minibatches(cfg, task)):
        assert x.shape == y.shape == (3, 12)
        for row_x, row_y in zip(x, y):
            start = train.find(chars(row_x) + chars(row_y)[-1])
            assert start >= 0 and chars(row_y) == train[start + 1:start + 13]


def test_windows_come_from_the_runs_own_seed_and_a_longer_run_begins_alike():
    def windows(seed: int, steps: int) -> list[torch.Tensor]:
        cfg = text_run(seed=seed, steps=steps)
        _, task = seeded_init(cfg)
        return [x for _, (x, _) in zip(range(steps + 1), minibatches(cfg, task))]

    first, again, other, longer = windows(0, 3), windows(0, 3), windows(1, 3), windows(0, 8)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not any(torch.equal(a, b) for a, b in zip(first, other))
    assert all(torch.equal(a, b) for a, b in zip(first, longer))
    assert torch.equal(first[0], minibatches_drawn_by_hand(0, 3, 12))


def minibatches_drawn_by_hand(seed: int, batch: int, length: int) -> torch.Tensor:
    """Step 0's inputs as nanoGPT's get_batch draws them: torch.randint(len(data) - block_size, (batch_size,))."""
    train = torch.from_numpy(corpus.load().train.astype("int64"))
    ix = torch.randint(len(train) - length, (batch,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([train[i:i + length] for i in ix])


def test_the_held_out_windows_lie_in_the_val_split_and_are_the_same_for_every_run():
    tasks = [make_task(text_run(seed=seed, placement=placement).data, text_run().model)
             for seed, placement in ((0, "pre"), (7, "post"))]
    assert torch.equal(tasks[0].val_x, tasks[1].val_x) and torch.equal(tasks[0].val_y, tasks[1].val_y)
    val = corpus.text()[len(corpus.load().train):]
    assert tasks[0].val_x.shape == (6, 12)
    for row_x, row_y in zip(tasks[0].val_x, tasks[0].val_y):
        start = val.find(chars(row_x) + chars(row_y)[-1])
        assert start >= 0 and chars(row_y) == val[start + 1:start + 13]
    assert VAL_SEED not in (0, 7)
    wider = make_task(text_run(n_val=9).data, text_run().model)
    assert torch.equal(wider.val_x[:6], tasks[0].val_x)  # more windows: the same first ones


def test_the_model_reads_the_context_and_is_scored_at_every_position():
    cfg = text_run()
    model, task = seeded_init(cfg)
    assert model.position.num_embeddings == 12 and task.positions.tolist() == list(range(12))
    assert model.token.num_embeddings == 84


def test_a_step_costs_its_windows():
    assert model_step_flops(text_run(batch_size=6)) == 2 * model_step_flops(text_run(batch_size=3))


# ----------------------------------------------------------------------------- training


@pytest.mark.equivalence
def test_a_run_repeats_bit_for_bit_and_scores_its_held_out_set_every_eval_every_steps():
    cfg = validate_run({**text_run(steps=7).model_dump(), "train": {"steps": 7, "threads": 1, "eval_every": 3}})
    a, b = train_run(cfg), train_run(cfg)
    assert {c: [repr(v) for v in a.metrics[c]] for c in a.metrics} == {c: [repr(v) for v in b.metrics[c]]
                                                                       for c in b.metrics}  # nan != nan: as written
    evaluated = [step for step, v in zip(a.metrics["step"], a.metrics["val_loss"]) if not math.isnan(v)]
    assert evaluated == [0, 3, 6, 7]
    assert all(math.log(84) - 1 < v < math.log(84) + 1 for v in a.metrics["val_loss"] if not math.isnan(v))


def test_the_held_out_loss_is_its_windows_mean_cross_entropy():
    cfg = text_run(steps=0)
    model, task = seeded_init(cfg)
    logits = model(task.val_x)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), task.val_y.flatten()).item()
    assert train_run(cfg).metrics["val_loss"][0] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("placement", ["admin", "post"])
def test_measurements_at_init_read_the_first_minibatch(placement):
    from normexp.diagnostics import layer_gradnorm_at_init

    cfg = text_run(placement)
    rows = layer_gradnorm_at_init(cfg)
    assert len(rows) == 2 and all(math.isfinite(r["attn_out_grad"]) for r in rows)
    assert math.isfinite(train_run(cfg).metrics["loss"][-1])


SWEEP = """\
name: text
base:
  model: {arch: transformer, depth: 2, width: 16, n_heads: 2}
  data: {task: shakespeare_char, seq_len: 12, n_val: 6, batch_size: 3}
  optim: {name: adam}
  schedule: {kind: linear_warmup}
  train: {steps: 4, threads: 1, eval_every: 2}
grid:
  norm.placement: [post, pre]
  optim.lr: [0.001, 0.01]
  schedule.warmup_steps: [0, 2]
seeds: [0, 1]
"""


@pytest.mark.equivalence
def test_the_batched_engine_trains_a_small_sweep_bit_for_bit_as_the_reference(tmp_path):
    config = tmp_path / "text.yaml"
    config.write_text(SWEEP)
    outs = {}
    for engine in ("reference", "batched", "fast"):
        outs[engine] = tmp_path / engine
        result = CliRunner().invoke(app, ["sweep", str(config), "--out", str(outs[engine]), "--engine", engine])
        assert result.exit_code == 0, result.output
    runs = sorted(p.name for p in outs["reference"].iterdir() if (p / "done.json").is_file())
    assert len(runs) == 16
    for run in runs:
        written = (outs["batched"] / run / "metrics.csv").read_bytes()
        assert written == (outs["reference"] / run / "metrics.csv").read_bytes(), run
    assert set(load_summary(outs["fast"])["engine"]) == {"fast"}  # its own bits, within its contract
    metrics = load_metrics(outs["reference"], all_config=True)
    assert metrics["val_loss"].notna().sum() == 16 * 3  # steps 0, 2, 4
    fast = load_metrics(outs["fast"], all_config=True)
    assert fast["val_loss"].isna().tolist() == metrics["val_loss"].isna().tolist()  # scored at the same steps
    runs = final_val_losses(metrics)  # the study's verdict reads a folder so
    assert len(runs) == 16 and runs["val_loss"].notna().all()
    assert verdict(runs, corpus.floors().unigram).startswith("Depth 2, lr 0.001: without warmup Post-LN stays")


def test_the_fast_engine_serves_text_runs_and_nanogpts_keys():
    text = text_run()
    synthetic = validate_run({"model": {"arch": "transformer", "depth": 1, "width": 8, "n_heads": 2},
                              "data": {"task": "copy", "n_samples": 16, "n_val": 8}})
    gelu = validate_run({**synthetic.model_dump(), "model": {**synthetic.model.model_dump(), "activation": "gelu",
                                                             "bias": False, "tie_embeddings": True, "init": "gpt2"}})
    thinned = validate_run({**synthetic.model_dump(), "train": {"eval_every": 2}})
    assert all(fast_serves(cfg) for cfg in (text, synthetic, gelu, thinned))
    units = plan_units([text, text.model_copy(update={"seed": 1})], "fast", "cpu", 1, compile=False)
    assert {unit.engine for unit in units} == {"fast"}
