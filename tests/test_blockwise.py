"""The fast engine's Adam step compiled block by block (normexp/engines/fast/blockwise.py): it computes what the
whole step computes, for every FFN placement, norm and init it serves; it serves only models that are a chain;
and two processes that start cold compile two of its pieces at once."""

from __future__ import annotations

import fcntl
import warnings

import pytest
import torch
from test_fast import runs
from test_fast_compiled import traced_eagerly
from test_starts import TRANSFORMER

from normexp.config import RunConfig
from normexp.engines.fast import aot, blockwise, plan, starts, train_fast
from normexp.engines.fast import compiled as compiling

STRUCTURES = [
    {"placement": "post", "kind": "layernorm"},
    {"placement": "pre", "kind": "rmsnorm"},
    {"placement": "sandwich", "kind": "rmsnorm_gemma"},
    {"placement": "peri", "kind": "layernorm", "peri_input_norm": False},
    {"placement": "deepnorm", "kind": "layernorm"},
    {"placement": "mixln", "kind": "layernorm"},
    {"placement": "none", "kind": "layernorm"},
    {"placement": "rezero", "kind": "layernorm"},
    {"placement": "respost", "kind": "dyt"},
    {"placement": "admin", "kind": "layernorm"},
]


def deep(norm: dict, depth: int = 4, init: str | None = None, n: int = 4, steps: int = 4) -> list[RunConfig]:
    base = runs(n=n, steps=steps, depth=depth)
    out = []
    for cfg in base:
        data = cfg.model_dump(mode="json")
        data["norm"].update(norm)
        if init:
            data["model"]["init"] = init
        out.append(RunConfig.model_validate(data))
    return out


def final_losses(results) -> list[float]:
    """Each run's losses and gradient norms, step by step."""
    return [x for r in results for x in r.metrics["loss"] + r.metrics["grad_norm"]]


@pytest.mark.parametrize("norm", STRUCTURES, ids=lambda n: f"{n['placement']}-{n['kind']}")
def test_the_step_compiled_block_by_block_computes_the_whole_steps_function(monkeypatch, norm):
    """Each placement's chain, its pieces traced and run as the compiled ones are called: the engine's check
    against the eager whole step passes (no fallback), and the runs train as the uncompiled engine trains
    them, within rounding. Mix-LN's blocks are two structures: two forwards, two backwards."""
    keys: list[str] = []
    monkeypatch.setattr(aot, "load_or_compile", traced_eagerly(keys))
    compiling.reset_cache()
    cfgs = deep(norm)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a refused step warns and trains uncompiled
        got = train_fast(cfgs, compile=True)
    pieces = sorted(key.rsplit(".", 1)[1] for key in keys)
    groups = 2 if norm["placement"] == "mixln" else 1
    assert pieces == sorted([f"block{g}-{p}" for g in range(groups) for p in ("forward", "backward", "update")]
                            + ["readout"])
    eager = train_fast(cfgs, compile=False)
    for a, b in zip(final_losses(got), final_losses(eager)):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("init", ["fixup", "tfixup"])
def test_inits_that_add_parameters_or_rescale_are_served_too(monkeypatch, init):
    """Fixup's blocks carry scalar shifts and a multiplier (and its head a shift): each is a parameter of its
    block or of the readout, updated by the piece that holds it."""
    keys: list[str] = []
    monkeypatch.setattr(aot, "load_or_compile", traced_eagerly(keys))
    compiling.reset_cache()
    cfgs = deep({"placement": "none" if init == "fixup" else "post", "kind": "layernorm"}, init=init)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = train_fast(cfgs, compile=True)
    assert any(key.endswith(".readout") for key in keys)
    for a, b in zip(final_losses(got), final_losses(train_fast(cfgs, compile=False))):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)


