"""Defaults resolve per run: for any sweep, each expanded run is its values written into the base and
resolved alone (a default that depends on another key, such as AdamW's weight decay, follows the run's
own value of that key, whether it comes from the base, the grid or --set). A key that acts only under
some optimizers or schedule kinds is inert elsewhere: one run, and a grid over it refused."""

from __future__ import annotations

import copy
import itertools
from typing import Any, get_args

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from normexp.config import (
    ACTS_ONLY_UNDER,
    ACTS_ONLY_UNDER_BY_SECTION,
    ARCH_ONLY,
    ConfigError,
    NormConfig,
    NormKind,
    Placement,
    RunConfig,
    build_sweep,
    inert_keys,
    parse_yaml,
    run_keys,
    validate_run,
)
from normexp.folder import run_id


def _floats(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_nan=False, allow_infinity=False)


def _optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), strategy)


# Values of each run key: mostly valid, some out of range or of the wrong type (the sweep must then be
# refused exactly when some run alone is refused).
VALUES: dict[str, st.SearchStrategy[Any]] = {
    "model.depth": st.integers(0, 12),
    "model.width": st.integers(1, 16),
    "model.hidden_mult": st.integers(1, 4),
    "model.n_classes": st.integers(1, 100),
    "model.final_norm": st.booleans(),
    "model.init": st.sampled_from(["xavier_uniform", "xavier_normal", "torch_default", "tfixup", "fixup", "gpt2"]),
    "model.arch": st.sampled_from(["ffn", "transformer", "rnn"]),
    "model.n_heads": st.integers(0, 5),
    "model.qk_norm": st.booleans(),
    "model.qk_norm_scope": st.sampled_from(["head", "full", "all"]),
    "model.qk_norm_eps": _optional(_floats(-1e-6, 1e-4)),
    "model.activation": st.sampled_from(["relu", "gelu", "tanh"]),
    "model.bias": st.booleans(),
    "model.tie_embeddings": st.booleans(),
    "norm.placement": st.sampled_from([*get_args(Placement), "skipinit"]),  # skipinit: rezero's alias
    "norm.kind": st.sampled_from(get_args(NormKind)),
    "norm.eps": _floats(1e-8, 1e-2),
    "norm.peri_input_norm": st.booleans(),
    "norm.mixln_fraction": _floats(0, 1),
    "norm.deepnorm_alpha": _optional(_floats(0.1, 10)),
    "norm.deepnorm_beta": _optional(_floats(0.1, 10)),
    "norm.prms_fraction": _floats(0.01, 1),
    "norm.dyt_alpha0": _floats(-0.5, 2),
    "norm.output_norm_init": st.sampled_from(["ones", "zeros", "twos"]),
    "norm.deepnorm_count": st.sampled_from(["sublayers", "two_per_block", "three"]),
    "norm.dyt_alpha0_attn": _optional(_floats(-0.5, 2)),
    "norm.dyt_alpha0_ffn": _optional(_floats(-0.5, 2)),
    "norm.dyt_alpha0_final": _optional(_floats(-0.5, 2)),
    "norm.dyt_bias": st.booleans(),
    "norm.derf_alpha0": _floats(-0.5, 2),
    "norm.b2t_rescale": st.booleans(),
    "norm.resdual_stream": st.sampled_from(["input", "zeros", "ones"]),
    "norm.resdual_final_norm": st.booleans(),
    "norm.admin_profile": st.sampled_from(["measured", "closed_form", "guess"]),
    "norm.rezero_gate": st.sampled_from(["layer", "sublayer", "block"]),
    "data.task": st.sampled_from(["random_labels", "assoc_recall", "copy", "modular_add", "shakespeare_char", "sort"]),
    "data.vocab": st.integers(1, 40),
    "data.seq_len": _optional(st.integers(1, 20)),
    "data.n_val": st.integers(0, 64),
    "data.batch_size": _optional(st.integers(0, 80)),
    "data.n_samples": st.integers(1, 128),
    "optim.name": st.sampled_from(["adam", "adamw", "sgd", "radam"]),
    "optim.lr": st.one_of(_floats(1e-5, 10), st.integers(1, 3)),
    "optim.betas": st.tuples(_floats(0, 1), _floats(0, 1)).map(list),
    "optim.eps": _floats(1e-10, 1e-6),
    "optim.weight_decay": _optional(_floats(0, 0.5)),
    "optim.momentum": _floats(0, 1),
    "optim.clip_norm": _optional(_floats(-0.1, 2)),
    "optim.agc": _optional(_floats(-0.01, 0.1)),
    "optim.agc_eps": _floats(0, 1e-2),
    "optim.v_only_steps": st.integers(-1, 3),
    "optim.v0": st.sampled_from(["zero", "grad_sq", "ones"]),
    "optim.radam_variant": st.sampled_from(["torch", "official", "paper"]),
    "optim.independent_weight_decay": st.booleans(),
    "schedule.kind": st.sampled_from(["constant", "linear_warmup", "inverse_sqrt", "cosine", "wsd"]),
    "schedule.warmup_steps": st.integers(0, 5),
    "schedule.min_lr_ratio": _floats(0, 1),
    "schedule.decay_fraction": _floats(0, 1.1),
    "schedule.decay_shape": st.sampled_from(["linear", "cosine", "exp", "mirror_cosine", "square", "sqrt", "step"]),
    "train.steps": st.integers(0, 50),
    "train.threads": _optional(st.integers(1, 4)),
    "train.stop_on_nonfinite": st.booleans(),
    "train.log_blocks": st.booleans(),
    "train.log_every": st.integers(0, 3),
    "train.log_sharpness": _optional(st.integers(0, 3)),
    "train.z_loss": st.one_of(_floats(-1e-4, 1e-2), st.just(0.0)),
    "train.stop_when": _optional(st.sampled_from(["trained", "stalled", "diverged"])),
    "train.stop_patience": st.integers(0, 12),
    "train.stop_below": _optional(_floats(-0.1, 2)),
    "train.eval_every": st.integers(0, 5),
}
GRID_KEYS = [k for k in run_keys() if k != "seed"]


