"""Every placement and norm kind normexp knows, registered once: its name, its label, its paper.

Config validation (`normexp.config.Placement`, `NormKind`), the tables' column labels
(`normexp.analysis.variants`), the docs' tables (tests/test_docs.py) and the tests' matrices all derive
from these two registries, so a placement or kind added here is validated, labelled and tested at once,
and one forgotten in the models fails the tests that build every registered name. The implementations
stay next to each other where they are read: a kind's class in `normexp/models/norms.py`
(`NORM_CLASSES`), a placement's line in `Block.forward` (`normexp/models/ffn.py`).

A placement or kind of your own, from your own package, is named by reference: `norm.kind:
mypkg.norms:MyNorm`, `norm.placement: mypkg.placements:Halfway` (docs/extending.md says what each must
provide). It is validated, labelled (by its whole reference), hashed into run ids (prefix `ext_`) and
trained on every engine like a registered one; only resolving it imports the user's module, and reading a
run folder never does (`references_unchecked`).

This module is data only (no torch), so that the config layer and the analysis layer can read it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ARCHS = ("ffn", "transformer")  # `model.arch`'s values


@dataclass(frozen=True)
class Method:
    """A placement or a norm kind: the name a config uses, the label tables print, the paper it follows."""

    name: str
    label: str
    paper: str
    archs: tuple[str, ...] = ARCHS  # the architectures it applies to


PLACEMENTS: dict[str, Method] = {m.name: m for m in (
    Method("post", "Post", "Vaswani et al. 2017, Attention Is All You Need"),
    Method("pre", "Pre", "Xiong et al. 2020, On Layer Normalization in the Transformer Architecture"),
    Method("sandwich", "Sandwich", "Ding et al. 2021, CogView"),
    Method("peri", "Peri", "Kim et al. 2025, Peri-LN"),
    Method("deepnorm", "DeepNorm", "Wang et al. 2022, DeepNet"),
    Method("mixln", "MixLN", "Li et al. 2024, Mix-LN"),
    Method("none", "NoNorm", "no normalization (baseline)"),
    Method("rezero", "ReZero", "Bachlechner et al. 2020, ReZero is All You Need"),
    Method("respost", "ResPost", "Liu et al. 2022, Swin Transformer V2 (res-post-norm); OLMo 2"),
    Method("resdual", "ResiDual", "Xie et al. 2023, ResiDual"),
    Method("admin", "Admin", "Liu et al. 2020, Understanding the Difficulty of Training Transformers"),
    Method("b2t", "B2T", "Takase et al. 2023, B2T Connection", archs=("transformer",)),
)}

KINDS: dict[str, Method] = {m.name: m for m in (
    Method("layernorm", "LN", "Ba et al. 2016, Layer Normalization"),
    Method("rmsnorm", "RMS", "Zhang & Sennrich 2019, Root Mean Square Layer Normalization (the article's code)"),
    Method("rmsnorm_torch", "RMSt", "Zhang & Sennrich 2019, as torch.nn.RMSNorm"),
    Method("rmsnorm_llama", "RMSl", "Touvron et al. 2023, LLaMA (HF LlamaRMSNorm)"),
    Method("rmsnorm_gemma", "RMSg", "Gemma Team 2024 (HF GemmaRMSNorm)"),
    Method("prmsnorm", "pRMS", "Zhang & Sennrich 2019, partial RMSNorm"),
    Method("scalenorm", "Scale", "Nguyen & Salazar 2019, Transformers without Tears"),
    Method("dyt", "DyT", "Zhu et al. 2025, Transformers without Normalization"),
    Method("derf", "Derf", "Chen et al. 2025, Stronger Normalization-Free Transformers"),
)}


def placements_for(arch: str) -> list[str]:
    """The placements that apply to the architecture `arch` (`model.arch`), in registry order."""
    return [name for name, method in PLACEMENTS.items() if arch in method.archs]


# ----------------------------------------------------------------------------- a user's own, by reference

PLUGIN_REF = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")  # package.module:attribute
PLUGIN_PREFIX = "ext_"  # a user's placement or kind in a run id: ext_<attribute>, never a registered name


class PluginError(ValueError):
    """A reference that names no usable placement or kind; the message says why."""


# Whether a reference is imported and checked where a config names it: when a config is read to train,
# yes; when a run folder is read (report, plot, verify), no: its runs were checked when they trained, and
# reading them must neither need the user's package nor run its code.
_CHECKING = contextvars.ContextVar("normexp_checks_references", default=True)


@contextlib.contextmanager
def references_unchecked() -> Iterator[None]:
    """Within: a user's placement or kind named in a config is taken as written, not imported."""
    token = _CHECKING.set(False)
    try:
        yield
    finally:
        _CHECKING.reset(token)


