"""A run's start replayed from its structure's recorded construction (normexp/engines/fast/starts.py) is
`seeded_init`'s, bit for bit: every parameter and the task, for any structure and seed, and the generator
left where seeded_init leaves it whatever its state before. A construction that reads drawn values back
(`.item()`, `.tolist()`, NumPy, a data-dependent shape) or draws from a generator of its own is built for
each run instead. The store of kept starts: what a batch holds of one, what its budget counts, two threads
keeping one seed."""

from __future__ import annotations

import textwrap
import threading

import numpy as np
import pytest
import torch
from conftest import subprocess_output
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_config_space import VALUES

from normexp.config import ConfigError, RunConfig, validate_run
from normexp.engines import common
from normexp.engines.common import seeded_init
from normexp.engines.fast import starts, step
from normexp.registry import ARCHS, KINDS, PLACEMENTS

STRUCTURE_KEYS = sorted(k for k in VALUES if k.split(".")[0] in ("model", "norm", "data"))


def _equal_start(cfg: RunConfig, start: tuple[dict[str, torch.Tensor], object]) -> bool:
    params, task = start
    net, want = seeded_init(cfg)
    same_task = all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in ((getattr(task, f), getattr(want, f)) for f in ("x", "y", "positions", "val_x", "val_y")))
    return same_params(params, dict(net.named_parameters())) and same_task


def same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Equal names in equal order, each tensor of equal dtype, shape and bits."""
    return list(a) == list(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(a.values(), b.values()))


def _small(data: dict) -> dict:
    model = data.setdefault("model", {})
    model["depth"] = min(model.get("depth", 2), 3)
    model["width"] = min(model.get("width", 8), 8)
    return data


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(values=st.fixed_dictionaries({}, optional={k: VALUES[k] for k in STRUCTURE_KEYS}),
    seeds=st.lists(st.integers(0, 2**31 - 1), min_size=2, max_size=3, unique=True))
def test_a_replayed_start_is_seeded_inits_for_any_structure_and_seed(values: dict, seeds: list[int]):
    data: dict = {}
    for key, value in values.items():
        section, field = key.split(".")
        data.setdefault(section, {})[field] = value
    try:
        configs = [validate_run({**_small(data), "seed": seed}) for seed in seeds]
    except (ConfigError, ValueError):
        assume(False)
    for cfg in configs:  # the first records the structure (where it is new), the others replay it
        assert _equal_start(cfg, starts.seeded_start(cfg)), cfg


STRUCTURES = [(arch, placement, kind) for arch in ARCHS for placement, method in PLACEMENTS.items()
              if arch in method.archs for kind in KINDS]


@pytest.mark.parametrize("arch, placement, kind", STRUCTURES)
def test_every_registered_structure_is_replayed_exactly_and_only_admin_is_built(arch, placement, kind):
    """From the registry: each placement and kind on each architecture it applies to, its first run recorded
    and later seeds replayed, equal to seeded_init; Admin's profiling reads the run's own data (`.item()`),
    so its runs are built, never replayed."""
    task = {"task": "copy"} if arch == "transformer" else {}
    configs = [validate_run({"model": {"arch": arch, "depth": 2, "width": 8}, "data": task,
                             "norm": {"placement": placement, "kind": kind}, "seed": seed}) for seed in (3, 11, 0)]
    for cfg in configs:
        assert _equal_start(cfg, starts.seeded_start(cfg))
    replayed = starts.is_replayed(configs[0])
    assert replayed == (placement != "admin")


def assert_built_each_time(monkeypatch, alter) -> list[int]:
    """With every model's construction followed by `alter(its first weight)` (under no_grad), each of six
    runs starts as seeded_init starts it and the structure is never replayed. Returns the seeds built."""
    built: list[int] = []
    real = common.build_model

    def altered(cfg: RunConfig):
        net = real(cfg)
        with torch.no_grad():
            alter(next(net.parameters()))
        built.append(cfg.seed)
        return net

    monkeypatch.setattr(common, "build_model", altered)
    monkeypatch.setattr(starts, "build_model", altered)
    starts.reset()  # every structure met before forgotten: this one is recorded with `alter`
    configs = [validate_run({"model": {"depth": 2, "width": 8}, "seed": seed}) for seed in range(6)]
    for cfg in configs:
        assert _equal_start(cfg, starts.seeded_start(cfg)), cfg.seed
    assert not starts.is_replayed(configs[0])
    return built


def test_a_construction_that_reads_a_value_back_is_built_each_time(monkeypatch):
    """A model whose construction branches on a drawn value (an operation that returns no tensor) could
    make other operations for another seed: such a structure is never replayed, and each run is built."""

    def branching(weight: torch.Tensor) -> None:
        if weight.sum().item() > 0:  # read back: what follows depends on the seed's draws
            weight.mul_(2.0)

    built = assert_built_each_time(monkeypatch, branching)
    assert len(built) >= 2 * 6  # each run built (and again by the comparison), none replayed


def test_replaying_is_the_global_generators_draws_in_order():
    """The replay draws from the global generator exactly as the build does: after a run's start, the
    generator is where seeded_init leaves it (a later draw of the same process sees the same numbers)."""
    cfg = validate_run({"model": {"depth": 2, "width": 8}, "seed": 5})
    starts.seeded_start(validate_run({"model": {"depth": 2, "width": 8}, "seed": 4}))  # records the structure
    starts.seeded_start(cfg)
    after_replay = torch.rand(4)
    seeded_init(cfg)
    assert torch.equal(after_replay, torch.rand(4))


_aten = torch.ops.aten
BINDING_CALLS = {  # each of starts.BINDINGS with arguments as a recording holds them
    _aten.empty.memory_format: (([3, 5],), {"dtype": torch.float32, "device": torch.device("cpu"),
                                           "pin_memory": False}),
    _aten.detach.default: ((torch.ones(3, 5),), {}),
    _aten.uniform_.default: ((torch.empty(3, 5), -0.3, 0.7), {}),
    _aten.normal_.default: ((torch.empty(3, 5), 0.1, 2.0), {}),
    _aten.zero_.default: ((torch.ones(3, 5),), {}),
    _aten.fill_.Scalar: ((torch.empty(3, 5), 0.25), {}),
}


@pytest.mark.parametrize("op", list(starts.BINDINGS), ids=str)
def test_each_binding_a_replay_calls_is_its_operator(op):
    """A replay calls torch's Python binding for these operators: same result, same draws (the generator's
    state after them), as the operator's overload; `empty` the same shape, dtype and device."""
    assert set(BINDING_CALLS) == set(starts.BINDINGS)
    args, kwargs = BINDING_CALLS[op]
    outs = []
    for call in (op, starts.BINDINGS[op]):
        torch.manual_seed(5)
        out = call(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
        outs.append((out, torch.get_rng_state()))
    (a, state_a), (b, state_b) = outs
    assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device) and torch.equal(state_a, state_b)
    if op is not _aten.empty.memory_format:
        assert torch.equal(a, b)


