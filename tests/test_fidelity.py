"""Each placement against its authors' definition, transcribed here from their code (docs/sources.md).

The transcriptions below are written from the authors' repositories, not from normexp's modules: plain
functions of a dict of float64 tensors (F.layer_norm, an explicit causal attention, an explicit FFN).
normexp's models contribute only their random draws, read from a Post-LN model of the same seed (every
placement draws the same weights: SPEC §1), which each transcription then transforms as its authors
do at init (B2T's rescaling_init, DeepNet's beta, Admin's profiling...). Each test compares:

- the outputs at init: normexp's model, cast to float64, against the transcription (to 1e-6, or 1e-5
  where normexp profiles in float32);
- the losses over 3 Adam steps: normexp's model in float64 against the transcription, both trained by
  torch.optim.Adam in float64 (to 1e-6), and the reference engine's float32 losses (within 2e-4 over
  the first two updates);
- and normexp's earlier reading (the named key that keeps it), which must miss the authors' losses by
  more than that: so each test fails on the definition it replaced.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from normexp.config import NormConfig, RunConfig, sequence_shape, validate_run
from normexp.engines.common import seeded_init
from normexp.engines.reference import train_run
from normexp.folder.ids import REVISED_DEFINITIONS
from normexp.models.norms import DyT, make_norm

STEPS = 3
LOSS_TOL = 2e-4
EPS = 1e-5
Params = dict[str, torch.Tensor]


def config(arch: str, placement: str, depth: int = 4, **norm: object) -> RunConfig:
    if arch == "ffn":
        return validate_run({"model": {"depth": depth, "width": 8}, "norm": {"placement": placement, **norm},
                             "data": {"n_samples": 16}, "train": {"steps": STEPS}, "seed": 3})
    return validate_run({"model": {"arch": "transformer", "depth": depth, "width": 8, "n_heads": 2},
                         "norm": {"placement": placement, **norm},
                         "data": {"task": "copy", "n_samples": 16, "n_val": 8}, "train": {"steps": STEPS},
                         "seed": 3})


# ----------------------------------------------------------------------------- the draws, as plain tensors


def raw_draws(cfg: RunConfig) -> tuple[Params, object]:
    """The run's random draws (a Post-LN model of the same seed: every placement draws alike) as float64
    tensors under the authors' names, and the task."""
    post = cfg.model_copy(update={"norm": NormConfig(placement="post")})
    model, task = seeded_init(post)
    p: Params = {}
    if cfg.model.arch == "ffn":
        for i, block in enumerate(model.blocks):
            for name in ("fc1", "fc2"):
                p[f"{i}.{name}.weight"] = getattr(block.branch, name).weight
                p[f"{i}.{name}.bias"] = getattr(block.branch, name).bias
    else:
        p["embed_tokens"], p["embed_positions"] = model.token.weight, model.position.weight
        for i, layer in enumerate(model.layers):
            for name in ("q", "k", "v", "out"):
                p[f"{i}.self_attn.{name}_proj.weight"] = getattr(layer.attn.branch, name).weight
                p[f"{i}.self_attn.{name}_proj.bias"] = getattr(layer.attn.branch, name).bias
            for name in ("fc1", "fc2"):
                p[f"{i}.{name}.weight"] = getattr(layer.ffn.branch, name).weight
                p[f"{i}.{name}.bias"] = getattr(layer.ffn.branch, name).bias
    p["head.weight"], p["head.bias"] = model.head.weight, model.head.bias
    return {k: v.detach().double().clone() for k, v in p.items()}, task


def add_norm(p: Params, name: str, d: int = 8) -> None:
    p[f"{name}.weight"], p[f"{name}.bias"] = torch.ones(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)


def ln(p: Params, name: str, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], p[f"{name}.weight"], p[f"{name}.bias"], EPS)


def ffn(p: Params, i: int, x: torch.Tensor) -> torch.Tensor:
    hidden = F.relu(F.linear(x, p[f"{i}.fc1.weight"], p[f"{i}.fc1.bias"]))
    return F.linear(hidden, p[f"{i}.fc2.weight"], p[f"{i}.fc2.bias"])


