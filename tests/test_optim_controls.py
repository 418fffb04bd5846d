"""The optimizer and schedule controls of issue 43, each against an independent transcription of its
authors' code (repository, file and lines named at each), over a few steps of the FFN toy and the
Transformer on the reference engine, and the batched engine bit for bit with the reference."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from normexp.config import ConfigError, RunConfig, build_sweep, validate_run
from normexp.engines.batched import plan_batches, train_batch
from normexp.engines.common import loss_and_acc, seeded_init
from normexp.engines.fast import fast_serves
from normexp.engines.reference import train_run
from normexp.folder import run_id
from normexp.optim import build_optimizer, step_lr

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


@pytest.mark.equivalence
@pytest.mark.parametrize("optim", ["adam", "adamw", "sgd"])
def test_clip_norm_batched_bit_for_bit(optim):
    assert_batched_is_reference(varied([{"clip_norm": c} for c in (1.0, 0.05, 0.3, 100.0)], optim))


def test_clipped_and_unclipped_runs_batch_apart():
    configs = varied([{"clip_norm": 0.1}, {}, {"clip_norm": 0.2}, {}])
    batches, alone = plan_batches(configs)
    assert sorted(len(b) for b in batches) == [2, 2] and not alone


# ----------------------------------------------------------------------------- optim.agc

def transcribed_agc(clip: float, eps: float) -> Callable[[torch.nn.Module], None]:
    """google-deepmind/deepmind-research nfnets/agc_optax.py (f5de0ede), lines 21-48 and 69-76:
    `compute_norm`, `unitwise_norm`, `my_clip` and `adaptive_grad_clip`'s update_fn, on Haiku's layout (a
    Linear's weight is (in, out), torch's transposed; an embedding table is (vocab, d) in both); and
    nfnets/experiment_nfnets.py lines 118-131: the classifier's (`linear`) weights get `clipping: None`."""
    def compute_norm(x, axis, keepdims):
        return torch.sum(x ** 2, dim=axis, keepdim=keepdims) ** 0.5 if axis is not None else torch.sum(x ** 2) ** 0.5

    def unitwise_norm(x):
        if len(x.squeeze().shape) <= 1:  # Scalars and vectors
            axis, keepdims = None, False
        elif len(x.shape) in [2, 3]:  # Linear layers of shape IO or multihead linear
            axis, keepdims = 0, True
        else:
            raise ValueError(x.shape)
        return compute_norm(x, axis, keepdims)

    def my_clip(g_norm, max_norm, grad):
        trigger = g_norm < max_norm
        clipped_grad = grad * (max_norm / torch.maximum(g_norm, torch.tensor(1e-6)))
        return torch.where(trigger, grad, clipped_grad)

    def apply(model: torch.nn.Module) -> None:
        with torch.no_grad():
            for module_name, module in model.named_modules():
                for leaf, param in module.named_parameters(recurse=False):
                    if f"{module_name}.{leaf}" == "head.weight":  # the final layer: no clipping
                        continue
                    haiku = isinstance(module, torch.nn.Linear) and leaf == "weight"  # (out, in) -> (in, out)
                    w, g = (param.T, param.grad.T) if haiku else (param, param.grad)
                    max_norm = clip * torch.maximum(unitwise_norm(w), torch.tensor(eps))
                    g.copy_(my_clip(unitwise_norm(g), max_norm, g))
    return apply


@pytest.mark.parametrize(("arch", "placement"), [("ffn", "post"), ("ffn", "rezero"), ("transformer", "post"),
                                                 ("transformer", "admin")])
@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_agc_is_the_authors_adaptive_grad_clip(arch, placement, optim):
    cfg = config(arch, norm={"placement": placement}, optim={"name": optim, "lr": 0.05, "agc": 0.01, "agc_eps": 2e-3})
    expected = plain_run(cfg, before_step=transcribed_agc(0.01, 2e-3))
    got = train_run(cfg).losses
    assert got == pytest.approx(expected, rel=1e-6, abs=0)
    unclipped = train_run(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"agc": None})}))
    assert unclipped.losses[1:] != got[1:]  # the clipping acted