def test_a_wrong_piece_is_caught_by_the_check_and_the_structure_trains_uncompiled(monkeypatch):
    """A backward piece that hands back the wrong gradient (doubled) fails the check against the eager whole
    step, compiled again and still wrong: the structure is refused and trains uncompiled, as the whole step's
    failure does."""
    def load_or_compile(key, trace, inputs, fresh=False, wait=True):
        graph = trace()
        if key.endswith("-backward"):
            return (lambda *a: [g * 2 for g in graph(*a)[:-1]] + [graph(*a)[-1]]), True
        return graph, True

    monkeypatch.setattr(aot, "load_or_compile", load_or_compile)
    compiling.reset_cache()
    cfgs = deep({"placement": "pre", "kind": "layernorm"})
    with pytest.warns(RuntimeWarning, match="compiling the step failed"):
        got = train_fast(cfgs, compile=True)
    assert final_losses(got) == final_losses(train_fast(cfgs, compile=False))


@pytest.mark.parametrize("what", ["resdual", "peri input norm", "shallow", "transformer", "sgd",
                                  "clip_norm", "a user's placement"])
def test_only_a_chain_trained_by_a_fused_adam_step_is_compiled_block_by_block(what):
    """ResiDual carries two streams, Peri-LN's input norm has parameters, a model under BLOCKWISE_DEPTH compiles
    whole in seconds, the Transformer is not the FFN toy, SGD and a clipped Adam have no update inside the compiled
    step, and a user's placement is traced whole: each is compiled whole, in batches of COMPILED_CHUNK runs; the
    chain in batches of BLOCKWISE_CHUNK."""
    chain = deep({"placement": "pre"})[0]
    assert plan.by_blocks(chain) and plan.chunk_runs(chain, True) == plan.BLOCKWISE_CHUNK
    assert blockwise.chain_of(starts.meta_model(chain)).blocks
    data = chain.model_dump(mode="json")
    if what == "transformer":
        data = TRANSFORMER
    elif what == "shallow":
        data["model"]["depth"] = plan.BLOCKWISE_DEPTH - 1
    elif what in ("sgd", "clip_norm"):
        data["optim"].update({"name": "sgd"} if what == "sgd" else {"clip_norm": 1.0})
    else:
        data["norm"]["placement"] = {"resdual": "resdual", "peri input norm": "peri",
                                     "a user's placement": "test_blockwise:Doubled"}[what]
    cfg = RunConfig.model_validate(data)
    assert not plan.by_blocks(cfg) and plan.chunk_runs(cfg, True) == plan.COMPILED_CHUNK


class Doubled:
    """A user's placement: x + 2 F(norm(x))."""

    @staticmethod
    def forward(block, x):
        return x + 2 * block.branch(block.norm(x))


def test_a_piece_another_process_is_compiling_is_left_for_last(tmp_path, monkeypatch):
    """Without waiting, a piece whose lock another holder has is not compiled (None); once the lock is free it
    is. (flock conflicts between two open files of one process as between two processes.)"""
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path))
    folder = aot.steps_dir()
    folder.mkdir(parents=True)
    traced = []

    def trace():
        traced.append(1)
        raise RuntimeError("compiling")

    with open(folder / "k.lock", "a+b") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        assert aot.load_or_compile("k", trace, [torch.zeros(1)], wait=False) is None
        assert not traced
        fcntl.flock(other, fcntl.LOCK_UN)
    with pytest.raises(RuntimeError, match="compiling"):
        aot.load_or_compile("k", trace, [torch.zeros(1)], wait=False)
    assert traced == [1]


def test_the_readout_is_the_models_own_end():
    """`Net.forward` is its blocks, then `Net.readout`: the chain's readout module computes the same logits."""
    cfg = deep({"placement": "post"})[0]
    model = starts.seeded_start(cfg)[0]
    net = starts.meta_model(cfg)
    chain = blockwise.chain_of(net)
    x = torch.randn(3, cfg.model.width)
    params = {name: p for name, p in model.items()}
    h = x
    for block, names in chain.blocks:
        h = torch.func.functional_call(block, {n.split(".", 2)[2]: params[n] for n in names}, (h,))
    logits = torch.func.functional_call(chain.readout, {f"net.{n}": params[n] for n in chain.readout_names}, (h,))
    assert torch.equal(logits, torch.func.functional_call(net, params, (x,)))