def test_every_grid_key_has_a_strategy():
    assert sorted(VALUES) == sorted(GRID_KEYS)


def _write(data: dict, key: str, value: Any) -> None:
    section, _, leaf = key.partition(".")
    data.setdefault(section, {})[leaf] = value


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_scalar(v) for v in value) + "]"
    return repr(value) if isinstance(value, float) else str(value)


@st.composite
def sweeps(draw: st.DrawFn) -> tuple[dict, list[str]]:
    """A sweep mapping (random base, random grid) and --set options over random keys."""
    base: dict = {}
    for key in draw(st.lists(st.sampled_from(GRID_KEYS), max_size=6, unique=True)):
        _write(base, key, draw(VALUES[key]))
    grid_keys = draw(st.lists(st.sampled_from(GRID_KEYS), max_size=3, unique=True))
    grid = {key: draw(st.lists(VALUES[key], min_size=1, max_size=3)) for key in grid_keys}
    set_keys = draw(st.lists(st.sampled_from(GRID_KEYS), max_size=2, unique=True))
    options = [f"{key}=" + ",".join(_yaml_scalar(v) for v in draw(st.lists(VALUES[key], min_size=1, max_size=2)))
               for key in set_keys]
    seeds = draw(st.lists(st.integers(0, 3), min_size=1, max_size=2))
    if draw(st.booleans()):
        options.append("seeds=" + ",".join(map(str, draw(st.lists(st.integers(0, 3), min_size=1, max_size=2)))))
    return {"name": "space", "base": base, "grid": grid, "seeds": seeds}, options