def test_agc_leaves_the_final_layers_weight_alone():
    from normexp.optim import AGC_SKIPPED, adaptive_clip_, agc_units

    for arch in ARCHS:
        model, task = seeded_init(config(arch))
        loss_and_acc(model(task.x), task.y, task.positions)[0].backward()
        names = [name for name, _ in model.named_parameters()]
        units = agc_units(model)
        assert dict(zip(names, units))["head.weight"] == AGC_SKIPPED and dict(zip(names, units))["head.bias"] is None
        before = {name: p.grad.clone() for name, p in model.named_parameters()}
        params = list(model.parameters())
        adaptive_clip_([p.unsqueeze(0) for p in params], [p.grad.unsqueeze(0) for p in params], units,
                       torch.tensor([1e-12]), torch.tensor([1e-3]))  # clips every unit but the skipped
        for name, p in model.named_parameters():
            if before[name].any():  # (a key bias's gradient can be all zeros: softmax ignores it)
                assert torch.equal(p.grad, before[name]) == (name == "head.weight"), name


@pytest.mark.equivalence
def test_agc_on_a_transposed_layout_gives_the_same_bits():
    """The batched engine stores some Linear weights transposed (`weight_t`); AGC reads them back in the
    reference's layout and gives the reference's bits."""
    from normexp.optim import adaptive_clip_

    generator = torch.Generator().manual_seed(0)
    weight, grad = torch.randn(3, 40, 24, generator=generator), torch.randn(3, 40, 24, generator=generator)
    factors = torch.tensor([0.01, 0.1, 1.0]), torch.tensor([1e-3, 1e-3, 1e-2])
    plain = grad.clone()
    adaptive_clip_([weight], [plain], [1], *factors)
    stored_t = grad.transpose(1, 2).contiguous()  # (R, in, out), as StackedLinear's weight_t
    adaptive_clip_([weight.transpose(1, 2).contiguous().transpose(1, 2)], [stored_t.transpose(1, 2)], [1], *factors)
    assert torch.equal(stored_t.transpose(1, 2), plain) and not torch.equal(plain, grad)
    alone = grad[1:2].clone()
    adaptive_clip_([weight[1:2]], [alone], [1], factors[0][1:2], factors[1][1:2])  # a run alone: its batch's bits
    assert torch.equal(alone, plain[1:2])


@pytest.mark.equivalence
@pytest.mark.parametrize("optim", ["adam", "adamw", "sgd"])
def test_agc_batched_bit_for_bit(optim):
    assert_batched_is_reference(varied([{"agc": a, "agc_eps": e} for a, e in
                                        ((0.01, 1e-3), (0.05, 1e-2), (0.3, 1e-3), (0.001, 1e-4))], optim))


def test_agc_eps_without_agc_and_agc_with_clip_norm_are_refused():
    with pytest.raises(ConfigError, match=r"optim\.agc_eps: has no effect without optim\.agc"):
        validate_run({"optim": {"agc_eps": 0.01}})
    with pytest.raises(ConfigError, match=r"optim\.agc: and optim\.clip_norm are two ways to clip"):
        validate_run({"optim": {"agc": 0.01, "clip_norm": 1.0}})
    validate_run({"optim": {"agc": 0.01, "agc_eps": 0.01}})
    sweep = build_sweep({"name": "eps", "base": {"optim": {"agc_eps": 0.01}}, "grid": {"optim.agc": [0.01, 0.1]}})
    assert [r.optim.agc for r in sweep.runs] == [0.01, 0.1]  # the base keeps it: every run sets agc


# ----------------------------------------------------------------------------- optim.v_only_steps (Adam-2k)

class Adam2(torch.optim.Optimizer):
    """LiyuanLucasLiu/RAdam nmt/my_module/adam2.py (d9fd30a3) lines 67-152, `Adam2.step` as run with
    `--adam-freeze k` ('adam_1k' in the optimizer's name), amsgrad and adam_no_correction1 off; the
    deprecated `add_(scalar, tensor)` forms written as `alpha=` / `value=`."""

    def __init__(self, params, lr, betas, eps, weight_decay, adam_freeze):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_freeze=adam_freeze))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad.data.float()
                p_data_fp32 = p.data.float()
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p_data_fp32)
                    state["exp_avg_sq"] = torch.zeros_like(p_data_fp32)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                beta1, beta2 = group["betas"]
                state["step"] += 1
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = exp_avg_sq.sqrt().add_(group["eps"])
                bias_correction1 = 1 - beta1 ** state["step"]
                bias_correction2 = (1 - beta2 ** state["step"]) ** 0.5
                step_size = group["lr"] * bias_correction2 / bias_correction1
                if state["step"] > group["adam_freeze"]:  # 'adam_1k' in self.name
                    if group["weight_decay"] != 0:
                        p_data_fp32.add_(p_data_fp32, alpha=-group["weight_decay"] * group["lr"])
                    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                    p_data_fp32.addcdiv_(exp_avg, denom, value=-step_size)
                    p.data.copy_(p_data_fp32)


