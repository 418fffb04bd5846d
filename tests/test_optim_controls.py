"""The optimizer and schedule controls of issue 43, each against an independent transcription of its
authors' code (repository, file and lines named at each), over a few steps of the FFN toy and the
Transformer on the reference engine, and the batched engine bit for bit with the reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from normexp.config import RunConfig, validate_run
from normexp.engines.batched import plan_batches, train_batch
from normexp.engines.common import loss_and_acc, seeded_init
from normexp.engines.cost import fast_serves
from normexp.engines.reference import train_run
from normexp.optim import build_optimizer, step_lr
from normexp.runfolder import run_id

FFN = {"model": {"depth": 3, "width": 8}, "norm": {"placement": "post"}}
TRANSFORMER = {"model": {"arch": "transformer", "depth": 2, "width": 16, "n_heads": 2},
               "norm": {"placement": "post"}, "data": {"task": "copy", "n_samples": 32, "n_val": 16}}
ARCHS = {"ffn": FFN, "transformer": TRANSFORMER}


def config(arch: str = "ffn", steps: int = 8, seed: int = 0, **sections: dict) -> RunConfig:
    data = {key: dict(value) for key, value in ARCHS[arch].items()}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return validate_run({**data, "train": {"steps": steps, "stop_on_nonfinite": False}, "seed": seed})


def plain_run(cfg: RunConfig, optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
              before_step: Callable[[torch.nn.Module], None] | None = None,
              lr: Callable[[int], float] | None = None) -> list[float]:
    """`cfg`'s losses, trained the plain way: the run's own model and data, `optimizer` (torch.optim's by
    default) over each parameter tensor, `before_step` (a transcribed gradient transformation) between
    backward and step, each update's learning rate `lr(step)` (normexp's schedule by default)."""
    model, task = seeded_init(cfg)
    params = list(model.parameters())
    opt = optimizer(params) if optimizer is not None else build_optimizer(params, cfg.optim)
    losses = []
    for step in range(cfg.train.steps + 1):
        loss, _ = loss_and_acc(model(task.x), task.y, task.positions)
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        if step < cfg.train.steps:
            if before_step is not None:
                before_step(model)
            for group in opt.param_groups:
                group["lr"] = lr(step) if lr is not None else step_lr(cfg, step)
            opt.step()
    return losses


def bits(values: list[float]) -> list[str]:
    return [repr(v) for v in values]


def assert_batched_is_reference(configs: list[RunConfig]) -> None:
    batches, alone = plan_batches(configs)
    assert [len(b) for b in batches] == [len(configs)] and not alone
    for cfg, result in zip(configs, train_batch(configs)):
        expected = train_run(cfg)
        assert bits(result.losses) == bits(expected.losses), cfg.optim
        assert bits(result.metrics["grad_norm"]) == bits(expected.metrics["grad_norm"])


def varied(controls: list[dict], optim: str = "adam", schedule: dict | None = None, steps: int = 8) -> list[RunConfig]:
    """One FFN run per entry of `controls` (optim keys), with its own seed, lr and weight decay."""
    return [config(optim={"name": optim, "lr": [0.01, 0.003, 0.03, 0.02][i % 4],
                          "weight_decay": [0.0, 0.01, 0.1, 0.0][i % 4], **values},
                   schedule=schedule or {"kind": "linear_warmup", "warmup_steps": 3}, steps=steps, seed=5 + i)
            for i, values in enumerate(controls)]


# ----------------------------------------------------------------------------- optim.clip_norm

def transcribed_clip_grad_norm(max_norm: float) -> Callable[[torch.nn.Module], None]:
    """pytorch/pytorch torch/nn/utils/clip_grad.py (torch 2.13) `_get_total_norm` and `_clip_grads_with_norm_`:
    the norm of the per-tensor norms, clip_coef = max_norm / (total_norm + 1e-6), clamped at 1.0, every
    gradient multiplied by it (on the CPU the foreach path: `_foreach_norm`, `_foreach_mul_`)."""
    def clip(model: torch.nn.Module) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
        total_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        clip_coef = max_norm / (total_norm + 1e-6)
        clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
        for g in grads:
            g.mul_(clip_coef_clamped)
    return clip


@pytest.mark.parametrize("arch", ["ffn", "transformer"])
@pytest.mark.parametrize("optim", ["adam", "adamw", "sgd", "radam"])
def test_clip_norm_is_clip_grad_norm(arch, optim):
    cfg = config(arch, optim={"name": optim, "lr": 0.02, "clip_norm": 0.5})
    expected = plain_run(cfg, before_step=transcribed_clip_grad_norm(0.5))
    assert bits(train_run(cfg).losses) == bits(expected)
    unclipped = train_run(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"clip_norm": None})}))
    assert unclipped.losses[1:] != expected[1:]  # the clipping acted
    assert train_run(cfg).metrics["grad_norm"][0] == unclipped.metrics["grad_norm"][0]  # recorded before clipping


@pytest.mark.parametrize("optim", ["adam", "adamw", "sgd"])
def test_clip_norm_batched_bit_for_bit(optim):
    assert_batched_is_reference(varied([{"clip_norm": c} for c in (1.0, 0.05, 0.3, 100.0)], optim))


def test_clipped_and_unclipped_runs_batch_apart():
    configs = varied([{"clip_norm": 0.1}, {}, {"clip_norm": 0.2}, {}])
    batches, alone = plan_batches(configs)
    assert sorted(len(b) for b in batches) == [2, 2] and not alone


# ----------------------------------------------------------------------------- every control

# A value of each control other than its default, and the optimizer it acts under
CONTROLS = {"optim.clip_norm": ("adam", 1.0)}


@pytest.mark.parametrize("key", sorted(CONTROLS))
def test_a_control_changes_the_run_id_only_when_set_and_the_fast_engine_leaves_it_to_the_exact_engines(key):
    from normexp.units import plan_units

    optim, value = CONTROLS[key]
    section, _, leaf = key.partition(".")

    def with_value(*value: object) -> RunConfig:  # no value: the key left unset
        sections = {"optim": {"name": optim}, "schedule": {"kind": "linear_warmup", "warmup_steps": 2}}
        sections[section].update(dict(zip([leaf], value)))
        return config(**sections)

    plain, controlled = with_value(), with_value(value)
    default = type(getattr(plain, section)).model_fields[leaf].default
    assert run_id(with_value(default)) == run_id(plain)  # the default written out is today's run
    assert run_id(controlled) != run_id(plain)
    assert fast_serves(plain) and not fast_serves(controlled)
    runs = [plain, plain.model_copy(update={"seed": 1}), controlled, controlled.model_copy(update={"seed": 1})]
    units = plan_units(runs, "fast", "cpu", 1, compile=False)
    engine_of = {run_id(cfg): unit.engine for unit in units for cfg in unit.runs}
    assert [engine_of[run_id(cfg)] for cfg in runs] == ["fast", "fast", "batched", "batched"]
