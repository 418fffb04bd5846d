"""Sharpness (`train.log_sharpness`, normexp/sharpness.py) against a dense eigendecomposition and its authors' code.

- a dense Hessian (torch.autograd.functional.hessian over the flat parameters) of tiny models in float64:
  its largest eigenvalue, and that of P^-1/2 H P^-1/2 for an Adam preconditioner;
- PyHessian (amirgholami/PyHessian `pyhessian/hessian.py` `hessian.eigenvalues`, `pyhessian/utils.py`) and
  the edge-of-stability code (locuslab/edge-of-stability `src/utilities.py` `compute_hvp`, `lanczos`,
  `get_hessian_eigenvalues`; Cohen et al. 2022's preconditioned form, their adam.py, as the `P` argument),
  transcribed below, run on the same model;
- and the wiring: rows every K steps, training's bits untouched, the batched and fast engines declining.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.sparse.linalg import LinearOperator, eigsh
from torch.func import functional_call
from torch.nn.utils import parameters_to_vector

from normexp.config import validate_run
from normexp.engines.batched import plan_batches, train_batch
from normexp.engines.common import loss_and_acc, seeded_init
from normexp.engines.reference import objective, train_run
from normexp.sharpness import SHARPNESS_COLUMNS, SecondMoment, measure, thresholds
from normexp.units import plan_units


def ffn(seed: int = 4, **train: object):
    return validate_run({"model": {"depth": 2, "width": 4, "hidden_mult": 2}, "data": {"n_samples": 8},
                         "train": {"steps": 4, **train}, "seed": seed})


def transformer(seed: int = 0, **train: object):
    return validate_run({"model": {"arch": "transformer", "depth": 1, "width": 4, "n_heads": 2, "hidden_mult": 2},
                         "data": {"task": "copy", "n_samples": 8, "n_val": 4, "vocab": 6, "seq_len": 5},
                         "train": {"steps": 4, **train}, "seed": seed})


def float64(cfg):
    model, task = seeded_init(cfg)
    model = model.double()
    x = task.x.double() if cfg.model.arch == "ffn" else task.x
    return model, x, task


def dense_hessian(cfg) -> torch.Tensor:
    """The Hessian of the run's training objective at init, in float64, over the flat parameters."""
    model, x, task = float64(cfg)
    names, shapes = zip(*((n, p.shape) for n, p in model.named_parameters()))
    flat = parameters_to_vector(model.parameters()).detach()

    def loss(v: torch.Tensor) -> torch.Tensor:
        parts = torch.split(v, [math.prod(s) for s in shapes])
        params = dict(zip(names, (part.view(s) for part, s in zip(parts, shapes))))
        logits = functional_call(model, params, (x,))
        value = loss_and_acc(logits, task.y, task.positions)[0]
        if cfg.train.z_loss:
            value = value + cfg.train.z_loss * logits[:, task.positions].flatten(0, 1).logsumexp(-1).pow(2).mean()
        return value

    return torch.autograd.functional.hessian(loss, flat, vectorize=True)


def ours(cfg, moment: SecondMoment | None = None) -> dict[str, float]:
    model, x, task = float64(cfg)
    return measure(lambda: objective(model, x, task.y, task.positions, cfg.train.z_loss), list(model.parameters()),
                   cfg.optim.lr, moment)


@pytest.mark.parametrize("cfg", [ffn(0), ffn(1), transformer(1, z_loss=1e-2)], ids=["ffn0", "ffn1", "transformer"])
def test_lambda_max_is_the_dense_hessians_largest_eigenvalue(cfg) -> None:
    """Several of these have a negative eigenvalue of larger magnitude than the largest: power iteration
    alone would return it."""
    expected = torch.linalg.eigvalsh(dense_hessian(cfg))[-1].item()
    assert ours(cfg)["lambda_max"] == pytest.approx(expected, rel=1e-7)


