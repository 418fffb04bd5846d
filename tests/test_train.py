"""The reference engine's optimizer step and gradient norm give torch.optim's and the per-tensor
formula's bits, and a sweep trains without importing what it does not need."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, SMALL_SWEEP
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from normexp.config import RunConfig
from normexp.engines.common import grad_norm, seeded_init
from normexp.engines.reference import train_run
from normexp.optim import build_optimizer, step_lr


def torch_optim_run(cfg: RunConfig) -> tuple[list[float], list[float]]:
    """Losses and gradient norms of `cfg` trained the plain way: torch.optim over each parameter
    tensor, the norm of the per-tensor `vector_norm`s."""
    model, task = seeded_init(cfg)
    params = list(model.parameters())
    optimizer = build_optimizer(params, cfg.optim)
    losses, norms = [], []
    for step in range(cfg.train.steps + 1):
        loss = F.cross_entropy(model(task.x), task.y)
        optimizer.zero_grad()
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])).item())
        if step < cfg.train.steps:
            for group in optimizer.param_groups:
                group["lr"] = step_lr(cfg, step)
            optimizer.step()
    return losses, norms


optim_settings = st.one_of(
    st.fixed_dictionaries({
        "name": st.sampled_from(["adam", "adamw", "radam"]),
        "lr": st.sampled_from([0.001, 0.01, 0.05]),
        "betas": st.sampled_from([[0.9, 0.999], [0.8, 0.99], [0.0, 0.9]]),
        "eps": st.sampled_from([1e-8, 1e-6]),
        "weight_decay": st.sampled_from([0.0, 0.01, 0.1]),
    }),
    st.fixed_dictionaries({
        "name": st.just("sgd"),
        "lr": st.sampled_from([0.01, 0.1]),
        "momentum": st.sampled_from([0.0, 0.9]),
        "weight_decay": st.sampled_from([0.0, 0.01]),
    }),
)


@pytest.mark.equivalence
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(optim=optim_settings,
       placement=st.sampled_from(["post", "pre", "sandwich", "peri", "deepnorm", "mixln", "none"]),
       kind=st.sampled_from(["layernorm", "rmsnorm", "rmsnorm_torch", "scalenorm", "rmsnorm_gemma"]),
       schedule=st.sampled_from([{"kind": "constant"}, {"kind": "cosine", "warmup_steps": 2}]),
       seed=st.integers(0, 2**16))
def test_reference_engine_has_torch_optims_bits(optim, placement, kind, schedule, seed):
    cfg = RunConfig.model_validate({
        "model": {"depth": 3, "width": 8}, "norm": {"placement": placement, "kind": kind}, "optim": optim,
        "schedule": schedule, "train": {"steps": 5, "stop_on_nonfinite": False}, "seed": seed})
    losses, norms = torch_optim_run(cfg)
    result = train_run(cfg)
    assert result.losses == losses
    assert result.metrics["grad_norm"] == norms


@given(shapes=st.lists(st.lists(st.integers(1, 40), min_size=0, max_size=3), min_size=1, max_size=8),
       seed=st.integers(0, 1000))
@settings(max_examples=50, deadline=None)
def test_grad_norm_is_the_norm_of_per_tensor_norms(shapes, seed):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    for param in params:
        scale = 10.0 ** torch.randint(-4, 4, (), generator=generator)
        param.grad = torch.randn(param.shape, generator=generator) * scale
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])).item()
    assert grad_norm(params) == expected
    assert math.isfinite(expected)


@pytest.mark.process
def test_sweep_imports_no_compiler_and_no_plotting(tmp_path):
    """torch.optim's constructors import torch._dynamo (about a second); matplotlib is for `plot`."""
    config = tmp_path / "small.yaml"
    config.write_text(SMALL_SWEEP)
    code = (
        "import sys\n"
        "from normexp.cli import app\n"
        f"try: app(['sweep', {str(config)!r}, '--out', {str(tmp_path / 'out')!r}, '--engine', 'reference'])\n"
        "except SystemExit as exc: assert not exc.code, exc.code\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    modules = set(done.stdout.splitlines()[-1].split())
    assert "normexp.engines.reference" in modules  # it trained in this process
    assert (tmp_path / "out" / "summary.csv").exists()
    assert "torch._dynamo" not in modules
    assert "sympy" not in modules
    assert "matplotlib" not in modules