@pytest.mark.slow
def test_the_pieces_compile_pass_the_check_and_load_in_a_later_process(tmp_path, monkeypatch):
    """Compiled for real (AOTInductor, four packages): the check against the eager whole step passes, the
    runs train within rounding of the uncompiled engine, and a later process loads the pieces, vouched for,
    and gives the same bits."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("NORMEXP_CACHE_DIR", str(tmp_path))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # where torch's loader extracts each package's library
    compiling.reset_cache()
    cfgs = deep({"placement": "post", "kind": "layernorm"}, depth=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        compiled = train_fast(cfgs, compile=True)
    assert sorted(p.name.split(".")[1] for p in (tmp_path / "steps").glob("*.pt2")) == [
        "block0-backward", "block0-forward", "block0-update", "readout"]
    assert len(list((tmp_path / "steps").glob("*.checked"))) == 1
    for a, b in zip(final_losses(compiled), final_losses(train_fast(cfgs, compile=False))):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    compiling.reset_cache()
    assert [repr(r.metrics) for r in train_fast(cfgs, compile=True)] == [repr(r.metrics) for r in compiled]
    assert not list((tmp_path / "tmp").glob("aotinductor_*"))  # each load removed the library it extracted


def test_the_sweeps_engine_line_says_the_step_is_compiled_block_by_block():
    from normexp.sweep import blockwise_note

    assert blockwise_note(deep({"placement": "post"}), compile=True) == (
        f" block by block ({plan.BLOCKWISE_CHUNK} runs a batch: its compile does not grow with the depth)")
    assert blockwise_note(deep({"placement": "post"}, depth=2), compile=True) == ""


def test_a_step_compiled_block_by_block_pays_for_its_compile_sooner():
    """The automatic compile choice weighs a block-by-block compile at BLOCKWISE_COMPILE_ESTIMATE_S, not the whole
    graph's COMPILE_ESTIMATE_S: the article's model (depth 32) compiles from fewer planned model-steps with Adam
    than with SGD, whose step is compiled whole."""
    adam = RunConfig()
    sgd = RunConfig.model_validate({"optim": {"name": "sgd"}})
    assert plan.by_blocks(adam) and not plan.by_blocks(sgd)
    assert plan.should_compile(adam, 50_000) and not plan.should_compile(sgd, 50_000)
    assert not plan.should_compile(adam, 64 * 31)


def test_a_stale_loaded_piece_beside_pieces_compiled_now_is_compiled_again(monkeypatch):
    """A forward piece loaded from its package that computes something else (stale), while the other pieces are
    compiled now: the check fails, and the stale piece is compiled again (fresh), as a loaded whole step that
    fails the check is; the structure is not refused for what the compiler never got wrong."""
    fresh_calls: list[str] = []

    def load_or_compile(key, trace, inputs, fresh=False, wait=True):
        if fresh:
            fresh_calls.append(key)
        graph = trace()
        if key.endswith("-forward") and not fresh:  # loaded: another step's bytes, its output doubled
            return (lambda *a: [2 * t for t in graph(*a)]), False
        return graph, True

    monkeypatch.setattr(aot, "load_or_compile", load_or_compile)
    compiling.reset_cache()
    cfgs = deep({"placement": "pre", "kind": "layernorm"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a refused step warns and trains uncompiled
        got = train_fast(cfgs, compile=True)
    assert any(key.endswith("-forward") for key in fresh_calls)
    for a, b in zip(final_losses(got), final_losses(train_fast(cfgs, compile=False))):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)


def test_the_engine_line_names_block_by_block_only_where_such_a_structure_compiles():
    """A sweep whose chain trains uncompiled (its planned model-steps do not pay for a compile, or --no-compile
    for it is not asked but the exact engines train it: train.log_blocks) while another structure compiles
    whole: the engine line does not claim a block-by-block compile; with --compile it does."""
    from normexp.sweep import blockwise_note

    chain = deep({"placement": "post"})  # a few tiny steps: never pays for a compile
    whole = [RunConfig.model_validate({"optim": {"name": "sgd"}, "train": {"steps": 100_000}})]  # pays
    assert plan.by_blocks(chain[0]) and not plan.by_blocks(whole[0])
    assert blockwise_note([*chain, *whole]) == ""
    assert blockwise_note([*chain, *whole], compile=True) != ""
    logged = [RunConfig.model_validate({**c.model_dump(mode="json"), "train": {**c.train.model_dump(mode="json"),
                                                                               "log_blocks": True}}) for c in chain]
    assert blockwise_note([*logged, *whole], compile=True) == ""