@pytest.mark.parametrize("arch", ["ffn", "transformer"])
@pytest.mark.parametrize(("optim", "decay"), [("adam", 0.0), ("adamw", 0.05)])
def test_v_only_steps_is_adam_2k(arch, optim, decay):
    k, lr, betas, eps = 3, 0.02, (0.9, 0.999), 1e-8
    cfg = config(arch, optim={"name": optim, "lr": lr, "weight_decay": decay, "v_only_steps": k},
                 schedule={"kind": "cosine", "warmup_steps": 0})
    got = train_run(cfg).losses
    assert bits(got[:k + 1]) == bits([got[0]] * (k + 1))  # the first k updates leave the weights as they were
    assert got[k + 1] != got[0]
    expected = plain_run(cfg, lambda params: Adam2(params, lr, betas, eps, decay, adam_freeze=k))
    # the authors' Adam2 adds eps to sqrt(v) before the bias correction (torch's Adam of 2019);
    # normexp's Adam, torch's, to sqrt(v) / sqrt(1 - beta2^t): the same update but for eps's scale
    assert got == pytest.approx(expected, rel=1e-4)
    adam = train_run(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"v_only_steps": 0})}))
    assert adam.losses[1] != got[1]


def test_v_only_steps_freezes_the_first_moment_and_counts_the_steps():
    """The state after the frozen updates: the first moment untouched, the second moment every gradient's,
    the step count (bias corrections) advanced, as Adam2's `state['step']`."""
    from normexp.optim import StackedOptimizer

    cfg = config(optim={"name": "adamw", "v_only_steps": 2, "weight_decay": 0.1})
    param = torch.nn.Parameter(torch.tensor([[1.0, -2.0, 3.0]]))
    optimizer = StackedOptimizer([param], [cfg])
    grads = [torch.tensor([[0.5, 0.25, -1.0]]), torch.tensor([[-0.5, 1.0, 2.0]]), torch.tensor([[1.0, 1.0, 1.0]])]
    for grad in grads[:2]:
        param.grad = grad
        optimizer.step([0.01])
    state = optimizer.state[0]
    assert torch.equal(param.detach(), torch.tensor([[1.0, -2.0, 3.0]])) and not state["exp_avg"].any()
    expected_v = (0.001 * grads[0] * grads[0]) * 0.999 + 0.001 * grads[1] * grads[1]
    assert torch.allclose(state["exp_avg_sq"], expected_v, rtol=1e-6)
    param.grad = grads[2]
    optimizer.step([0.01])  # update 3: the first that moves, with step count 3
    assert optimizer.steps == 3 and torch.allclose(state["exp_avg"], 0.1 * grads[2])
    v3 = expected_v * 0.999 + 0.001 * grads[2] * grads[2]
    decayed = torch.tensor([[1.0, -2.0, 3.0]]) * (1 - 0.01 * 0.1)
    step = 0.01 / (1 - 0.9 ** 3) * (0.1 * grads[2]) / ((v3 / (1 - 0.999 ** 3)).sqrt() + 1e-8)
    assert torch.allclose(param.detach(), decayed - step, rtol=1e-6)


@pytest.mark.equivalence
@pytest.mark.parametrize("optim", ["adam", "adamw"])
def test_v_only_steps_batched_bit_for_bit(optim):
    assert_batched_is_reference(varied([{"v_only_steps": 3}] * 4, optim))


# ----------------------------------------------------------------------------- optim.v0 (GI-Adam)

