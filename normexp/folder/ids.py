"""A run's id: its resolved config hashed (`hashed_config`, `config_hash`), under a readable name (`run_id`).

A run id never changes across releases: the keys of release 0.1 are always hashed, a key added since only
where a run sets it away from its default, and a run whose placement normexp revised to its authors'
definition hashes the revision (`REVISED_DEFINITIONS`). Never change a byte of what is hashed:
tests/test_run_ids.py holds golden ids.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import weakref
from typing import Any, get_args

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from normexp.config import NormKind, Placement, RunConfig, mixln_post_count, section_cache
from normexp.registry import PLUGIN_PREFIX, short_name

# The keys a run id covered when run ids were defined (release 0.1): they are always hashed, as then.
# A key added since enters the hash only where a run sets it away from its declared default, so a release
# that adds a defaulted key keeps the id, and the folder, of every finished run that leaves it there.
# Never edit this set. A new key's declared default must be the value it means (not a None that a
# validator resolves from other keys), or its runs could not be told apart from the old ones.
HASHED_SINCE_0_1 = frozenset({
    "model.depth", "model.width", "model.hidden_mult", "model.n_classes", "model.final_norm", "model.init",
    "norm.placement", "norm.kind", "norm.eps", "norm.peri_input_norm", "norm.mixln_fraction",
    "norm.deepnorm_alpha", "norm.deepnorm_beta", "norm.prms_fraction", "data.task", "data.n_samples",
    "optim.name", "optim.lr", "optim.betas", "optim.eps", "optim.weight_decay", "optim.momentum",
    "schedule.kind", "schedule.warmup_steps", "schedule.min_lr_ratio", "train.steps", "train.threads",
    "train.stop_on_nonfinite", "seed",
})


@functools.cache
def _declared_default(model: type[BaseModel], name: str) -> Any:
    return to_jsonable_python(model.model_fields[name].get_default(call_default_factory=True))


@section_cache
def _section_view(section: str, value: BaseModel) -> dict[str, Any] | None:
    """The hashed part of one config section (see `hashed_config`); None where nothing of it is hashed.
    Cached: the 10,000 runs of a grid hold a few dozen distinct sections (a copy is handed out)."""
    values = value.model_dump(mode="json")
    model = type(value)
    kept = {key: v for key, v in values.items()
            if f"{section}.{key}" in HASHED_SINCE_0_1 or v != _declared_default(model, key)}
    if kept or any(key.startswith(f"{section}.") for key in HASHED_SINCE_0_1):
        return kept
    return None


# Placements whose definition normexp revised to the authors' own (docs/sources.md), with what changed.
# A run that the revision changes hashes {"definition": {placement: 2}} as well, so it gets a new id and
# no run trained under the earlier definition is reused or reported as the new one; every other run
# keeps its id. A folder of the earlier definition is recognised (`earlier_run_id`) and named as such.
REVISED_DEFINITIONS = {
    "b2t": "B2T now rescales the layer weights by N^(-1/2) at init (the authors' rescaling_init)",
    "resdual": "ResiDual's dual stream now starts at the embedding and has no final norm after it",
    "admin": "Admin now profiles omega from measured variances, sublayer by sublayer (Transformer-Clinic)",
    "rezero": "ReZero's Transformer layers now share one gate between attention and FFN",
    "deepnorm": "DeepNorm on the FFN toy now counts one sublayer per block: N^(1/4), (4N)^(-1/4)",
    "mixln": "Mix-LN now makes floor(f * N) layers Post-LN, not round(f * N)",
}


def revised_definition(cfg: RunConfig) -> str | None:
    """The placement of REVISED_DEFINITIONS whose revision changes how `cfg` trains, else None."""
    norm, arch, placement = cfg.norm, cfg.model.arch, cfg.norm.placement
    if placement == "resdual":
        return placement
    if placement == "b2t" and cfg.model.depth > 1:  # one layer: N^(-1/2) = 1 rescales nothing
        return placement
    if placement == "admin" and (arch == "transformer" or cfg.model.depth > 1):  # one FFN block: omega = 1 either way
        return placement
    if placement == "rezero" and arch == "transformer":  # an FFN block had one gate already
        return placement
    if placement == "deepnorm" and arch == "ffn" and (norm.deepnorm_alpha is None or norm.deepnorm_beta is None):
        return placement
    depth, fraction = cfg.model.depth, norm.mixln_fraction
    if placement == "mixln" and mixln_post_count(depth, fraction) != round(fraction * depth):
        return placement
    return None


def hashed_config(cfg: RunConfig, revised: bool = True) -> dict[str, Any]:
    """The part of a resolved config that its run id covers: every 0.1 key, and later keys off their
    default; and, for a run whose placement's definition was revised, the revision (`revised` False:
    the view before it, the one normexp's earlier definition hashed)."""
    view: dict[str, Any] = {}
    for section in type(cfg).model_fields:
        value = getattr(cfg, section)
        if isinstance(value, BaseModel):  # a grid's runs share their sections: each is viewed once
            try:
                kept = _section_view(section, value)
            except TypeError:  # an unhashable section value: viewed here
                kept = _section_view.__wrapped__(section, value)
            if kept is not None:
                view[section] = dict(kept)
            continue
        values = to_jsonable_python(value)
        if section in HASHED_SINCE_0_1 or values != _declared_default(RunConfig, section):
            view[section] = values
    placement = revised_definition(cfg)
    if revised and placement is not None:
        view["definition"] = {placement: 2}
    return view


