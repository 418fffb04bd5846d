"""The fast engine: as close to the reference as the reference is to itself, deterministic, every
placement, norm kind and optimizer through the model's own modules."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import OptimConfig, RunConfig
from normexp.engines.fast import aot, plan_fast, train, train_fast
from normexp.engines.fast import compiled as compiling
from normexp.engines.fast import optim as fast_optim
from normexp.engines.fast.optim import FastOptimizer, stretches
from normexp.engines.fast.plan import compile_choice, compile_pays, fast_key, should_compile
from normexp.engines.reference import train_run
from normexp.registry import KINDS, placements_for
from normexp.results import load_summary
from normexp.units import plan_units

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_fast import (  # noqa: E402
    compare,
    contract_holds,
    deep_grid,
    per_kind,
    run_fast,
    stable_grid,
    unstable_grid,
    with_threads,
    yardstick,
)

ALL_PLACEMENTS = placements_for("ffn")  # from the registry: a placement or kind added there is tested here
ALL_KINDS = list(KINDS)


def runs(placement="pre", kind="rmsnorm", optim="adam", n=4, steps=8, depth=3, width=8):
    """n runs of one structure that differ in seed, lr, betas, eps, weight decay, momentum and schedule."""
    schedules = [("constant", 0), ("linear_warmup", 3), ("cosine", 2), ("inverse_sqrt", 2)]
    return [RunConfig.model_validate({
        "model": {"depth": depth, "width": width},
        "norm": {"placement": placement, "kind": kind},
        "optim": {"name": optim, "lr": [0.01, 0.003, 0.03, 0.02][i % 4], "weight_decay": [0.0, 0.01, 0.1, 0][i % 4],
                  "betas": [[0.9, 0.999], [0.8, 0.99], [0.95, 0.9], [0.9, 0.98]][i % 4],
                  "eps": [1e-8, 1e-6, 1e-8, 1e-7][i % 4], "momentum": [0.9, 0.5, 0.0, 0.99][i % 4]},
        "schedule": {"kind": schedules[i % 4][0], "warmup_steps": schedules[i % 4][1]},
        "train": {"steps": steps},
        "seed": 11 + i,
    }) for i in range(n)]


def assert_close_to_reference(configs, tol=2e-4):
    """Every metric of every step within `tol` of the reference's (lr exactly), same status and length;
    gradient norms within 5 x `tol`, relative: they sum many squares, and where they blow up (3e4 for
    pRMSNorm over 16 channels) the order of the fast engine's reductions shows in their 4th digit."""
    for cfg, result in zip(configs, train_fast(configs, compile=False)):
        expected = train_run(cfg)
        assert result.engine == "fast" and result.status == expected.status
        assert result.metrics["step"] == expected.metrics["step"]
        assert result.metrics["lr"] == expected.metrics["lr"]
        for column, rel in (("loss", tol), ("grad_norm", 5 * tol)):
            for got, want in zip(result.metrics[column], expected.metrics[column]):
                assert got == pytest.approx(want, rel=rel, abs=tol), (column, cfg.norm, cfg.optim)


@pytest.mark.parametrize("optim", ["adam", "adamw", "sgd", "radam"])
def test_each_optimizer_with_per_run_hyper_parameters_matches_the_reference(optim):
    """Per-run lr, betas, eps, weight decay, momentum and schedules inside one batch: torch's formulas."""
    assert_close_to_reference(runs("pre", "rmsnorm", optim, n=4, steps=12))


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
def test_every_placement_through_the_models_own_blocks(placement):
    assert_close_to_reference(runs(placement, "layernorm", n=2, steps=6))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_every_norm_kind_through_the_models_own_norms(kind):
    assert_close_to_reference(runs("pre", kind, n=2, steps=6, width=16))


@pytest.mark.equivalence
def test_same_sweep_twice_same_bits():
    configs = runs("post", "layernorm", "adamw", n=4, steps=10)
    first, second = train_fast(configs, compile=False), train_fast(configs, compile=False)
    assert [repr(r.metrics) for r in first] == [repr(r.metrics) for r in second]


