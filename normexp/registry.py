"""Every placement and norm kind normexp knows, registered once: its name, its label, its paper.

Config validation (`normexp.config.Placement`, `NormKind`), the tables' column labels
(`normexp.analysis.variants`), the docs' tables (tests/test_docs.py) and the tests' matrices all derive
from these two registries, so a placement or kind added here is validated, labelled and tested at once,
and one forgotten in the models fails the tests that build every registered name. The implementations
stay next to each other where they are read: a kind's class in `normexp/models/norms.py`
(`NORM_CLASSES`), a placement's line in `Block.forward` (`normexp/models/ffn.py`).

This module is data only (no torch), so that the config layer and the analysis layer can read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    """A placement or a norm kind: the name a config uses, the label tables print, the paper it follows."""

    name: str
    label: str
    paper: str
    archs: tuple[str, ...] = ("ffn", "transformer")  # the architectures it applies to


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
