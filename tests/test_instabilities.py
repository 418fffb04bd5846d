"""Wortsman et al. 2023's mitigations and diagnostics on the Transformer: qk-norm against a plain-torch
transcription, the z-loss's value and gradient against the closed form, the per-layer diagnostics against
a hand computation, every engine with both on, and the instabilities study's verdict from numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from normexp.config import ConfigError, RunConfig, build_sweep, parse_yaml, validate_run
from normexp.engines.common import loss_and_acc, seeded_init, z_loss
from normexp.engines.reference import train_run
from normexp.folder import run_id
from normexp.models.transformer import CausalSelfAttention, Transformer
from normexp.registry import placements_for

WIDTH, HEADS = 8, 2


def tiny(placement: str = "pre", kind: str = "layernorm", qk: bool = True, scope: str = "head", z: float = 1e-2,
         steps: int = 3, qk_eps: float | None = None, **train) -> RunConfig:
    return validate_run({"model": {"arch": "transformer", "depth": 2, "width": WIDTH, "n_heads": HEADS,
                                   "qk_norm": qk, "qk_norm_scope": scope, "qk_norm_eps": qk_eps},
                         "norm": {"placement": placement, "kind": kind},
                         "data": {"task": "assoc_recall", "seq_len": 8, "n_samples": 16, "n_val": 8},
                         "optim": {"lr": 0.03}, "train": {"steps": steps, "z_loss": z, **train}})


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Give every parameter (the norms' gains and biases included) values away from their init."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.7 + (1.0 if param.dim() == 1 else 0.0))


def transcribed_attention(attn: CausalSelfAttention, x: torch.Tensor, scope: str, kind: str,
                          eps: float = 1e-5) -> torch.Tensor:
    """Causal multi-head attention with qk-norm written from the papers, in plain torch ops on attn's weights."""
    n, t, d = x.shape
    hd = d // HEADS
    q, k, v = (x @ lin.weight.T + lin.bias for lin in (attn.q, attn.k, attn.v))

    def norm(y: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        if kind == "layernorm":  # (y - mean) / sqrt(var + eps) * g over the last axis, no bias: flax's
            # MultiHeadDotProductAttention(normalize_qk=True), `LayerNorm(name='query_ln', use_bias=False)`
            mean, var = y.mean(-1, keepdim=True), y.var(-1, unbiased=False, keepdim=True)
            return (y - mean) / torch.sqrt(var + eps) * module.weight
        return y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + eps) * module.weight  # rmsnorm

    if scope == "full":
        q, k = norm(q, attn.q_norm), norm(k, attn.k_norm)
    q, k, v = (y.reshape(n, t, HEADS, hd).permute(0, 2, 1, 3) for y in (q, k, v))
    if scope == "head":
        q, k = norm(q, attn.q_norm), norm(k, attn.k_norm)
    out = torch.zeros(n, HEADS, t, hd)
    for i in range(t):  # query i sees keys 0..i
        scores = (q[:, :, i:i + 1] * k[:, :, :i + 1]).sum(-1) / math.sqrt(hd)
        out[:, :, i] = (torch.softmax(scores, -1).unsqueeze(-1) * v[:, :, :i + 1]).sum(2)
    return out.permute(0, 2, 1, 3).reshape(n, t, d) @ attn.out.weight.T + attn.out.bias


