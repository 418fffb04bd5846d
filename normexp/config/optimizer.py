"""The optimizer's and the learning-rate schedule's config sections (`optim`, `schedule`), their keys that act
only under some optimizers or schedule kinds, and their checks across keys. normexp/optim.py implements
them; docs/configs.md explains each key.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, model_validator

from normexp.config.fields import (
    ActsOnlyUnder,
    Beta,
    Fraction,
    NonNegFloat,
    PositiveFloat,
    _Section,
    cross_key_error,
    keeps_inert,
    reset_unused_keys,
)

OptimName = Literal["adam", "adamw", "sgd", "radam"]
ScheduleKind = Literal["constant", "linear_warmup", "inverse_sqrt", "cosine", "wsd"]
# wsd's decay shapes: epfml/schedules-and-scaling's `wsd_schedule` decay_type (its `miror_cosine` spelled right)
DecayShape = Literal["linear", "cosine", "exp", "mirror_cosine", "square", "sqrt"]
AGC_EPS = 1e-3  # optim.agc_eps's default: NFNets' (deepmind-research nfnets/agc_optax.py, experiment_nfnets.py)


class OptimConfig(_Section):
    name: OptimName = "adam"
    lr: PositiveFloat = 0.01
    betas: Annotated[tuple[Beta, Beta], Field(strict=False)] = (0.9, 0.999)  # adam, adamw, radam only
    eps: PositiveFloat = 1e-8  # adam, adamw, radam only
    weight_decay: NonNegFloat | None = None  # None: the optimizer's own default (adamw 0.01, others 0)
    momentum: Fraction = 0.9  # sgd only
    # every optimizer: the gradients' global L2 norm clipped to at most this before each update, as
    # torch.nn.utils.clip_grad_norm_ (all gradients' norm together, 1e-6 added to it); null: no clipping
    clip_norm: PositiveFloat | None = None
    # every optimizer: adaptive gradient clipping (Brock et al. 2021, NFNets), unit-wise: each output unit's
    # gradient norm to at most agc * max(its weights' norm, agc_eps), the final layer's weight excepted;
    # null: none
    agc: PositiveFloat | None = None
    agc_eps: PositiveFloat = AGC_EPS  # acts only with agc
    # adam, adamw: Adam-2k (Liu et al. 2020): the first k updates move the second moment only
    v_only_steps: int = Field(0, ge=0, le=10_000_000)
    v0: Literal["zero", "grad_sq"] = "zero"  # adam, adamw: grad_sq starts the second moment at g0^2 (GI-Adam)
    # radam: torch's RAdam (SGD with momentum while the variance is intractable, rho_t <= 5) or the
    # authors' (LiyuanLucasLiu/RAdam radam/radam.py: no update at all while rho_t < 5)
    radam_variant: Literal["torch", "official"] = "torch"
    # adamw: weight decay independent of the peak lr (Wortsman et al. 2023): each update decays by
    # weight_decay times the schedule's multiplier, lr_t / lr, not by lr_t * weight_decay
    independent_weight_decay: bool = False

    @model_validator(mode="after")
    def _resolve_weight_decay(self) -> OptimConfig:
        if self.weight_decay is None:
            object.__setattr__(self, "weight_decay", 0.01 if self.name == "adamw" else 0.0)
        return self

    @model_validator(mode="after")
    def _inert_keys_at_default(self, info: ValidationInfo) -> OptimConfig:
        """As NormConfig's: momentum under Adam, betas and eps under SGD go back to their defaults. A key
        that acts only where another is set is refused where it is not (a sweep's base keeps it: its grid
        may set the other)."""
        reset_unused_keys(self, OPTIM_ACTS_ONLY_UNDER, info)
        if keeps_inert(info):
            return self
        if self.agc is None and self.agc_eps != AGC_EPS:
            raise cross_key_error("optim.agc_eps", "has no effect without optim.agc (the clipping factor): set it")
        if self.agc is not None and self.clip_norm is not None:
            raise cross_key_error("optim.agc", "and optim.clip_norm are two ways to clip: set one (neither "
                                  "source defines their order)")
        if self.independent_weight_decay and self.weight_decay == 0:
            raise cross_key_error("optim.independent_weight_decay", "has no effect with optim.weight_decay 0")
        return self


class ScheduleConfig(_Section):
    kind: ScheduleKind = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: Fraction = 0.0  # cosine, wsd: the multiplier the decay ends at
    decay_fraction: Fraction = 0.1  # wsd: the last int(f * train.steps) updates decay (the authors' fract_decay)
    decay_shape: DecayShape = "linear"  # wsd: the decay's shape

    @model_validator(mode="after")
    def _warmup_needs_a_schedule(self) -> ScheduleConfig:
        if self.kind == "constant" and self.warmup_steps > 0:
            raise ValueError(
                "warmup_steps has no effect with kind 'constant': "
                "use kind linear_warmup, inverse_sqrt, cosine or wsd"
            )
        return self

    @model_validator(mode="after")
    def _inert_keys_at_default(self, info: ValidationInfo) -> ScheduleConfig:
        """As NormConfig's: min_lr_ratio under any kind but cosine and wsd, decay_fraction and decay_shape
        under any but wsd, go back to their defaults."""
        return reset_unused_keys(self, SCHEDULE_ACTS_ONLY_UNDER, info)


ADAM_FAMILY = frozenset({"adam", "adamw", "radam"})  # normexp/optim.py: the optimizers that take betas and eps
ADAM = frozenset({"adam", "adamw"})  # normexp/optim.py `StackedOptimizer._adam`: Adam's own update
# The optimizer's and the schedule's keys that act only under some optimizers or kinds (normexp/optim.py
# and the engines read them only there), as ACTS_ONLY_UNDER for the norm's; weight_decay, clip_norm and
# agc act under all.
OPTIM_ACTS_ONLY_UNDER: ActsOnlyUnder = {
    "betas": ("name", ADAM_FAMILY),
    "eps": ("name", ADAM_FAMILY),
    "momentum": ("name", frozenset({"sgd"})),
    "v_only_steps": ("name", ADAM),
    "v0": ("name", ADAM),
    "radam_variant": ("name", frozenset({"radam"})),
    "independent_weight_decay": ("name", frozenset({"adamw"})),
}
SCHEDULE_ACTS_ONLY_UNDER: ActsOnlyUnder = {
    "min_lr_ratio": ("kind", frozenset({"cosine", "wsd"})),
    "decay_fraction": ("kind", frozenset({"wsd"})),
    "decay_shape": ("kind", frozenset({"wsd"})),
}
