"""One run's typed config: its sections (model, norm, train; data from `data.py`, optim and schedule from
`optimizer.py`) and `RunConfig`.

Every section forbids unknown keys and validates strictly (no "32" -> 32, no true -> 1). A key that a run
does not use (an optimizer key under another optimizer, a placement's key under another placement) goes
back to its default, so runs that train alike are one run with one id. Cross-key rules (which keys fit
which architecture) are here too (the data section's own, sequence shapes, in `data.py`); errors are
worded by `errors.py`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError, to_jsonable_python

from normexp.config.data import TRANSFORMER_TASKS, DataConfig
from normexp.config.errors import ConfigError, _format_errors, _section_fields
from normexp.config.fields import (
    Fraction,
    PositiveFloat,
    _Section,
    cross_key_error,
    reset_unused_keys,
    unused_keys,
)
from normexp.config.inits import init_problem, resolve_skipinit
from normexp.config.loader import read_mapping
from normexp.config.optimizer import (
    OPTIM_ACTS_ONLY_UNDER,
    SCHEDULE_ACTS_ONLY_UNDER,
    OptimConfig,
    ScheduleConfig,
)
from normexp.registry import (
    ARCHS,
    KINDS,
    PLACEMENTS,
    PluginError,
    check_kind_plugin,
    check_placement_plugin,
    checks_references,
    is_plugin,
    placement_archs,
)

Placement = Literal[tuple(PLACEMENTS)]  # normexp/registry.py: every placement, registered once
NormKind = Literal[tuple(KINDS)]
# tfixup, fixup: config/inits.py; gpt2 (transformer only): nanoGPT's model.py, every Linear and embedding
# N(0, 0.02), the residual projections (attention out, fc2) N(0, 0.02 / sqrt(2 N)) (normexp/models/transformer.py)
Init = Literal["xavier_uniform", "xavier_normal", "torch_default", "tfixup", "fixup", "gpt2"]
Activation = Literal["relu", "gelu"]
Arch = Literal[ARCHS]  # normexp/registry.py
STOP_REASONS = ("trained", "stalled", "diverged")  # train.stop_when: why a run stops early
StopReason = Literal[STOP_REASONS]
STOP_PATIENCE = 10  # train.stop_patience's default
METRIC_COLUMNS = ("step", "loss", "acc", "lr", "grad_norm")  # metrics.csv's columns, in order: one per recorded step
VAL_COLUMNS = ("val_loss", "val_acc")  # sequence tasks: the held-out split, after METRIC_COLUMNS
Z_LOSS_COLUMN = "z_loss"  # train.z_loss > 0: the z term of each recorded step, after the columns above
METRICS = ("loss", "acc", "grad_norm", "lr", *VAL_COLUMNS, Z_LOSS_COLUMN)  # what a report or a figure can show
Metric = Literal[METRICS]

DEFAULT_REPORT_STEPS = (0, 1, 2, 3, 5, 10, 20, 30)
# Keys whose declared default (None) a validator resolves from other keys of the run. A sweep keeps them
# open in its base until each run's grid and --set values are in, so every run resolves them alone.
RESOLVED_PER_RUN = ("optim.weight_decay",)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"


class ModelConfig(_Section):
    depth: int = Field(32, ge=1, le=10_000)
    width: int = Field(32, ge=1, le=65_536)
    hidden_mult: int = Field(4, ge=1, le=64)
    n_classes: int = Field(10, ge=2)
    final_norm: bool = True
    init: Init = "xavier_uniform"
    arch: Arch = "ffn"  # transformer: the causal decoder of normexp/models/transformer.py
    n_heads: int = Field(4, ge=1, le=1024)  # transformer only: attention heads, each width / n_heads wide
    # transformer only: queries and keys normalised with the run's norm kind before their dot product
    # (Wortsman et al. 2023's qk-layernorm); scope head: per head, over width / n_heads features, one norm
    # shared by the heads (ViT-22B, Wortsman, Gemma); full: over the whole projection before the heads
    # split (OLMo 2's q_norm / k_norm)
    qk_norm: bool = False
    qk_norm_scope: Literal["head", "full"] = "head"
    # the qk norms' epsilon (kinds with one: LayerNorm, the RMSNorms); None: norm.eps, as every other norm.
    # Wortsman et al.'s qk-layernorm is flax's LayerNorm, whose epsilon is 1e-6
    qk_norm_eps: PositiveFloat | None = None
    # transformer only, nanoGPT's choices where set (docs/realtext.md): the FFN's nonlinearity (gelu: the exact,
    # erf one); bias false: no bias in any Linear nor any LayerNorm (nanoGPT's bias=False); tie_embeddings:
    # the head's weight is the token embedding's (nanoGPT's wte = lm_head)
    activation: Activation = "relu"
    bias: bool = True
    tie_embeddings: bool = False

    @model_validator(mode="after")
    def _heads_divide_width(self, info: ValidationInfo) -> ModelConfig:
        if self.arch == "transformer" and self.width % self.n_heads:
            raise cross_key_error("model.n_heads", f"must divide model.width {self.width}, got {self.n_heads}")
        if not self.qk_norm and not (info.context or {}).get("keep_inert"):  # inert without qk_norm: one id
            object.__setattr__(self, "qk_norm_scope", type(self).model_fields["qk_norm_scope"].default)
            object.__setattr__(self, "qk_norm_eps", None)
        return self


TRANSFORMER_ONLY = ("activation", "bias", "tie_embeddings")  # model keys an FFN run must leave at their default


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
        if not checks_references():  # a run folder being read: checked when it trained
            return value
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
    return reset_unused_keys(section, ACTS_ONLY_UNDER_BY_SECTION[_SECTION_NAMES[type(section)]], info)


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
    return unused_keys(section, ACTS_ONLY_UNDER_BY_SECTION[_SECTION_NAMES[type(section)]])


# train.stop_when's keys (normexp/engines/common.py `EarlyStop` reads them only under it)
TRAIN_ACTS_ONLY_UNDER: dict[str, tuple[str, frozenset[str]]] = {
    "stop_patience": ("stop_when", frozenset(STOP_REASONS)),
    "stop_below": ("stop_when", frozenset({"trained"})),
}
ACTS_ONLY_UNDER_BY_SECTION = {"norm": ACTS_ONLY_UNDER, "optim": OPTIM_ACTS_ONLY_UNDER,
                              "schedule": SCHEDULE_ACTS_ONLY_UNDER, "train": TRAIN_ACTS_ONLY_UNDER}


class TrainConfig(_Section):
    steps: int = Field(30, ge=0, le=10_000_000)
    threads: int | None = Field(None, ge=1, le=1024)  # torch intra-op threads; None: torch's default
    stop_on_nonfinite: bool = True
    log_blocks: bool = False  # write <run_id>/blocks.csv: per-block gradients, updates, activations
    log_every: int = Field(1, ge=1, le=10_000_000)  # blocks.csv keeps steps 0, k, 2k, ...
    # transformer only: add z_loss * mean(log(Z)^2) over the loss's tokens to the training objective, Z the
    # softmax normaliser of the output logits (PaLM; Wortsman et al. 2023 use 1e-4); metrics.csv's `loss`
    # stays the cross-entropy, the term is recorded in its own column `z_loss`
    z_loss: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    # opt-in early stopping (normexp/engines/common.py `EarlyStop`, docs/configs.md): stop a run once the
    # condition held for stop_patience consecutive recorded steps; null: never (every step runs)
    stop_when: StopReason | None = None
    stop_patience: int = Field(STOP_PATIENCE, ge=1, le=10_000_000)  # acts only under stop_when
    stop_below: PositiveFloat | None = None  # stop_when: trained only
    log_sharpness: int | None = Field(None, ge=1, le=10_000_000)  # every K steps: sharpness rows (sharpness.py)
    # sequence tasks: val_loss and val_acc at steps 0, k, 2k, ..., the last step and the step a run stops at
    # (train.stop_when, a non-finite loss: engines/common.py `evaluates`); nan at the others
    eval_every: int = Field(1, ge=1, le=10_000_000)

    @model_validator(mode="after")
    def _inert_keys_at_default(self, info: ValidationInfo) -> TrainConfig:
        """stop_patience and stop_below unused by this run's stop_when go back to their defaults (one id)."""
        return _inert_keys_to_default(self, info)

    @field_validator("log_every")
    @classmethod
    def _log_every_needs_log_blocks(cls, value: int, info: ValidationInfo) -> int:
        if value != 1 and not info.data.get("log_blocks"):
            raise ValueError(f"thins blocks.csv, so it needs log_blocks: true (got log_every {value} without it)")
        return value