def test_diverged_run_stops_at_its_first_nonfinite_loss_and_its_batch_mates_go_on():
    configs = runs("none", "rmsnorm", "sgd", n=3, steps=12)
    wild = configs[1].model_copy(update={"optim": configs[1].optim.model_copy(update={"lr": 1e4})})
    configs[1] = wild
    results = train_fast(configs, compile=False)
    expected = train_run(wild)
    assert expected.diverged and results[1].diverged
    assert results[1].metrics["step"] == expected.metrics["step"]  # stopped at the same step
    assert math.isnan(results[1].metrics["grad_norm"][-1]) and not math.isfinite(results[1].losses[-1])
    for i in (0, 2):
        assert not results[i].diverged and len(results[i].losses) == 13
        assert results[i].losses == pytest.approx(train_run(configs[i]).losses, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("optim", ["adam", "adamw"])
def test_adam_through_a_scratch_direction_matches_the_reference_too(optim, monkeypatch):
    """With more stretches of equal learning rates than MAX_STRETCHES, Adam writes each run's update
    direction first and scales it by the run's learning rate: the same formulas."""
    monkeypatch.setattr(fast_optim, "MAX_STRETCHES", 1)
    assert_close_to_reference(runs("pre", "rmsnorm", optim, n=4, steps=12))


@pytest.mark.parametrize("max_stretches", [1, 16])
def test_frozen_run_keeps_its_parameters_even_with_a_nan_gradient(max_stretches, monkeypatch):
    monkeypatch.setattr(fast_optim, "MAX_STRETCHES", max_stretches)
    params = [torch.ones(3, 4), torch.ones(3)]
    optimizer = FastOptimizer("adamw", [OptimConfig(name="adamw")] * 3, params)
    grads = [torch.full((3, 4), float("nan")), torch.full((3,), float("nan"))]
    grads[0][0], grads[1][0] = 1.0, 1.0
    optimizer.step(grads, [0.1, 0.1, 0.1], [True, False, False])
    assert (params[0][1:] == 1).all() and (params[1][1:] == 1).all()
    assert (params[0][0] < 1).all() and params[1][0] < 1


@given(st.lists(st.sampled_from(["a", "b", "c"]), max_size=12))
def test_stretches_cover_every_run_in_maximal_stretches_of_equal_keys(keys):
    found = stretches(keys)
    assert [r for start, stop, _ in found for r in range(start, stop)] == list(range(len(keys)))
    for start, stop, key in found:
        assert all(k == key for k in keys[start:stop])
    assert all(a[2] != b[2] for a, b in zip(found, found[1:]))  # maximal


def test_compile_pays_when_the_saving_exceeds_the_compile_time():
    # 100 000 model-steps at 2 ms, compiled 2x faster: saves 100 s
    assert compile_pays(100_000, 2e-3, compile_s=60, speedup=2.0)
    assert not compile_pays(100_000, 2e-3, compile_s=120, speedup=2.0)
    assert not compile_pays(10, 2e-3)
    article = RunConfig()
    assert not should_compile(article, 64 * 31) and should_compile(article, 4096 * 61)



def test_the_compile_choice_is_one_per_structure_from_all_its_planned_model_steps():
    """Every run of a structure counts towards its choice (the sweep's pool and its units decide by this one
    function): 4096 article runs of 61 steps pay for a compile together, though no batch of them does alone;
    a small structure beside them does not; --compile and --no-compile decide alone."""
    article = RunConfig.model_validate({"train": {"steps": 60}})
    big = [article.model_copy(update={"seed": s}) for s in range(4096)]
    small = runs(n=2)
    choice = compile_choice([*big, *small])
    assert choice == {fast_key(article): True, fast_key(small[0]): False}
    assert compile_choice(big[:64]) == {fast_key(article): False}  # one batch's model-steps alone
    assert set(compile_choice([*big, *small], compile=False).values()) == {False}
    assert set(compile_choice(small, compile=True).values()) == {True}
    units = plan_units([*big[:64], *small], "fast", "cpu", 1, planned=[*big, *small])
    assert {(u.runs[0].model.depth, u.compile) for u in units} == {(article.model.depth, True),
                                                                    (small[0].model.depth, False)}

def test_plan_fast_chunks_each_structure_and_keeps_every_run():
    configs = runs(n=4) * 40 + runs(kind="layernorm", n=3)
    batches = plan_fast(configs)
    assert sorted(len(b) for b in batches) == [3, 32, 64, 64]
    assert all(len({fast_key(c) for c in b}) == 1 for b in batches)
    assert sum(map(len, batches)) == len(configs)


def test_plan_units_fast_decides_compile_per_structure_unless_told():
    configs = runs(n=4)
    assert all(u.engine == "fast" and not u.compile for u in plan_units(configs, "fast", "cpu", 1))
    assert all(u.engine == "fast" and u.compile for u in plan_units(configs, "fast", "cpu", 1, compile=True))


def test_compile_failure_falls_back_to_eager_with_one_warning(monkeypatch, tmp_path):
    def broken_compile(graph, inputs, package):
        raise RuntimeError("no C++ compiler found\nlong details")

    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(aot, "compile_package", broken_compile)
    compiling.reset_cache()
    configs = runs(n=2, steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = train_fast(configs, compile=True)
    assert [str(w.message) for w in caught] == [
        "compiling the step failed (RuntimeError: no C++ compiler found); training this structure's runs uncompiled"]
    assert [repr(r.metrics) for r in results] == [repr(r.metrics) for r in train_fast(configs, compile=False)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the structure's next batch: uncompiled at once, no second compile or warning
        again = train_fast(configs, compile=True)
    assert [repr(r.metrics) for r in again] == [repr(r.metrics) for r in results]


def flipped(step):
    """A compiled step that returns the eager metrics but every gradient negated (the same norms), or, for
    a step that updates its inputs in place (Adam's), every update reversed."""
    def call(*args):
        before = [a.clone() for a in args]
        *grads, metrics = step(*args)
        for now, then in zip(args, before):
            if not torch.equal(now, then):
                now.copy_(2 * then - now)
        return (*(-g for g in grads), metrics)
    return call


@pytest.mark.parametrize(("optim", "what"), [("adam", "its first moments"), ("adamw", "its first moments"),
                                            ("sgd", "its gradients")])
def test_a_compiled_step_with_wrong_gradients_but_the_eager_metrics_is_refused(monkeypatch, optim, what):
    """The check against the eager step compares the gradients (with Adam, the update made from them and the
    moments) too: a graph that returns the eager loss, accuracy and gradient norm but a flipped gradient
    (same norm) would train every run of the structure the wrong way (it passed the check when only the
    metrics were compared)."""
    monkeypatch.setattr(aot, "load_or_compile", lambda key, trace, inputs, **_: (flipped(trace()), True))
    compiling.reset_cache()
    configs = runs(optim=optim, n=2, steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = train_fast(configs, compile=True)
    assert [str(w.message).split(";")[0] for w in caught] == [
        f"compiling the step failed (ValueError: the traced step does not reproduce the eager one ({what}))"]
    assert [repr(r.metrics) for r in results] == [repr(r.metrics) for r in train_fast(configs, compile=False)]


def doubled_update(step):
    """A compiled Adam step (params, exp_avg, exp_avg_sq, x, y, hyper -> metrics, in place) whose moments are
    right but whose parameters move twice as far."""
    def call(*args):
        n = (len(args) - 3) // 3
        before = [a.clone() for a in args[:n]]
        out = step(*args)
        for now, then in zip(args[:n], before):
            now.copy_(then + 2 * (now - then))
        return out
    return call


def test_a_compiled_adam_step_with_the_right_moments_but_a_wrong_update_is_refused(monkeypatch):
    monkeypatch.setattr(aot, "load_or_compile", lambda key, trace, inputs, **_: (doubled_update(trace()), True))
    compiling.reset_cache()
    configs = runs(n=2, steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_fast(configs, compile=True)
    assert [str(w.message).split(";")[0] for w in caught] == [
        "compiling the step failed (ValueError: the traced step does not reproduce the eager one (its update))"]


def test_why_the_update_is_checked_from_the_compiled_moments_not_against_the_eager_update():
    """Adam scales a gradient that is zero in exact arithmetic (rounding noise) to a full step of either sign:
    two orders of summation give moments that agree and updates that do not. A phase-grid batch was refused
    for it (and every later batch compiled again); the check now compares the moments with the eager ones
    and the update with the one `adam_move` makes from the compiled moments."""
    start = [torch.tensor([[1.0, 2.0, 3.0]])]
    hyper = fast_optim.adam_hypers([OptimConfig(lr=0.1)], "adam", 1, [0.1], [True])
    m = [torch.tensor([[0.1, -0.2, 1e-10]])]
    v = [torch.tensor([[1e-3, 4e-3, 1e-20]])]
    m_other = [torch.tensor([[0.1, -0.2, -1e-10]])]  # the noise entry's sign flipped
    moved = [fast_optim.adam_move(p, a, b, hyper) - p for p, a, b in zip(start, m, v)]
    moved_other = [fast_optim.adam_move(p, a, b, hyper) - p for p, a, b in zip(start, m_other, v)]
    assert compiling.gradients_close(m, m_other)  # the moments agree: the noise is 1e-9 of the tensor
    assert not compiling.gradients_close(moved, moved_other)  # the updates do not: a full step of the other sign


def test_a_package_on_disk_is_loaded_by_later_processes_and_compiled_again_when_it_disagrees(monkeypatch, tmp_path):
    """The package is a cache: a second process loads it instead of compiling; a package whose step does
    not reproduce the eager one (stale, or another machine's) is compiled again, not used or refused.
    (The compiler is stood in for by the traced graph itself; the real one is test_scale's slow test.)"""
    compiled: list[Path] = []
    graphs: dict[Path, object] = {}

    def fake_compile(graph, inputs, package):
        compiled.append(package)
        graphs[package] = graph
        package.write_bytes(b"package")

    def fake_load(package):
        step = graphs[package]
        return flipped(step) if package.read_bytes() == b"stale" else step

    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(aot, "compile_package", fake_compile)
    monkeypatch.setattr(aot, "load_package", fake_load)
    configs = runs(n=2, steps=4)
    results = []
    for _ in range(2):  # a second process: nothing compiled in memory, the package on disk
        compiling.reset_cache()
        results.append(train_fast(configs, compile=True))
    assert len(compiled) == 1 and [p.parent for p in compiled] == [tmp_path / "steps"]
    compiled[0].write_bytes(b"stale")
    compiling.reset_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "compiling the step failed": compiled again and used
        results.append(train_fast(configs, compile=True))
    assert compiled == [compiled[0]] * 2 and compiled[0].read_bytes() == b"package"
    assert len({repr([r.metrics for r in batch]) for batch in results}) == 1


def packaged_graphs(monkeypatch) -> dict[Path, object]:
    """The compiler stood in for by the traced graph: `aot.compile_package` writes b"package" and keeps the
    graph (in the dict returned, by package path); `aot.load_package` gives it back carrying the sha256 of the
    package's bytes, as a loaded step does (what `aot.vouch` records)."""
    import hashlib

    graphs: dict[Path, object] = {}

    def fake_compile(graph, inputs, package):
        graphs[package] = graph
        package.write_bytes(b"package")

    def fake_load(package):
        step = graphs[package]

        def call(*args):
            return step(*args)
        call.digest = hashlib.sha256(package.read_bytes()).hexdigest()
        return call

    monkeypatch.setattr(aot, "compile_package", fake_compile)
    monkeypatch.setattr(aot, "load_package", fake_load)
    return graphs


def test_a_package_that_passed_the_check_is_used_unchecked_by_later_processes_until_its_bytes_change(
        monkeypatch, tmp_path):
    """The check's eager step costs a worker ~1.3 s: a package that passed it is vouched for by the sha256 of
    its bytes (<key>.checked), and a later process that loads those very bytes skips the check. Other bytes
    under the same name (recompiled, replaced, damaged) are checked again; a step not loaded from a package
    (no digest) never vouches."""
    checks: list[int] = []
    real_close = compiling.metrics_close
    monkeypatch.setattr(compiling, "metrics_close", lambda e, g: (checks.append(1), real_close(e, g))[1])
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path))
    graphs = packaged_graphs(monkeypatch)
    configs = runs(n=2, steps=4)
    results = []
    for expect_checked in (True, False):  # the compiling process checks; the next one loads vouched bytes
        compiling.reset_cache()
        checks.clear()
        results.append(train_fast(configs, compile=True))
        assert bool(checks) == expect_checked
    assert [p.name for p in (tmp_path / "steps").glob("*.checked")] == [f"{p.stem}.checked" for p in graphs]
    package = next(iter(graphs))
    package.write_bytes(b"other bytes")  # same name, other bytes: checked again (and vouched for anew)
    compiling.reset_cache()
    checks.clear()
    results.append(train_fast(configs, compile=True))
    assert checks
    assert len({repr([r.metrics for r in batch]) for batch in results}) == 1
    monkeypatch.setattr(aot, "load_package", lambda package: graphs[package])  # no digest: nothing vouched
    package.with_suffix(".checked").unlink()
    compiling.reset_cache()
    train_fast(configs, compile=True)
    assert not package.with_suffix(".checked").exists()


def test_a_compiled_batch_copies_the_model_only_to_trace_its_step(monkeypatch, tmp_path):
    """The batch's own meta model (a deepcopy: ~8 ms a depth-24 batch) is what a step not compiled yet traces;
    a later batch of the same structure needs none, and trains to the same numbers."""
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path))
    packaged_graphs(monkeypatch)
    compiling.reset_cache()
    copies: list[int] = []
    real = train.batch_model
    monkeypatch.setattr(train, "batch_model", lambda cfg: (copies.append(1), real(cfg))[1])
    configs = runs(n=2, steps=3)
    first = train_fast(configs, compile=True)
    assert copies
    copies.clear()
    again = train_fast(configs, compile=True)
    assert copies == []
    assert repr([r.metrics for r in again]) == repr([r.metrics for r in first])
    eager = train_fast(configs, compile=False)  # the eager step runs the model: one copy per batch
    assert copies == [1] and len(eager) == 2


def test_a_package_is_named_by_everything_that_makes_its_step(monkeypatch):
    what = {"step": "grad", "model": {"depth": 2}, "runs": 64}
    key = aot.step_key(what, "cpu")
    assert aot.step_key(dict(what), "cpu") == key  # a pure function of its inputs
    assert aot.step_key({**what, "runs": 32}, "cpu") != key
    assert aot.step_key(what, "cuda") != key
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    assert aot.step_key(what, "cpu") != key
    monkeypatch.undo()
    monkeypatch.setattr(aot, "source_digest", lambda: "another normexp")
    assert aot.step_key(what, "cpu") != key


def test_the_gradient_check_tolerates_rounding_noise_in_a_gradient_that_is_zero_in_exact_arithmetic():
    """Attention's key bias has a zero gradient in exact arithmetic (softmax ignores a shift): eager and
    compiled give different ~1e-9 noise there, and a per-tensor relative check refused every compiled
    Transformer step. Flipped or swapped gradients are still refused."""
    big, other = torch.tensor([[1.0, -2.0, 0.5]]), torch.tensor([[0.3, 0.2, -0.1]])
    noise = [torch.tensor([[2e-9, -1e-9]]), torch.tensor([[-3e-9, 4e-9]])]
    eager = [big, other, noise[0]]
    assert compiling.gradients_close(eager, [big * (1 + 1e-6), other, noise[1]])
    assert not compiling.gradients_close(eager, [-big, other, noise[0]])
    assert not compiling.gradients_close(eager, [big, -other, noise[0]])
    assert not compiling.gradients_close([big, big.roll(1, 1)], [big.roll(1, 1), big])
    assert not compiling.gradients_close(eager, [big, other, torch.tensor([[float("nan"), 0.0]])])


@pytest.mark.slow
def test_a_transformer_step_compiles_and_passes_the_check_against_the_eager_one(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path))
    compiling.reset_cache()
    configs = [RunConfig.model_validate({"model": {"arch": "transformer", "depth": 2, "width": 16},
                                         "data": {"task": "assoc_recall"}, "norm": {"placement": "post"},
                                         "train": {"steps": 2}, "seed": s}) for s in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = train_fast(configs, compile=True)
    assert not [w for w in caught if "compiling the step failed" in str(w.message)]  # it was refused (its gradients)
    eager = train_fast(configs, compile=False)
    assert len(compiling.kept_steps()) == 1
    for a, b in zip(compiled, eager):
        assert max(abs(x - y) for x, y in zip(a.losses, b.losses)) < 1e-4
    assert len(list((tmp_path / "steps").glob("*.checked"))) == 1  # it passed the check: vouched for
    compiling.reset_cache()  # as a second process: the package loaded, unchecked, the same bits
    assert [repr(r.metrics) for r in train_fast(configs, compile=True)] == [repr(r.metrics) for r in compiled]

@pytest.mark.equivalence
def test_stable_grid_contract_fast_is_as_close_as_the_reference_to_itself():
    """Pre-LN runs: the reference does not move when its rows are summed in another order, so neither may fast."""
    configs = [with_threads(c, 2) for c in stable_grid(4, steps=15, depth=6, width=16)]
    reference = [train_run(c) for c in configs]
    f = compare(configs, train_fast(configs[:4], compile=False) + train_fast(configs[4:], compile=False), reference)
    assert f.flips == 0 and f.cells_off == 0 and f.max_dloss < 1e-3
    assert contract_holds(f, yardstick(configs, reference))


CONTRACT_KINDS = ("layernorm", "rmsnorm", "scalenorm")  # thread-dependent bits, thread-stable ones, a third


def assert_contract_per_kind(configs, fast_results):
    """F within the contract of S (the reference with its rows reordered) for each norm kind alone."""
    reference = [train_run(c) for c in configs]
    s = {kind: yardstick(*zip(*[(c, r) for c, r in zip(configs, reference) if c.norm.kind == kind]))
         for kind in CONTRACT_KINDS}
    f = per_kind(configs, fast_results, reference)
    assert set(f) == set(CONTRACT_KINDS)
    broken = {kind: (f[kind], s[kind]) for kind in f if not contract_holds(f[kind], s[kind])}
    assert not broken, broken
    return f, s


@pytest.fixture(scope="module")
def small_chaotic_grid():
    """48 Post-LN runs (depth 8, lr x warmup x 4 seeds x 3 kinds, 30 steps), their reference and S per kind.
    Chaotic enough that RMSNorm's fast runs move (its reference does not move with the thread count)."""
    grid = unstable_grid(4, 30, CONTRACT_KINDS, lrs=(0.01, 0.03), warmups=(0, 10), depth=8)
    configs = [with_threads(c, 2) for c in grid]
    reference = [train_run(c) for c in configs]
    kinds = {kind: [i for i, c in enumerate(configs) if c.norm.kind == kind] for kind in CONTRACT_KINDS}
    s = {kind: yardstick([configs[i] for i in idx], [reference[i] for i in idx]) for kind, idx in kinds.items()}
    return configs, reference, s


def contract_broken(grid, fast_results):
    configs, reference, s = grid
    f = per_kind(configs, fast_results, reference)
    return {kind: (f[kind], s[kind]) for kind in CONTRACT_KINDS if not contract_holds(f[kind], s[kind])}


@pytest.mark.equivalence
def test_small_chaotic_grid_contract_holds_per_kind_where_the_thread_count_moves_nothing(small_chaotic_grid):
    configs, reference, s = small_chaotic_grid
    fast_results = run_fast(configs)
    assert not contract_broken(small_chaotic_grid, fast_results)
    rms = [i for i, c in enumerate(configs) if c.norm.kind == "rmsnorm"]
    f = compare([configs[i] for i in rms], [fast_results[i] for i in rms], [reference[i] for i in rms])
    # Both move, whatever the CPU: S never collapses to 0. Where the reference's RMSNorm bits do not depend
    # on the thread count (MKL's AVX2 kernels), a 1- vs 2-thread yardstick would have been 0 here; on an
    # AVX-512 machine they do depend on it, so that yardstick is merely machine-dependent there.
    assert f.cells_off > 0 and s["rmsnorm"].cells_off > 0


@pytest.mark.equivalence
@pytest.mark.parametrize("error", [1.02, 0.98])
def test_small_chaotic_grid_contract_catches_a_learning_rate_two_percent_off(small_chaotic_grid, error, monkeypatch):
    """The contract discriminates: a fast engine whose learning rates are 2% off breaks it."""
    step_lr = train.step_lr
    monkeypatch.setattr(train, "step_lr", lambda cfg, step: error * step_lr(cfg, step))
    assert contract_broken(small_chaotic_grid, run_fast(small_chaotic_grid[0]))


@pytest.mark.slow
def test_unstable_grid_contract():
    """384 Post-LN runs (lr x warmup x 8 seeds x 3 kinds, 60 steps): F within the contract of S, per kind."""
    configs = [with_threads(c, 2) for c in unstable_grid(8, 60, CONTRACT_KINDS)]
    assert_contract_per_kind(configs, run_fast(configs))


@pytest.mark.slow
def test_deep_grid_contract():
    """issue 25's grid (Post-LN depth 8, lr {0.003, 0.01, 0.03} x warmup {0, 10} x 8 seeds, 40 steps), with
    ScaleNorm beside LayerNorm and RMSNorm: F within the contract of S, per kind."""
    configs = [with_threads(c, 2) for c in deep_grid(8, kinds=CONTRACT_KINDS)]
    assert_contract_per_kind(configs, run_fast(configs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_runs_the_same_engine():
    configs = runs(n=3, steps=8)
    results = train_fast(configs, "cuda", compile=False)
    for cfg, result in zip(configs, results):
        assert result.losses == pytest.approx(train_run(cfg).losses, rel=1e-3, abs=1e-3)


runner = CliRunner()
SWEEP = """\
name: f
base: {model: {depth: 3, width: 8}, train: {steps: 4}}
grid: {norm.placement: [post, pre], optim.lr: [0.01, 0.02]}
seeds: [0, 1]
"""


def test_cli_sweep_engine_fast_writes_fast_in_the_summary(write_yaml, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["sweep", str(write_yaml(SWEEP)), "--out", str(out), "--engine", "fast", "-q"])
    assert result.exit_code == 0, result.output
    summary = load_summary(out)
    assert len(summary) == 8 and set(summary["engine"]) == {"fast"} and set(summary["status"]) == {"completed"}


@pytest.mark.parametrize("engine", ["auto", "reference", "batched"])
@pytest.mark.parametrize("flag", ["--compile", "--no-compile"])
def test_compile_flag_with_an_exact_engine_is_exit_2_and_writes_nothing(write_yaml, tmp_path, engine, flag):
    out = tmp_path / "out"
    result = runner.invoke(app, ["sweep", str(write_yaml(SWEEP)), "--out", str(out), "--engine", engine, flag])
    assert result.exit_code == 2
    assert f"{flag}: only --engine fast compiles" in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_an_exact_sweep_redoes_runs_the_fast_engine_trained_and_a_fast_sweep_keeps_exact_ones(write_yaml, tmp_path):
    out, config = tmp_path / "out", str(write_yaml(SWEEP))
    assert runner.invoke(app, ["sweep", config, "--out", str(out), "--engine", "fast", "-q"]).exit_code == 0
    assert runner.invoke(app, ["sweep", config, "--out", str(out), "-q"]).exit_code == 0
    exact = set(load_summary(out)["engine"])  # auto: batched or reference, as measured on this machine
    assert exact and exact <= {"batched", "reference"}  # none of the fast runs was kept
    result = runner.invoke(app, ["sweep", config, "--out", str(out), "--engine", "fast"])
    assert result.exit_code == 0 and "0 ran, 8 already done" in result.output
    assert set(load_summary(out)["engine"]) == exact


def test_a_package_on_disk_that_fails_when_called_is_compiled_again(monkeypatch, tmp_path):
    """A loaded package that raises when called (another structure's, with other inputs; a library that
    loads but does not run) is stale like one that disagrees: compiled again and used, with no warning,
    not a fallback to eager for every later batch and process while it stays on disk."""
    compiled: list[Path] = []

    def fake_compile(graph, inputs, package):
        compiled.append(package)
        package.write_bytes(b"package")

    def fake_load(package):
        if package.read_bytes() == b"other":
            def call(*args):
                raise RuntimeError("expected 9 inputs, got 11")
            return call
        return make_fx_step[0]

    make_fx_step: list = []
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(aot, "compile_package", lambda graph, inputs, package: (
        make_fx_step.append(graph), fake_compile(graph, inputs, package)))
    monkeypatch.setattr(aot, "load_package", fake_load)
    compiling.reset_cache()
    configs = runs(n=2, steps=4)
    first = train_fast(configs, compile=True)
    compiled[0].write_bytes(b"other")
    compiling.reset_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = train_fast(configs, compile=True)
    assert compiled == [compiled[0]] * 2 and compiled[0].read_bytes() == b"package"
    assert repr([r.metrics for r in again]) == repr([r.metrics for r in first])


def test_the_metrics_check_lets_one_accuracy_flip_through_but_not_a_wrong_loss():
    """A sample whose top two logits tie within rounding may flip between eager and compiled: accuracy moves
    by 1/n. Refusing that step made the compile choice depend on which batch a process met first."""
    eager = torch.tensor([[2.30, 1.10], [0.50, 0.25], [3.0, 4.0]])  # loss, accuracy, gradient norm per run
    assert compiling.metrics_close(eager, eager + torch.tensor([[0.0, 0.0], [1 / 64, 0.0], [0.0, 0.0]]))
    assert not compiling.metrics_close(eager, eager + torch.tensor([[0.0, 0.0], [0.25, 0.0], [0.0, 0.0]]))
    assert not compiling.metrics_close(eager, eager * torch.tensor([[1.01], [1.0], [1.0]]))
    assert not compiling.metrics_close(eager, eager[:, :1])


@given(st.lists(st.integers(0, 5), min_size=1, max_size=8), st.sampled_from(["adam", "adamw"]))
def test_a_compiled_steps_update_numbers_made_ahead_are_adam_hypers_at_each_step(frozen_at: list[int], name: str):
    """The fused step's numbers for each update, made ahead (`MadeAhead`) for runs all live, are bit for
    bit those `adam_hypers` makes at that update; once a run stops they come from `adam_hypers` with it
    frozen (every run of `frozen_at` stops after that step)."""
    optims = [OptimConfig(name=name, lr=0.01 * (1 + r), betas=(0.9, 0.99 - 0.01 * r), weight_decay=0.1 * r)
              for r in range(len(frozen_at))]
    schedule = [[o.lr * (s + 1) / 7 for o in optims] for s in range(7)]
    seen: list[torch.Tensor] = []

    def compiled(*tensors: torch.Tensor) -> tuple[torch.Tensor]:
        seen.append(tensors[-1].clone())
        return (torch.zeros(3, len(optims)),)

    params = [torch.zeros(len(optims), 2)]
    step = compiling.CompiledStep(compiled, FastOptimizer(name, optims, params), True, schedule)
    for s, lrs in enumerate(schedule):
        live = [s <= stop for stop in frozen_at]
        step.step({}, torch.zeros(1), torch.zeros(1), lrs, live)
        expected = fast_optim.adam_hypers(optims, name, s + 1, lrs, live)
        assert seen[-1].dtype == expected.dtype and torch.equal(seen[-1], expected)