@pytest.mark.process
def test_recording_a_structure_does_not_load_the_compiler():
    """A process's first run of a structure records its construction under a dispatch mode; torch wraps a
    mode's handler to keep torch.compile out of it, importing the compiler (~1 s in each sweep worker) unless
    the mode says it need not (`_Recorder._should_skip_dynamo`). Checked in a fresh process."""
    code = ("import sys; from normexp.config import RunConfig; from normexp.engines.fast import starts\n"
            "cfg = RunConfig.model_validate({'model': {'depth': 2, 'width': 8}})\n"
            "starts.seeded_start(cfg); starts.seeded_start(cfg.model_copy(update={'seed': 1}))\n"
            "assert starts.is_replayed(cfg), 'not recorded'\n"
            "print('torch._dynamo' in sys.modules)")
    assert subprocess_output(code).strip() == "False"


def _toy(seed: int, **sections: dict) -> RunConfig:
    return validate_run({"model": {"depth": 2, "width": 8}, **sections, "seed": seed})


def test_a_seed_met_again_starts_from_its_kept_replay_with_the_generator_where_seeded_init_leaves_it():
    """The runs of a grid that share a structure and a seed share one replayed start (`starts.Starts`): asked
    again, in any order and with other learning rates, each seed's start is seeded_init's, the very tensors
    kept the first time, and the global generator is left where seeded_init leaves it."""
    starts.seeded_start(_toy(99))  # records the structure
    first = {seed: starts.seeded_start(_toy(seed)) for seed in (4, 7)}
    for seed, lr in ((7, 0.5), (4, 0.01), (7, 0.02)):
        cfg = _toy(seed, optim={"lr": lr})
        params, task = starts.seeded_start(cfg)
        after = torch.rand(3)
        assert params is first[seed][0] and task is first[seed][1]
        assert _equal_start(cfg, (params, task))  # seeded_init(cfg) draws again: the generator's state after
        assert torch.equal(after, torch.rand(3))


