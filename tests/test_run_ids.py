"""Run ids survive upgrades: today's ids are pinned, and a key added with a default leaves them alone.

A finished sweep is found again by its run ids (the folder names). If a release changed the id of a
run whose config it did not change, every finished sweep would be retrained. The golden ids below were
computed by release 0.1, before any key was added after it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import create_model

from normexp.config import ModelConfig, RunConfig, load_sweep
from normexp.folder import run_id
from normexp.folder.ids import HASHED_SINCE_0_1, config_hash, earlier_run_id, hashed_config

ROOT = Path(__file__).resolve().parent.parent

WARMUP_IDS = ["post-layernorm-s0-eab306657c", "post-rmsnorm-s0-6c00cd2a84",
              "pre-layernorm-s0-cfccfa7a2b", "pre-rmsnorm-s0-65c4558701"]

PLACEMENT_IDS = {  # {"norm": {"placement": p}, "model": {"depth": 4, "width": 8}, "train": {"steps": 5}}
    "post": "post-layernorm-s0-45d6994c68",
    "pre": "pre-layernorm-s0-cdb85b88c7",
    "sandwich": "sandwich-layernorm-s0-07a6999c98",
    "peri": "peri-layernorm-s0-bb618540e8",
    # DeepNorm's FFN constants were revised to DeepNet's sublayer count (N^(1/4), (4N)^(-1/4) for N
    # blocks, docs/sources.md): the run trains differently, so it has a new id; its release 0.1 id,
    # "deepnorm-layernorm-s0-0a8a95ac65", is still its `earlier_run_id` (test below).
    "deepnorm": "deepnorm-layernorm-s0-7ed454694b",
    "mixln": "mixln-layernorm-s0-b3b0e24d14",
    "none": "none-layernorm-s0-9bac816e28",
}


def test_the_article_sweep_keeps_its_ids() -> None:
    assert [run_id(cfg) for cfg in load_sweep(ROOT / "configs" / "warmup.yaml").runs] == WARMUP_IDS


@pytest.mark.parametrize("placement", sorted(PLACEMENT_IDS))
def test_each_placement_keeps_its_id(placement: str) -> None:
    cfg = RunConfig.model_validate({"norm": {"placement": placement}, "model": {"depth": 4, "width": 8},
                                    "train": {"steps": 5}})
    assert run_id(cfg) == PLACEMENT_IDS[placement]


def test_every_key_of_release_0_1_is_still_hashed() -> None:
    flat = {f"{section}.{key}" if isinstance(values, dict) else section
            for section, values in hashed_config(RunConfig()).items()
            for key in (values if isinstance(values, dict) else [None])}
    assert HASHED_SINCE_0_1 <= flat


def _with_a_new_key() -> type[RunConfig]:
    """RunConfig as a later release might grow it: a defaulted key in a section and a new section."""
    model = create_model("ModelWithPositions", __base__=ModelConfig, positions=(str, "learned"))
    extra = create_model("LoggingConfig", __base__=ModelConfig.__bases__[0], every=(int, 1))
    return create_model("RunConfigLater", __base__=RunConfig, model=(model, model()), logging=(extra, extra()))


def test_a_key_added_at_its_default_keeps_the_id() -> None:
    later = _with_a_new_key()
    for data in ({}, {"norm": {"placement": "post"}, "optim": {"name": "sgd", "lr": 0.1}}):
        assert config_hash(later.model_validate(data)) == config_hash(RunConfig.model_validate(data))


def test_a_key_added_and_set_away_from_its_default_changes_the_id() -> None:
    later = _with_a_new_key()
    base = config_hash(later())
    assert config_hash(later.model_validate({"model": {"positions": "rotary"}})) != base
    assert config_hash(later.model_validate({"logging": {"every": 5}})) != base


def test_the_placement_keys_enter_the_hash_only_off_their_declared_default() -> None:
    """norm.output_norm_init and norm.dyt_alpha0 came after 0.1: at their defaults no id moves."""
    assert {"norm.output_norm_init", "norm.dyt_alpha0"}.isdisjoint(HASHED_SINCE_0_1)
    for placement, expected in PLACEMENT_IDS.items():
        at_default = RunConfig.model_validate({
            "norm": {"placement": placement, "output_norm_init": "ones", "dyt_alpha0": 0.5},
            "model": {"depth": 4, "width": 8}, "train": {"steps": 5}})
        assert run_id(at_default) == expected
    base = RunConfig.model_validate({"norm": {"placement": "respost", "kind": "dyt"}})
    zeros = base.model_copy(update={"norm": base.norm.model_copy(update={"output_norm_init": "zeros"})})
    alpha = base.model_copy(update={"norm": base.norm.model_copy(update={"dyt_alpha0": 1.0})})
    assert len({config_hash(base), config_hash(zeros), config_hash(alpha)}) == 3


def test_the_transformer_keys_enter_the_hash_only_off_their_declared_default() -> None:
    """model.arch, model.n_heads and the sequence tasks' data keys came after 0.1."""
    added = {"model.arch", "model.n_heads", "data.vocab", "data.seq_len", "data.n_val", "data.batch_size"}
    assert added.isdisjoint(HASHED_SINCE_0_1)
    explicit = RunConfig.model_validate({"model": {"arch": "ffn", "n_heads": 4}})
    assert config_hash(explicit) == config_hash(RunConfig())
    transformer = RunConfig.model_validate({"model": {"arch": "transformer"}, "data": {"task": "copy"}})
    assert hashed_config(transformer)["model"]["arch"] == "transformer"
    assert "n_heads" not in hashed_config(transformer)["model"]


EARLIER_IDS = {"deepnorm": "deepnorm-layernorm-s0-0a8a95ac65"}  # release 0.1's, before the revision


@pytest.mark.parametrize("placement", sorted(PLACEMENT_IDS))
def test_a_revised_definition_keeps_the_earlier_id_as_its_earlier_run_id(placement: str) -> None:
    """A placement whose definition was revised (DeepNorm on the FFN toy) names the folder it had before,
    so verify and report can say what that folder is; the others have no earlier id."""
    cfg = RunConfig.model_validate({"norm": {"placement": placement}, "model": {"depth": 4, "width": 8},
                                    "train": {"steps": 5}})
    assert earlier_run_id(cfg) == EARLIER_IDS.get(placement)