@pytest.mark.parametrize("scope", ["head", "full"])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_qk_norm_attention_is_the_transcription(scope, kind):
    cfg = tiny(kind=kind, scope=scope)
    attn = CausalSelfAttention(WIDTH, HEADS, cfg.model, cfg.norm)
    assert attn.q_norm.weight.shape == ((WIDTH // HEADS,) if scope == "head" else (WIDTH,))  # shared by the heads
    assert {name for name, _ in attn.q_norm.named_parameters()} == {"weight"}  # a gain, no bias (ViT-22B, OLMo 2)
    _randomise(attn, 3)
    x = torch.randn(3, 5, WIDTH, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(attn(x), transcribed_attention(attn, x, scope, kind), rtol=1e-5, atol=1e-5)
    plain = CausalSelfAttention(WIDTH, HEADS, cfg.model.model_copy(update={"qk_norm": False}), cfg.norm)
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if "_norm" not in k})
    assert not torch.allclose(plain(x), attn(x), atol=1e-3)  # the norms do act


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_the_qk_norm_epsilon_is_its_own_key(kind):
    """model.qk_norm_eps (flax's LayerNorm: 1e-6) sets the qk norms' epsilon alone; the block norms keep norm.eps.
    A large epsilon makes the difference visible on queries of unit scale."""
    cfg = tiny(kind=kind, qk_eps=0.5)
    attn = CausalSelfAttention(WIDTH, HEADS, cfg.model, cfg.norm)
    _randomise(attn, 5)
    x = torch.randn(2, 4, WIDTH, generator=torch.Generator().manual_seed(6)) * 0.3
    torch.testing.assert_close(attn(x), transcribed_attention(attn, x, "head", kind, eps=0.5), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(attn(x), transcribed_attention(attn, x, "head", kind), atol=1e-4)
    model = Transformer(cfg.model, cfg.norm, cfg.data)
    eps = {name: m.eps for name, m in model.named_modules() if hasattr(m, "eps")}
    qk = {name for name in eps if name.endswith(("q_norm", "k_norm"))}
    assert len(qk) == 4 and {eps[n] for n in qk} == {0.5} and {eps[n] for n in set(eps) - qk} == {1e-5}


def test_a_derf_qk_norm_keeps_its_bias_as_the_docs_say():
    attn = CausalSelfAttention(WIDTH, HEADS, tiny(kind="derf").model, tiny(kind="derf").norm)
    assert {name for name, _ in attn.q_norm.named_parameters()} == {"alpha", "shift", "weight", "bias"}


def test_a_dyt_qk_norm_has_no_bias_either():
    attn = CausalSelfAttention(WIDTH, HEADS, tiny(kind="dyt").model, tiny(kind="dyt").norm)
    assert not any("bias" in name for name, _ in attn.q_norm.named_parameters())
    assert any("bias" in name for name, _ in attn.named_parameters() if "_norm" not in name)  # q, k, v, out keep theirs


def test_qk_norm_draws_nothing_so_every_other_weight_is_the_same():
    torch.manual_seed(0)
    plain = dict(Transformer(tiny(qk=False).model, tiny().norm, tiny().data).named_parameters())
    torch.manual_seed(0)
    normed = dict(Transformer(tiny().model, tiny().norm, tiny().data).named_parameters())
    assert set(normed) - set(plain) == {f"layers.{i}.attn.branch.{n}_norm.{p}" for i in range(2)
                                        for n in "qk" for p in ("weight",)}
    assert all(torch.equal(plain[name], normed[name]) for name in plain)


def test_the_default_keys_keep_every_run_id_and_the_scope_is_inert_without_qk_norm():
    base = {"model": {"arch": "transformer", "width": 8, "n_heads": 2}, "data": {"task": "copy"}}
    plain = RunConfig.model_validate(base)
    for extra in ({"model": {**base["model"], "qk_norm": False}}, {"model": {**base["model"], "qk_norm_scope": "full"}},
                  {"model": {**base["model"], "qk_norm_eps": 1e-6}}, {"train": {"z_loss": 0.0}}):
        assert run_id(RunConfig.model_validate({**base, **extra})) == run_id(plain)
    assert run_id(RunConfig.model_validate({**base, "train": {"z_loss": 1e-4}})) != run_id(plain)
    qk = {**base, "model": {**base["model"], "qk_norm": True}}
    unset = run_id(RunConfig.model_validate(qk))
    assert run_id(RunConfig.model_validate({**qk, "model": {**qk["model"], "qk_norm_eps": None}})) == unset
    assert run_id(RunConfig.model_validate({**qk, "model": {**qk["model"], "qk_norm_eps": 1e-6}})) != unset


@pytest.mark.parametrize("key", ["qk_norm_scope", "qk_norm_eps"])
def test_a_qk_norm_epsilon_no_run_uses_is_refused_naming_the_key(key):
    text = "name: s\nbase:\n  model: {arch: transformer, width: 8, n_heads: 2}\n  data: {task: copy}\n"
    value = "full" if key == "qk_norm_scope" else "1e-6"
    with pytest.raises(ConfigError, match=f"model.{key}: has no effect"):
        build_sweep(parse_yaml(text), [f"model.{key}={value}"])


@pytest.mark.parametrize("where", ["grid:\n  model.qk_norm_scope: [head, full]", "SET"])
def test_a_qk_norm_scope_no_run_uses_is_refused_naming_the_key(where):
    """model.qk_norm_scope: full without model.qk_norm: true would train every run without qk-norm."""
    text = ("name: s\nbase:\n  model: {arch: transformer, width: 8, n_heads: 2}\n  data: {task: copy}\n"
            + ("" if where == "SET" else where + "\n"))
    overrides = ["model.qk_norm_scope=full"] if where == "SET" else []
    with pytest.raises(ConfigError, match="model.qk_norm_scope: has no effect"):
        build_sweep(parse_yaml(text), overrides)
    assert len(build_sweep(parse_yaml(text), [*overrides, "model.qk_norm=true,false"]).runs) == (2 if overrides else 3)


def test_z_loss_value_and_gradient_are_the_closed_form():
    """value: coef * mean(log(sum exp)^2) over the answer tokens; gradient of CE + z with respect to the
    logits: ((1 + 2 coef log Z) softmax - onehot) / tokens (t5x losses.py's backward)."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 6, 7, generator=generator, dtype=torch.float64) * 3).requires_grad_()
    positions, y = torch.tensor([2, 5]), torch.randint(0, 7, (4, 2), generator=generator)
    coef = 0.05
    loss, _ = loss_and_acc(logits, y, positions)
    z = z_loss(logits, positions, coef)
    read = logits.detach()[:, positions].reshape(-1, 7)
    log_z = torch.log(torch.exp(read).sum(-1))
    assert z.item() == pytest.approx(coef * (log_z ** 2).mean().item(), rel=1e-12)
    (loss + z).backward()
    expected = torch.zeros_like(logits)
    closed = ((1 + 2 * coef * log_z)[:, None] * torch.softmax(read, -1) - F.one_hot(y.reshape(-1), 7)) / len(read)
    expected[:, positions] = closed.reshape(4, 2, 7)
    torch.testing.assert_close(logits.grad, expected, rtol=1e-10, atol=1e-12)


def test_the_recorded_loss_stays_the_cross_entropy_and_the_z_term_has_its_column():
    with_z, without = train_run(tiny(z=0.5)), train_run(tiny(z=0.0))
    assert with_z.metrics["loss"][0] == without.metrics["loss"][0]  # same start, same cross-entropy
    assert with_z.metrics["loss"][1:] != without.metrics["loss"][1:]  # the z term moved the training
    assert "z_loss" not in without.metrics and len(with_z.metrics["z_loss"]) == len(with_z.metrics["loss"])
    model, task = seeded_init(tiny(z=0.5))
    assert with_z.metrics["z_loss"][0] == z_loss(model(task.x), task.positions, 0.5).item()


def test_the_diagnostics_are_the_hand_computation_on_a_tiny_model():
    cfg = tiny(steps=0, log_blocks=True)
    rows = train_run(cfg).blocks
    model, task = seeded_init(cfg)
    x = model.embed(task.x)
    hd = WIDTH // HEADS
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            attn = layer.attn.branch
            h = layer.attn.norm(x)  # Pre-LN: the attention reads the normed stream
            q, k = (lin(h).reshape(*h.shape[:2], HEADS, hd).transpose(1, 2) for lin in (attn.q, attn.k))
            q, k = attn.q_norm(q), attn.k_norm(k)
            biggest, entropies = -math.inf, []
            for a in range(q.shape[0]):
                for head in range(HEADS):
                    for t in range(q.shape[2]):
                        logits = [float(q[a, head, t] @ k[a, head, s]) / math.sqrt(hd) for s in range(t + 1)]
                        biggest = max(biggest, *logits)
                        weights = [math.exp(v - max(logits)) for v in logits]
                        p = [w / sum(weights) for w in weights]
                        entropies.append(-sum(pi * math.log(pi) for pi in p if pi > 0))
            assert rows["attn_logit_max"][i] == pytest.approx(biggest, rel=1e-5)
            assert rows["attn_entropy"][i] == pytest.approx(sum(entropies) / len(entropies), rel=1e-5)
            x = layer(x)
        out = model.head(model.final_norm(x))[:, task.positions].reshape(-1, cfg.data.vocab).double()
    log_z = torch.log(torch.exp(out).sum(-1)).mean().item()
    assert rows["log_z"] == pytest.approx([log_z] * 2, rel=1e-5)
    assert rows["block"] == [1, 2] and rows["step"] == [0, 0]


def test_block_logging_changes_no_bit_of_a_transformer_run():
    logged, plain = train_run(tiny("post", log_blocks=True)), train_run(tiny("post"))
    assert logged.metrics == plain.metrics
    assert all(len(v) == 2 * 4 for v in logged.blocks.values())  # 2 layers x steps 0..3
    assert all(math.isfinite(v) for v in logged.blocks["attn_logit_max"] + logged.blocks["log_z"])


ENGINES_GRID = """\
name: qkz
base:
  model: {arch: transformer, depth: 2, width: 8, n_heads: 2, qk_norm: true}
  data: {task: assoc_recall, seq_len: 8, n_samples: 16, n_val: 8}
  optim: {lr: 0.03}
  train: {steps: STEPS, threads: 1, z_loss: 0.01}
grid:
  norm.placement: [PLACEMENTS]
  model.qk_norm_scope: [SCOPES]
seeds: [SEEDS]
"""


@pytest.mark.equivalence
@pytest.mark.parametrize("scopes, seeds, steps", [
    ("head", "0", 4),
    pytest.param("head, full", "0, 1", 8, marks=pytest.mark.slow),
])
def test_every_engine_trains_qk_norm_and_z_loss_batched_bit_for_bit_fast_within_its_spread(scopes, seeds, steps):
    """Every Transformer placement (registry): the batched engine hands these runs to the reference (its
    bits); the fast engine's metrics are within 1e-4 of the reference's (the bound test_transformer holds
    it to; the reference's own 1- vs 2-thread spread is ~1e-6 here). Slow: both scopes, two seeds."""
    from normexp.engines.batched import plan_batches
    from normexp.engines.fast import plan_fast, train_fast

    text = ENGINES_GRID.replace("PLACEMENTS", ", ".join(placements_for("transformer")))
    sweep = build_sweep(parse_yaml(text.replace("SCOPES", scopes).replace("SEEDS", seeds).replace("STEPS", str(steps))))
    assert plan_batches(sweep.runs) == ([], sweep.runs)
    for batch in plan_fast(sweep.runs):
        for cfg, fast in zip(batch, train_fast(batch, compile=False)):
            reference = train_run(cfg)
            assert list(fast.metrics) == list(reference.metrics) and "z_loss" in fast.metrics
            for column in ("loss", "acc", "val_loss", "z_loss"):
                assert fast.metrics[column] == pytest.approx(reference.metrics[column], abs=1e-4), (cfg.norm, column)


STUDY = """\
name: instab
base:
  model: {arch: transformer, depth: 1, width: 8, n_heads: 2}
  data: {task: assoc_recall, seq_len: 8}
  train: {steps: 1, log_blocks: true}
grid:
  model.qk_norm: [false, true]
  train.z_loss: [0.0, 0.0001]
  optim.lr: [0.001, 0.01, 0.1]
seeds: [0, 1]
"""


def study_folder(tmp_path, peak, final_loss, text: str = STUDY):
    """A study folder written through the store (no training): each run's largest attention logit is 3 at
    step 0 and peak(cfg) at step 1, its losses [2.7, final_loss(cfg)]."""
    from normexp.blocklog import TRANSFORMER_BLOCK_COLUMNS
    from normexp.folder import FinishedRun, atomic_write, write_run, write_summary

    sweep = build_sweep(parse_yaml(text))
    out = tmp_path / sweep.name
    out.mkdir(parents=True)
    atomic_write(out / "sweep.yaml", sweep.to_yaml())
    for cfg in sweep.runs:
        metrics = {"step": [0, 1], "loss": [2.7, final_loss(cfg)], "acc": [0.1] * 2, "lr": [cfg.optim.lr] * 2,
                   "grad_norm": [1.0] * 2}
        blocks = {c: [1.0, 1.0] for c in TRANSFORMER_BLOCK_COLUMNS}
        blocks.update(step=[0, 1], block=[1, 1], attn_logit_max=[3.0, peak(cfg)], log_z=[2.0, 2.5])
        write_run(out / run_id(cfg), cfg, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu", blocks))
    write_summary(out, sweep.runs)
    return out


def test_the_instabilities_verdict_says_the_papers_trend_reproduces_only_when_the_numbers_do(tmp_path):
    from normexp.studies.verdicts import instabilities_verdict

    def grows(cfg):  # without qk-norm the logits reach 500 at lr 0.1; qk-norm holds them at 10
        return 500.0 if cfg.optim.lr == 0.1 and not cfg.model.qk_norm else 10.0

    def qk_rescues(cfg):
        return 2.5 if cfg.optim.lr == 0.1 and not cfg.model.qk_norm else 0.05

    said = instabilities_verdict(study_folder(tmp_path / "a", grows, qk_rescues))
    assert "at least 50 and 2x its step-0 value at lr 0.1" in said and "qk-norm lowers its LR sensitivity" in said
    assert "the paper's trend reproduces here" in said
    assert "moves no design's sensitivity beyond the seed spread" in said  # the z-loss changed no loss
    said = instabilities_verdict(study_folder(tmp_path / "b", grows, lambda cfg: 2.5 if cfg.optim.lr == 0.1 else 0.05))
    assert "leaves within noise" in said and "does not reproduce here" in said
    said = instabilities_verdict(study_folder(tmp_path / "c", lambda cfg: 10.0, qk_rescues))
    assert "does not reach the regime" in said and "reproduces" not in said


def test_a_negative_largest_attention_logit_is_drawn_not_left_blank(tmp_path):
    """A layer whose every causal logit is below 0 (seen in the study: Post-LN with qk-norm at lr 0.1) has
    a negative attn_logit_max: a value, which a log colour scale would mask as a gap."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import QuadMesh

    from normexp.figures import blocks_figure
    from normexp.results import load_blocks

    folder = study_folder(tmp_path, lambda cfg: -0.5 if cfg.model.qk_norm else 80.0, lambda cfg: 1.0)
    tidy = load_blocks(folder, all_config=True)
    fig = blocks_figure(tidy, ["model.qk_norm"], "attn_logit_max")
    meshes = [c for ax in fig.axes for c in ax.collections if isinstance(c, QuadMesh)]
    plt.close(fig)
    assert meshes and all(not np.ma.getmaskarray(mesh.get_array()).any() for mesh in meshes)
    drawn = sorted(float(v) for mesh in meshes for v in np.ma.compressed(mesh.get_array()))
    assert drawn[0] < 0 < drawn[-1]


@pytest.mark.slow
def test_the_compiled_fast_engine_trains_the_z_loss_within_its_contract():
    """The fast engine's compiled path (the z objective's vmapped gradient and the Adam update, compiled ahead
    of time): its metrics and z column within the fast contract of the reference's (about a minute of
    compiling on 2 cores). The step must have compiled: a compile that fails trains eagerly, and would pass."""
    from normexp.engines.fast import compiled as compiling
    from normexp.engines.fast import train_fast
    from normexp.engines.fast.compiled import compiled_structure

    compiling.reset_cache()
    cfg = tiny("pre", "layernorm", z=0.05, steps=3)
    fast, reference = train_fast([cfg], compile=True)[0], train_run(cfg)
    made = {key: step for key, step in compiling.kept_steps().items() if key[:len(compiled_structure(cfg))]
            == compiled_structure(cfg) or key[:1] == ("refused",)}
    assert len(made) == 1 and next(iter(made.values())) is not None, made  # compiled, not refused
    assert list(fast.metrics) == list(reference.metrics)
    for column in ("loss", "acc", "val_loss", "z_loss"):
        assert fast.metrics[column] == pytest.approx(reference.metrics[column], abs=1e-4), column
    assert fast.metrics["grad_norm"] == pytest.approx(reference.metrics["grad_norm"], rel=1e-4)


# ---- the verdict's sentences against its inputs, over synthetic frames (not one fixture) ----
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_DESIGNS = [("post", "layernorm"), ("pre", "layernorm"), ("pre", "rmsnorm")]
_PEAKS = st.one_of(st.floats(0.5, 20.0), st.floats(49.9, 50.1), st.floats(1e3, 2e5))


@st.composite
def _verdict_inputs(draw):
    from types import SimpleNamespace

    import pandas as pd

    designs = draw(st.lists(st.sampled_from(_DESIGNS), min_size=1, max_size=3, unique=True))
    lrs, seeds = [0.001, 0.01, 0.1], draw(st.integers(1, 2))
    rows, sens = [], {}
    for placement, kind in designs:
        for qk, z in ((False, 0.0), (True, 0.0), (False, 1e-4)):
            for lr in lrs:
                for seed in range(seeds):
                    rows.append({"norm.placement": placement, "norm.kind": kind, "model.qk_norm": qk,
                                 "train.z_loss": z, "model.width": 64, "optim.lr": lr, "seed": seed,
                                 "logit_peak": draw(_PEAKS), "log_z_peak": draw(st.floats(0.0, 30.0)),
                                 "growth": draw(st.sampled_from([1.0, 1.9, 2.0, 50.0]))})
            sensitivity = draw(st.one_of(st.just(math.nan), st.floats(0.0, 2.0)))
            sens[(placement, kind, qk, z, 64)] = SimpleNamespace(
                sensitivity=sensitivity, spread=draw(st.one_of(st.just(math.nan), st.floats(0.0, 0.3))),
                best_loss=draw(st.sampled_from([0.05, 0.2, 2.5])), seeds=seeds)
    return pd.DataFrame(rows), sens


@settings(max_examples=150, deadline=None)
@given(_verdict_inputs())
def test_every_instabilities_sentence_follows_from_its_numbers(inputs):
    """Item: "No design's attention logits reach 50" was printed beside peaks of 1.1e5 when every design
    whose logits grew never trained. Each claim about the 50 limit must agree with the peaks (seeds' mean
    without qk-norm) the verdict itself is given."""
    from normexp.analysis.variants import variant_label
    from normexp.studies.verdicts import LOGIT_GROWTH, LOGIT_LIMIT, instabilities_text

    runs, sens = inputs
    said = instabilities_text(runs, sens, threshold=0.23, diverged=0)
    off = runs[~runs["model.qk_norm"] & (runs["train.z_loss"] == 0.0)]
    mean = off.groupby(["norm.placement", "norm.kind", "optim.lr"])[["logit_peak", "growth"]].mean()
    grew = (mean["logit_peak"] >= LOGIT_LIMIT) & (mean["growth"] >= LOGIT_GROWTH)
    reached = {variant_label({"norm.placement": p, "norm.kind": k})
               for (p, k), peaks in grew.groupby(level=[0, 1]) if peaks.any()}
    labels = {variant_label({"norm.placement": p, "norm.kind": k}) for p, k in zip(runs["norm.placement"],
                                                                                    runs["norm.kind"])}
    assert ("No design's attention logits grow to" in said) == (not reached), said
    for label in labels:
        section = next(part for part in said.split(". ") if part.startswith(label + ":"))
        if "grows to 50 at no lr" in section or "at least 50 and" in section:
            assert ("at least 50 and" in section) == (label in reached), section
    for sentence in said.split(". "):
        for lead in ("Where the attention logits grow (", "The attention logits grow to 50 in "):
            if sentence.startswith(lead):
                named = sentence[len(lead):].split(")")[0].split(", but")[0].split(", ")
                assert set(named) <= reached, sentence


@pytest.mark.parametrize(("metric", "hint"), [("z_loss", "Transformer runs with train.z_loss above 0 only"),
                                              ("val_loss", "sequence tasks only")])
def test_a_metric_ffn_runs_do_not_record_gets_its_own_hint(tmp_path, metric, hint):
    """`report --metric z_loss` on FFN runs said "(val_loss and val_acc: sequence tasks only)": a hint about
    other columns. Each metric's refusal names the runs that record it."""
    from typer.testing import CliRunner

    from normexp.cli import app

    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nbase: {model: {depth: 2, width: 4}, train: {steps: 1}}\nseeds: [0]\n")
    out = tmp_path / "out"
    assert CliRunner().invoke(app, ["sweep", str(sweep), "--out", str(out), "-q"]).exit_code == 0
    said = CliRunner().invoke(app, ["report", str(out), "--metric", metric])
    text = " ".join(said.output.split())
    assert said.exit_code == 2 and f"--metric {metric}: not recorded by these runs" in text and hint in text, text
    assert (metric == "z_loss") != ("val_loss and val_acc" in text)


def test_one_seed_claims_nothing_beyond_the_spread_and_says_what_it_cannot_conclude(tmp_path):
    from normexp.studies.verdicts import instabilities_verdict

    def grows(cfg):
        return 500.0 if cfg.optim.lr == 0.1 and not cfg.model.qk_norm else 10.0

    def z_moves(cfg):  # the z-loss and qk-norm each change the losses: with one seed, no change is judged
        return (2.5 if cfg.optim.lr == 0.1 and not cfg.model.qk_norm else 0.05) + (0.3 if cfg.train.z_loss else 0.0)

    said = instabilities_verdict(study_folder(tmp_path, grows, z_moves, STUDY.replace("seeds: [0, 1]", "seeds: [0]")))
    assert "beyond the seed spread for" not in said and "lowers its LR sensitivity" not in said
    assert "one seed cannot tell whether qk-norm's change" in said
    assert "cannot tell whether the z-loss moves any design's sensitivity beyond the seed spread" in said
    assert "This grid cannot conclude whether any change is beyond the seed spread (one seed" in said
    assert "how the LR sensitivity moves with width (1 width;" in said


def test_logits_large_from_init_do_not_count_as_growth(tmp_path):
    from normexp.studies.verdicts import instabilities_verdict

    said = instabilities_verdict(study_folder(tmp_path, lambda cfg: 4.0, lambda cfg: 0.05))  # step 0: 3
    assert "No design's attention logits grow to 50" in said


def test_the_width_axis_tests_the_papers_claim(tmp_path):
    """Without qk-norm the sensitivity grows with width (lr 0.1 fails more the wider), with it it stays flat."""
    from normexp.studies.verdicts import instabilities_verdict

    text = STUDY.replace("grid:\n", "grid:\n  model.width: [4, 8, 16]\n").replace("width: 8, ", "")
    bad = {4: 0.3, 8: 1.0, 16: 2.5}

    def loss(cfg):
        return bad[cfg.model.width] if cfg.optim.lr == 0.1 and not cfg.model.qk_norm else 0.05 + 0.001 * cfg.seed

    said = instabilities_verdict(study_folder(tmp_path, lambda cfg: 10.0, loss, text))
    assert "Across widths 4, 8, 16" in said and "(grows), with" in said and "(stays flat)" in said
    assert "holds for Pre-LN" in said and "with width" not in said.split("This grid cannot conclude")[-1]


def test_the_figures_draw_a_line_per_width_and_the_heat_maps_at_the_nearest_lr(tmp_path):
    """A grid without lr 0.1 exactly still gets its heat maps (at the nearest lr, the widest width)."""
    from normexp.results import load_folder
    from normexp.studies.figures import instabilities_figures

    text = (STUDY.replace("grid:\n", "grid:\n  model.width: [4, 8]\n").replace("width: 8, ", "")
            .replace("[0.001, 0.01, 0.1]", "[0.001, 0.01, 0.0948683298051]"))
    folder = load_folder(study_folder(tmp_path, lambda cfg: 10.0, lambda cfg: 0.05 * cfg.model.width, text))
    paths = instabilities_figures(folder)
    assert [p.name for p in paths] == ["final_loss-lr.png", "blocks-attn_logit_max.png", "blocks-attn_entropy.png",
                                       "blocks-log_z.png"]


def test_the_study_has_no_biases_and_a_bias_free_run_logs_its_blocks_with_qk_norm():
    """The paper's models have no biases: every run of the study sets model.bias false, which drops every
    Linear's and LayerNorm's bias (the qk-norms have none anyway; DyT keeps its own, outside the paper), and
    composes with qk-norm and block logging: the same losses logged or not, every diagnostic finite."""
    from normexp.studies.run import _spec

    assert {cfg.model.bias for cfg in _spec("instabilities", quick=False).runs} == {False}
    for kind in ("layernorm", "dyt"):
        cfg = validate_run({"model": {"arch": "transformer", "depth": 2, "width": WIDTH, "n_heads": HEADS,
                                      "qk_norm": True, "qk_norm_eps": 1e-6, "bias": False},
                            "norm": {"placement": "peri", "kind": kind},
                            "data": {"task": "assoc_recall", "seq_len": 8, "n_samples": 16, "n_val": 8},
                            "optim": {"lr": 0.03}, "train": {"steps": 3}})
        model, _ = seeded_init(cfg)
        biased = {type(m).__name__ for m in model.modules() if getattr(m, "bias", None) is not None}
        assert biased == (set() if kind == "layernorm" else {"DyT"}), biased
        assert model.layers[0].attn.branch.q_norm.bias is None
        logged = train_run(cfg.model_copy(update={"train": cfg.train.model_copy(update={"log_blocks": True})}))
        assert logged.metrics == train_run(cfg).metrics
        assert all(math.isfinite(v) for column in ("attn_logit_max", "attn_entropy", "log_z")
                   for v in logged.blocks[column])


def test_the_quick_study_keeps_the_papers_lr_range_and_steps_at_three_widths_an_octave_down():
    """--quick: the full study's 320 steps and lr range end to end at widths 16, 32, 64 (head dim 16, as the full
    study's 32, 64, 128), one seed, LayerNorm, z-loss off: 72 runs, each reduction named in the config."""
    from normexp.studies.run import _config, _spec

    quick, full = _spec("instabilities", quick=True), _spec("instabilities", quick=False)
    assert len(quick.runs) == 72
    assert sorted({(c.model.width, c.model.n_heads) for c in quick.runs}) == [(16, 1), (32, 2), (64, 4)]
    assert sorted({(c.model.width, c.model.n_heads) for c in full.runs}) == [(32, 2), (64, 4), (128, 8)]
    for spec in (quick, full):
        lrs = sorted({c.optim.lr for c in spec.runs})
        assert lrs[0] == pytest.approx(3e-4) and lrs[-1] == pytest.approx(0.3)
        assert {c.train.steps for c in spec.runs} == {320} and {c.model.bias for c in spec.runs} == {False}
    comment = " ".join(line.lstrip("# ") for line in _config("instabilities").read_text().splitlines()
                       if line.startswith("#"))
    assert "widths 16, 32, 64" in comment and "biases everywhere" not in comment
