"""Configs: one run's typed config, a sweep file, YAML loading, `--set` overrides and grid expansion.

YAML stops here. Everything past this module receives validated pydantic objects
(`RunConfig` and its sections), never dicts:

- Every section forbids unknown keys and validates strictly (no "32" -> 32, no true -> 1).
- Every error is a `ConfigError` whose message names the key path (`base.optim.lr: must be > 0`)
  and, for a typo, the closest valid key. The CLI prints it and exits 2.
- YAML is read with a safe loader that also rejects duplicate keys and keys that are not strings,
  and reads `1e-3` as a float (YAML 1.2), as users expect.

A sweep expands to runs in a fixed order: the Cartesian product of the grid axes (in file order,
with `--set` axes replacing or appending), then seeds innermost.
"""

from __future__ import annotations

import difflib
import errno
import itertools
import json
import math
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from normexp.registry import (
    KINDS,
    PLACEMENTS,
    PluginError,
    check_kind_plugin,
    check_placement_plugin,
    is_plugin,
    placement_archs,
)

Placement = Literal[tuple(PLACEMENTS)]  # normexp/registry.py: every placement, registered once
NormKind = Literal[tuple(KINDS)]
Init = Literal["xavier_uniform", "xavier_normal", "torch_default"]
OptimName = Literal["adam", "adamw", "sgd", "radam"]
ScheduleKind = Literal["constant", "linear_warmup", "inverse_sqrt", "cosine"]
Arch = Literal["ffn", "transformer"]
TaskName = Literal["random_labels", "assoc_recall", "copy", "modular_add"]
SEQUENCE_TASKS = ("assoc_recall", "copy", "modular_add")  # the Transformer's tasks; random_labels is the FFN's
METRIC_COLUMNS = ("step", "loss", "acc", "lr", "grad_norm")  # metrics.csv's columns, in order: one per recorded step
VAL_COLUMNS = ("val_loss", "val_acc")  # sequence tasks: the held-out split, after METRIC_COLUMNS
METRICS = ("loss", "acc", "grad_norm", "lr", *VAL_COLUMNS)  # what a report or a figure can show
Metric = Literal[METRICS]

FLOAT32_TINIEST = 1.401298464324817e-45  # the smallest positive float32 (a subnormal, 2^-149)


def _not_0_in_float32(value: float) -> float:
    """Refuse a positive value that float32 rounds to 0: runs train in float32, where an eps, a learning
    rate or an init scale of 1e-50 is exactly 0 (a division by zero, a step that moves nothing), not the
    positive number the config shows. The value itself is kept as written (run ids are of it)."""
    try:
        in_float32 = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond float32's largest: far from 0
        return value
    if in_float32 == 0:
        raise PydanticCustomError("zero_in_float32", "is 0 in float32 (training's precision; the smallest "
                                  "positive float32 is {tiniest}), got {value}",
                                  {"tiniest": f"{FLOAT32_TINIEST:.2g}", "value": _brief(value)})
    return value


# > 0, and > 0 in float32 too (a positive float is an eps, a learning rate or a scale in float32 training)
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False), AfterValidator(_not_0_in_float32)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Beta = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]  # Adam's decay rates: 1 divides by 1 - 1

DEFAULT_REPORT_STEPS = (0, 1, 2, 3, 5, 10, 20, 30)
DEFAULT_MAX_RUNS = 100_000
# Keys whose declared default (None) a validator resolves from other keys of the run. A sweep keeps them
# open in its base until each run's grid and --set values are in, so every run resolves them alone.
RESOLVED_PER_RUN = ("optim.weight_decay",)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"


class ConfigError(ValueError):
    """A bad config or command-line value. The message names the offending key path."""


class TooManyRuns(ConfigError):
    """The grid expands to more runs than the limit (`normexp sweep --max-runs` sets it)."""

    def __init__(self, total: int, limit: int, option: str = "the limit of", distinct: bool = True) -> None:
        super().__init__(f"grid: expands to {total} runs, more than {option} {limit}" if distinct else
                         f"grid: expands to more than {option} {limit} distinct runs ({total} combinations)")
        self.total, self.limit, self.distinct = total, limit, distinct


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @model_validator(mode="after")
    def _unsigned_zeros(self) -> _Section:
        """-0.0 is 0.0 (weight_decay: -0.0 trains as 0.0): written as 0.0, so that both are one run id."""
        for name in type(self).model_fields:
            value = getattr(self, name)
            unsigned = _unsigned_zero(value)
            if unsigned is not value:
                object.__setattr__(self, name, unsigned)
        return self


def _unsigned_zero(value: Any) -> Any:
    """`value` with any float -0.0 in it (a tuple's items too) made 0.0; `value` itself if it has none."""
    if isinstance(value, float) and value == 0 and math.copysign(1.0, value) < 0:
        return 0.0
    if isinstance(value, tuple) and any(_unsigned_zero(v) is not v for v in value):
        return tuple(_unsigned_zero(v) for v in value)
    return value


class ModelConfig(_Section):
    depth: int = Field(32, ge=1, le=10_000)
    width: int = Field(32, ge=1, le=65_536)
    hidden_mult: int = Field(4, ge=1, le=64)
    n_classes: int = Field(10, ge=2)
    final_norm: bool = True
    init: Init = "xavier_uniform"
    arch: Arch = "ffn"  # transformer: the causal decoder of normexp/models/transformer.py
    n_heads: int = Field(4, ge=1, le=1024)  # transformer only: attention heads, each width / n_heads wide

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.arch == "transformer" and self.width % self.n_heads:
            raise cross_key_error("model.n_heads", f"must divide model.width {self.width}, got {self.n_heads}")
        return self


