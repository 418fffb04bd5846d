"""The optimizer controls of normexp/optim.py (issue 43) on the fast engine: each run of a batch, with its own
value of a control, within the fast engine's contract of the reference (docs/fast-contract.md: on a stable
grid, every loss within rounding of the reference's), FFN and Transformer."""

from __future__ import annotations

import pytest

from normexp.config import RunConfig, validate_run
from normexp.engines.fast import fast_key, fast_serves, plan_fast, train_fast
from normexp.engines.reference import train_run

FFN = {"model": {"depth": 3, "width": 8}, "norm": {"placement": "pre"}}
TRANSFORMER = {"model": {"arch": "transformer", "depth": 2, "width": 16, "n_heads": 2},
               "norm": {"placement": "pre"}, "data": {"task": "copy", "n_samples": 32, "n_val": 16}}
ARCHS = {"ffn": FFN, "transformer": TRANSFORMER}
TOL = 2e-4  # tests/test_fast.py's `assert_close_to_reference`: a stable grid, every loss within rounding


def grid(arch: str, optim: str, controls: list[dict], steps: int = 10) -> list[RunConfig]:
    """One run per entry of `controls` (optim keys), each with its own seed, lr, betas and weight decay."""
    runs = []
    for i, values in enumerate(controls):
        data = {key: dict(value) for key, value in ARCHS[arch].items()}
        data["optim"] = {"name": optim, "lr": [0.01, 0.003, 0.03, 0.02][i % 4],
                         "weight_decay": [0.1, 0.01, 0.1, 0.05][i % 4],
                         "betas": [[0.9, 0.999], [0.8, 0.99], [0.9, 0.98], [0.0, 0.999]][i % 4], **values}
        if optim == "sgd":
            del data["optim"]["betas"]
        data["schedule"] = {"kind": "linear_warmup", "warmup_steps": [0, 3, 2, 0][i % 4]}
        runs.append(validate_run({**data, "train": {"steps": steps}, "seed": 3 + i}))
    return runs


def assert_within_contract(configs: list[RunConfig]) -> list[list[float]]:
    """The configs train as one fast batch, each run's learning rates the reference's and its losses within
    TOL of them. Returns the reference's losses."""
    assert all(fast_serves(cfg) for cfg in configs)
    assert [len(batch) for batch in plan_fast(configs)] == [len(configs)]  # one batch: the values vary per run
    expected = []
    for cfg, result in zip(configs, train_fast(configs, compile=False)):
        reference = train_run(cfg)
        assert result.engine == "fast" and result.status == reference.status
        assert result.metrics["lr"] == reference.metrics["lr"]
        assert result.losses == pytest.approx(reference.losses, rel=TOL, abs=TOL), cfg.optim
        expected.append(reference.losses)
    return expected


def assert_acts(configs: list[RunConfig], expected: list[list[float]], key: str, default: object) -> None:
    """The control moves each of these runs' losses beyond the contract's tolerance: the check above
    would see a run trained without it, or with another run's value."""
    for cfg, losses in zip(configs, expected):
        plain = train_run(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={key: default})}))
        assert plain.losses != pytest.approx(losses, rel=TOL, abs=TOL), cfg.optim


# ----------------------------------------------------------------------------- optim.clip_norm


@pytest.mark.parametrize("arch", ["ffn", "transformer"])
@pytest.mark.parametrize("optim", ["adam", "sgd"])
def test_clip_norm_each_run_clipped_by_its_own_global_norm_and_threshold(arch, optim):
    thresholds = [0.05, 0.2, 0.02, 0.1]
    configs = grid(arch, optim, [{"clip_norm": c} for c in thresholds])
    expected = assert_within_contract(configs)
    assert_acts(configs, expected, "clip_norm", None)


def test_clipped_and_unclipped_runs_train_in_separate_fast_batches():
    clipped = grid("ffn", "adam", [{"clip_norm": 0.1}] * 2)
    plain = grid("ffn", "adam", [{}] * 2)
    assert fast_key(clipped[0]) == fast_key(clipped[1].model_copy(update={"optim": clipped[0].optim}))
    assert len(plan_fast([*clipped, *plain])) == 2


# ----------------------------------------------------------------------------- optim.independent_weight_decay