def _alone(data: dict, options: list[str]) -> list[RunConfig]:
    """Every run of the sweep built the long way: grid after --set, each run's values written into
    the base, each run resolved alone."""
    grid, seeds = dict(data["grid"]), data["seeds"]
    for option in options:
        key, _, raw = option.partition("=")
        values = [parse_yaml(part) for part in _split(raw)]
        if key == "seeds":
            seeds = values
        else:
            grid[key] = values
    runs = []
    for combo in itertools.product(*grid.values()):
        for seed in dict.fromkeys(seeds):
            run = copy.deepcopy(data["base"])
            for key, value in zip(grid, combo):
                _write(run, key, value)
            runs.append(validate_run({**run, "seed": seed}))
    _unused_anywhere(data["base"], grid, runs)
    return list(dict.fromkeys(runs))


def _unused_anywhere(base: dict, grid: dict, runs: list[RunConfig]) -> None:
    """A placement-, kind-, optimizer- or schedule-specific key set off its default (in the grid, else
    in the base) that no run uses is refused."""
    for section, table in ACTS_ONLY_UNDER_BY_SECTION.items():
        for key in table:
            default = type(getattr(RunConfig(), section)).model_fields[key].default
            values = grid.get(f"{section}.{key}", [base.get(section, {}).get(key, default)])
            values = [tuple(v) if isinstance(v, list) else v for v in values]
            if any(value != default for value in values) and all(key in inert_keys(getattr(r, section)) for r in runs):
                raise ConfigError(key)
    scopes = grid.get("model.qk_norm_scope", [base.get("model", {}).get("qk_norm_scope", "head")])
    if any(scope != "head" for scope in scopes) and not any(r.model.qk_norm for r in runs):
        raise ConfigError("qk_norm_scope")  # set where no run has qk-norm
    epsilons = grid.get("model.qk_norm_eps", [base.get("model", {}).get("qk_norm_eps")])
    if any(eps is not None for eps in epsilons) and not any(r.model.qk_norm for r in runs):
        raise ConfigError("qk_norm_eps")  # set where no run has qk-norm


def _split(raw: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in raw:
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sweep=sweeps())
# an arch-only key that the base's placement leaves unused is no arch error (a draw of CI's)
@example(sweep=({"name": "space", "base": {"norm": {"rezero_gate": "sublayer"}},
                 "grid": {"norm.rezero_gate": ["layer"]}, "seeds": [0]}, []))
def test_each_run_resolves_as_if_alone(sweep: tuple[dict, list[str]]):
    data, options = sweep
    try:
        validate_run(data["base"])
    except ConfigError:
        assume(False)  # a base must be valid on its own; that it is refused is tested elsewhere
    try:
        expected = _alone(data, options)
    except ConfigError:
        with pytest.raises(ConfigError):
            build_sweep(data, options)
        return
    built = build_sweep(data, options)
    assert built.runs == expected
    assert [r.model_dump() for r in built.runs] == [r.model_dump() for r in expected]
    again = build_sweep(parse_yaml(built.to_yaml()))  # sweep.yaml expands to the same runs
    assert again.runs == built.runs


SWEEP = {"name": "wd", "base": {"model": {"depth": 2, "width": 4}, "optim": {"name": "adam"}}}


@pytest.mark.parametrize(("base_optim", "grid", "decays"), [
    ({"name": "adam"}, ["adam", "adamw"], [0.0, 0.01]),
    ({"name": "adamw"}, ["adam", "adamw", "sgd"], [0.0, 0.01, 0.0]),
    ({"name": "adamw", "weight_decay": 0.05}, ["adam", "adamw"], [0.05, 0.05]),  # set in the base: kept
    ({"name": "adamw", "weight_decay": None}, ["sgd", "adamw"], [0.0, 0.01]),
])
def test_weight_decay_follows_each_runs_optimizer(base_optim: dict, grid: list[str], decays: list[float]):
    data = {**SWEEP, "base": {**SWEEP["base"], "optim": base_optim}, "grid": {"optim.name": grid}}
    assert [r.optim.weight_decay for r in build_sweep(data).runs] == decays
    assert [r.optim.weight_decay for r in build_sweep({**SWEEP, "base": data["base"]},
                                                      [f"optim.name={','.join(grid)}"]).runs] == decays