_SECTION_NAMES = {NormConfig: "norm", OptimConfig: "optim", ScheduleConfig: "schedule", TrainConfig: "train"}


class RunConfig(_Section):
    """One training run, fully resolved: enough to rerun it alone."""

    model: ModelConfig = ModelConfig()
    norm: NormConfig = NormConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    train: TrainConfig = TrainConfig()
    seed: int = Field(0, ge=0, le=2**63 - 1)

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        return resolve_skipinit(data)  # norm.placement: skipinit is rezero (config/inits.py)

    @model_validator(mode="after")
    def _arch_fits(self, info: ValidationInfo) -> RunConfig:
        problem = arch_problem(self) or init_problem(self)
        if problem is not None:
            raise cross_key_error(*problem)
        if self.norm.placement == "resdual" and not self.norm.resdual_final_norm and not self.model.final_norm:
            if not (info.context or {}).get("keep_inert"):  # ResiDual ends without a final norm either way
                object.__setattr__(self, "model", self.model.model_copy(update={"final_norm": True}))
        return self


def arch_problem(cfg: RunConfig) -> tuple[str, str] | None:
    """(key, why) for the first key that does not fit `model.arch`, else None."""
    if cfg.model.arch == "ffn":
        if cfg.model.qk_norm:
            return "model.qk_norm", "applies to model.arch transformer only (the FFN has no attention)"
        if cfg.train.z_loss:
            return "train.z_loss", "applies to model.arch transformer only (its output logits over data.vocab)"
        if cfg.data.task != "random_labels":
            return "data.task", f"{cfg.data.task} is a sequence task: it needs model.arch transformer"
        if cfg.model.n_heads != ModelConfig.model_fields["n_heads"].default:
            return "model.n_heads", "applies to model.arch transformer only (the FFN has no attention)"
        for key in TRANSFORMER_ONLY:
            if getattr(cfg.model, key) != ModelConfig.model_fields[key].default:
                return f"model.{key}", "applies to model.arch transformer only (nanoGPT's choices: docs/realtext.md)"
        if cfg.model.init == "gpt2":
            return "model.init", "gpt2 applies to model.arch transformer only (nanoGPT's init of its projections)"
        if cfg.train.eval_every != TrainConfig.model_fields["eval_every"].default:
            return "train.eval_every", "applies to model.arch transformer only (the FFN toy has no held-out split)"
        if cfg.norm.placement == "b2t":
            return "norm.placement", ("b2t skips from a layer's input to its second sublayer's norm: it needs "
                                      "model.arch transformer (an FFN block has one sublayer)")
        if "ffn" not in placement_archs(cfg.norm.placement):
            return "norm.placement", "applies to model.arch transformer only (its archs)"
        return _arch_only_problem(cfg)
    if cfg.data.task == "random_labels":
        return "data.task", f"model.arch transformer trains on a sequence task: one of {', '.join(TRANSFORMER_TASKS)}"
    if cfg.model.n_classes != ModelConfig.model_fields["n_classes"].default:
        return "model.n_classes", "applies to model.arch ffn only (the transformer predicts data.vocab tokens)"
    if "transformer" not in placement_archs(cfg.norm.placement):
        return "norm.placement", "applies to model.arch ffn only (its archs)"
    return _arch_only_problem(cfg)


