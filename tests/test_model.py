"""Placements and norm kinds: equivalences and definitions, checked on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from normexp.config import ModelConfig, NormConfig, RunConfig
from normexp.engines.reference import train_run
from normexp.models.ffn import Block, Net, block_placements, deepnorm_constants
from normexp.models.norms import make_norm
from normexp.registry import KINDS, placements_for

ALL_PLACEMENTS = placements_for("ffn")  # normexp/registry.py
ALL_KINDS = list(KINDS)
SMALL = ModelConfig(depth=4, width=8)


def build(placement: str, kind: str = "layernorm", seed: int = 0, model: ModelConfig = SMALL, **norm) -> Net:
    torch.manual_seed(seed)
    return Net(model, NormConfig(placement=placement, kind=kind, **norm))


def test_peri_without_input_norm_equals_sandwich():
    x = torch.randn(5, 8)
    peri = build("peri", "rmsnorm", peri_input_norm=False)
    sandwich = build("sandwich", "rmsnorm")
    assert torch.equal(peri(x), sandwich(x))
    cfg = {"model": {"depth": 3, "width": 8}, "train": {"steps": 4}}
    a = train_run(RunConfig.model_validate({**cfg, "norm": {"placement": "peri", "peri_input_norm": False}}))
    b = train_run(RunConfig.model_validate({**cfg, "norm": {"placement": "sandwich"}}))
    assert a.losses == b.losses


def test_peri_with_input_norm_differs_from_sandwich():
    x = 3 + 2 * torch.randn(5, 8)
    assert not torch.allclose(build("peri")(x), build("sandwich")(x))


def test_same_seed_same_weights_whatever_the_norm():
    """Norms draw no random numbers, so every placement and kind starts from the same fc weights."""
    reference = build("post").blocks[2].branch.fc2.weight
    for placement in ("pre", "sandwich", "peri", "mixln", "none"):
        for kind in ALL_KINDS:
            assert torch.equal(build(placement, kind).blocks[2].branch.fc2.weight, reference)


def test_deepnorm_alpha_multiplies_the_residual():
    block = build("deepnorm").blocks[0]
    alpha, _ = deepnorm_constants(4, NormConfig(placement="deepnorm"))  # 4 blocks: 4 residual sublayers
    assert block.alpha == alpha == pytest.approx(4 ** 0.25)
    x = torch.randn(5, 8)
    assert torch.equal(block(x), block.norm(alpha * x + block.branch(x)))
    # not on the branch: Norm(x + alpha F(x)) is a different function
    assert not torch.allclose(block(x), block.norm(x + alpha * block.branch(x)), atol=1e-3)


def test_deepnorm_beta_scales_fc_weights_at_init():
    _, beta = deepnorm_constants(4, NormConfig(placement="deepnorm"))
    assert beta == pytest.approx(16 ** -0.25)
    plain, deep = build("post"), build("deepnorm")
    assert torch.allclose(deep.blocks[1].branch.fc1.weight, beta * plain.blocks[1].branch.fc1.weight)
    assert torch.equal(deep.head.weight, plain.head.weight)  # the head is not scaled


def test_deepnorm_overrides():
    net = build("deepnorm", deepnorm_alpha=2.0, deepnorm_beta=1.0)
    assert net.blocks[0].alpha == 2.0
    assert torch.equal(net.blocks[0].branch.fc1.weight, build("post").blocks[0].branch.fc1.weight)


def test_mixln_is_post_then_pre():
    assert block_placements(8, NormConfig(placement="mixln")) == ["post"] * 2 + ["pre"] * 6
    assert block_placements(8, NormConfig(placement="mixln", mixln_fraction=0.5)) == ["post"] * 4 + ["pre"] * 4
    net = build("mixln", model=ModelConfig(depth=8, width=8))
    x = torch.randn(3, 8)
    h = x
    for i, block in enumerate(net.blocks):
        ffn, norm = block.branch, block.norm
        h = norm(h + ffn(h)) if i < 2 else h + ffn(norm(h))
    assert torch.equal(net(x), net.head(net.final_norm(h)))


def test_placement_forward_definitions():
    x = torch.randn(6, 8)
    for placement, expected in {
        "post": lambda b, x: b.norm(x + b.branch(x)),
        "pre": lambda b, x: x + b.branch(b.norm(x)),
        "sandwich": lambda b, x: x + b.norm_out(b.branch(b.norm(x))),
        "none": lambda b, x: x + b.branch(x),
    }.items():
        block = build(placement).blocks[0]
        assert torch.equal(block(x), expected(block, x)), placement
    assert build("none").blocks[0].norm is None


def test_final_norm_off():
    net = Net(ModelConfig(depth=2, width=8, final_norm=False), NormConfig(placement="post"))
    assert isinstance(net.final_norm, torch.nn.Identity)


@pytest.mark.parametrize("init", ["xavier_uniform", "xavier_normal", "torch_default"])
def test_inits(init):
    torch.manual_seed(0)
    net = Net(ModelConfig(depth=2, width=64, init=init), NormConfig())
    w, b = net.blocks[0].branch.fc1.weight, net.blocks[0].branch.fc1.bias
    xavier_std = math.sqrt(2 / (64 + 256))
    if init == "torch_default":
        assert b.abs().sum() > 0  # nn.Linear's own init draws biases
        assert w.std().item() == pytest.approx(1 / math.sqrt(3 * 64), rel=0.05)
    else:
        assert torch.count_nonzero(b) == 0
        assert w.std().item() == pytest.approx(xavier_std, rel=0.05)


def test_rmsnorm_variants_agree_in_float32():
    torch.manual_seed(1)
    x = torch.randn(16, 64) * 3 + 0.5
    cfg = NormConfig(eps=1e-5)
    outputs = {k: make_norm(64, cfg.model_copy(update={"kind": k}))(x)
               for k in ("rmsnorm", "rmsnorm_torch", "rmsnorm_llama", "rmsnorm_gemma")}
    for kind, y in outputs.items():
        torch.testing.assert_close(y, outputs["rmsnorm"], rtol=1e-6, atol=1e-6, msg=kind)
    partial = make_norm(64, cfg.model_copy(update={"kind": "prmsnorm", "prms_fraction": 1.0}))(x)
    torch.testing.assert_close(partial, outputs["rmsnorm"], rtol=1e-4, atol=1e-4)


def test_rmsnorm_matches_the_formula():
    x = torch.tensor([[3.0, 4.0]])
    y = make_norm(2, NormConfig(kind="rmsnorm", eps=0.0001))(x)
    rms = math.sqrt((9 + 16) / 2 + 0.0001)
    torch.testing.assert_close(y, torch.tensor([[3 / rms, 4 / rms]]))


def test_prmsnorm_uses_the_first_k_features_and_eps_outside_sqrt():
    norm = make_norm(32, NormConfig(kind="prmsnorm", prms_fraction=0.0625, eps=0.5))
    assert norm.k == 2
    x = torch.ones(1, 32)
    x[0, :2] = 2.0  # the RMS is estimated from these two alone: 2
    torch.testing.assert_close(norm(x), x / (2.0 + 0.5))


def test_scalenorm():
    norm = make_norm(4, NormConfig(kind="scalenorm"))
    assert norm.g.item() == pytest.approx(2.0)  # sqrt(d)
    x = torch.tensor([[1.0, 2.0, 2.0, 4.0]])  # ||x|| = 5
    torch.testing.assert_close(norm(x), 2.0 * x / 5.0)


def test_gemma_weight_starts_at_zero_and_acts_as_one_plus_weight():
    norm = make_norm(8, NormConfig(kind="rmsnorm_gemma"))
    assert torch.count_nonzero(norm.weight) == 0
    llama = make_norm(8, NormConfig(kind="rmsnorm_llama"))
    with torch.no_grad():
        norm.weight.fill_(0.5)
        llama.weight.fill_(1.5)
    x = torch.randn(4, 8)
    torch.testing.assert_close(norm(x), llama(x))


def test_llama_upcast_survives_fp16_overflow():
    x = torch.full((1, 16), 300.0, dtype=torch.float16)
    assert torch.all(make_norm(16, NormConfig(kind="rmsnorm_llama")).half()(x) == 1.0)


def test_layernorm_uses_eps():
    norm = make_norm(8, NormConfig(kind="layernorm", eps=0.01))
    assert isinstance(norm, torch.nn.LayerNorm) and norm.eps == 0.01


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_every_placement_and_kind_trains_a_few_steps(placement, kind):
    cfg = RunConfig.model_validate({"model": {"depth": 3, "width": 8}, "train": {"steps": 3},
                                    "norm": {"placement": placement, "kind": kind}})
    result = train_run(cfg)
    assert len(result.losses) == 4 and all(math.isfinite(v) for v in result.losses)
    assert result.metrics["grad_norm"][0] > 0


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd", "radam"])
@pytest.mark.parametrize("schedule", ["constant", "linear_warmup", "inverse_sqrt", "cosine"])
def test_every_optimizer_and_schedule_runs(name, schedule):
    cfg = RunConfig.model_validate({
        "model": {"depth": 2, "width": 8}, "train": {"steps": 4}, "optim": {"name": name, "lr": 0.01},
        "schedule": {"kind": schedule, "warmup_steps": 0 if schedule == "constant" else 2},
    })
    result = train_run(cfg)
    expected_lr = [0.01 * (0.5 if schedule != "constant" else 1.0), 0.01]
    assert result.metrics["lr"][:2] == pytest.approx(expected_lr)
    assert result.losses[-1] != result.losses[0]


def test_block_extra_repr_names_the_placement():
    assert "placement='pre'" in repr(build("pre").blocks[0])
    assert isinstance(build("pre").blocks[0], Block)