def test_set_adamw_on_an_adam_base_gets_adamw_decay():
    assert [r.optim.weight_decay for r in build_sweep(SWEEP, ["optim.name=adamw"]).runs] == [0.01]


def test_the_resolved_sweep_leaves_the_decay_open():
    sweep = build_sweep(SWEEP)
    assert sweep.base.optim.weight_decay == 0.0  # the base alone resolves as before
    again = build_sweep(parse_yaml(sweep.to_yaml()), ["optim.name=adamw"])
    assert again.runs[0].optim.weight_decay == 0.01


@pytest.mark.parametrize("betas", [[1, 0.999], [0.9, 1.0], [-0.1, 0.9], [0.9, 1.5]])
def test_betas_must_be_below_one(betas: list[float]):
    with pytest.raises(ConfigError, match=r"base\.optim\.betas"):
        build_sweep({**SWEEP, "base": {"optim": {"betas": betas}}})
    with pytest.raises(ConfigError, match=r"grid\.optim\.betas"):
        build_sweep({**SWEEP, "grid": {"optim.betas": [[0.9, 0.999], betas]}})
    with pytest.raises(ConfigError, match=r"optim\.betas"):
        build_sweep(SWEEP, [f"optim.betas=[{betas[0]},{betas[1]}]"])


def test_betas_of_one_in_the_grid_exit_2_and_write_nothing(write_yaml, tmp_path):
    from typer.testing import CliRunner

    from normexp.cli import app

    config = write_yaml("name: b\nbase: {model: {depth: 2, width: 4}, train: {steps: 2}}\n"
                        "grid: {optim.betas: [[1, 0.999], [0.9, 0.999], [0.9, 1.0]]}\n")
    result = CliRunner().invoke(app, ["sweep", str(config), "--out", str(tmp_path / "out"), "--engine", "batched"])
    assert result.exit_code == 2 and "grid.optim.betas" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


# A value of each placement- or kind-specific key other than its default.
OTHER_VALUE = {"peri_input_norm": False, "mixln_fraction": 0.5, "deepnorm_alpha": 2.0, "deepnorm_beta": 0.5,
               "output_norm_init": "zeros", "prms_fraction": 0.5, "dyt_alpha0": 1.5,
               "dyt_alpha0_attn": 0.9, "dyt_alpha0_ffn": 0.9, "dyt_alpha0_final": 0.9, "dyt_bias": False,
               "derf_alpha0": 1.5, "deepnorm_count": "two_per_block", "b2t_rescale": False,
               "resdual_stream": "zeros", "resdual_final_norm": True, "admin_profile": "closed_form",
               "rezero_gate": "sublayer"}


def test_every_placement_specific_key_has_another_value():
    assert sorted(OTHER_VALUE) == sorted(ACTS_ONLY_UNDER)
    assert all(OTHER_VALUE[k] != NormConfig.model_fields[k].default for k in OTHER_VALUE)


def _trained_alike(a: RunConfig, b: RunConfig) -> bool:
    """Both configs build the same network from the same seed and it computes the same outputs."""
    import torch

    from normexp.models.ffn import Net

    nets = []
    for cfg in (a, b):
        torch.manual_seed(cfg.seed)
        nets.append(Net(cfg.model, cfg.norm))
    x = torch.randn(3, a.model.width, generator=torch.Generator().manual_seed(1))
    params = [[p.detach() for p in net.parameters()] for net in nets]
    return (len(params[0]) == len(params[1]) and all(torch.equal(p, q) for p, q in zip(*params))
            and torch.equal(nets[0](x), nets[1](x)))