def _arch_only_problem(cfg: RunConfig) -> tuple[str, str] | None:
    """(key, why) for a key of ARCH_ONLY set away from its default under the other architecture."""
    why = {"rezero_gate": "an FFN block is one sublayer, so its gate is the layer's",
           "deepnorm_count": "the Transformer's layer has two sublayers, so both readings give M = 2N",
           "dyt_alpha0_attn": "the FFN toy has no attention sublayer"}
    inert = inert_keys(cfg.norm)  # kept only in a sweep's base (keep_inert): its grid may set what uses them
    for key, arch in ARCH_ONLY.items():
        if key in inert:
            continue
        if cfg.model.arch != arch and getattr(cfg.norm, key) != NormConfig.model_fields[key].default:
            return f"norm.{key}", f"applies to model.arch {arch} only ({why[key]})"
    return None


class ReportConfig(_Section):
    steps: list[Annotated[int, Field(ge=0)]] = list(DEFAULT_REPORT_STEPS)
    columns: list[str] | None = None  # dotted keys that make the table's columns; None: the grid keys
    metric: Metric = "loss"
    # the trained rule: a run trained when its final loss is under this; None: ln(C)/10 (`trained_threshold`).
    # Analysis, not a run key: it changes no run id, only how summary.csv, report and plot judge the runs
    trained_below: Annotated[float, Field(gt=0)] | None = None