def self_attn(p: Params, i: int, x: torch.Tensor, heads: int = 2) -> torch.Tensor:
    n, t, d = x.shape
    proj = {w: F.linear(x, p[f"{i}.self_attn.{w}_proj.weight"], p[f"{i}.self_attn.{w}_proj.bias"])
            for w in "qkv"}
    q, k, v = (proj[w].view(n, t, heads, d // heads).transpose(1, 2) for w in "qkv")
    mask = torch.full((t, t), float("-inf"), dtype=x.dtype).triu(1)
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // heads) + mask, dim=-1)
    mixed = (weights @ v).transpose(1, 2).reshape(n, t, d)
    return F.linear(mixed, p[f"{i}.self_attn.out_proj.weight"], p[f"{i}.self_attn.out_proj.bias"])


def embed(p: Params, tokens: torch.Tensor) -> torch.Tensor:
    return p["embed_tokens"][tokens] + p["embed_positions"][torch.arange(tokens.shape[-1])]


def sublayer_branches(cfg: RunConfig) -> list[Callable[[Params, torch.Tensor], torch.Tensor]]:
    """The residual sublayers in order: the FFN toy's blocks, or each layer's attention then FFN."""
    depth = cfg.model.depth
    if cfg.model.arch == "ffn":
        return [lambda p, x, i=i: ffn(p, i, x) for i in range(depth)]
    return [f for i in range(depth) for f in (lambda p, x, i=i: self_attn(p, i, x), lambda p, x, i=i: ffn(p, i, x))]


def head(p: Params, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, p["head.weight"], p["head.bias"])


def loss_of(cfg: RunConfig, task, logits: torch.Tensor) -> torch.Tensor:
    if cfg.model.arch == "ffn":
        return F.cross_entropy(logits, task.y)
    return F.cross_entropy(logits[:, task.positions].flatten(0, 1), task.y.flatten())


def inputs(cfg: RunConfig, p: Params, task) -> torch.Tensor:
    return task.x.double() if cfg.model.arch == "ffn" else embed(p, task.x)


Forward = Callable[[Params, torch.Tensor], torch.Tensor]


def adam_losses(cfg: RunConfig, p: Params, task, forward: Forward) -> list[float]:
    """The transcription trained as normexp trains: full batch, torch's Adam with the run's settings."""
    params = {k: v.clone().requires_grad_(True) for k, v in p.items()}
    optim = torch.optim.Adam(params.values(), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps)
    losses = []
    for step in range(STEPS + 1):
        loss = loss_of(cfg, task, forward(params, inputs(cfg, params, task)))
        losses.append(loss.item())
        if step < STEPS:
            optim.zero_grad()
            loss.backward()
            optim.step()
    return losses


def normexp_losses64(cfg: RunConfig) -> list[float]:
    """normexp's own model (its modules, as seeded_init builds and profiles it), cast to float64 and
    trained by the same Adam loop as the transcription."""
    model, task = seeded_init(cfg)
    model = model.double()
    x = task.x.double() if cfg.model.arch == "ffn" else task.x
    optim = torch.optim.Adam(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps)
    losses = []
    for step in range(STEPS + 1):
        loss = loss_of(cfg, task, model(x))
        losses.append(loss.item())
        if step < STEPS:
            optim.zero_grad()
            loss.backward()
            optim.step()
    return losses


def normexp_logits(cfg: RunConfig) -> torch.Tensor:
    model, task = seeded_init(cfg)
    with torch.no_grad():
        return model.double()(task.x.double() if cfg.model.arch == "ffn" else task.x)


def check(cfg: RunConfig, p: Params, task, forward, earlier: RunConfig, init_atol: float = 1e-6) -> None:
    """normexp (default keys) against the transcription: outputs at init; losses over STEPS Adam steps
    in float64 (to 1e-6: the definition); the reference engine's float32 losses within LOSS_TOL over the
    first two updates (later steps of the most sensitive runs drift from float64 by float32 rounding
    alone); and the earlier reading, which must miss the authors' float64 losses by more than LOSS_TOL."""
    with torch.no_grad():
        authors = forward(p, inputs(cfg, p, task))
    assert torch.allclose(normexp_logits(cfg), authors, atol=init_atol, rtol=0), "outputs at init"
    expected = adam_losses(cfg, p, task, forward)
    got = normexp_losses64(cfg)
    assert got == pytest.approx(expected, abs=1e-6, rel=0), (got, expected)
    engine = train_run(cfg).losses
    assert engine[:3] == pytest.approx(expected[:3], abs=LOSS_TOL, rel=0), (engine, expected)
    before = normexp_losses64(earlier)
    assert max(abs(a - b) for a, b in zip(before, expected)) > LOSS_TOL, ("the earlier reading passes too", before)


def with_keys(cfg: RunConfig, **norm: object) -> RunConfig:
    return validate_run({**cfg.model_dump(mode="json"), "norm": {**cfg.norm.model_dump(mode="json"), **norm}})


# ----------------------------------------------------------------------------- B2T (Takase et al. 2023)


def test_b2t_matches_the_authors_layer_with_its_rescaling_init() -> None:
    """takase/b2t_connection fairseq/modules/transformer_layer.py: Post-LN layer plus residual_bottom
    added before final_layer_norm; `rescaling_init(self, args.decoder_layers)` multiplies every
    parameter named *weight* but the layer norms' (q, k, v, out_proj, fc1, fc2) by layers^-0.5."""
    cfg = config("transformer", "b2t", depth=3)
    p, task = raw_draws(cfg)
    depth = cfg.model.depth
    for name in list(p):
        if name[0].isdigit() and name.endswith("weight"):
            p[name] = p[name] * depth ** -0.5
    for i in range(depth):
        add_norm(p, f"{i}.self_attn_layer_norm")
        add_norm(p, f"{i}.final_layer_norm")
    add_norm(p, "final")

    def forward(q: Params, x: torch.Tensor) -> torch.Tensor:
        for i in range(depth):
            bottom = x
            x = ln(q, f"{i}.self_attn_layer_norm", x + self_attn(q, i, x))
            x = ln(q, f"{i}.final_layer_norm", x + ffn(q, i, x) + bottom)
        return head(q, ln(q, "final", x))  # normexp's model.final_norm, not B2T's

    check(cfg, p, task, forward, with_keys(cfg, b2t_rescale=False), init_atol=1e-6)  # normexp scales in float32


# ----------------------------------------------------------------------------- ResiDual (Xie et al. 2023)


@pytest.mark.parametrize("arch", typing.get_args(typing.Literal["ffn", "transformer"]))
def test_resdual_matches_the_authors_dual_stream(arch: str) -> None:
    """microsoft/ResiDual resi_dual/resi_dual.py: `res = x * res_input_norm_scale` (1.0) from the
    embedding, each sublayer adds its raw output to res and Post-LNs x; the output is
    `x * alpha + self.layer_norm(res)` (alpha 1.0), with no norm after it."""
    cfg = config(arch, "resdual", depth=3)
    p, task = raw_draws(cfg)
    branches = sublayer_branches(cfg)
    for j in range(len(branches)):
        add_norm(p, f"ln{j}")
    add_norm(p, "dual")

    def forward(q: Params, x: torch.Tensor) -> torch.Tensor:
        res = x
        for j, branch in enumerate(branches):
            out = branch(q, x)
            res = res + out
            x = ln(q, f"ln{j}", out + x)
        return head(q, x + ln(q, "dual", res))

    check(cfg, p, task, forward, with_keys(cfg, resdual_stream="zeros", resdual_final_norm=True))


def test_resdual_earlier_reading_is_the_two_keys() -> None:
    """resdual_stream zeros + resdual_final_norm: x_d from 0 and model.final_norm on top, as before."""
    cfg = with_keys(config("ffn", "resdual", depth=3), resdual_stream="zeros", resdual_final_norm=True)
    model, task = seeded_init(cfg)
    with torch.no_grad():
        x_a, x_d = task.x, torch.zeros_like(task.x)
        for block in model.blocks:
            f = block.branch(x_a)
            x_a, x_d = block.norm(x_a + f), x_d + f
        assert torch.equal(model(task.x), model.head(model.final_norm(x_a + model.dual_norm(x_d))))
    assert not isinstance(model.final_norm, torch.nn.Identity)


# ----------------------------------------------------------------------------- Admin (Liu et al. 2020)


@pytest.mark.parametrize("arch", ["ffn", "transformer"])
def test_admin_matches_transformer_clinics_profiling(arch: str) -> None:
    """LiyuanLucasLiu/Transformer-Clinic fairseq/fairseq/modules/transformer_layer.py, init_type
    adaptive-profiling: a global ratio starts at 1.0; at each sublayer, in order, its
    `ratio_change.data.fill_(ratio)`, then ratio = sqrt(np.var(residual * ratio_change) + np.var(F(x)))
    (numpy: population variance over every element), then x = LN(F(x) + residual * ratio_change)."""
    cfg = config(arch, "admin", depth=3)
    p, task = raw_draws(cfg)
    branches = sublayer_branches(cfg)
    for j in range(len(branches)):
        add_norm(p, f"ln{j}")
    add_norm(p, "final")
    with torch.no_grad():
        x, ratio = inputs(cfg, p, task), 1.0
        for j, branch in enumerate(branches):
            p[f"omega{j}"] = torch.full((8,), ratio, dtype=torch.float64)
            residual, out = x * p[f"omega{j}"], branch(p, x)
            ratio = math.sqrt(residual.flatten().numpy().var() + out.flatten().numpy().var())
            x = ln(p, f"ln{j}", out + residual)

    def forward(q: Params, x: torch.Tensor) -> torch.Tensor:
        for j, branch in enumerate(branches):
            x = ln(q, f"ln{j}", branch(q, x) + x * q[f"omega{j}"])
        return head(q, ln(q, "final", x))

    model, _ = seeded_init(cfg)  # normexp profiles in float32: omega to float32 rounding
    blocks = model.blocks if arch == "ffn" else model.sublayers
    for j, block in enumerate(blocks):
        assert torch.allclose(block.omega.weight.double(), p[f"omega{j}"], rtol=1e-5, atol=0), j
        # train from the same omegas: a run this sensitive (omega_2 = 0.03 on the Transformer's small
        # embeddings) turns float32's rounding of omega into 4e-5 of loss within 3 steps
        p[f"omega{j}"] = block.omega.weight.detach().double().clone()
    check(cfg, p, task, forward, with_keys(cfg, admin_profile="closed_form"), init_atol=1e-5)


# ----------------------------------------------------------------------------- ReZero (Bachlechner et al. 2020)


def test_rezero_transformer_shares_one_gate_per_layer() -> None:
    """majumderb/rezero rezero/transformer/rztx.py RZTXEncoderLayer: one `resweight` (zeros(1)) per
    layer, multiplying both the attention's and the FFN's output; no norm in the layer."""
    cfg = config("transformer", "rezero", depth=3)
    p, task = raw_draws(cfg)
    for i in range(cfg.model.depth):
        p[f"{i}.resweight"] = torch.zeros(1, dtype=torch.float64)
    add_norm(p, "final")

    def forward(q: Params, x: torch.Tensor) -> torch.Tensor:
        for i in range(cfg.model.depth):
            x = x + self_attn(q, i, x) * q[f"{i}.resweight"]
            x = x + ffn(q, i, x) * q[f"{i}.resweight"]
        return head(q, ln(q, "final", x))

    check(cfg, p, task, forward, with_keys(cfg, rezero_gate="sublayer"))
    model, _ = seeded_init(cfg)
    assert all(layer.attn.gate.weight is layer.ffn.gate.weight for layer in model.layers)
    assert sum(1 for name, _ in model.named_parameters() if "gate" in name) == cfg.model.depth


def test_rezero_gate_applies_to_the_transformer_only() -> None:
    with pytest.raises(Exception, match="norm.rezero_gate: applies to model.arch transformer only"):
        config("ffn", "rezero", rezero_gate="sublayer")


# ----------------------------------------------------------------------------- DeepNorm (Wang et al. 2022)


@pytest.mark.parametrize("depth", [2, 5, 32])
def test_deepnorm_ffn_default_is_one_sublayer_per_block(depth: int) -> None:
    """DeepNet: alpha = (2N)^(1/4), beta = (8N)^(-1/4) for N layers of 2 sublayers (microsoft/torchscale
    torchscale/architecture/decoder.py: alpha pow(2.0 * decoder_layers, 0.25), init_scale
    pow(8.0 * decoder_layers, 0.25)), i.e. M^(1/4), (4M)^(-1/4) for M residual sublayers. An FFN block is
    one: N blocks give N^(1/4) and (4N)^(-1/4); the default trains bit for bit as those set explicitly."""
    cfg = config("ffn", "deepnorm", depth=depth)
    model, _ = seeded_init(cfg)
    assert all(block.alpha == pytest.approx(depth ** 0.25, rel=1e-15) for block in model.blocks)
    post, _ = seeded_init(config("ffn", "post", depth=depth))
    ratio = model.blocks[0].branch.fc1.weight / post.blocks[0].branch.fc1.weight
    assert torch.allclose(ratio, torch.full_like(ratio, (4 * depth) ** -0.25), rtol=1e-6)
    explicit = with_keys(cfg, deepnorm_alpha=depth ** 0.25, deepnorm_beta=(4 * depth) ** -0.25)
    assert train_run(cfg).losses == train_run(explicit).losses
    earlier = with_keys(cfg, deepnorm_count="two_per_block")
    assert seeded_init(earlier)[0].blocks[0].alpha == pytest.approx((2 * depth) ** 0.25)


def test_deepnorm_ffn_matches_deepnet() -> None:
    cfg = config("ffn", "deepnorm", depth=4)
    p, task = raw_draws(cfg)
    n = cfg.model.depth
    alpha, beta = n ** 0.25, (4 * n) ** -0.25
    for name in list(p):
        if name[0].isdigit() and name.endswith("weight"):
            p[name] = p[name] * beta
    for i in range(n):
        add_norm(p, f"ln{i}")
    add_norm(p, "final")

    def forward(q: Params, x: torch.Tensor) -> torch.Tensor:
        for i in range(n):
            x = ln(q, f"ln{i}", x * alpha + ffn(q, i, x))  # torchscale: residual * alpha + x, then Post-LN
        return head(q, ln(q, "final", x))

    check(cfg, p, task, forward, with_keys(cfg, deepnorm_count="two_per_block"))


def test_deepnorm_transformer_keeps_torchscales_constants() -> None:
    cfg = config("transformer", "deepnorm", depth=3)
    model, _ = seeded_init(cfg)
    assert model.layers[0].attn.alpha == pytest.approx(6 ** 0.25)
    post, _ = seeded_init(config("transformer", "post", depth=3))
    v, v0 = model.layers[1].attn.branch.v.weight, post.layers[1].attn.branch.v.weight
    assert torch.allclose(v, v0 * 24 ** -0.25)
    assert torch.equal(model.layers[1].attn.branch.q.weight, post.layers[1].attn.branch.q.weight)
    with pytest.raises(Exception, match="norm.deepnorm_count: applies to model.arch ffn only"):
        config("transformer", "deepnorm", deepnorm_count="two_per_block")


# ----------------------------------------------------------------------------- Mix-LN (Li et al. 2024)


@pytest.mark.parametrize("arch", ["ffn", "transformer"])
def test_mixln_post_layers_are_floor_of_the_fraction(arch: str) -> None:
    """Mix-LN: the first floor(f * N) layers Post-LN, the rest Pre-LN ("3 of 12, 6 of 24" at f = 0.25).
    At N = 6, f = 0.25 banker's round(1.5) = 2 made two Post-LN layers; the authors' count is 1."""
    cfg = config(arch, "mixln", depth=6)
    p, task = raw_draws(cfg)
    branches = sublayer_branches(cfg)
    per_layer = 1 if arch == "ffn" else 2
    n_post = math.floor(0.25 * 6)
    for j in range(len(branches)):
        add_norm(p, f"ln{j}")
    add_norm(p, "final")

    def forward(q: Params, x: torch.Tensor) -> torch.Tensor:
        for j, branch in enumerate(branches):
            if j // per_layer < n_post:
                x = ln(q, f"ln{j}", x + branch(q, x))
            else:
                x = x + branch(q, ln(q, f"ln{j}", x))
        return head(q, ln(q, "final", x))

    earlier = with_keys(cfg, mixln_fraction=2 / 6)  # round(0.25 * 6) = 2 Post-LN layers, as before
    check(cfg, p, task, forward, earlier)


# ----------------------------------------------------------------------------- DyT and Derf


def test_dyt_alpha0_per_site_and_bias() -> None:
    """DyT's LLaMA runs set alpha0 per site (attention, FFN, final norm) and have no bias."""
    cfg = config("transformer", "pre", kind="dyt", dyt_alpha0_attn=0.8, dyt_alpha0_ffn=0.2,
                 dyt_alpha0_final=1.5, dyt_bias=False)
    model, _ = seeded_init(cfg)
    assert all(layer.attn.norm.alpha.item() == pytest.approx(0.8) for layer in model.layers)
    assert all(layer.ffn.norm.alpha.item() == pytest.approx(0.2) for layer in model.layers)
    assert model.final_norm.alpha.item() == pytest.approx(1.5)
    assert all(m.bias is None for m in model.modules() if isinstance(m, DyT))
    x = torch.randn(3, 8)
    norm = model.final_norm
    assert torch.equal(norm(x), norm.weight * torch.tanh(norm.alpha * x))
    ffn_toy, _ = seeded_init(config("ffn", "pre", kind="dyt", dyt_alpha0_ffn=0.2))
    assert ffn_toy.blocks[0].norm.alpha.item() == pytest.approx(0.2)
    assert ffn_toy.final_norm.alpha.item() == 0.5


def test_dyt_site_alpha_equal_to_dyt_alpha0_is_the_same_run() -> None:
    from normexp.folder import run_id

    plain = config("ffn", "pre", kind="dyt", dyt_alpha0=0.7)
    assert run_id(config("ffn", "pre", kind="dyt", dyt_alpha0=0.7, dyt_alpha0_ffn=0.7)) == run_id(plain)
    assert run_id(config("ffn", "pre", kind="dyt", dyt_alpha0_ffn=0.7)) != run_id(plain)


def test_derf_alpha0_key() -> None:
    norm = make_norm(8, NormConfig(kind="derf", derf_alpha0=1.25))
    assert norm.alpha.item() == 1.25 and norm.shift.item() == 0.0


def test_every_revised_placement_is_a_placement() -> None:
    from normexp.config import Placement

    assert set(REVISED_DEFINITIONS) <= set(typing.get_args(Placement))


def test_sequence_shape_is_what_the_transcriptions_read() -> None:
    cfg = config("transformer", "post", depth=3)
    _, task = raw_draws(cfg)
    assert task.x.shape[1] == sequence_shape(cfg.data).seq_len - 1


# ----------------------------------------------------------------------------- every engine


REVISED_CASES = [("transformer", "b2t", 3), ("ffn", "resdual", 3), ("transformer", "resdual", 3),
                 ("ffn", "admin", 3), ("transformer", "admin", 3), ("transformer", "rezero", 3),
                 ("ffn", "deepnorm", 4), ("ffn", "mixln", 6), ("transformer", "mixln", 6)]


def test_the_cases_cover_every_revised_placement() -> None:
    assert {placement for _, placement, _ in REVISED_CASES} == set(REVISED_DEFINITIONS)


@pytest.mark.parametrize(("arch", "placement", "depth"), REVISED_CASES)
def test_every_engine_trains_the_revised_definition(arch: str, placement: str, depth: int) -> None:
    """The batched engine (FFN toy) bit for bit as the reference, the fast engine within its contract,
    both from the model's own modules: the authors' definition reaches every engine."""
    from normexp.engines.batched import train_batch
    from normexp.engines.fast import train_fast

    seeds = [config(arch, placement, depth).model_copy(update={"seed": s}) for s in (3, 4)]
    reference = [train_run(cfg).losses for cfg in seeds]
    if arch == "ffn":
        assert [r.losses for r in train_batch(seeds)] == reference
    for result, want in zip(train_fast(seeds, compile=False), reference):
        assert result.losses == pytest.approx(want, rel=2e-4, abs=2e-4)


# ----------------------------------------------------------------------------- runs of the earlier definition

EARLIER_SWEEP = """\
name: earlier
base: {model: {depth: 4, width: 8}, data: {n_samples: 16}, train: {steps: 3, threads: 1}}
grid: {norm.placement: [deepnorm, pre]}
"""


def _cli(*args: object):
    from typer.testing import CliRunner

    from normexp.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture
def earlier_folder(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A sweep trained before DeepNorm's FFN revision: its deepnorm run sits under its earlier id."""
    from normexp.folder import ids

    (tmp_path / "sweep.yaml").write_text(EARLIER_SWEEP)
    with monkeypatch.context() as patch:  # the earlier release: no revision in the hashed view
        patch.setattr(ids, "revised_definition", lambda cfg: None)
        result = _cli("sweep", tmp_path / "sweep.yaml", "--out", tmp_path / "out", "-q")
        assert result.exit_code == 0, result.output
    return tmp_path / "sweep.yaml", tmp_path / "out"


def test_verify_and_report_name_runs_of_the_earlier_definition(earlier_folder) -> None:
    from normexp.config import load_sweep
    from normexp.folder import inspect_run, run_id
    from normexp.folder.ids import earlier_run_id

    config_file, out = earlier_folder
    deepnorm = next(cfg for cfg in load_sweep(config_file).runs if cfg.norm.placement == "deepnorm")
    old = out / earlier_run_id(deepnorm)
    assert old.is_dir() and not (out / run_id(deepnorm)).exists()
    state = inspect_run(old, thorough=True)
    assert state.kind == "superseded" and not state.finished
    assert "trained under normexp's earlier definition of deepnorm" in state.problem

    from normexp.verify import verify_sweep

    assert _cli("verify", out).exit_code == 1
    found = {f.path: f for f in verify_sweep(out).findings}
    assert "trained under normexp's earlier definition of deepnorm" in found[old.name].problem
    assert found[old.name].severity == "problem" and "corrupt" not in found[old.name].problem
    fixed = verify_sweep(out, fix=True)
    assert old.is_dir() and fixed.verified == 1 and not fixed.clean  # kept, never counted as this sweep's run
    assert _cli("verify", out, "--fix").exit_code == 1 and old.is_dir()
    summary = (out / "summary.csv").read_text()
    assert run_id(deepnorm) in summary and "superseded" in summary

    report = _cli("report", out)
    assert "trained under normexp's earlier definition of deepnorm" in " ".join(report.output.split())

    rerun = _cli("sweep", config_file, "--out", out, "-q")  # retrains it under its new id
    assert rerun.exit_code == 0, rerun.output
    assert inspect_run(out / run_id(deepnorm), deepnorm).finished and old.is_dir()
    after = verify_sweep(out)
    assert after.clean and after.verified == 2
    assert [f.severity for f in after.findings if f.path == old.name] == ["note"]  # left in place


def test_resdual_without_its_final_norm_is_one_run_whatever_model_final_norm_says() -> None:
    """ResiDual ends with x_a + Norm_d(x_d): model.final_norm changes nothing unless resdual_final_norm."""
    from normexp.folder import run_id

    on, off = config("ffn", "resdual"), with_keys(config("ffn", "resdual"), resdual_final_norm=False)
    off = validate_run({**off.model_dump(mode="json"), "model": {**off.model.model_dump(mode="json"),
                                                                 "final_norm": False}})
    assert off == on and run_id(off) == run_id(on)
    kept = with_keys(config("ffn", "resdual"), resdual_final_norm=True)
    no_final = validate_run({**kept.model_dump(mode="json"), "model": {**kept.model.model_dump(mode="json"),
                                                                       "final_norm": False}})
    assert run_id(no_final) != run_id(kept)