def test_preconditioned_lambda_max_is_the_dense_one() -> None:
    cfg = ffn(1)
    model, _, _ = float64(cfg)
    generator = torch.Generator().manual_seed(0)
    v = [torch.rand(p.shape, generator=generator, dtype=torch.float64) * 1e-3 for p in model.parameters()]
    moment = SecondMoment(v, updates=3, betas=(0.9, 0.999), eps=1e-8)
    p = torch.cat([((1 - 0.9 ** 3) * ((x / (1 - 0.999 ** 3)).sqrt() + 1e-8)).reshape(-1) for x in v])
    h = dense_hessian(cfg)
    expected = torch.linalg.eigvals(torch.diag(1 / p) @ h).real.max().item()  # P^-1 H itself, not symmetrised
    assert ours(cfg, moment)["precond_lambda_max"] == pytest.approx(expected, rel=1e-7)
    assert ours(cfg)["precond_lambda_max"] != ours(cfg)["precond_lambda_max"]  # nan without a second moment


# ----------------------------------------------------------------------------- the authors' code, transcribed


def pyhessian_top(model, x, y, seed: int = 0, max_iter: int = 100, tol: float = 1e-3) -> float:
    """amirgholami/PyHessian pyhessian/hessian.py `hessian.__init__` (single batch: `loss.backward(create_graph=
    True)`, `get_params_grad`) and `eigenvalues(maxIter=100, tol=1e-3, top_n=1)`; pyhessian/utils.py
    `group_product`, `normalization` (s + 1e-6), `hessian_vector_product`, `orthnormal`."""
    torch.manual_seed(seed)
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward(create_graph=True)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [0. if p.grad is None else p.grad + 0. for p in params]

    def group_product(xs, ys):
        return sum([torch.sum(a * b) for (a, b) in zip(xs, ys)])

    def normalization(v):
        s = group_product(v, v) ** 0.5
        s = s.cpu().item()
        return [vi / (s + 1e-6) for vi in v]

    eigenvalue = None
    v = normalization([torch.randn(p.size(), dtype=p.dtype) for p in params])
    for _ in range(max_iter):
        model.zero_grad()
        hv = torch.autograd.grad(grads, params, grad_outputs=v, only_inputs=True, retain_graph=True)
        tmp = group_product(hv, v).cpu().item()
        v = normalization(hv)
        if eigenvalue is None:
            eigenvalue = tmp
        elif abs(eigenvalue - tmp) / (abs(eigenvalue) + 1e-6) < tol:
            break
        else:
            eigenvalue = tmp
    model.zero_grad(set_to_none=True)
    return eigenvalue


def eos_eigenvalues(model, x, y, neigs: int = 6, P: torch.Tensor | None = None) -> torch.Tensor:
    """locuslab/edge-of-stability src/utilities.py `compute_hvp` (l. 90-103, one physical batch, CPU, the
    model's dtype), `lanczos` (l. 106-117), `get_hessian_eigenvalues` (l. 120-127); with Cohen et al. 2022's
    `P` (their adam.py, as adapted copies carry it): `vector / P.sqrt()` before and `hvp / P.sqrt()` after."""
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    dtype = next(model.parameters()).dtype

    def compute_hvp(vector):
        p = len(parameters_to_vector(model.parameters()))
        n = len(x)
        hvp = torch.zeros(p, dtype=dtype)
        if P is not None:
            vector = vector / P.sqrt()
        loss = loss_fn(model(x), y) / n
        grads = torch.autograd.grad(loss, inputs=model.parameters(), create_graph=True)
        dot = parameters_to_vector(grads).mul(vector).sum()
        grads = [g.contiguous() for g in torch.autograd.grad(dot, model.parameters(), retain_graph=True)]
        hvp += parameters_to_vector(grads)
        if P is not None:
            hvp = hvp / P.sqrt()
        return hvp

    def mv(vec: np.ndarray):
        return compute_hvp(torch.tensor(vec, dtype=dtype)).detach().numpy()

    nparams = len(parameters_to_vector(model.parameters()))
    evals, _ = eigsh(LinearOperator((nparams, nparams), matvec=mv), neigs)
    return torch.from_numpy(np.ascontiguousarray(evals[::-1]).copy())


@pytest.mark.equivalence
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")  # PyHessian's own call
def test_lambda_max_agrees_with_pyhessian_and_the_edge_of_stability_lanczos() -> None:
    """A model whose largest-magnitude eigenvalue is its largest (the authors' codes return that one)."""
    cfg = ffn(4)
    model, x, task = float64(cfg)
    dense = torch.linalg.eigvalsh(dense_hessian(cfg))
    assert dense[-1] > -dense[0]
    got = ours(cfg)["lambda_max"]
    assert got == pytest.approx(pyhessian_top(model, x, task.y), rel=1e-2)  # its tol: 1e-3 relative change
    assert got == pytest.approx(eos_eigenvalues(model, x, task.y)[0].item(), rel=1e-7)