FFN_PLACEMENTS = [p for p in get_args(Placement) if p != "b2t"]  # b2t needs two sublayers: the Transformer's
# keys for the Transformer only are refused on the FFN toy (norm.rezero_gate...: tests/test_fidelity.py)
FFN_KEYS = [key for key in ACTS_ONLY_UNDER if ARCH_ONLY.get(key, "ffn") == "ffn"]


@settings(max_examples=60, deadline=None)
@given(placement=st.sampled_from(FFN_PLACEMENTS), kind=st.sampled_from(get_args(NormKind)),
       key=st.sampled_from(sorted(FFN_KEYS)), seed=st.integers(0, 3))
def test_configs_that_train_alike_share_one_id(placement: str, kind: str, key: str, seed: int):
    """Setting a key that the run's placement or kind does not use gives the same run (same id, one
    run in a sweep); setting one it uses gives another run, with another id."""
    data = {"model": {"depth": 3, "width": 4}, "norm": {"placement": placement, "kind": kind}, "seed": seed}
    plain = validate_run(data)
    other = validate_run({**data, "norm": {**data["norm"], key: OTHER_VALUE[key]}})
    literal = validate_run({**data, "norm": {**data["norm"], key: OTHER_VALUE[key]}}, keep_inert=True)
    if key in inert_keys(plain.norm):
        assert other == plain and run_id(other) == run_id(plain)
        assert _trained_alike(plain, literal)  # the key truly changes nothing
        sweep = {"name": "alike", "base": data, "grid": {f"norm.{key}": [NormConfig.model_fields[key].default,
                                                                         OTHER_VALUE[key]]}}
        with pytest.raises(ConfigError, match=f"grid.norm.{key}: has no effect"):
            build_sweep(sweep)
    else:
        assert run_id(other) != run_id(plain)


def test_a_grid_that_makes_a_key_apply_keeps_it_for_those_runs_only():
    sweep = build_sweep({"name": "mix", "base": {"norm": {"mixln_fraction": 0.5, "output_norm_init": "zeros"}},
                         "grid": {"norm.placement": ["pre", "mixln", "respost"]}})
    norms = [(r.norm.placement, r.norm.mixln_fraction, r.norm.output_norm_init) for r in sweep.runs]
    assert norms == [("pre", 0.25, "ones"), ("mixln", 0.5, "ones"), ("respost", 0.25, "zeros")]
    again = build_sweep(parse_yaml(sweep.to_yaml()))
    assert again.runs == sweep.runs


def test_inert_values_in_a_grid_collapse_to_one_run():
    sweep = build_sweep({"name": "dup", "grid": {"norm.placement": ["pre", "mixln"],
                                                 "norm.mixln_fraction": [0.25, 0.5]}})
    assert [(r.norm.placement, r.norm.mixln_fraction) for r in sweep.runs] == [
        ("pre", 0.25), ("mixln", 0.25), ("mixln", 0.5)]
    assert len({run_id(r) for r in sweep.runs}) == 3


# ----------------------------------------------------------------------------- inert optimizer and schedule keys


# A value of each optimizer- or schedule-specific key other than its default.
OTHER_OPTIM_VALUE = {"optim.betas": [0.8, 0.99], "optim.eps": 1e-3, "optim.momentum": 0.5,
                     "optim.v_only_steps": 2, "optim.v0": "grad_sq", "optim.radam_variant": "official",
                     "optim.independent_weight_decay": True,
                     "schedule.min_lr_ratio": 0.3, "schedule.decay_fraction": 0.5, "schedule.decay_shape": "cosine"}