class GIAdam(torch.optim.Optimizer):
    """dayal-kalra/why-warmup vision/mechanisms/utils/optim_utils.py (877d887f) lines 14-44, `adam_init`
    with `grads` given: nu starts at grads ** 2, mu at zeros; update_fn's count, bias-corrected mu_hat
    and nu_hat, -learning_rate * mu_hat / (sqrt(nu_hat) + eps); train_fcn_grads_adam_lobpcg.py lines
    92-98: `grads` is the gradient at the initial weights (the first gradient, on a full batch)."""

    def __init__(self, params, lr, betas, eps):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                state, grads = self.state[p], p.grad
                if not state:  # init_fn: the first gradient is the one at initialisation
                    state.update(mu=torch.zeros_like(p), nu=grads ** 2, count=0)
                state["count"] += 1
                count = state["count"]
                state["mu"] = b1 * state["mu"] + (1 - b1) * grads
                mu_hat = state["mu"] / (1 - b1 ** count)
                state["nu"] = b2 * state["nu"] + (1 - b2) * (grads ** 2)
                nu_hat = state["nu"] / (1 - b2 ** count)
                p.add_(-group["lr"] * mu_hat / (torch.sqrt(nu_hat) + group["eps"]))


@pytest.mark.parametrize("arch", ["ffn", "transformer"])
def test_v0_grad_sq_is_gi_adam(arch):
    lr, betas, eps = 0.05, (0.9, 0.999), 1e-8
    cfg = config(arch, optim={"name": "adam", "lr": lr, "v0": "grad_sq"}, schedule={"kind": "linear_warmup",
                                                                                     "warmup_steps": 3})
    got = train_run(cfg).losses
    expected = plain_run(cfg, lambda params: GIAdam(params, lr, betas, eps))
    assert got == pytest.approx(expected, rel=1e-5)
    adam = train_run(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"v0": "zero"})}))
    assert adam.losses[1] != got[1]


def test_v0_grad_sq_shrinks_the_first_update_by_sqrt_one_minus_beta2():
    """With v0 = g0^2 and the bias correction kept, the first update is Adam's times about
    sqrt(1 - beta2): GI-Adam's built-in warmup."""
    from normexp.optim import StackedOptimizer

    moves = {}
    for v0 in ("zero", "grad_sq"):
        param = torch.nn.Parameter(torch.zeros(1, 4))
        optimizer = StackedOptimizer([param], [config(optim={"name": "adam", "lr": 1.0, "v0": v0})])
        param.grad = torch.tensor([[1.0, -2.0, 0.5, 4.0]])
        optimizer.step([1.0])
        moves[v0] = param.detach().clone()
    assert torch.allclose(moves["grad_sq"], moves["zero"] * math.sqrt(1 - 0.999), rtol=1e-4)


@pytest.mark.equivalence
@pytest.mark.parametrize("optim", ["adam", "adamw"])
def test_v0_batched_bit_for_bit(optim):
    assert_batched_is_reference(varied([{"v0": "grad_sq"}] * 4, optim))


# ----------------------------------------------------------------------------- optim.radam_variant