def checks_references() -> bool:
    return _CHECKING.get()


def is_plugin(name: str) -> bool:
    """Whether `name` is a reference to a user's own placement or kind (`package.module:attribute`)."""
    return isinstance(name, str) and PLUGIN_REF.fullmatch(name) is not None


@functools.cache
def load_plugin(ref: str) -> Any:
    """The object `ref` (`package.module:attribute`) names, imported once per process."""
    module, _, attribute = ref.partition(":")
    try:
        found = importlib.import_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure of the user's import is this one error
        raise PluginError(f"cannot import {module}: {type(exc).__name__}: {exc}") from None
    if not hasattr(found, attribute):
        raise PluginError(f"{module} has no attribute {attribute}")
    return getattr(found, attribute)


def reset() -> None:
    """Forget the objects `load_plugin` looked up, as a fresh process starts: the next lookup imports its
    module again (a module still in sys.modules is that module, not read again)."""
    load_plugin.cache_clear()


def check_placement_plugin(ref: str) -> None:
    """PluginError unless `ref` names a placement: an object with `forward(block, x)` that is no module
    (a torch.nn.Module is a norm kind, not a placement), and `archs` (if given) a tuple of ffn and/or
    transformer."""
    found = load_plugin(ref)
    if not callable(getattr(found, "forward", None)):
        raise PluginError(f"{ref}: a placement needs forward(block, x) (docs/extending.md)")
    if any(c.__name__ == "Module" and c.__module__.startswith("torch.nn") for c in getattr(found, "__mro__", ())):
        raise PluginError(f"{ref}: is a torch.nn.Module, which makes a norm kind (norm.kind), not a placement; "
                          "a placement is forward(block, x) (docs/extending.md)")
    archs = getattr(found, "archs", ARCHS)
    if not isinstance(archs, tuple | list) or not archs or not set(archs) <= set(ARCHS):
        raise PluginError(f"{ref}: archs must be a tuple of ffn and/or transformer, got {archs!r}")


def check_kind_plugin(ref: str) -> None:
    """PluginError unless `ref` names a norm kind: a class (or factory) called as `Kind(d, eps)`."""
    if not callable(load_plugin(ref)):
        raise PluginError(f"{ref}: a norm kind is a class called as Kind(d, eps) (docs/extending.md)")


def plugin_archs(found: Any) -> tuple[str, ...]:
    return tuple(getattr(found, "archs", ARCHS))


def placement_archs(name: str) -> tuple[str, ...]:
    """The architectures the placement `name` (registered, or a user's by reference) applies to."""
    if is_plugin(name):  # a folder being read: its runs were checked when they trained
        return plugin_archs(load_plugin(name)) if checks_references() else ARCHS
    return PLACEMENTS[name].archs


def stackable(name: str) -> bool:
    """Whether the batched engine may stack runs of this placement or kind: every registered one; a
    user's only if it says `stackable = True` (its forward treats a leading run axis as a batch axis)."""
    return not is_plugin(name) or bool(getattr(load_plugin(name), "stackable", False))


def label(name: str, registry: dict[str, Method]) -> str:
    """A table's label: the registered one, or a user's whole reference (two packages' `Halfway` are two
    variants; no import needed)."""
    return name if is_plugin(name) or name not in registry else registry[name].label


def short_name(name: str) -> str:
    """The placement's or kind's part of a run id: its name, or ext_<attribute> for a user's."""
    if not is_plugin(name):
        return name
    return PLUGIN_PREFIX + re.sub(r"[^a-z0-9_]", "_", name.partition(":")[2].lower())