def test_the_kept_starts_are_the_last_structures_and_fit_the_budget():
    """A new structure empties the store; a full one keeps what it has and replays the rest."""
    measure = starts.reset()
    starts.seeded_start(_toy(99))  # records the structure (its first run is built, not kept)
    starts.seeded_start(_toy(0))
    store = starts.reset(3 * measure.size)  # three seeds' parameters, task and generator state
    starts.seeded_start(_toy(99))
    for seed in range(5):
        starts.seeded_start(_toy(seed))
    assert sorted(store.by_seed) == [0, 1, 2] and store.size <= store.budget
    assert starts.seeded_start(_toy(4))[0] is not starts.seeded_start(_toy(4))[0]  # not kept: replayed each time
    other = _toy(1, norm={"placement": "post"})
    starts.seeded_start(other)  # records it where it is new (a recorded run is built, not kept)
    starts.seeded_start(other.model_copy(update={"seed": 2}))
    assert store.structure == starts.structure(other) and 2 in store.by_seed and 0 not in store.by_seed


# ----------------------------------------------------------------------------- reading drawn values back


def _largest(w: torch.Tensor) -> float:
    return max(abs(v) for v in w.flatten().tolist())


READS = {  # each reads the drawn weight back, without `.item()` or a comparison in an `if`
    "tolist": _largest,
    "numpy": lambda w: float(np.abs(w.numpy()).max()),
    "__array__": lambda w: float(np.asarray(w).std()),
    "a data-dependent shape": lambda w: float((w > 0).nonzero().shape[0]),
    "a data-dependent numel": lambda w: float(torch.unique(w > 0.1).numel() + (w > 0).nonzero().numel()),
}


@pytest.mark.parametrize("read", list(READS))
def test_a_construction_reading_values_back_without_item_is_built_not_replayed(monkeypatch, read):
    """A model whose construction scales a weight by a value read from the drawn weights: each seed's
    scale is its own, so a recording of the first seed's construction replays the wrong scale for the
    others. Such a structure must be built for each run, as `.item()` already makes it."""
    assert_built_each_time(monkeypatch, lambda weight: weight.mul_(READS[read](weight.detach())))


PACKAGE = '''
import torch
from torch import nn


class Measured:
    """x + g * Norm(F(x)), g = 1 / the largest |entry| of the branch's output weight, read with tolist."""

    stackable = True

    @staticmethod
    def build(block, norm):
        block.norm = norm()
        largest = max(abs(v) for v in block.branch.fc2.weight.detach().flatten().tolist())
        block.gain = nn.Parameter(torch.full((1,), 1.0 / largest))

    @staticmethod
    def forward(block, x):
        return x + block.gain * block.norm(block.branch(x))
'''


def test_a_users_placement_that_measures_its_branch_starts_as_seeded_init(tmp_path, monkeypatch):
    """docs/extending.md: a placement's build() may read the block it is given (its branch is drawn by
    then). One that reads the branch's weights through `.tolist()` starts each run as seeded_init does
    (the reference engine's start), not from the first seed's gain."""
    (tmp_path / "measuring.py").write_text(textwrap.dedent(PACKAGE))
    monkeypatch.syspath_prepend(str(tmp_path))
    starts.reset()
    configs = [validate_run({"model": {"depth": 2, "width": 8}, "norm": {"placement": "measuring:Measured"},
                             "seed": seed}) for seed in range(3)]
    for cfg in configs:
        assert _equal_start(cfg, starts.seeded_start(cfg)), cfg.seed


def test_after_a_structures_first_run_the_generator_is_where_seeded_init_leaves_it():
    """A seed met again is checked for this above; the first run of a structure (built, then recorded and
    replayed once for the check) must leave the global generator after the task's draws too, as
    seeded_init does, not after the model's only."""
    starts.reset()
    cfg = validate_run({"model": {"depth": 2, "width": 8}, "seed": 5})
    starts.seeded_start(cfg)
    after_first = torch.rand(4)
    common.seeded_init(cfg)
    assert torch.equal(after_first, torch.rand(4))


# ----------------------------------------------------------------------------- the generator before and after a replay


TRANSFORMER = {"model": {"arch": "transformer", "depth": 1, "width": 16}, "data": {"task": "assoc_recall"}}


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), before=st.integers(0, 2**64 - 1), draws=st.integers(0, 3),
       arch=st.sampled_from(["ffn", "transformer"]))