@pytest.mark.equivalence
def test_preconditioned_lambda_max_agrees_with_the_edge_of_stability_adam_code() -> None:
    """A float32 Adam run of the reference engine, measured after 3 updates, against the authors' P from
    torch.optim.Adam's state after the same 3 updates (the reference replays torch's Adam bit for bit):
    `P = (1 - beta1**step) * ((nu / (1 - beta2**step)).sqrt() + adam_epsilon)`, nu the exp_avg_sq's."""
    cfg = ffn(4, log_sharpness=3)
    rows = train_run(cfg).sharpness
    model, task = seeded_init(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps)
    for _ in range(3):
        optimizer.zero_grad()
        loss_and_acc(model(task.x), task.y)[0].backward()
        optimizer.step()
    (beta1, beta2), step = cfg.optim.betas, 3
    nu = torch.cat([optimizer.state[p]["exp_avg_sq"].view(-1) for p in model.parameters()])
    P = (1 - beta1 ** step) * ((nu / (1 - beta2 ** step)).sqrt() + cfg.optim.eps)
    expected = eos_eigenvalues(model, task.x, task.y, P=P)[0].item()
    assert rows["step"] == [0, 3] and rows["precond_lambda_max"][1] == pytest.approx(expected, rel=1e-4)
    assert rows["lambda_max"][1] == pytest.approx(eos_eigenvalues(model, task.x, task.y)[0].item(), rel=1e-4)


# ----------------------------------------------------------------------------- the wiring


def test_rows_every_k_steps_with_their_thresholds() -> None:
    cfg = validate_run({"model": {"depth": 2, "width": 4}, "data": {"n_samples": 8},
                        "schedule": {"kind": "linear_warmup", "warmup_steps": 4},
                        "train": {"steps": 5, "log_sharpness": 2}})
    result = train_run(cfg)
    rows = result.sharpness
    assert list(rows) == list(SHARPNESS_COLUMNS) and rows["step"] == [0, 2, 4]
    assert rows["lr"] == [result.metrics["lr"][s] for s in (0, 2, 4)]
    assert rows["threshold_gd"] == [2 / lr for lr in rows["lr"]]
    assert rows["threshold_adam"] == pytest.approx([38 / lr for lr in rows["lr"]])
    assert math.isnan(rows["precond_lambda_max"][0]) and all(v > 0 for v in rows["precond_lambda_max"][1:])
    sgd = train_run(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"name": "sgd"})})).sharpness
    assert all(math.isnan(v) for v in sgd["precond_lambda_max"] + sgd["threshold_adam"])
    radam = train_run(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"name": "radam"})})).sharpness
    assert all(v > 0 for v in radam["precond_lambda_max"][1:])
    assert thresholds(0.0, 0.9) == (math.inf, math.inf) and math.isnan(thresholds(0.1, None)[1])


@pytest.mark.equivalence
@pytest.mark.parametrize("cfg", [ffn(2), transformer(1, z_loss=1e-3)], ids=["ffn", "transformer"])
def test_training_is_the_same_bits_with_or_without_it(cfg) -> None:
    logged = cfg.model_copy(update={"train": cfg.train.model_copy(update={"log_sharpness": 2, "steps": 2})})
    plain = logged.model_copy(update={"train": cfg.train.model_copy(update={"steps": 2})})
    on, off = train_run(logged), train_run(plain)
    assert {k: [repr(v) for v in vs] for k, vs in on.metrics.items()} == \
           {k: [repr(v) for v in vs] for k, vs in off.metrics.items()}
    assert off.sharpness is None and on.sharpness["step"] == [0, 2]
    assert train_run(logged).sharpness == on.sharpness  # deterministic


def test_the_batched_and_fast_engines_leave_it_to_the_reference() -> None:
    runs = [ffn(seed, log_sharpness=2) for seed in range(3)]
    batches, alone = plan_batches(runs)
    assert not batches and alone == runs
    for engine in ("batched", "fast"):
        assert {unit.engine for unit in plan_units(runs, engine, "cpu", 1)} == {"reference"}
    with pytest.raises(ValueError, match="train.log_sharpness"):
        train_batch(runs)