def config_hash(cfg: RunConfig, revised: bool = True) -> str:
    """A stable hash of the resolved config (see `hashed_config`): equal configs, equal hashes, anywhere.
    The SHA-256 of `_canonical(hashed_config(cfg, revised))`, written a section at a time (`_canonical_view`),
    once per config object while it lives (`_HASHES`: a command of 10,000 runs asks for each several times)."""
    key = (id(cfg), revised)
    known = _HASHES.get(key)
    if known is not None and known[0]() is cfg:
        return known[1]
    value = hashlib.sha256(_canonical_view(cfg, revised).encode()).hexdigest()
    _HASHES[key] = (weakref.ref(cfg, lambda _, key=key: _HASHES.pop(key, None)), value)
    return value


# config_hash's values by config object (a RunConfig is frozen: its hash never changes), each entry dropped
# when its object is (the weak reference's callback runs before the object's id can be reused)
_HASHES: dict[tuple[int, bool], tuple[weakref.ref, str]] = {}


def _canonical(value: Any) -> str:
    """The one JSON text that a hashed view is hashed as: keys sorted, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _canonical_view(cfg: RunConfig, revised: bool) -> str:
    """`_canonical(hashed_config(cfg, revised))`, the same text, from each section's text (`_section_text`,
    each distinct section written once): JSON writes an object's members one after the other, so the
    sorted members' texts joined are its text. A 10,000-run grid hashes in a tenth of the time."""
    members = {}
    for section in type(cfg).model_fields:
        value = getattr(cfg, section)
        if isinstance(value, BaseModel):
            try:
                text = _section_text(section, value)
            except TypeError:  # an unhashable section value: written here
                text = _section_text.__wrapped__(section, value)
            if text is not None:
                members[section] = text
            continue
        values = to_jsonable_python(value)
        if section in HASHED_SINCE_0_1 or values != _declared_default(RunConfig, section):
            members[section] = _canonical(values)
    placement = revised_definition(cfg)
    if revised and placement is not None:
        members["definition"] = _canonical({placement: 2})
    # the members' names are identifiers (sections, "definition"): JSON writes each as itself in quotes
    return "{" + ",".join(f'"{name}":{members[name]}' for name in sorted(members)) + "}"


@section_cache
def _section_text(section: str, value: BaseModel) -> str | None:
    kept = _section_view(section, value)
    return None if kept is None else _canonical(kept)


def run_id(cfg: RunConfig, revised: bool = True) -> str:
    """A readable, unique folder name: `post-layernorm-s0-1a2b3c4d5e` (a user's own placement or kind
    reads `ext_<attribute>`; its whole reference is in the hash)."""
    norm = cfg.norm
    return f"{short_name(norm.placement)}-{short_name(norm.kind)}-s{cfg.seed}-{config_hash(cfg, revised)[:10]}"


def _one_of(names: tuple[str, ...]) -> str:
    return "(?:" + "|".join(re.escape(name) for name in names) + ")"


# The names `run_id` makes, and only those: a folder so named may be normexp's (verify --fix removes it when
# it is broken and holds normexp's files alone: `remove_run_folder`); any other is a user's and never
# touched. Built from the config's own names, so a placement or norm kind added there is matched here.
_OWN = rf"{re.escape(PLUGIN_PREFIX)}[a-z0-9_]+"  # a user's placement or kind (registry.short_name)


RUN_ID = re.compile(rf"(?:{_one_of(get_args(Placement))}|{_OWN})-(?:{_one_of(get_args(NormKind))}|{_OWN})"
                    r"-s(?:0|[1-9][0-9]*)-[0-9a-f]{10}")


def is_run_id(name: str) -> bool:
    """Whether `name` has the form of a run id (`run_id`): `post-layernorm-s0-1a2b3c4d5e`."""
    return RUN_ID.fullmatch(name) is not None


def earlier_run_id(cfg: RunConfig) -> str | None:
    """The id `cfg` had under normexp's earlier definition of its placement, if its revision changed it."""
    return run_id(cfg, revised=False) if revised_definition(cfg) is not None else None


def superseded_problem(cfg: RunConfig) -> str:
    """What a folder trained under the earlier definition of `cfg`'s placement is, for verify and report."""
    placement = revised_definition(cfg)
    return (f"trained under normexp's earlier definition of {placement} ({REVISED_DEFINITIONS[placement]}): "
            f"rerun to retrain")