class AuthorsRAdam(torch.optim.Optimizer):
    """LiyuanLucasLiu/RAdam radam/radam.py (d9fd30a3) lines 5-94, class `RAdam` with its default
    `degenerated_to_sgd=False`, its shared 10-slot buffer included; the deprecated `add_(scalar, tensor)`
    forms written as `alpha=` / `value=`."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, degenerated_to_sgd=False):
        self.degenerated_to_sgd = degenerated_to_sgd
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        buffer=[[None, None, None] for _ in range(10)])
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.data.float()
                p_data_fp32 = p.data.float()
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p_data_fp32)
                    state["exp_avg_sq"] = torch.zeros_like(p_data_fp32)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                beta1, beta2 = group["betas"]
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                state["step"] += 1
                buffered = group["buffer"][int(state["step"] % 10)]
                if state["step"] == buffered[0]:
                    n_sma, step_size = buffered[1], buffered[2]
                else:
                    buffered[0] = state["step"]
                    beta2_t = beta2 ** state["step"]
                    n_sma_max = 2 / (1 - beta2) - 1
                    n_sma = n_sma_max - 2 * state["step"] * beta2_t / (1 - beta2_t)
                    buffered[1] = n_sma
                    if n_sma >= 5:
                        step_size = math.sqrt((1 - beta2_t) * (n_sma - 4) / (n_sma_max - 4) * (n_sma - 2) / n_sma
                                              * n_sma_max / (n_sma_max - 2)) / (1 - beta1 ** state["step"])
                    elif self.degenerated_to_sgd:
                        step_size = 1.0 / (1 - beta1 ** state["step"])
                    else:
                        step_size = -1
                    buffered[2] = step_size
                if n_sma >= 5:
                    if group["weight_decay"] != 0:
                        p_data_fp32.add_(p_data_fp32, alpha=-group["weight_decay"] * group["lr"])
                    denom = exp_avg_sq.sqrt().add_(group["eps"])
                    p_data_fp32.addcdiv_(exp_avg, denom, value=-step_size * group["lr"])
                    p.data.copy_(p_data_fp32)
                elif step_size > 0:
                    if group["weight_decay"] != 0:
                        p_data_fp32.add_(p_data_fp32, alpha=-group["weight_decay"] * group["lr"])
                    p_data_fp32.add_(exp_avg, alpha=-step_size * group["lr"])
                    p.data.copy_(p_data_fp32)


@pytest.mark.parametrize("arch", ["ffn", "transformer"])
@pytest.mark.parametrize("decay", [0.0, 0.05])
def test_radam_official_is_the_authors_radam(arch, decay):
    lr, betas, eps = 0.02, (0.9, 0.999), 1e-8
    cfg = config(arch, steps=12, optim={"name": "radam", "lr": lr, "weight_decay": decay,
                                        "radam_variant": "official"},
                 schedule={"kind": "linear_warmup", "warmup_steps": 3})
    got = train_run(cfg).losses
    assert bits(got) == bits(plain_run(cfg, lambda params: AuthorsRAdam(params, lr, betas, eps, decay)))
    # rho_t < 5 for t <= 5 at beta2 = 0.999: the first five updates leave the weights alone
    assert bits(got[:6]) == bits([got[0]] * 6) and got[6] != got[0]
    torch_radam = train_run(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"radam_variant": "torch"})}))
    assert torch_radam.losses[1] != got[1]  # torch's RAdam takes momentum steps there


def test_torch_radam_stays_the_default():
    cfg = config(steps=6, optim={"name": "radam", "lr": 0.02})
    assert cfg.optim.radam_variant == "torch"
    assert bits(train_run(cfg).losses) == bits(plain_run(cfg, lambda params: torch.optim.RAdam(params, lr=0.02)))


@pytest.mark.equivalence
def test_radam_official_batched_bit_for_bit():
    configs = [config(optim={"name": "radam", "radam_variant": "official", "weight_decay": 0.01}, steps=10,
                      seed=s) for s in range(3)]
    assert_batched_is_reference(configs)


# ----------------------------------------------------------------------------- schedule.kind: wsd

def wsd_schedule(n_iterations, final_lr_factor=0.0, n_warmup=1000, init_div_factor=100, fract_decay=0.1,
                 decay_type="linear"):
    """epfml/schedules-and-scaling src/optim/utils.py (17e78d60) lines 55-125, `wsd_schedule`; main.py lines
    129-138 call it with init_div_factor=1e2 and hand it to torch's LambdaLR."""
    n_anneal_steps = int(fract_decay * n_iterations)
    n_hold = n_iterations - n_anneal_steps

    def schedule(step):
        if step < n_warmup:
            return (step / n_warmup) + (1 - step / n_warmup) / init_div_factor
        elif step < n_hold:
            return 1.0
        elif step < n_iterations:
            if decay_type == "linear":
                return final_lr_factor + (1 - final_lr_factor) * (1 - (step - n_hold) / n_anneal_steps)
            elif decay_type == "exp":
                return final_lr_factor ** ((step - n_hold) / n_anneal_steps)
            elif decay_type == "cosine":
                return final_lr_factor + (1 - final_lr_factor) * (
                    1 + math.cos(math.pi * (step - n_hold) / n_anneal_steps)) * 0.5
            elif decay_type == "miror_cosine":
                cosine_value = final_lr_factor + (1 - final_lr_factor) * (
                    1 + math.cos(math.pi * (step - n_hold) / n_anneal_steps)) * 0.5
                linear_value = final_lr_factor + (1 - final_lr_factor) * (1 - (step - n_hold) / n_anneal_steps)
                return linear_value * 2 - cosine_value
            elif decay_type == "square":
                return final_lr_factor + (1 - final_lr_factor) * (1 - ((step - n_hold) / n_anneal_steps) ** 2)
            elif decay_type == "sqrt":
                return final_lr_factor + (1 - final_lr_factor) * (1 - math.sqrt((step - n_hold) / n_anneal_steps))
            raise ValueError(decay_type)
        else:
            return final_lr_factor

    return schedule


