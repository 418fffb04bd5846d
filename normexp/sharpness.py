"""Sharpness over training (`train.log_sharpness: K`): the top Hessian eigenvalue of the training loss and, for
Adam-family runs, of the preconditioned Hessian, beside their stability thresholds.

At every K-th recorded step (0, K, 2K, ...) one row, measured after the step's gradient and before its update:

    step                the recorded step
    lambda_max          the largest eigenvalue of H, the Hessian of the training objective on the step's batch
                        (its cross-entropy, plus the z term with train.z_loss; what backward() differentiates)
                        with respect to every parameter
    precond_lambda_max  Adam, AdamW, RAdam: the largest eigenvalue of P^-1 H, computed as that of the
                        symmetric P^-1/2 H P^-1/2 (the same eigenvalues), with Cohen et al. 2022's
                        P = (1 - beta1^t) (sqrt(v_t / (1 - beta2^t)) + eps): v_t the optimizer's second moment
                        after its t updates so far, the first moment's bias correction folded in (their
                        adam.py: `P = (1 - beta1**step) * ((nu / (1 - beta2**step)).sqrt() + adam_epsilon)`).
                        nan at step 0 (no update yet: no second moment) and for SGD. RAdam's rectification and
                        weight decay are left out, as in their code
    lr                  the step's lr: that of the update that follows (metrics.csv's `lr`)
    threshold_gd        2 / lr, gradient descent's stability threshold (Cohen et al. 2021)
    threshold_adam      (2 + 2 beta1) / ((1 - beta1) lr), Adam's (38 / lr at beta1 = 0.9; Cohen et al. 2022);
                        nan for SGD. Both inf where the lr is 0

Each eigenvalue comes from Hessian-vector products: the gradient is taken once with `create_graph` and each
product is a second backward through it (PyHessian's `hessian_vector_product`, the edge-of-stability code's
`compute_hvp`). The products drive a Lanczos iteration, the Krylov-space form of power iteration, with full
reorthogonalisation: the largest eigenvalue of its tridiagonal matrix is the estimate (the edge-of-stability
code's `lanczos` calls ARPACK's Lanczos, scipy's `eigsh`). Plain power iteration, PyHessian's, converges to
the eigenvalue of largest magnitude, which on these models is often a negative one; shifted by it, it
converges slowly where the top two are close, and its relative-change rule stops it early (0.2% off a
dense eigendecomposition on a depth-2 toy, where Lanczos is within 1e-10). Lanczos gives the largest
eigenvalue itself. The start vector is drawn from a generator of its own seeded
with START_SEED (the global generator is untouched, so training draws the same with or without it); the
iteration stops after ITERATIONS products, or once the top Ritz pair's residual |H y - theta y| (Lanczos'
|beta_k s_k|, a bound on theta's distance to an eigenvalue) is under TOLERANCE |theta|. It keeps its basis:
ITERATIONS x parameters numbers at most. Deterministic where the model's kernels are. Nothing a run records
changes: the measurement takes its own forward and never touches `.grad` or the optimizer.

Cost per call (both eigenvalues of an Adam run, 22-33 Hessian-vector products; one thread, float32, on a
shared 2-core CPU under a load of ~13, so absolute times are inflated, ratios less so): the article's toy
(depth 32, width 32, 64 samples, 270k parameters) 3.3 s against a 47 ms training step; a 2-layer width-32
Transformer on copy (27k parameters) 2.1 s against 36 ms: about 60-70 training steps each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

SHARPNESS_COLUMNS = ("step", "lambda_max", "precond_lambda_max", "lr", "threshold_gd", "threshold_adam")
ITERATIONS = 100  # Hessian-vector products at most, per eigenvalue (PyHessian's maxIter)
TOLERANCE = 1e-5  # stop once the top Ritz pair's residual |H y - theta y| is under this fraction of |theta|
START_SEED = 0

Vector = list[torch.Tensor]  # one tensor per parameter
MatVec = Callable[[Vector], Vector]


@dataclass(frozen=True)
class SecondMoment:
    """An Adam-family optimizer's state as the preconditioner reads it: v per parameter (shaped like it),
    the updates taken so far, beta1, beta2 and eps."""

    values: Vector
    updates: int
    betas: tuple[float, float]
    eps: float


def hessian_vector_product(objective: torch.Tensor, params: Sequence[torch.Tensor]) -> MatVec:
    """v -> H v for the Hessian of the scalar `objective` w.r.t. `params`: one gradient with `create_graph`,
    then a backward through it per product. A parameter the objective does not reach, or whose gradient is
    constant, contributes zeros."""
    grads = torch.autograd.grad(objective, params, create_graph=True, allow_unused=True)
    live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]

    def product(v: Vector) -> Vector:
        found = torch.autograd.grad([grads[i] for i in live], params, grad_outputs=[v[i] for i in live],
                                    retain_graph=True, allow_unused=True) if live else [None] * len(params)
        return [torch.zeros_like(p) if h is None else h.detach() for p, h in zip(params, found)]

    return product


def preconditioned(product: MatVec, scale: Vector) -> MatVec:
    """v -> D H D v, D = `scale` (P^-1/2) element-wise: symmetric, with the eigenvalues of P^-1 H."""
    return lambda v: [d * h for d, h in zip(scale, product([d * x for d, x in zip(scale, v)]))]


def adam_preconditioner(moment: SecondMoment) -> Vector | None:
    """Cohen et al. 2022's P per parameter, (1 - beta1^t) (sqrt(v / (1 - beta2^t)) + eps); None at t = 0."""
    t = moment.updates
    if t == 0:
        return None
    beta1, beta2 = moment.betas
    return [(1 - beta1 ** t) * ((v / (1 - beta2 ** t)).sqrt() + moment.eps) for v in moment.values]


