"""Revised placements and run ids: a revised placement changes a run's id exactly where it changes what
the run trains, and Mix-LN's integer count is the floor of f * N as the decimals written mean it."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from normexp.config import RunConfig, mixln_post_count, validate_run
from normexp.engines.common import seeded_init
from normexp.folder import run_id
from normexp.folder.ids import revised_definition

# each revised placement whose earlier reading has a key, with that key (docs/sources.md)
EARLIER_READING = {
    "b2t": {"b2t_rescale": False},
    "admin": {"admin_profile": "closed_form"},
}


def _config(arch: str, placement: str, depth: int, **norm: object) -> RunConfig:
    model = {"arch": arch, "depth": depth, "width": 8}
    raw = {"model": model, "norm": {"placement": placement, **norm}, "train": {"steps": 1}}
    if arch == "transformer":
        model["n_heads"] = 2
        raw["data"] = {"task": "assoc_recall", "seq_len": 8, "n_samples": 8, "n_val": 8}
    return validate_run(raw)


def _initial_state(cfg: RunConfig) -> dict[str, torch.Tensor]:
    model, _ = seeded_init(cfg)
    return model.state_dict()


@pytest.mark.parametrize("arch", ["ffn", "transformer"])
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("placement", sorted(EARLIER_READING))
def test_a_run_the_revision_leaves_unchanged_keeps_its_id(placement: str, depth: int, arch: str) -> None:
    """Where the authors' init equals normexp's earlier one (B2T's N^(-1/2) at N = 1, Admin's single
    omega = 1 on a one-block FFN toy), the run trains as before, so its id must be the one it had."""
    if placement == "b2t" and arch == "ffn":
        return  # the FFN toy refuses b2t
    cfg = _config(arch, placement, depth)
    earlier = _config(arch, placement, depth, **EARLIER_READING[placement])
    new_state, old_state = _initial_state(cfg), _initial_state(earlier)
    unchanged = all(torch.equal(new_state[name], old_state[name]) for name in new_state)
    assert (revised_definition(cfg) is None) == unchanged
    assert (run_id(cfg) == run_id(cfg, revised=False)) == unchanged


@pytest.mark.parametrize("hundredths", range(1, 100))
def test_mixln_count_is_the_floor_of_the_written_fraction(hundredths: int) -> None:
    """f written with two decimals: floor(f * N) computed exactly (0.58 of 50 layers is 29, where the
    float product 28.999999999999996 floored to 28)."""
    fraction = hundredths / 100
    for depth in range(1, 257):
        assert mixln_post_count(depth, fraction) == int(Fraction(hundredths, 100) * depth), (fraction, depth)