AUTHORS_SHAPE = {"mirror_cosine": "miror_cosine"}


@pytest.mark.parametrize("shape", ["linear", "cosine", "exp", "mirror_cosine", "square", "sqrt"])
@pytest.mark.parametrize(("steps", "warmup", "fraction", "final"), [(30, 5, 0.1, 0.0), (40, 0, 0.5, 0.1),
                                                                    (7, 3, 0.45, 0.3), (100, 10, 1.0, 0.05)])
def test_wsd_is_the_authors_schedule(shape, steps, warmup, fraction, final):
    from normexp.optim import lr_multiplier

    cfg = config(steps=steps, schedule={"kind": "wsd", "warmup_steps": warmup, "decay_fraction": fraction,
                                        "decay_shape": shape, "min_lr_ratio": final})
    authors = wsd_schedule(steps, final, warmup, 1e2, fraction, AUTHORS_SHAPE.get(shape, shape))
    # torch's LambdaLR: the optimizer's first step uses schedule(0), each scheduler.step() moves one on
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, authors)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    assert [0.1 * lr_multiplier(s, cfg.schedule, steps) for s in range(1, steps + 1)] == lrs
    assert [step_lr(cfg, step) for step in range(steps)] == [cfg.optim.lr * authors(i) for i in range(steps)]


@pytest.mark.parametrize("arch", ["ffn", "transformer"])
def test_wsd_trains_with_the_authors_learning_rates(arch):
    cfg = config(arch, steps=10, optim={"name": "adamw", "lr": 0.02},
                 schedule={"kind": "wsd", "warmup_steps": 3, "decay_fraction": 0.4, "decay_shape": "cosine"})
    authors = wsd_schedule(10, 0.0, 3, 1e2, 0.4, "cosine")
    result = train_run(cfg)
    assert bits(result.losses) == bits(plain_run(cfg, lr=lambda step: 0.02 * authors(step)))
    assert result.metrics["lr"][:10] == [0.02 * authors(i) for i in range(10)]


@pytest.mark.equivalence
def test_wsd_batched_bit_for_bit_and_the_fast_engine_within_its_contract():
    from normexp.engines.fast import train_fast

    shapes = ["linear", "cosine", "sqrt", "mirror_cosine"]
    configs = [config(steps=12, seed=i, optim={"name": "adam", "lr": [0.01, 0.003, 0.03, 0.02][i]},
                      schedule={"kind": "wsd", "warmup_steps": i, "decay_fraction": 0.25 + 0.1 * i,
                                "decay_shape": shape, "min_lr_ratio": 0.1 * i})
               for i, shape in enumerate(shapes)]
    assert_batched_is_reference(configs)
    assert all(fast_serves(cfg) for cfg in configs)  # its schedule is step_lr's, as every engine's
    for cfg, result in zip(configs, train_fast(configs, compile=False)):
        expected = train_run(cfg)
        assert result.metrics["lr"] == expected.metrics["lr"]
        assert result.losses == pytest.approx(expected.losses, rel=2e-4, abs=2e-4)


def test_wsd_keys_act_under_wsd_only():
    cosine = validate_run({"schedule": {"kind": "cosine", "decay_shape": "sqrt", "decay_fraction": 0.5}})
    assert cosine.schedule.decay_shape == "linear" and cosine.schedule.decay_fraction == 0.1
    with pytest.raises(ConfigError, match=r"base\.schedule\.decay_shape: has no effect: only schedule\.kind wsd"):
        build_sweep({"name": "w", "base": {"schedule": {"kind": "cosine", "decay_shape": "sqrt"}}})
    plain = validate_run({"schedule": {"kind": "wsd"}})
    assert run_id(plain) == run_id(validate_run({"schedule": {"kind": "wsd", "decay_fraction": 0.1,
                                                              "decay_shape": "linear"}}))


# ----------------------------------------------------------------------------- optim.independent_weight_decay