def top_eigenvalue(product: MatVec, like: Vector, iterations: int = ITERATIONS, tolerance: float = TOLERANCE,
                   seed: int = START_SEED) -> float:
    """The largest eigenvalue of the symmetric operator `product` on vectors shaped like `like`, by Lanczos
    iteration with full reorthogonalisation (see the module docstring); nan where a product is not finite."""
    sizes = [p.numel() for p in like]
    n, dtype, device = sum(sizes), like[0].dtype, like[0].device

    def apply(q: torch.Tensor) -> torch.Tensor:
        found = product([part.view_as(p) for part, p in zip(torch.split(q, sizes), like)])
        return torch.cat([h.reshape(-1) for h in found])

    q = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(device)
    basis = torch.empty(min(iterations, n), n, dtype=dtype, device=device)  # untouched rows take no memory
    alphas: list[float] = []
    betas: list[float] = []
    top = math.nan
    for k in range(len(basis)):
        basis[k] = q / torch.linalg.vector_norm(q)
        w = apply(basis[k])
        alphas.append(torch.dot(w, basis[k]).item())
        done = basis[:k + 1]
        for _ in range(2):  # subtract the whole basis, twice ("twice is enough": Parlett)
            w = w - done.T @ (done @ w)
        beta = torch.linalg.vector_norm(w).item()
        if not all(map(math.isfinite, (*alphas, beta))):
            return math.nan
        ritz, vectors = torch.linalg.eigh(_tridiagonal(alphas, betas))
        top = ritz[-1].item()
        if abs(beta * vectors[-1, -1].item()) <= tolerance * abs(top) or beta == 0:  # |H y - top y|, y its Ritz vector
            break
        betas.append(beta)
        q = w
    return top


def _tridiagonal(alphas: list[float], betas: list[float]) -> torch.Tensor:
    """Lanczos' T in float64: `alphas` on the diagonal, `betas` beside it."""
    t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if betas:
        off = torch.tensor(betas, dtype=torch.float64)
        t += torch.diag(off, 1) + torch.diag(off, -1)
    return t


def thresholds(lr: float, beta1: float | None) -> tuple[float, float]:
    """(2 / lr, (2 + 2 beta1) / ((1 - beta1) lr)); the second nan without beta1 (SGD), both inf at lr 0."""
    gd = 2 / lr if lr else math.inf
    if beta1 is None:
        return gd, math.nan
    return gd, (2 + 2 * beta1) / ((1 - beta1) * lr) if lr else math.inf


def measure(objective: Callable[[], torch.Tensor], params: Sequence[torch.Tensor], lr: float,
            moment: SecondMoment | None) -> dict[str, float]:
    """One row but its step: `objective()` computes the training objective from the model's current
    parameters (its own forward); `moment` is the Adam-family optimizer's state, None for SGD."""
    with torch.enable_grad():
        product = hessian_vector_product(objective(), params)
        sharpest = top_eigenvalue(product, list(params))
        scale = adam_preconditioner(moment) if moment is not None else None
        precond = (top_eigenvalue(preconditioned(product, [p.rsqrt() for p in scale]), list(params))
                   if scale is not None else math.nan)
    gd, adam = thresholds(lr, moment.betas[0] if moment is not None else None)
    return {"lambda_max": sharpest, "precond_lambda_max": precond, "lr": lr, "threshold_gd": gd, "threshold_adam": adam}


class SharpnessRecorder:
    """sharpness.csv's rows of one run, every `every` recorded steps: `due(step)`, then `observe(...)`
    after the step's backward and before its update; `rows()` gives the columns (SHARPNESS_COLUMNS),
    as `RunResult.sharpness` carries them to the run folder."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.columns: dict[str, list[float]] = {column: [] for column in SHARPNESS_COLUMNS}

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def observe(self, step: int, objective: Callable[[], torch.Tensor], params: Sequence[torch.Tensor], lr: float,
                moment: SecondMoment | None) -> None:
        row = {"step": step, **measure(objective, params, lr, moment)}
        for column in SHARPNESS_COLUMNS:
            self.columns[column].append(row[column])

    def rows(self) -> dict[str, list[float]]:
        return {column: list(values) for column, values in self.columns.items()}
