"""The init family's config rules (`model.init: tfixup | fixup`) and SkipInit's alias (`norm.placement: skipinit`).

What each init does is normexp/models/inits.py's; here is only which configs it fits (docs/configs.md):

- `tfixup` (Huang et al. 2020, layer6ai-labs/T-Fixup) rescales the weights xavier_uniform draws. It fits
  every placement but the two that rescale the same weights at init themselves (the two factors would
  compound, and the authors' code has neither): `deepnorm` (its beta) and `b2t` (its rescaling_init,
  unless `norm.b2t_rescale: false`). The authors' flags `--Tfixup` and `--dont-use-layernorm` are
  independent, so it is not tied to a norm-free placement; "T-Fixup without norm", the authors' run, is
  `norm.placement: none` with `model.final_norm: false`.
- `fixup` (Zhang et al. 2019, hongyi-zhang/Fixup) makes a residual net without any norm: its scalar
  biases and multiplier are the branch's only additions, so it needs `norm.placement: none`
  (`model.final_norm` stays the user's: the authors' nets have none).
- `norm.placement: skipinit` (De & Smith 2020, "Batch Normalization Biases Residual Blocks Towards the
  Identity Function in Deep Networks") is one learnable scalar at the end of each residual branch, 0 at
  init, with the norm removed: on the FFN toy exactly `rezero` (one gate per block); on the Transformer
  `rezero` with `norm.rezero_gate: sublayer` (one gate per residual branch; the ReZero authors share one
  per layer). A config that names it is resolved to those values before validation, so a SkipInit run is
  the ReZero run of the same keys, with its id. SkipInit's other option, a small non-zero initial scalar,
  has no key (normexp's gate starts at 0).
"""

from __future__ import annotations

from typing import Any

SKIPINIT = "skipinit"  # norm.placement's alias of rezero


def init_problem(cfg: Any) -> tuple[str, str] | None:
    """(key, why) where `model.init` does not fit the run's placement (a `RunConfig`), else None."""
    init, placement = cfg.model.init, cfg.norm.placement
    if init == "fixup" and placement != "none":
        return "model.init", (f"fixup is a residual net without norm (its scalar biases and multiplier replace it): "
                              f"it needs norm.placement none, got {placement}")
    if init == "fixup" and cfg.model.tie_embeddings:
        return "model.tie_embeddings", ("fixup zeroes the head and puts a scalar bias before it: its weight cannot "
                                        "be the token embedding's")
    if init == "tfixup" and (placement == "deepnorm" or (placement == "b2t" and cfg.norm.b2t_rescale)):
        why = "its beta" if placement == "deepnorm" else "its rescaling_init (norm.b2t_rescale)"
        return "model.init", f"tfixup and {placement} both rescale the branch weights at init ({why}): choose one"
    return None


def resolve_skipinit(data: Any) -> Any:
    """A run mapping with `norm.placement: skipinit` resolved to rezero (and, on the Transformer, one gate per
    sublayer); any other value unchanged."""
    norm = data.get("norm") if isinstance(data, dict) else None
    if not isinstance(norm, dict) or norm.get("placement") != SKIPINIT:
        return data
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    norm = {**norm, "placement": "rezero"}
    if model.get("arch") == "transformer":
        norm["rezero_gate"] = "sublayer"
    return {**data, "norm": norm}