def _deciders() -> list[tuple[str, str, str]]:
    """(dotted key, its deciding key, a value of that decider) for every key of the optimizer's and the
    schedule's tables and every value its decider can take: the matrix comes from the code's lists."""
    from typing import get_args

    from normexp.config import ACTS_ONLY_UNDER_BY_SECTION, OptimName, ScheduleKind

    choices = {"optim": get_args(OptimName), "schedule": get_args(ScheduleKind)}
    return [(f"{section}.{key}", f"{section}.{decider}", value)
            for section in ("optim", "schedule") for key, (decider, _) in ACTS_ONLY_UNDER_BY_SECTION[section].items()
            for value in choices[section]]


def test_every_optimizer_specific_key_has_another_value():
    from normexp.config import ACTS_ONLY_UNDER_BY_SECTION

    assert sorted(OTHER_OPTIM_VALUE) == sorted(f"{s}.{k}" for s in ("optim", "schedule")
                                               for k in ACTS_ONLY_UNDER_BY_SECTION[s])


def _nested(pairs: dict[str, object]) -> dict:
    # RAdam uses eps from step 6; wsd's default decay_fraction 0.1 decays the last int(0.1 * steps) updates
    # (3 of 30: enough for decay_shape to act)
    data: dict = {"model": {"depth": 3, "width": 4}, "train": {"steps": 30}}
    for key, value in pairs.items():
        section, _, leaf = key.partition(".")
        data.setdefault(section, {})[leaf] = value
    return data


@pytest.mark.parametrize(("key", "decider", "value"), _deciders())
def test_an_inert_optimizer_key_is_one_run_and_a_grid_over_it_is_refused(key, decider, value):
    from normexp.config import ConfigError, inert_keys, validate_run
    from normexp.engines.reference import train_run

    section, _, leaf = key.partition(".")
    base = {decider: value, **({"schedule.warmup_steps": 1} if value != "constant" and section == "schedule" else {})}
    plain = validate_run(_nested(base))
    other = validate_run(_nested({**base, key: OTHER_OPTIM_VALUE[key]}))
    literal = validate_run(_nested({**base, key: OTHER_OPTIM_VALUE[key]}), keep_inert=True)
    if leaf in inert_keys(getattr(plain, section)):
        assert other == plain and run_id(other) == run_id(plain)
        # the key truly changes nothing: the run with the value kept trains bit for bit as the default's
        assert [repr(v) for v in train_run(literal).losses] == [repr(v) for v in train_run(plain).losses]
        sweep = {"name": "alike", "base": _nested(base), "grid": {key: [OTHER_OPTIM_VALUE[key]]}}
        with pytest.raises(ConfigError, match=f"grid.{key}: has no effect"):
            build_sweep(sweep)
        with pytest.raises(ConfigError, match=f"base.{key}: has no effect"):
            build_sweep({"name": "alike", "base": _nested({**base, key: OTHER_OPTIM_VALUE[key]})})
    else:
        assert run_id(other) != run_id(plain)
        assert [repr(v) for v in train_run(literal).losses] != [repr(v) for v in train_run(plain).losses]


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd", "radam"])
def test_negative_zero_is_zero(name):
    from normexp.config import validate_run

    zero = validate_run(_nested({"optim.name": name, "optim.weight_decay": 0.0, "optim.momentum": 0.0}))
    negative = validate_run(_nested({"optim.name": name, "optim.weight_decay": -0.0, "optim.momentum": -0.0}))
    assert run_id(zero) == run_id(negative)
    sweep = build_sweep({"name": "z", "base": _nested({"optim.name": name}),
                         "grid": {"optim.weight_decay": [0.0, -0.0]}})
    assert len(sweep.runs) == 1


def test_a_mixed_grid_folds_only_where_the_key_is_inert():
    sweep = build_sweep({"name": "mix", "base": _nested({}),
                         "grid": {"optim.name": ["adam", "sgd"], "optim.momentum": [0.5, 0.9]}})
    assert [(r.optim.name, r.optim.momentum) for r in sweep.runs] == [("adam", 0.9), ("sgd", 0.5), ("sgd", 0.9)]