class NormConfig(_Section):
    placement: Placement = "pre"
    kind: NormKind = "layernorm"
    eps: PositiveFloat = 1e-5
    peri_input_norm: bool = True
    mixln_fraction: Fraction = 0.25
    deepnorm_alpha: PositiveFloat | None = None  # None: M^(1/4), M residual sublayers (DeepNet)
    deepnorm_beta: PositiveFloat | None = None  # None: (4M)^(-1/4)
    # FFN toy: what DeepNet's M counts. sublayers: a block is one residual sublayer, M = N (DeepNet's
    # rule); two_per_block: M = 2N, (2N)^(1/4) and (8N)^(-1/4) (normexp's earlier reading)
    deepnorm_count: Literal["sublayers", "two_per_block"] = "sublayers"
    prms_fraction: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 0.0625
    output_norm_init: Literal["ones", "zeros"] = "ones"  # respost: the branch norm's gain (zeros: Swin V2)
    dyt_alpha0: PositiveFloat = 0.5  # dyt: the initial alpha of tanh(alpha * x) (Zhu et al. 2025)
    # dyt, per site as in DyT's LLaMA runs: the attention sublayers' norms, the FFN's (the FFN toy's
    # blocks), the final norm. None: dyt_alpha0 (a value equal to dyt_alpha0 is folded to None)
    dyt_alpha0_attn: PositiveFloat | None = None
    dyt_alpha0_ffn: PositiveFloat | None = None
    dyt_alpha0_final: PositiveFloat | None = None
    dyt_bias: bool = True  # dyt: the learnable bias (false: none, as in DyT's LLaMA runs)
    derf_alpha0: PositiveFloat = 0.5  # derf: the initial alpha of erf(alpha * x + shift) (Chen et al. 2025)
    b2t_rescale: bool = True  # b2t: every layer weight (q, k, v, out, fc1, fc2) * N^(-1/2) at init, as shipped
    resdual_stream: Literal["input", "zeros"] = "input"  # resdual: x_d starts as the first block's input (authors)
    resdual_final_norm: bool = False  # resdual: also model.final_norm on x_a + Norm_d(x_d) (normexp's earlier reading)
    admin_profile: Literal["measured", "closed_form"] = "measured"  # admin: how omega is profiled (models/ffn.py)
    rezero_gate: Literal["layer", "sublayer"] = "layer"  # rezero, transformer: one gate per layer (authors)

    @field_validator("placement", "kind", mode="wrap")
    @classmethod
    def _own_placement_or_kind(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        """A registered name, or a user's own by reference (`package.module:Attribute`), imported and
        checked here so that a bad reference is a config error naming the key."""
        if not is_plugin(value):
            return handler(value)
        check = check_placement_plugin if info.field_name == "placement" else check_kind_plugin
        try:
            check(value)
        except PluginError as exc:
            raise PydanticCustomError("value_error", "{error}", {"error": str(exc)}) from None
        return value

    @model_validator(mode="after")
    def _inert_keys_at_default(self, info: ValidationInfo) -> NormConfig:
        """A key that this run's placement or kind does not use is put back to its default: runs that
        train alike are one run, with one id. A sweep's base keeps what it was given (see build_sweep)."""
        for site in DYT_SITES:  # a site's alpha0 written out equal to dyt_alpha0 is the same run as unset
            if getattr(self, site) == self.dyt_alpha0:
                object.__setattr__(self, site, None)
        return _inert_keys_to_default(self, info)


def _inert_keys_to_default(section: _Section, info: ValidationInfo) -> _Section:
    """Put each key that `section` leaves unused (`inert_keys`) back to its default, unless the context
    says `keep_inert` (a sweep's base, whose grid runs may use them)."""
    if (info.context or {}).get("keep_inert"):
        return section
    for key in inert_keys(section):
        object.__setattr__(section, key, type(section).model_fields[key].default)
    return section


# Keys that act only under some placements or norm kinds: key -> (the key that decides, where it acts).
ACTS_ONLY_UNDER: dict[str, tuple[str, frozenset[str]]] = {
    "peri_input_norm": ("placement", frozenset({"peri"})),
    "mixln_fraction": ("placement", frozenset({"mixln"})),
    "deepnorm_alpha": ("placement", frozenset({"deepnorm"})),
    "deepnorm_beta": ("placement", frozenset({"deepnorm"})),
    "output_norm_init": ("placement", frozenset({"respost"})),
    "prms_fraction": ("kind", frozenset({"prmsnorm"})),
    "dyt_alpha0": ("kind", frozenset({"dyt"})),
    "dyt_alpha0_attn": ("kind", frozenset({"dyt"})),
    "dyt_alpha0_ffn": ("kind", frozenset({"dyt"})),
    "dyt_alpha0_final": ("kind", frozenset({"dyt"})),
    "dyt_bias": ("kind", frozenset({"dyt"})),
    "derf_alpha0": ("kind", frozenset({"derf"})),
    "deepnorm_count": ("placement", frozenset({"deepnorm"})),
    "b2t_rescale": ("placement", frozenset({"b2t"})),
    "resdual_stream": ("placement", frozenset({"resdual"})),
    "resdual_final_norm": ("placement", frozenset({"resdual"})),
    "admin_profile": ("placement", frozenset({"admin"})),
    "rezero_gate": ("placement", frozenset({"rezero"})),
}
DYT_SITES = ("dyt_alpha0_attn", "dyt_alpha0_ffn", "dyt_alpha0_final")
# Keys of ACTS_ONLY_UNDER that act on one architecture only: key -> the model.arch where it acts
ARCH_ONLY = {"rezero_gate": "transformer", "deepnorm_count": "ffn", "dyt_alpha0_attn": "transformer"}


def mixln_post_count(depth: int, fraction: float) -> int:
    """How many of Mix-LN's first layers are Post-LN: floor(f * N), an integer count (Li et al.:
    "3 of 12, 6 of 24" at f = 0.25). The product is rounded to 9 decimals first, so that a float
    product just under the integer it stands for (0.58 * 50 = 28.999999999999996) counts as that integer."""
    return math.floor(round(fraction * depth, 9))


def inert_keys(section: NormConfig | OptimConfig | ScheduleConfig) -> list[str]:
    """The keys of the section's ACTS_ONLY_UNDER table (`ACTS_ONLY_UNDER_BY_SECTION`) that its own
    deciding key (the norm's placement or kind, the optimizer's name, the schedule's kind) leaves unused."""
    table = ACTS_ONLY_UNDER_BY_SECTION[_SECTION_NAMES[type(section)]]
    return [key for key, (decider, where) in table.items() if getattr(section, decider) not in where]


class DataConfig(_Section):
    task: TaskName = "random_labels"
    n_samples: int = Field(64, ge=1, le=10_000_000)  # sequence tasks: the training split's size
    vocab: int = Field(16, ge=2, le=65_536)  # sequence tasks: token count (modular_add: p + 2 tokens)
    seq_len: int | None = Field(None, ge=2, le=4096)  # sequence tasks: tokens per sequence; None: the task's
    n_val: int = Field(128, ge=1, le=10_000_000)  # sequence tasks: the held-out split's size
    batch_size: int | None = Field(None, ge=1, le=10_000_000)  # sequence tasks: minibatch; None: full batch

    @model_validator(mode="after")
    def _task_shape(self) -> DataConfig:
        if self.task == "random_labels":
            for key in ("vocab", "seq_len", "n_val", "batch_size"):
                if getattr(self, key) != DataConfig.model_fields[key].default:
                    raise cross_key_error(f"data.{key}", "applies to the sequence tasks "
                                          f"({', '.join(SEQUENCE_TASKS)}), not to random_labels")
            return self
        problem = sequence_problem(self)
        if problem is not None:
            raise cross_key_error(*problem)
        if self.seq_len == DEFAULT_SEQ_LEN[self.task]:
            # the task's own length written out is the same run as leaving it unset: one config, one run id
            object.__setattr__(self, "seq_len", None)
        return self


@dataclass(frozen=True)
class SequenceShape:
    """The layout of a sequence task (normexp/data.py draws it): every sequence has `seq_len` tokens;
    the model reads the first seq_len - 1 and is scored where its next token is an answer, at input
    `positions`; `capacity` is how many distinct sequences the task has."""

    seq_len: int
    positions: tuple[int, ...]
    capacity: int


MODULAR_ADD_MAX_VOCAB = 2050  # p = 2048: randperm(p^2) is 32 MiB (Power et al. use p = 97)
DEFAULT_SEQ_LEN = {"assoc_recall": 16, "copy": 17, "modular_add": 5}


def sequence_shape(data: DataConfig) -> SequenceShape:
    """assoc_recall: k1 v1 .. kP vP q1 a1 .. qP aP (P = seq_len / 4 distinct keys from the lower half of
    the vocabulary, values from the upper half, the queries a permutation of the keys); copy: s1 .. sn 0
    s1 .. sn (n = (seq_len - 1) / 2 tokens from 1..vocab-1, 0 the separator); modular_add: a + b = c
    with p = vocab - 2 (tokens p and p + 1 are '+' and '=')."""
    length = data.seq_len if data.seq_len is not None else DEFAULT_SEQ_LEN[data.task]
    if data.task == "assoc_recall":
        pairs, keys = length // 4, data.vocab // 2
        positions = tuple(2 * pairs + 2 * j for j in range(pairs))
        capacity = math.perm(keys, pairs) * (data.vocab - keys) ** pairs * math.factorial(pairs) if keys >= pairs else 0
        return SequenceShape(length, positions, capacity)
    if data.task == "copy":
        n = (length - 1) // 2
        return SequenceShape(length, tuple(range(n, 2 * n)), (data.vocab - 1) ** n)
    return SequenceShape(length, (3,), max(data.vocab - 2, 0) ** 2)


def sequence_problem(data: DataConfig) -> tuple[str, str] | None:
    """(key, why) for the first data key a sequence task cannot work with, else None."""
    shape, given = sequence_shape(data), data.seq_len
    if data.task == "assoc_recall" and given is not None and (given % 4 or given < 8):
        return "data.seq_len", f"assoc_recall needs a multiple of 4, at least 8 (2 pairs, 2 queries), got {given}"
    if data.task == "copy" and given is not None and (given % 2 == 0 or given < 5):
        return "data.seq_len", f"copy needs an odd length, at least 5 (2 tokens, separator, 2 copies), got {given}"
    if data.task == "modular_add" and given is not None and given != 5:
        return "data.seq_len", f"modular_add sequences are 'a + b = c', 5 tokens: leave it unset, got {given}"
    if data.task == "modular_add" and data.vocab > MODULAR_ADD_MAX_VOCAB:
        return "data.vocab", (f"modular_add shuffles all p^2 sums (p = vocab - 2): at most {MODULAR_ADD_MAX_VOCAB} "
                              f"tokens ({(MODULAR_ADD_MAX_VOCAB - 2) ** 2} sums), got {data.vocab}")
    smallest = {"assoc_recall": max(2 * (shape.seq_len // 4), 4), "copy": 3, "modular_add": 4}[data.task]
    if data.vocab < smallest:
        return "data.vocab", f"{data.task} at seq_len {shape.seq_len} needs >= {smallest} tokens, got {data.vocab}"
    wanted = data.n_samples + data.n_val
    # modular_add splits its p^2 sums exactly; the others draw at random, so keep them far from full
    if shape.capacity < (wanted if data.task == "modular_add" else 2 * wanted):
        return "data.vocab", (f"{data.task} has {shape.capacity} distinct sequences at vocab {data.vocab}, too few "
                              f"for n_samples + n_val = {wanted} distinct ones: raise vocab or lower the counts")
    if data.batch_size is not None and data.batch_size > data.n_samples:
        return "data.batch_size", f"must be <= data.n_samples {data.n_samples}, got {data.batch_size}"
    return None


class OptimConfig(_Section):
    name: OptimName = "adam"
    lr: PositiveFloat = 0.01
    betas: Annotated[tuple[Beta, Beta], Field(strict=False)] = (0.9, 0.999)  # adam, adamw, radam only
    eps: PositiveFloat = 1e-8  # adam, adamw, radam only
    weight_decay: NonNegFloat | None = None  # None: the optimizer's own default (adamw 0.01, others 0)
    momentum: Fraction = 0.9  # sgd only

    @model_validator(mode="after")
    def _resolve_weight_decay(self) -> OptimConfig:
        if self.weight_decay is None:
            object.__setattr__(self, "weight_decay", 0.01 if self.name == "adamw" else 0.0)
        return self

    @model_validator(mode="after")
    def _inert_keys_at_default(self, info: ValidationInfo) -> OptimConfig:
        """As NormConfig's: momentum under Adam, betas and eps under SGD go back to their defaults."""
        return _inert_keys_to_default(self, info)


class ScheduleConfig(_Section):
    kind: ScheduleKind = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: Fraction = 0.0  # cosine only

    @model_validator(mode="after")
    def _warmup_needs_a_schedule(self) -> ScheduleConfig:
        if self.kind == "constant" and self.warmup_steps > 0:
            raise ValueError(
                "warmup_steps has no effect with kind 'constant': "
                "use kind linear_warmup, inverse_sqrt or cosine"
            )
        return self

    @model_validator(mode="after")
    def _inert_keys_at_default(self, info: ValidationInfo) -> ScheduleConfig:
        """As NormConfig's: min_lr_ratio under any kind but cosine goes back to its default."""
        return _inert_keys_to_default(self, info)


ADAM_FAMILY = frozenset({"adam", "adamw", "radam"})  # normexp/optim.py: the optimizers that take betas and eps
# The optimizer's and the schedule's keys that act only under some optimizers or kinds (normexp/optim.py
# and the engines read them only there), as ACTS_ONLY_UNDER for the norm's; weight_decay acts under all.
OPTIM_ACTS_ONLY_UNDER: dict[str, tuple[str, frozenset[str]]] = {
    "betas": ("name", ADAM_FAMILY),
    "eps": ("name", ADAM_FAMILY),
    "momentum": ("name", frozenset({"sgd"})),
}
SCHEDULE_ACTS_ONLY_UNDER: dict[str, tuple[str, frozenset[str]]] = {
    "min_lr_ratio": ("kind", frozenset({"cosine"})),
}
ACTS_ONLY_UNDER_BY_SECTION = {"norm": ACTS_ONLY_UNDER, "optim": OPTIM_ACTS_ONLY_UNDER,
                              "schedule": SCHEDULE_ACTS_ONLY_UNDER}
_SECTION_NAMES = {NormConfig: "norm", OptimConfig: "optim", ScheduleConfig: "schedule"}


class TrainConfig(_Section):
    steps: int = Field(30, ge=0, le=10_000_000)
    threads: int | None = Field(None, ge=1, le=1024)  # torch intra-op threads; None: torch's default
    stop_on_nonfinite: bool = True
    log_blocks: bool = False  # write <run_id>/blocks.csv: per-block gradients, updates, activations
    log_every: int = Field(1, ge=1, le=10_000_000)  # blocks.csv keeps steps 0, k, 2k, ...

    @field_validator("log_every")
    @classmethod
    def _log_every_needs_log_blocks(cls, value: int, info: ValidationInfo) -> int:
        if value != 1 and not info.data.get("log_blocks"):
            raise ValueError(f"thins blocks.csv, so it needs log_blocks: true (got log_every {value} without it)")
        return value


class RunConfig(_Section):
    """One training run, fully resolved: enough to rerun it alone."""

    model: ModelConfig = ModelConfig()
    norm: NormConfig = NormConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    train: TrainConfig = TrainConfig()
    seed: int = Field(0, ge=0, le=2**63 - 1)

    @model_validator(mode="after")
    def _arch_fits(self, info: ValidationInfo) -> RunConfig:
        problem = arch_problem(self)
        if problem is not None:
            raise cross_key_error(*problem)
        if self.norm.placement == "resdual" and not self.norm.resdual_final_norm and not self.model.final_norm:
            if not (info.context or {}).get("keep_inert"):  # ResiDual ends without a final norm either way
                object.__setattr__(self, "model", self.model.model_copy(update={"final_norm": True}))
        return self


def model_step_flops(cfg: RunConfig) -> float:
    """FLOPs of one training step of one run: the forward matmuls, times 3 (forward and backward)."""
    n, d, depth = cfg.data.n_samples, cfg.model.width, cfg.model.depth
    hidden = d * cfg.model.hidden_mult
    if cfg.model.arch == "transformer":  # per token: FFN, q k v out, scores and mixing; the head
        t = sequence_shape(cfg.data).seq_len - 1
        return 3 * 2 * n * t * (depth * (2 * d * hidden + 4 * d * d + 2 * t * d) + d * cfg.data.vocab)
    return 3 * 2 * n * (2 * d * hidden * depth + d * cfg.model.n_classes)


def arch_problem(cfg: RunConfig) -> tuple[str, str] | None:
    """(key, why) for the first key that does not fit `model.arch`, else None."""
    if cfg.model.arch == "ffn":
        if cfg.data.task != "random_labels":
            return "data.task", f"{cfg.data.task} is a sequence task: it needs model.arch transformer"
        if cfg.model.n_heads != ModelConfig.model_fields["n_heads"].default:
            return "model.n_heads", "applies to model.arch transformer only (the FFN has no attention)"
        if cfg.norm.placement == "b2t":
            return "norm.placement", ("b2t skips from a layer's input to its second sublayer's norm: it needs "
                                      "model.arch transformer (an FFN block has one sublayer)")
        if "ffn" not in placement_archs(cfg.norm.placement):
            return "norm.placement", "applies to model.arch transformer only (its archs)"
        return _arch_only_problem(cfg)
    if cfg.data.task == "random_labels":
        return "data.task", f"model.arch transformer trains on a sequence task: one of {', '.join(SEQUENCE_TASKS)}"
    if cfg.model.n_classes != ModelConfig.model_fields["n_classes"].default:
        return "model.n_classes", "applies to model.arch ffn only (the transformer predicts data.vocab tokens)"
    if cfg.train.log_blocks:
        return "train.log_blocks", "records FFN blocks only: not supported with model.arch transformer"
    if "transformer" not in placement_archs(cfg.norm.placement):
        return "norm.placement", "applies to model.arch ffn only (its archs)"
    return _arch_only_problem(cfg)


def _arch_only_problem(cfg: RunConfig) -> tuple[str, str] | None:
    """(key, why) for a key of ARCH_ONLY set away from its default under the other architecture."""
    why = {"rezero_gate": "an FFN block is one sublayer, so its gate is the layer's",
           "deepnorm_count": "the Transformer's layer has two sublayers, so both readings give M = 2N",
           "dyt_alpha0_attn": "the FFN toy has no attention sublayer"}
    for key, arch in ARCH_ONLY.items():
        if cfg.model.arch != arch and getattr(cfg.norm, key) != NormConfig.model_fields[key].default:
            return f"norm.{key}", f"applies to model.arch {arch} only ({why[key]})"
    return None


def cross_key_error(key: str, why: str) -> PydanticCustomError:
    """A check across keys, blamed on `key` (a dotted path): the error formatters put it in the path."""
    return PydanticCustomError("cross_key", "{key}: {why}", {"key": key, "why": why})


class ReportConfig(_Section):
    steps: list[Annotated[int, Field(ge=0)]] = list(DEFAULT_REPORT_STEPS)
    columns: list[str] | None = None  # dotted keys that make the table's columns; None: the grid keys
    metric: Metric = "loss"


class SweepFile(_Section):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    base: dict[str, Any] = Field(default_factory=dict)
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    seeds: list[Annotated[int, Field(ge=0, le=2**63 - 1)]] | None = None  # RunConfig.seed's bounds
    report: ReportConfig = ReportConfig()
    notes: str = ""  # free text about the sweep: kept in sweep.yaml, shown in the report's title area
    tags: list[str] = Field(default_factory=list)


@dataclass(frozen=True)
class Sweep:
    """A validated sweep: its name, the grid (after `--set`), and the runs it expands to."""

    name: str
    base: RunConfig
    grid: dict[str, list[Any]]
    seeds: list[int]
    report: ReportConfig
    runs: list[RunConfig]
    open_keys: tuple[str, ...] = ()  # keys of RESOLVED_PER_RUN that the base leaves to each run
    notes: str = ""  # the sweep file's notes and tags: about the sweep, never part of a run (or its id)
    tags: tuple[str, ...] = ()

    def base_mapping(self, mode: Literal["python", "json"] = "python") -> dict[str, Any]:
        """The base as a mapping of sections, its open keys put back to None (resolved per run)."""
        return _open_mapping(self.base, self.open_keys, mode)

    @property
    def varying_keys(self) -> list[str]:
        """Grid keys whose runs take more than one value (`1` and `1.0` are one value, null is a value of
        its own), then `seed` if several seeds."""
        flat = [flatten(cfg) for cfg in self.runs]
        keys = [k for k in self.grid if len({json.dumps(f[k]) for f in flat}) > 1]
        return keys + (["seed"] if len(self.seeds) > 1 else [])

    def to_yaml(self) -> str:
        """The resolved sweep, as it ran: loadable again with `load_sweep`."""
        doc = {
            "name": self.name,
            "base": self.base_mapping("json"),
            "grid": self.grid,
            "seeds": self.seeds,
            "report": self.report.model_dump(mode="json"),
            **({"notes": self.notes} if self.notes else {}),
            **({"tags": list(self.tags)} if self.tags else {}),
        }
        return yaml.safe_dump(doc, sort_keys=False)


# ----------------------------------------------------------------------------- YAML


MAX_YAML_NODES = 100_000  # a config is a few hundred values; aliases must not expand past this


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 scalars, string keys only, no duplicate keys, and a bound on what aliases
    expand to.

    Scalars follow the YAML 1.2 core schema where YAML 1.1 surprises: `010` is ten (not octal eight),
    `yes`/`no`/`on`/`off` are strings, `1:30` is a string (not 90), `1e-3` is a float. Merge keys
    (`<<: *defaults`) work, and a key written after them overrides the merged value; a key written
    twice is an error. A document whose aliases expand past MAX_YAML_NODES values is refused before
    anything is built from it (a few hundred bytes of nested aliases can expand to gigabytes)."""

    def compose_document(self) -> yaml.Node | None:
        node = super().compose_document()
        if node is not None:
            _expanded_size(node, {})
            _refuse_keys_not_strings(node, "", set())
        return node


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many nodes `node` stands for once every alias in it is expanded (each node counted once
    per path that reaches it, each shared node computed once)."""
    if id(node) in sizes:
        if sizes[id(node)] < 0:
            raise ConfigError(f"line {node.start_mark.line + 1}: an alias refers to the node that contains it")
        return sizes[id(node)]
    sizes[id(node)] = -1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    else:
        children = []
    total = 1 + sum(_expanded_size(child, sizes) for child in children)
    if total > MAX_YAML_NODES:
        raise ConfigError(f"line {node.start_mark.line + 1}: expands to more than {MAX_YAML_NODES} values "
                          "(aliases inside aliases?); refused")
    sizes[id(node)] = total
    return total


MERGE_TAG = "tag:yaml.org,2002:merge"
STR_TAG = "tag:yaml.org,2002:str"


def _refuse_keys_not_strings(node: yaml.Node, path: str, seen: set[int]) -> None:
    """Refuse a mapping with a key YAML reads as other than a string (`1`, `null`, `true`, a list), naming
    the mapping by its key path. Every key of a config is a string; and checked here, before Python
    builds the dict, `{1: a, true: b}` (1 == True in Python) cannot pass for a duplicate key."""
    if id(node) in seen:  # a node that aliases share is checked once, where it is first reached
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, child in enumerate(node.value):
            _refuse_keys_not_strings(child, _join_path(path, str(index)), seen)
    if not isinstance(node, yaml.MappingNode):
        return
    bad = [key for key, _ in node.value if key.tag not in (STR_TAG, MERGE_TAG)]
    if bad:
        shown = ", ".join(_key_text(key) for key in bad[:5]) + (", ..." if len(bad) > 5 else "")
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}keys must be strings (got {shown}; line {bad[0].start_mark.line + 1})")
    for key, value in node.value:  # a merged mapping's keys are this mapping's keys
        _refuse_keys_not_strings(value, path if key.tag == MERGE_TAG else _join_path(path, key.value), seen)


def _join_path(path: str, part: str) -> str:
    return f"{path}.{part}" if path else part


def _key_text(node: yaml.Node) -> str:
    """A key as written (`1`, `null`, `true`), cut short; a list or mapping used as a key by its kind."""
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    text = node.value or "null"  # an empty key (`? ` alone) is null
    return text if len(text) <= 20 else text[:19] + "…"


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    """A mapping: merged keys first (`<<`: an earlier source wins), then the keys written here, which
    override merged ones but must not repeat each other."""
    mapping: dict = {}
    for key_node, value_node in node.value:
        if key_node.tag == MERGE_TAG:
            for source in reversed(_merge_sources(value_node)):
                mapping.update(loader.construct_object(source, deep=True))
    written: set = set()
    for key_node, value_node in node.value:
        if key_node.tag == MERGE_TAG:
            continue
        key = loader.construct_object(key_node, deep=deep)  # a string: _refuse_keys_not_strings ran first
        if key in written:
            raise ConfigError(f"{str(key)[:60]}: duplicate key (line {key_node.start_mark.line + 1})")
        written.add(key)
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


def _merge_sources(node: yaml.Node) -> list[yaml.MappingNode]:
    sources = node.value if isinstance(node, yaml.SequenceNode) else [node]
    if not all(isinstance(source, yaml.MappingNode) for source in sources):
        raise ConfigError(f"line {node.start_mark.line + 1}: '<<' merges a mapping or a list of mappings")
    return sources


def _construct_int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    """YAML 1.2 integers: decimal (leading zeros too), 0o octal, 0x hexadecimal; '_' separates digits."""
    text = loader.construct_scalar(node).replace("_", "")
    sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text.lstrip("+"))
    base = {"0o": 8, "0x": 16}.get(digits[:2].lower(), 10)
    return sign * int(digits[2:] if base != 10 else digits, base)


def _yaml_12_resolvers() -> dict:
    """PyYAML's implicit resolvers without its YAML 1.1 booleans and integers (replaced below)."""
    dropped = {"tag:yaml.org,2002:bool", "tag:yaml.org,2002:int"}
    return {first: [(tag, regexp) for tag, regexp in resolvers if tag not in dropped]
            for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


_StrictLoader.yaml_implicit_resolvers = _yaml_12_resolvers()
_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _brief(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: an error names a value, it never echoes the input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML safely; every failure is a ConfigError naming the source and line."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - _StrictLoader derives from SafeLoader
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except yaml.constructor.ConstructorError as exc:
        mark = exc.problem_mark
        where = f" (line {mark.line + 1})" if mark else ""
        raise ConfigError(f"{source}: unsupported or unsafe YAML: {exc.problem}{where}") from None
    except RecursionError:
        raise ConfigError(f"{source}: malformed YAML: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}: malformed YAML: {where}{problem}") from None


SYMLINK_LOOP = "a symbolic link loop (too many levels of symbolic links)"  # ELOOP, said as such


def is_symlink_loop(path: Path) -> bool:
    """Whether resolving `path` (or a folder on its way) runs into a loop of symbolic links (ELOOP).
    Path.exists() and is_dir() say False there, as for a missing file: check this first."""
    try:
        path.stat()
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def read_mapping(path: str | Path) -> dict:
    """Read a YAML file that must hold a mapping."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:  # a dangling symbolic link too
        raise ConfigError(f"{path}: no such file") from None
    except OSError as exc:  # the path is already named: the reason alone, not errno's repr of it
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{path}: {SYMLINK_LOOP}") from None
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    data = parse_yaml(text, str(path))
    if data is None:
        raise ConfigError(f"{path}: the file is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a mapping of keys to values, got {type(data).__name__}")
    return data


# ----------------------------------------------------------------------------- keys and errors


def _section_fields(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    out: dict[str, type[BaseModel] | None] = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        out[name] = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return out


def run_keys() -> list[str]:
    """Every dotted leaf key of a run config: `model.depth`, ..., `seed`."""
    keys = []
    for name, sub in _section_fields(RunConfig).items():
        keys += [f"{name}.{leaf}" for leaf in sub.model_fields] if sub else [name]
    return keys


GENERIC_LEAVES = ("name", "kind")  # `name=adam`, `kind=cosine`: the section says what is named


def key_label(key: str) -> str:
    """A dotted key's short label in a table or figure: its leaf (`lr`, `warmup_steps`) where that names
    one key alone; its section for a generic leaf (`optim.name` -> `optim`, `schedule.kind` -> `schedule`);
    the whole key where two sections share the leaf (`norm.eps`, `optim.eps`). A key that is not a run
    key (a column of an older folder) keeps its leaf unless it is generic."""
    section, _, leaf = key.rpartition(".")
    if not section:
        return key
    if leaf in GENERIC_LEAVES:
        return section
    shared = sum(k.rpartition(".")[2] == leaf for k in run_keys())
    return key if shared > 1 else leaf


def _closest(word: str, choices: Iterable[str]) -> str:
    match = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _valid_keys_at(model: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    """The field names valid at `loc` inside `model` (for the 'did you mean' hint)."""
    for part in loc[:-1]:
        sub = _section_fields(model).get(str(part)) if isinstance(part, str) else None
        if sub is None:
            return []
        model = sub
    return list(model.model_fields)


def _describe(err: dict, model: type[BaseModel]) -> str:
    kind, ctx, value = err["type"], err.get("ctx", {}), err.get("input")
    if kind == "extra_forbidden":
        return "unknown key" + _closest(err["loc"][-1], _valid_keys_at(model, err["loc"]))
    if kind == "missing":
        return "required key is missing"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}, got {_brief(value)}" + _closest(
            value, re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        )
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"must be {bounds[kind]} {limit}, got {_brief(value)}"
    if kind == "finite_number":
        return f"must be a finite number, got {_brief(value)}"
    names = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
             "string_type": "a string", "list_type": "a list", "dict_type": "a mapping",
             "model_type": "a mapping", "tuple_type": "a list", "int_from_float": "an integer"}
    if kind in names:
        return f"must be {names[kind]}, got {_brief(value)}"
    if kind == "string_pattern_mismatch":
        return f"must be letters, digits, '_', '.', '-' (start with a letter or digit), got {_brief(value)}"
    if kind == "invalid_key":
        return "a key must be a string"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    if kind == "cross_key":
        return ctx["why"]
    if kind in ("too_short", "too_long"):
        return err["msg"].replace("Tuple", "list").lower()
    return err["msg"]


MAX_ERROR_LINES = 8


def _format_errors(exc: ValidationError, model: type[BaseModel], prefix: str) -> ConfigError:
    lines = [f"{_key_path(prefix, _loc(err))}: {_describe(err, model)}" for err in _errors(exc, model)]
    return _error_lines(lines)


TUPLE_SHAPE_ERRORS = ("missing", "too_short", "too_long", "tuple_type")
ITEM_NOUNS = {float: "numbers", int: "integers", str: "strings", bool: "true or false values"}
COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}


def _errors(exc: ValidationError, model: type[BaseModel]) -> list[dict]:
    """pydantic's errors, each one about the shape of a fixed-length list put as what that key must be.
    pydantic reports `betas: [0.9]` as item 1 "missing" and `[0.9, 0.9, 0.9]` in its own words about
    tuples; the user wrote a list of the wrong length, at the key `betas`."""
    return [_tuple_shape_error(err, model) or err for err in exc.errors()]


def _tuple_shape_error(err: dict, model: type[BaseModel]) -> dict | None:
    """`err` as one error at the tuple field it concerns, if it is about that field's shape; else None."""
    if err["type"] not in TUPLE_SHAPE_ERRORS:
        return None
    found = _tuple_field_at(model, err["loc"])
    if found is None:
        return None
    depth, field = found
    if len(err["loc"]) != depth + (err["type"] == "missing"):  # "missing" is about an item of the list
        return None
    items = get_args(field.annotation)
    kinds = {get_args(item)[0] if get_origin(item) is Annotated else item for item in items}
    noun = ITEM_NOUNS.get(next(iter(kinds)), "values") if len(kinds) == 1 else "values"
    why = (f"must be a list of {COUNT_WORDS.get(len(items), len(items))} {noun}, "
           f"e.g. {_brief(list(field.default))}, got {_brief(err['input'])}")
    return {"type": "tuple_shape", "loc": tuple(err["loc"][:depth]), "msg": why, "input": err["input"]}


def _tuple_field_at(model: type[BaseModel], loc: Sequence[Any]) -> tuple[int, Any] | None:
    """(how many parts of `loc` name it, its FieldInfo) for the fixed-length tuple field that `loc`
    leads to (through nested sections), else None."""
    for depth, part in enumerate(loc, 1):
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        if get_origin(field.annotation) is tuple and Ellipsis not in get_args(field.annotation):
            return depth, field
        if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return None


def _loc(err: dict) -> tuple[Any, ...]:
    """Where an error lies: pydantic's location, or for a check across keys the key it blames
    (a check on `model` that blames `model.n_heads` lies at ('model', 'n_heads'))."""
    if err["type"] != "cross_key":
        return tuple(err["loc"])
    key = tuple(err["ctx"]["key"].split("."))
    loc = tuple(err["loc"])
    return loc + key[len(loc):] if key[:len(loc)] == loc else key


def _key_path(prefix: str, loc: Sequence[Any]) -> str:
    """`base.optim.lr`, `seeds.2` for a list item, `base.model.1` for a bad key 1: the parts joined
    by dots, never an empty part (pydantic's `[key]` marker for a bad key is dropped)."""
    parts = [str(part) for part in (prefix, *loc) if part not in ("", "[key]")]
    return ".".join(parts) or "config"


def _error_lines(lines: Sequence[str]) -> ConfigError:
    """One ConfigError of at most MAX_ERROR_LINES lines (each already brief), repeated lines once."""
    lines = list(dict.fromkeys(lines))
    if len(lines) > MAX_ERROR_LINES:
        lines = [*lines[: MAX_ERROR_LINES - 1], f"... and {len(lines) - MAX_ERROR_LINES + 1} more errors"]
    return ConfigError("\n".join(lines))


def validate_run(data: dict, prefix: str = "", keep_inert: bool = False) -> RunConfig:
    """Validate one run's config mapping, naming bad keys under `prefix` (e.g. 'base'). `keep_inert`
    keeps the keys its placement or kind does not use (a sweep's base: a grid run may use them)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: must be a mapping, got {type(data).__name__}")
    try:
        return RunConfig.model_validate(data, context={"keep_inert": keep_inert})
    except ValidationError as exc:
        raise _format_errors(exc, RunConfig, prefix) from None


def load_run_config(path: str | Path) -> RunConfig:
    """Load a single run's `config.yaml` (as written into a run folder)."""
    return validate_run(read_mapping(path))


# ----------------------------------------------------------------------------- overrides and grid


def _split_values(text: str) -> list[str]:
    """Split 'a,b,[1,2]' on top-level commas (brackets keep a list value together)."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def parse_set(option: str) -> tuple[str, list[Any]]:
    """Parse one `--set key=v1,v2` into a key and its values (each read as a YAML scalar)."""
    key, sep, raw = option.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {option}: expected KEY=VALUE[,VALUE...], e.g. optim.lr=0.01,0.001")
    if not raw.strip():
        raise ConfigError(f"--set {key}: no values given")
    values = [parse_yaml(part.strip(), f"--set {key}") for part in _split_values(raw)]
    return key, values


def _check_grid_key(key: str, where: str) -> None:
    if key in ("seed", "seeds"):
        raise ConfigError(f"{where}: seeds are set with the 'seeds' list (or --set seeds=0,1,2)")
    if key not in run_keys():
        raise ConfigError(f"{where}: unknown key{_closest(key, run_keys())}")


def _set_dotted(data: dict, key: str, value: Any) -> None:
    section, _, leaf = key.partition(".")
    if not leaf:
        data[section] = value
        return
    existing = data.get(section)
    data[section] = {**(existing if isinstance(existing, dict) else {}), leaf: value}


def _open_keys(base: dict[str, Any]) -> tuple[str, ...]:
    """The keys of RESOLVED_PER_RUN that a base mapping leaves unset (or sets to null)."""
    def given(key: str) -> Any:
        section, _, leaf = key.partition(".")
        values = base.get(section)
        return values.get(leaf) if isinstance(values, dict) else None

    return tuple(key for key in RESOLVED_PER_RUN if given(key) is None)


def _open_mapping(cfg: RunConfig, open_keys: Sequence[str], mode: Literal["python", "json"]) -> dict[str, Any]:
    """`cfg` as a mapping of sections without the seed, with each of `open_keys` set to None."""
    data = cfg.model_dump(mode=mode, exclude={"seed"})
    for key in open_keys:
        section, _, leaf = key.partition(".")
        data[section] = {**data[section], leaf: None}
    return data


def _expand(sweep_file: SweepFile, base: RunConfig, seeds: list[int], max_runs: int) -> list[RunConfig]:
    """Each grid combination written into the base, then resolved alone (defaults that depend on
    other keys, such as AdamW's weight decay, resolve with that run's own values; keys the run does
    not use go back to their defaults). Runs that resolve alike are one run; `max_runs` bounds the
    distinct runs, counted as they come so that an absurd grid is refused without expanding it all."""
    total = math.prod(len(v) for v in sweep_file.grid.values()) * len(seeds)
    base_data = _open_mapping(base, _open_keys(sweep_file.base), "python")
    runs: dict[RunConfig, None] = {}  # insertion-ordered set: a repeated grid value runs once
    keys, resolved = list(sweep_file.grid), 0
    for combo in itertools.product(*sweep_file.grid.values()):
        data = {section: dict(values) for section, values in base_data.items()}
        for key, value in zip(keys, combo):
            _set_dotted(data, key, value)
        for seed in seeds:
            try:
                runs.setdefault(RunConfig.model_validate({**data, "seed": seed}))
            except ValidationError as exc:
                raise _grid_error(exc, dict(zip(keys, combo)), {**data, "seed": seed}, base_data) from None
            resolved += 1
            if len(runs) > max_runs:
                raise TooManyRuns(total, max_runs, distinct=len(runs) == resolved)
    return list(runs)


def _grid_error(exc: ValidationError, combo: dict[str, Any], point: dict, base_data: dict) -> ConfigError:
    lines = []
    for err in _errors(exc, RunConfig):
        loc, why = _loc(err), _describe(err, RunConfig)
        culprits = [] if _blame(loc, combo).startswith("grid.") else _culprits(combo, point, base_data)
        if culprits:
            values = ", ".join(f"grid.{key} = {_brief(combo[key])}" for key in culprits)
            lines.append(f"{values} makes {_key_path('base', loc)} invalid: {why}")
        else:
            lines.append(f"{_blame(loc, combo)}: {why}")
    return _error_lines(lines)


def _culprits(combo: dict[str, Any], point: dict, base_data: dict) -> list[str]:
    """The grid keys of `combo` whose value, put back to the base's, makes the grid point valid: the
    grid values that broke a check across keys blamed on a key the grid does not set."""
    culprits = []
    for key in combo:
        reverted = {section: dict(values) if isinstance(values, dict) else values for section, values in point.items()}
        section, _, leaf = key.partition(".")
        _set_dotted(reverted, key, base_data[section][leaf] if leaf else base_data[section])
        try:
            RunConfig.model_validate(reverted)
        except ValidationError:
            continue
        culprits.append(key)
    return culprits


def _blame(loc: Sequence[Any], combo: dict[str, Any]) -> str:
    """Where an error in one grid point comes from: the grid keys it involves (a check over a whole
    section, such as warmup_steps with kind constant, involves each of the section's grid keys), else base."""
    key = ".".join(str(p) for p in loc[:2])
    if key in combo:
        return f"grid.{key}"
    if len(loc) == 1:
        involved = [f"grid.{k}" for k in combo if k.startswith(f"{loc[0]}.")]
        if involved:
            return ", ".join(involved)
    return _key_path("base", loc)


def build_sweep(data: dict, overrides: Sequence[str] = (), max_runs: int = DEFAULT_MAX_RUNS) -> Sweep:
    """Validate a sweep mapping, apply `--set` overrides, and expand it into runs."""
    data = dict(data)
    grid = data.get("grid")
    grid = dict(grid) if isinstance(grid, dict) else grid
    for option in overrides:
        key, values = parse_set(option)
        if key == "seeds":
            data["seeds"] = values
            continue
        _check_grid_key(key, f"--set {key}")
        if isinstance(grid, dict):
            grid[key] = values
        elif grid is None:
            grid = {key: values}
    if grid is not None:
        data["grid"] = grid
    try:
        sweep_file = SweepFile.model_validate(data)
    except ValidationError as exc:
        raise _format_errors(exc, SweepFile, "") from None
    for key, values in sweep_file.grid.items():
        _check_grid_key(key, f"grid.{key}")
        if not values:
            raise ConfigError(f"grid.{key}: the list is empty, so the grid expands to no runs")
    if sweep_file.seeds is not None and not sweep_file.seeds:
        raise ConfigError("seeds: the list is empty, so the grid expands to no runs")
    if sweep_file.report.columns:
        for column in sweep_file.report.columns:
            if column not in run_keys():
                raise ConfigError(f"report.columns: unknown key '{column}'{_closest(column, run_keys())}")
    base = validate_run(sweep_file.base, "base", keep_inert=True)
    seeds = list(dict.fromkeys(sweep_file.seeds if sweep_file.seeds is not None else [base.seed]))
    runs = _expand(sweep_file, base, seeds, max_runs)
    _refuse_unused_keys(base, sweep_file.grid, runs)
    open_keys = _open_keys(sweep_file.base)
    return Sweep(sweep_file.name, base, sweep_file.grid, seeds, sweep_file.report, runs, open_keys,
                 sweep_file.notes, tuple(sweep_file.tags))


def _refuse_unused_keys(base: RunConfig, grid: dict[str, list[Any]], runs: Sequence[RunConfig]) -> None:
    """A key of ACTS_ONLY_UNDER_BY_SECTION set away from its default where no run of the sweep uses it
    is a mistake (it would change nothing): refused, naming where it was set."""
    for section, table in ACTS_ONLY_UNDER_BY_SECTION.items():
        for key, (decider, where) in table.items():
            dotted = f"{section}.{key}"
            default = _unsigned_zero(type(getattr(base, section)).model_fields[key].default)
            set_in = [f"grid.{dotted}"] if any(not _same_value(v, default) for v in grid.get(dotted, [])) else []
            if dotted not in grid and not _same_value(getattr(getattr(base, section), key), default):
                set_in.append(f"base.{dotted}")
            if set_in and all(key in inert_keys(getattr(run, section)) for run in runs):
                raise ConfigError(f"{set_in[0]}: has no effect: only {section}.{decider} "
                                  f"{' or '.join(sorted(where))} uses it, and no run of this sweep has that {decider}")


def _same_value(value: Any, default: Any) -> bool:
    """A grid or base value equal to a key's default, a YAML list matching a default tuple."""
    return _unsigned_zero(tuple(value) if isinstance(value, list) else value) == default


def load_sweep(path: str | Path, overrides: Sequence[str] = (), max_runs: int = DEFAULT_MAX_RUNS) -> Sweep:
    """Load, validate and expand a sweep file, or a run folder's `config.yaml` (a sweep of that one run,
    named after its folder). Raises ConfigError with the key path on any problem."""
    data = read_mapping(path)
    if "name" not in data and set(data) <= set(RunConfig.model_fields):
        folder = Path(path).resolve().parent.name
        data = {"name": folder if re.fullmatch(NAME_PATTERN, folder) else "run", "base": data}
    return build_sweep(data, overrides, max_runs)


def flatten(cfg: RunConfig) -> dict[str, Any]:
    """A run config as one flat mapping of dotted keys (tuples become lists)."""
    flat = {}
    for section, values in cfg.model_dump(mode="json").items():
        if isinstance(values, dict):
            flat.update({f"{section}.{k}": v for k, v in values.items()})
        else:
            flat[section] = values
    return flat
