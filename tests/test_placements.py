"""The placements and norm kinds of 2020-2025: ReZero, res-post-norm, ResiDual, Admin, DyT and Derf.

Each formula is checked on a hand-built input against the paper's equation, and each new module is
checked to draw no random numbers at init (the seed's other weights keep their bits)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from normexp.config import ModelConfig, NormConfig, RunConfig
from normexp.engines.common import seeded_init
from normexp.models.ffn import Net
from normexp.models.norms import Derf, DyT, make_norm
from normexp.registry import KINDS, placements_for

ALL_KINDS = list(KINDS)  # normexp/registry.py
SMALL = ModelConfig(depth=4, width=8)


def build(placement: str, kind: str = "layernorm", seed: int = 0, model: ModelConfig = SMALL, **norm) -> Net:
    torch.manual_seed(seed)
    return Net(model, NormConfig(placement=placement, kind=kind, **norm))


def inputs(seed: int = 1, n: int = 5, d: int = 8) -> torch.Tensor:
    return 2 * torch.randn(n, d, generator=torch.Generator().manual_seed(seed)) + 0.5


def test_rezero_is_the_identity_at_init_and_scales_the_branch_by_its_scalar():
    net = build("rezero")
    x = inputs()
    for block in net.blocks:
        assert block.norm is None and block.gate.weight.shape == () and block.gate.weight.item() == 0.0
        assert torch.equal(block(x), x)
    block = net.blocks[1]
    with torch.no_grad():
        block.gate.weight.fill_(0.3)
    assert torch.equal(block(x), x + 0.3 * block.branch(x))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_respost_with_zero_init_is_the_identity_for_every_kind(kind):
    net = build("respost", kind, output_norm_init="zeros")
    x = inputs()
    for block in net.blocks:
        assert torch.equal(block(x), x)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_respost_normalises_the_branch_only(kind):
    block = build("respost", kind).blocks[2]
    x = inputs()
    fresh = make_norm(8, NormConfig(kind=kind))  # ones: the norm's own init (OLMo 2)
    assert torch.equal(block(x), x + fresh(block.branch(x)))
    assert not torch.allclose(block(x), block.norm(x + block.branch(x)), atol=1e-3)  # not Post-LN


def test_resdual_output_is_the_two_stream_formula():
    net = build("resdual", "rmsnorm")
    x = inputs()
    x_a, x_d = x, x  # both streams start at the input (Xie et al.'s `res = x`)
    for block in net.blocks:
        f = block.branch(x_a)
        x_a, x_d = block.norm(x_a + f), x_d + f
    expected = net.head(x_a + net.dual_norm(x_d))  # no final norm after the dual stream's
    assert isinstance(net.final_norm, torch.nn.Identity)
    assert torch.equal(net(x), expected)
    # x_d sums the raw branch outputs: the same as summing F_j(x_a^j) from the Post-LN stream
    assert net.dual_norm is not None and build("post").dual_norm is None


def test_admin_omega_after_profiling_matches_the_variance_sum_by_hand():
    cfg = RunConfig.model_validate({"norm": {"placement": "admin", "kind": "rmsnorm", "admin_profile": "closed_form"},
                                    "model": {"depth": 5, "width": 8}, "seed": 3})
    net, task = seeded_init(cfg)
    # normexp's earlier closed form (the default, the measured profile: test_fidelity.py);
    # by hand: a Post-LN forward (w = 1) records Var[F_j] over every entry of block j's branch output
    h, variances = task.x, []
    with torch.no_grad():
        for block in net.blocks:
            f = block.branch(h)
            variances.append(float(((f - f.mean()) ** 2).sum() / (f.numel() - 1)))
            h = block.norm(h + f)
    for i, block in enumerate(net.blocks):
        expected = math.sqrt(1 + sum(variances[:i]))
        assert block.omega.weight.shape == (8,)
        assert torch.allclose(block.omega.weight, torch.full((8,), expected), rtol=1e-5), i
    assert torch.equal(net.blocks[0].omega.weight, torch.ones(8))
    x = inputs()
    block = net.blocks[3]
    assert torch.equal(block(x), block.norm(block.omega.weight * x + block.branch(x)))


def test_admin_profiling_draws_nothing_and_leaves_the_seed_weights():
    cfg = RunConfig.model_validate({"norm": {"placement": "admin"}, "model": {"depth": 4, "width": 8}, "seed": 7})
    post = cfg.model_copy(update={"norm": NormConfig(placement="post")})
    admin_net, admin_task = seeded_init(cfg)
    after = torch.rand(3)  # the generator's state after init
    post_net, post_task = seeded_init(post)
    assert torch.equal(after, torch.rand(3))
    assert torch.equal(admin_task.x, post_task.x) and torch.equal(admin_task.y, post_task.y)
    for a, b in zip(admin_net.blocks, post_net.blocks):
        assert torch.equal(a.branch.fc1.weight, b.branch.fc1.weight)
        assert torch.equal(a.branch.fc2.weight, b.branch.fc2.weight)
    assert torch.equal(admin_net.head.weight, post_net.head.weight)


@pytest.mark.parametrize("placement", [p for p in placements_for("ffn") if p != "deepnorm"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_new_placements_and_kinds_keep_the_seed_weights(placement, kind):
    """Same seed, same fc and head weights, and the generator ends where it ends for Pre-LN: no
    placement or kind draws a random number. (DeepNorm rescales its fc weights by design.)"""
    reference, after_reference = build("pre"), torch.rand(4)
    net, after = build(placement, kind), torch.rand(4)
    assert torch.equal(net.blocks[2].branch.fc2.weight, reference.blocks[2].branch.fc2.weight)
    assert torch.equal(net.head.weight, reference.head.weight)
    assert torch.equal(after, after_reference)


@settings(max_examples=30, deadline=None)
@given(alpha=st.floats(0.05, 3.0), scale=st.floats(0.1, 4.0), seed=st.integers(0, 2**16))
def test_dyt_value_and_gradients_follow_the_formula(alpha, scale, seed):
    x = scale * torch.randn(4, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    norm = DyT(6, alpha).double()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 6))
        norm.bias.copy_(torch.linspace(-0.2, 0.3, 6))
    x.requires_grad_(True)
    y = norm(x)
    a = norm.alpha.detach()  # alpha as the module holds it: made in float32, then widened by .double()
    assert a.item() == pytest.approx(alpha, rel=1e-7)
    t = torch.tanh(a * x.detach())
    assert torch.allclose(y, norm.weight.detach() * t + norm.bias.detach())
    y.sum().backward()
    sech2 = 1 - t ** 2  # d tanh(u)/du
    w = norm.weight.detach()
    assert torch.allclose(x.grad, w * sech2 * a)
    assert torch.allclose(norm.alpha.grad, (w * sech2 * x.detach()).sum())
    assert torch.allclose(norm.weight.grad, t.sum(0))
    assert torch.allclose(norm.bias.grad, torch.full((6,), 4.0, dtype=torch.float64))


@settings(max_examples=30, deadline=None)
@given(alpha=st.floats(0.05, 3.0), shift=st.floats(-1.0, 1.0), seed=st.integers(0, 2**16))
def test_derf_value_and_gradients_follow_the_formula(alpha, shift, seed):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    norm = Derf(6).double()
    with torch.no_grad():
        norm.alpha.fill_(alpha)
        norm.shift.fill_(shift)
        norm.weight.copy_(torch.linspace(0.5, 1.5, 6))
    x.requires_grad_(True)
    y = norm(x)
    u = alpha * x.detach() + shift
    w = norm.weight.detach()
    assert torch.allclose(y, w * torch.erf(u) + norm.bias.detach())
    y.sum().backward()
    derf = 2 / math.sqrt(math.pi) * torch.exp(-u ** 2)  # d erf(u)/du
    assert torch.allclose(x.grad, w * derf * alpha)
    assert torch.allclose(norm.alpha.grad, (w * derf * x.detach()).sum())
    assert torch.allclose(norm.shift.grad, (w * derf).sum())
    assert torch.allclose(norm.weight.grad, torch.erf(u).sum(0))


def test_dyt_and_derf_initial_values():
    dyt = make_norm(8, NormConfig(kind="dyt"))
    assert dyt.alpha.item() == 0.5 and torch.equal(dyt.weight, torch.ones(8)) and torch.equal(dyt.bias, torch.zeros(8))
    assert make_norm(8, NormConfig(kind="dyt", dyt_alpha0=2.0)).alpha.item() == 2.0
    derf = make_norm(8, NormConfig(kind="derf"))
    assert (derf.alpha.item(), derf.shift.item()) == (0.5, 0.0)
    x = inputs()
    assert torch.equal(dyt(x), torch.tanh(0.5 * x))
    assert torch.equal(derf(x), torch.erf(0.5 * x))


@pytest.mark.parametrize("line,expected", [
    ("norm: {kind: dyt, dyt_alpha0: 0}", "base.norm.dyt_alpha0: must be > 0"),
    ("norm: {kind: dyt, dyt_alpha0: -0.5}", "base.norm.dyt_alpha0: must be > 0"),
    ("norm: {kind: dyt, dyt_alpha0: .inf}", "base.norm.dyt_alpha0: must be a finite number"),
    ("norm: {kind: dyt, dyt_alpha0: .nan}", "base.norm.dyt_alpha0: must be a finite number"),
    ("norm: {placement: respost, output_norm_init: one}", "base.norm.output_norm_init: must be one of"),
    ("norm: {placement: rezro}", "did you mean 'rezero'"),
])
def test_bad_placement_keys_exit_2_naming_the_key(write_yaml, tmp_path, line, expected):
    from typer.testing import CliRunner

    from normexp.cli import app

    path = write_yaml(f"name: bad\nbase:\n  {line}\n")
    out = tmp_path / "out"
    for args in (["validate", str(path)], ["sweep", str(path), "--out", str(out)]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and expected in result.output, (args, result.output)
        assert "Traceback" not in result.output and not out.exists()


@pytest.mark.parametrize("placement", placements_for("ffn"))
def test_gradnorm_at_init_reads_every_placement(placement):
    """ResiDual's blocks take the pair of streams: the gradnorm diagnostic follows x_a."""
    from normexp.diagnostics import gradnorm_at_init

    cfg = RunConfig.model_validate({"norm": {"placement": placement}, "model": {"depth": 3, "width": 8}})
    rows = gradnorm_at_init(cfg)
    assert [r["block"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["stream_sq"]) and r["fc2_grad"] >= 0 for r in rows)