def nanodo_adamw(params, c: dict) -> torch.optim.Optimizer:
    """google-deepmind/nanodo nanodo/optimizer.py (10aefdee) lines 157-160 and 175-183: with
    `independent_weight_decay` the decay handed to optax.adamw is `weight_decay / peak_learning_rate`, which
    optax scales by the scheduled learning rate (lr_t * wd / peak per update); torch's AdamW applies its
    `weight_decay` the same way, param * (1 - lr_t * weight_decay)."""
    if c.get("independent_weight_decay", False):
        weight_decay = c["weight_decay"] / c["peak_learning_rate"]
    else:
        weight_decay = c["weight_decay"]
    return torch.optim.AdamW(params, lr=c["peak_learning_rate"], weight_decay=weight_decay)


@pytest.mark.parametrize("arch", ["ffn", "transformer"])
def test_independent_weight_decay_is_nanodos(arch):
    lr, decay = 0.02, 0.05
    cfg = config(arch, optim={"name": "adamw", "lr": lr, "weight_decay": decay, "independent_weight_decay": True},
                 schedule={"kind": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1})
    got = train_run(cfg).losses
    settings = {"weight_decay": decay, "peak_learning_rate": lr, "independent_weight_decay": True}
    assert bits(got) == bits(plain_run(cfg, lambda params: nanodo_adamw(params, settings)))
    coupled_optim = cfg.optim.model_copy(update={"independent_weight_decay": False})
    coupled = train_run(cfg.model_copy(update={"optim": coupled_optim}))
    assert coupled.losses[1:] != got[1:]
    assert bits(coupled.losses) == bits(plain_run(cfg, lambda params: nanodo_adamw(
        params, {**settings, "independent_weight_decay": False})))


def test_independent_weight_decay_follows_the_schedule_not_the_lr():
    """A weight with no gradient only decays: by weight_decay times the schedule's multiplier per update."""
    from normexp.optim import StackedOptimizer

    cfg = config(optim={"name": "adamw", "lr": 0.02, "weight_decay": 0.1, "independent_weight_decay": True})
    param = torch.nn.Parameter(torch.ones(1, 3))
    optimizer = StackedOptimizer([param], [cfg])
    for multiplier in (0.5, 1.0):
        param.grad = torch.zeros(1, 3)
        before = param.detach().clone()
        optimizer.step([0.02 * multiplier])
        assert torch.allclose(param.detach(), before * (1 - 0.1 * multiplier), rtol=1e-6)


@pytest.mark.equivalence
def test_independent_weight_decay_batched_bit_for_bit_beside_coupled_runs():
    assert_batched_is_reference(varied([{"independent_weight_decay": True, "weight_decay": 0.1}, {},
                                        {"independent_weight_decay": True, "weight_decay": 1e-3},
                                        {"weight_decay": 0.1}], "adamw"))


def test_independent_weight_decay_without_decay_is_refused():
    with pytest.raises(ConfigError, match=r"optim\.independent_weight_decay: has no effect with optim\.weight_decay 0"):
        validate_run({"optim": {"name": "adamw", "weight_decay": 0.0, "independent_weight_decay": True}})
    adam = validate_run({"optim": {"name": "adam", "independent_weight_decay": True}})
    assert not adam.optim.independent_weight_decay  # adam's decay is L2, in the gradient: the key acts under adamw


# ----------------------------------------------------------------------------- every control

# A value of each control other than its default, and the optimizer it acts under
CONTROLS = {"optim.clip_norm": ("adam", 1.0), "optim.agc": ("sgd", 0.01), "optim.v_only_steps": ("adam", 2),
            "optim.v0": ("adamw", "grad_sq"), "optim.radam_variant": ("radam", "official"),
            "optim.independent_weight_decay": ("adamw", True)}


@pytest.mark.parametrize("key", sorted(CONTROLS))
def test_a_control_changes_the_run_id_only_when_set_and_the_fast_engine_trains_it_unless_unserved(key):
    from normexp.engines.fast.plan import FAST_UNSERVED_OPTIM
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
    served = leaf not in FAST_UNSERVED_OPTIM  # tests/test_fast_controls.py: within the fast engine's contract
    assert fast_serves(plain) and fast_serves(controlled) == served
    runs = [plain, plain.model_copy(update={"seed": 1}), controlled, controlled.model_copy(update={"seed": 1})]
    units = plan_units(runs, "fast", "cpu", 1, compile=False)
    engine_of = {run_id(cfg): unit.engine for unit in units for cfg in unit.runs}
    assert [engine_of[run_id(cfg)] for cfg in runs] == ["fast", "fast", *["fast" if served else "batched"] * 2]