TRAINED_FRACTION = 0.1  # the default trained rule: a final loss under a tenth of chance


def chance_classes(cfg: RunConfig) -> int:
    """How many classes a run's loss chooses among: model.n_classes, or data.vocab for a Transformer."""
    return cfg.data.vocab if cfg.model.arch == "transformer" else cfg.model.n_classes


def trained_threshold(n_classes: int) -> float:
    """The default trained rule: a final loss under a tenth of chance, ln(n_classes) / 10."""
    return math.log(n_classes) * TRAINED_FRACTION


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


def flatten(cfg: RunConfig) -> dict[str, Any]:
    """A run config as one flat mapping of dotted keys (tuples become lists): `cfg.model_dump(mode="json")`
    with each section's keys under `section.`. Each distinct section is dumped once (`_flat_section`): the
    runs of a grid share most of theirs."""
    flat: dict[str, Any] = {}
    for section in type(cfg).model_fields:
        value = getattr(cfg, section)
        if not isinstance(value, BaseModel):
            flat[section] = to_jsonable_python(value)
            continue
        try:
            items, lists = _flat_section(section, value)
        except TypeError:  # an unhashable section value: dumped here
            items, lists = _flat_section.__wrapped__(section, value)
        flat.update(items)
        flat.update((key, list(items[key])) for key in lists)  # a list is the caller's own, not the cache's
    return flat


T = TypeVar("T")


def section_cache(function: Callable[[str, BaseModel], T]) -> Callable[[str, BaseModel], T]:
    """`function(section, value)` of a config section's frozen `value`, cached: by the object first (a
    grid's runs share their section objects: 10,000 runs hold a few hundred, and pydantic's hash and ==
    of a model cost ten times a dict lookup), then by equal value (`functools.lru_cache`). An unhashable
    value raises TypeError as lru_cache does; `function` itself is the result's `__wrapped__`."""
    by_value = functools.lru_cache(maxsize=SECTIONS_CACHED)(function)
    by_object: dict[tuple[str, int], tuple[BaseModel, T]] = {}

    @functools.wraps(function)
    def cached(section: str, value: BaseModel) -> T:
        known = by_object.get((section, id(value)))
        if known is not None and known[0] is value:  # the entry holds its object: its id is not reused meanwhile
            return known[1]
        result = by_value(section, value)
        if len(by_object) >= SECTIONS_CACHED:
            by_object.clear()
        by_object[section, id(value)] = (value, result)
        return result

    return cached


SECTIONS_CACHED = 4096


@section_cache
def _flat_section(section: str, value: BaseModel) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The section's keys under `section.` and their values, and which of those are lists."""
    items = {f"{section}.{key}": v for key, v in value.model_dump(mode="json").items()}
    return items, tuple(key for key, v in items.items() if isinstance(v, list))