@pytest.mark.parametrize("arch", ["ffn", "transformer"])
def test_independent_weight_decay_per_run_beside_coupled_runs(arch):
    independent = {"independent_weight_decay": True, "weight_decay": 0.5}  # 0.5 / lr: 17 to 170 per unit of lr
    configs = grid(arch, "adamw", [independent, {"weight_decay": 0.5}, independent, {}])
    assert len({fast_key(cfg) for cfg in configs}) == 1
    expected = assert_within_contract(configs)
    assert_acts(configs[::2], expected[::2], "independent_weight_decay", False)


# ----------------------------------------------------------------------------- optim.v_only_steps, optim.v0


@pytest.mark.parametrize("arch", ["ffn", "transformer"])
@pytest.mark.parametrize("optim", ["adam", "adamw"])
def test_v_only_steps_freezes_each_runs_first_moment_and_weights_for_k_updates(arch, optim):
    configs = grid(arch, optim, [{"v_only_steps": 3}] * 4)
    expected = assert_within_contract(configs)
    assert all(losses[:4] == [losses[0]] * 4 for losses in expected)  # the weights stand still for 3 updates
    assert_acts(configs, expected, "v_only_steps", 0)


@pytest.mark.parametrize("arch", ["ffn", "transformer"])
@pytest.mark.parametrize("optim", ["adam", "adamw"])
def test_v0_grad_sq_starts_each_runs_second_moment_at_its_own_first_gradient(arch, optim):
    configs = grid(arch, optim, [{"v0": "grad_sq"}] * 4)
    expected = assert_within_contract(configs)
    assert_acts(configs, expected, "v0", "zero")


def test_v_only_steps_and_v0_together_and_apart_train_in_batches_of_their_own():
    kinds = [{"v_only_steps": 2}, {"v0": "grad_sq"}, {"v_only_steps": 2, "v0": "grad_sq"}, {}]
    configs = [cfg for values in kinds for cfg in grid("ffn", "adam", [values] * 2)]
    assert sorted(len(batch) for batch in plan_fast(configs)) == [2, 2, 2, 2]
    assert_within_contract(configs[4:6])


# ----------------------------------------------------------------------------- optim.agc


@pytest.mark.parametrize("arch", ["ffn", "transformer"])
@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_agc_clips_each_runs_units_by_its_own_factor_and_eps(arch, optim):
    factors = [{"agc": 0.01}, {"agc": 0.003, "agc_eps": 0.01}, {"agc": 0.02}, {"agc": 0.005, "agc_eps": 0.1}]
    configs = grid(arch, optim, factors)
    assert len({fast_key(cfg) for cfg in configs}) == 1
    expected = assert_within_contract(configs)
    assert_acts(configs, expected, "agc", None)


# ----------------------------------------------------------------------------- optim.radam_variant


@pytest.mark.parametrize("arch", ["ffn", "transformer"])
def test_radam_official_skips_each_runs_early_updates(arch):
    configs = grid(arch, "radam", [{"radam_variant": "official"}] * 4, steps=8)
    expected = assert_within_contract(configs)
    assert all(losses[:6] == [losses[0]] * 6 for losses in expected)  # rho_t < 5 for t <= 5 at these beta2
    assert_acts(configs, expected, "radam_variant", "torch")


def test_radam_variants_train_in_batches_of_their_own():
    configs = [*grid("ffn", "radam", [{"radam_variant": "official"}] * 2), *grid("ffn", "radam", [{}] * 2)]
    assert len(plan_fast(configs)) == 2


# ----------------------------------------------------------------------------- compiled


@pytest.mark.slow
def test_compiled_steps_with_controls_stay_within_the_contract(tmp_path, monkeypatch):
    """A compiled batch with clip_norm compiles its gradient step only (the update eager, after the clipping);
    AdamW's independent decay stays inside the compiled update (`adam_hypers`). Both within the contract."""
    from normexp.engines.fast import compiled as compiling

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path))
    clipped = grid("ffn", "adam", [{"clip_norm": c} for c in (0.05, 0.2)], steps=6)
    independent = grid("ffn", "adamw", [{"independent_weight_decay": True, "weight_decay": 0.5}, {}], steps=6)
    for configs in (clipped, independent):
        for cfg, result in zip(configs, train_fast(configs, compile=True)):
            assert result.losses == pytest.approx(train_run(cfg).losses, rel=TOL, abs=TOL), cfg.optim
    fused = sorted(key[len(compiling.compiled_structure(clipped[0])) - 1] for key in compiling.kept_steps())
    assert fused == [False, True]  # the clipped step without its update, the independent one with it