def test_a_replayed_start_and_the_generator_after_it_do_not_depend_on_the_generator_before(seed, before, draws, arch):
    """A replay seeds the CPU generator alone (`starts._seed`): over the whole range of seeds the schema allows,
    whatever the generator's state before (another seed, draws of normal samples, whose cached second value
    torch.manual_seed clears), the replayed start is seeded_init's and the generator's whole state after it
    (get_rng_state: the Mersenne state and the normal caches) is where seeded_init leaves it."""
    structure = TRANSFORMER if arch == "transformer" else {"model": {"depth": 2, "width": 8}}
    starts.seeded_start(RunConfig.model_validate({**structure, "seed": seed ^ 1}))  # the structure recorded
    cfg = RunConfig.model_validate({**structure, "seed": seed})
    assert starts.is_replayed(cfg)  # replayed, not built
    torch.manual_seed(before)
    torch.randn(draws)  # an odd count leaves a normal sample cached
    params, task = starts.seeded_start(cfg)
    after = torch.get_rng_state()
    net, want = seeded_init(cfg)
    assert torch.equal(after, torch.get_rng_state())
    assert same_params(params, dict(net.named_parameters()))
    assert torch.equal(task.x, want.x) and torch.equal(task.y, want.y)


def test_a_construction_drawing_from_its_own_generator_is_built_each_time(monkeypatch):
    """`starts._seed` seeds the CPU generator alone; a construction that draws from another generator (here
    its own, seeded alike for every run) fails `_record`'s check, whose replay is seeded the same way, so its
    structure is built, never replayed from a generator left where the check left it."""

    def own_draws(weight: torch.Tensor) -> None:
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(7)))

    assert len(assert_built_each_time(monkeypatch, own_draws)) >= 6


# ----------------------------------------------------------------------------- the store of kept starts


def _sequence(seed: int, **data: object) -> RunConfig:
    return validate_run({"model": {"arch": "transformer", "depth": 2, "width": 8, "n_heads": 2},
                         "data": {"task": "modular_add", "vocab": 12, "n_samples": 48, "n_val": 24, **data},
                         "train": {"steps": 2}, "seed": seed})


def _storages(tensors: object) -> dict[int, int]:
    """Each storage the tensors use, once: its address and its bytes."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tensors if isinstance(t, torch.Tensor)}


def test_a_batch_shares_no_storage_with_a_kept_start():
    """stack_runs hands the batch copies of every kept tensor, the answer positions included (`.to("cpu")`
    of a CPU tensor is that tensor): a write into the batch (the compiled Adam step updates in place) can
    never reach the start that later runs of the same seed are given."""
    store = starts.reset()
    starts.seeded_start(_sequence(99))  # records the structure (its first run is built, not kept)
    batch = step.stack_runs([_sequence(0), _sequence(1)], "cpu")
    kept = [t for params, task, _ in store.by_seed.values() for t in (*params.values(), *vars(task).values())]
    held = [*batch.params.values(), batch.x, batch.y, batch.positions, batch.val_x, batch.val_y]
    assert sorted(store.by_seed) == [0, 1]
    assert not set(_storages(kept)) & set(_storages(held))


def test_the_budget_counts_the_storage_a_kept_start_holds_each_once():
    """A sequence task's inputs are views of its drawn sequences (x = train[:, :-1]; modular_add's two
    splits are views of one tensor): what a kept start holds alive is the storages, each counted once, and
    that is what the budget bounds."""
    store = starts.reset()
    starts.seeded_start(_sequence(99))  # records the structure (its first run is built, not kept)
    params, task = starts.seeded_start(_sequence(3))
    after = store.by_seed[3][2]
    held = sum(_storages((*params.values(), *vars(task).values(), after)).values())
    assert held > sum(t.nbytes for t in (*params.values(), *vars(task).values(), after) if t is not None)
    assert store.size == held


def test_two_threads_replaying_one_seed_at_once_keep_it_once(monkeypatch):
    """Two batches of one structure trained in two threads (the paired thread executor) miss the same
    seed together: the store keeps one start for it and counts its bytes once."""
    store = starts.reset()
    starts.seeded_start(_sequence(99))  # records the structure (its first run is built, not kept)
    replayed, together = starts.replay_start, threading.Barrier(2, timeout=30)

    def replayed_together(recording: starts.Recording, cfg: RunConfig) -> tuple:
        start = replayed(recording, cfg)
        together.wait()  # both have replayed seed 5, neither has kept it yet
        return start

    monkeypatch.setattr(starts, "replay_start", replayed_together)
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(starts.seeded_start(_sequence(5)))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    monkeypatch.setattr(starts, "replay_start", replayed)
    single = starts.reset()
    starts.seeded_start(_sequence(99))
    starts.seeded_start(_sequence(5))
    assert len(got) == 2 and list(store.by_seed) == [5]
    assert store.size == single.size
