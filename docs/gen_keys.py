"""The keys table of docs/configs.md, derived from normexp/config/schema.py's pydantic models.

The key names, types, allowed values, bounds and defaults come from the code; only the "meaning" column is
written here (MEANINGS). tests/test_docs.py fails when a key of the code has no meaning, when a meaning names
a key the code no longer has, or when docs/configs.md's table is not what this script writes.

    python docs/gen_keys.py           rewrite the table in docs/configs.md (between the two markers)
    python docs/gen_keys.py --check   exit 1 if it is stale
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path

import annotated_types as at
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from normexp.config import ReportConfig, RunConfig  # noqa: E402

PAGE = ROOT / "docs" / "configs.md"
BEGIN, END = "<!-- keys:begin (docs/gen_keys.py writes this table) -->", "<!-- keys:end -->"

MEANINGS = {
    "model.depth": "number of residual blocks N (Transformer: layers)",
    "model.width": "hidden size d",
    "model.hidden_mult": "FFN inner size = hidden_mult * d",
    "model.n_classes": "classes of the toy task (`arch: ffn` only)",
    "model.final_norm": "a norm before the head (the article keeps one; Xiong's Post-LN has none)",
    "model.init": "weight init of fc1/fc2: `xavier_normal` is Xiong's theory's; `tfixup` and `fixup` are "
                  "T-Fixup's and Fixup's rescaled xavier ([Inits](#inits-t-fixup-fixup-skipinit)); `gpt2` "
                  "(transformer only): nanoGPT's, every Linear and embedding N(0, 0.02), the residual projections "
                  "N(0, 0.02 / sqrt(2N)), drawn in nanoGPT's order ([Real text](realtext.md#nanogpts-model))",
    "model.arch": "`ffn` (the article's toy) or `transformer` ([The Transformer](transformer.md))",
    "model.n_heads": "transformer only: attention heads; must divide `model.width`",
    "model.qk_norm": "transformer only: normalise queries and keys with the run's norm kind before their dot "
                     "product (Wortsman et al. 2023's qk-layernorm; [Transformer](transformer.md#qk-norm-and-z-loss))",
    "model.qk_norm_scope": "with `qk_norm`: `head` per head over width / n_heads features (ViT-22B, Wortsman, "
                           "Gemma); `full` over the whole projection before the heads split (OLMo 2)",
    "model.qk_norm_eps": "with `qk_norm`: the qk norms' epsilon (kinds with one); unset: `norm.eps` (flax's "
                         "LayerNorm, the paper's qk-layernorm: 1e-6)",
    "model.activation": "transformer only: the FFN's nonlinearity; `gelu` is nanoGPT's (exact, erf)",
    "model.bias": "transformer only: `false` drops every bias of its Linears and LayerNorms (nanoGPT's "
                  "`bias=False`)",
    "model.tie_embeddings": "transformer only: the head's weight is the token embedding's (nanoGPT's `wte = "
                            "lm_head`)",
    "norm.placement": "where the norm goes ([placements](#placements-and-kinds)); `b2t` is transformer only",
    "norm.kind": "which norm ([kinds](#placements-and-kinds))",
    "norm.eps": "epsilon of every norm (the qk norms: `model.qk_norm_eps` where set)",
    "norm.peri_input_norm": "peri: the extra norm on the model input (off: Peri == Sandwich)",
    "norm.mixln_fraction": "mixln: the first floor(f * N) blocks are Post-LN, the rest Pre-LN",
    "norm.deepnorm_alpha": "deepnorm: the residual multiplier; unset: M^(1/4) for M residual sublayers (FFN toy: "
                           "N, Transformer: 2N)",
    "norm.deepnorm_beta": "deepnorm: the init scale of the branch weights; unset: (4M)^(-1/4)",
    "norm.prms_fraction": "prmsnorm: the RMS is taken over the first max(1, int(d * p)) features",
    "norm.output_norm_init": "respost: the branch norm's gain at init; `zeros` (Swin V2) starts every block as the "
                             "identity",
    "norm.deepnorm_count": "deepnorm, FFN toy: `sublayers` (M = N, DeepNet\'s count of sublayers) or "
                           "`two_per_block` (M = 2N, normexp\'s earlier reading)",
    "norm.b2t_rescale": "b2t: multiply every layer weight (q, k, v, out, fc1, fc2) by N^(-1/2) at init, as the "
                        "authors\' rescaling_init; false: not",
    "norm.resdual_stream": "resdual: where the dual stream x_d starts: `input` (the authors\') or `zeros` "
                           "(normexp\'s earlier reading)",
    "norm.resdual_final_norm": "resdual: apply model.final_norm on top of x_a + Norm_d(x_d) (normexp\'s earlier "
                               "reading); false: the authors\' output",
    "norm.admin_profile": "admin: `measured` (Transformer-Clinic\'s sequential profile) or `closed_form` sqrt(1 "
                          "+ sum Var F_j)",
    "norm.rezero_gate": "rezero, Transformer: `layer` (one gate shared by a layer\'s two sublayers, the "
                        "authors\') or `sublayer`",
    "norm.dyt_alpha0_attn": "dyt, Transformer: alpha0 of the attention sublayers\' norms; unset: dyt_alpha0",
    "norm.dyt_alpha0_ffn": "dyt, Transformer: alpha0 of the FFN sublayers\' norms; unset: dyt_alpha0",
    "norm.dyt_alpha0_final": "dyt: alpha0 of the final norm; unset: dyt_alpha0",
    "norm.dyt_bias": "dyt: a learnable bias after the tanh (false: none)",
    "norm.derf_alpha0": "derf: the initial alpha of erf(alpha x + shift)",
    "norm.dyt_alpha0": "dyt: the initial alpha of tanh(alpha x)",
    "data.task": "`random_labels`: X ~ randn(n, d), y ~ randint(n_classes), memorisation (ffn); the sequence tasks "
                 "and `shakespeare_char` ([Real text](realtext.md)) are the Transformer's",
    "data.n_samples": "full-batch size; sequence tasks: the training split; not `shakespeare_char`",
    "data.vocab": "sequence tasks: tokens (modular_add: p = vocab - 2, vocab at most 2050); `shakespeare_char`: "
                  "set to its 84 characters",
    "data.seq_len": "sequence tasks: tokens per sequence; unset: the task's (assoc_recall 16, a multiple of 4; "
                    "copy 17, odd; modular_add 5), and the task's length written out is the same run as unset; "
                    "`shakespeare_char`: characters of context (nanoGPT's block_size), unset 64",
    "data.n_val": "sequence tasks: the held-out split; `shakespeare_char`: windows of the val split, the same "
                  "for every run",
    "data.batch_size": "sequence tasks: minibatch size, epochs in a seeded order; unset: the full batch; "
                       "`shakespeare_char`: random windows a step (unset: 32)",
    "optim.name": "`sgd` is SGD with momentum",
    "optim.lr": "peak learning rate",
    "optim.betas": "Adam-family betas",
    "optim.eps": "Adam-family eps",
    "optim.weight_decay": "unset: the optimizer's own, 0.01 for adamw and 0 otherwise, resolved per run after the "
                          "grid and `--set`",
    "optim.momentum": "sgd only",
    "optim.clip_norm": "every optimizer: clip the gradients' global L2 norm to this before each update, as "
                       "`torch.nn.utils.clip_grad_norm_`; unset: no clipping "
                       "([controls](#optimizer-and-schedule-controls))",
    "optim.agc": "every optimizer: adaptive gradient clipping (NFNets), each unit's gradient norm at most agc * "
                 "max(its weights' norm, agc_eps), the final layer's weight unclipped; unset: none; not with "
                 "clip_norm",
    "optim.agc_eps": "with `agc`: the floor of a unit's weight norm (NFNets' 1e-3)",
    "optim.v_only_steps": "adam, adamw: Adam-2k, the first k updates move only the second moment (the step "
                          "count advances)",
    "optim.v0": "adam, adamw: the second moment's start: `zero` (Adam's) or `grad_sq`, the first gradient "
                "squared (GI-Adam)",
    "optim.radam_variant": "radam: `torch` (torch's RAdam: momentum steps while rho_t <= 5) or `official` (the "
                           "authors' radam.py: no update while rho_t < 5, decoupled weight decay)",
    "optim.independent_weight_decay": "adamw: decay each update by weight_decay times the schedule's multiplier "
                                      "(lr_t / lr), not lr_t * weight_decay (Wortsman et al. 2023)",
    "schedule.kind": "the learning-rate schedule ([schedules](#schedules))",
    "schedule.warmup_steps": "linear warmup length (0 = none; must be 0 with `constant`)",
    "schedule.min_lr_ratio": "cosine's final multiplier; wsd's final_lr_factor",
    "schedule.decay_fraction": "wsd: the last int(f * train.steps) updates decay (the authors' fract_decay)",
    "schedule.decay_shape": "wsd: the decay's shape, as epfml/schedules-and-scaling's decay_type (`mirror_cosine` "
                            "is their `miror_cosine`)",
    "train.steps": "optimizer steps S; losses are recorded at steps 0..S",
    "train.threads": "torch intra-op threads for the run (recorded in done.json); unset: torch's default",
    "train.stop_on_nonfinite": "stop a run at its first nan/inf loss (it is marked `diverged`)",
    "train.log_blocks": "also write `<run_id>/blocks.csv`: per-block gradients, updates and activations (a "
                        "Transformer's also attention logits, entropy and log Z)",
    "train.log_every": "blocks.csv keeps steps 0, k, 2k, ... (needs `log_blocks: true`)",
    "train.log_sharpness": "every K steps (0, K, 2K, ...), the top Hessian eigenvalue, the preconditioned one "
                           "(Adam family) and their thresholds 2/lr, (2+2 beta1)/((1-beta1) lr) "
                           "([Sharpness](#sharpness)); unset: off. The reference engine measures it",
    "train.stop_when": "opt-in early stopping: `trained`, `stalled` or `diverged` (rules in "
                       "[Early stopping](#early-stopping)); unset: every run runs all its steps",
    "train.stop_patience": "consecutive steps the stop_when condition must hold before the run stops "
                           "(only under stop_when)",
    "train.stop_below": "stop_when: trained only: the loss to stay below; unset: the default trained rule "
                        "ln(C)/10",
    "train.z_loss": "transformer only: add z_loss * mean(log(Z)^2) to the objective (PaLM's z-loss; 1e-4 is "
                    "Wortsman's); `loss` stays the cross-entropy, the term goes to metrics.csv's `z_loss` column",
    "train.eval_every": "transformer only: val_loss and val_acc at steps 0, k, 2k, ..., the last and the step "
                        "a run stops at (train.stop_when, a non-finite loss); nan at the others",
    "seed": "set by the sweep's `seeds` list",
    "report.steps": "rows of the table (each run's last step is always one)",
    "report.columns": "keys that make the table's columns; unset: the keys that vary",
    "report.metric": "the table's metric; `val_loss`, `val_acc` for sequence tasks",
    "report.trained_below": "the trained rule: a run trained when its final loss is under this; unset: ln(C)/10 "
                            "(C: n_classes, or data.vocab for the Transformer). Changes no run id",
}


def keys() -> dict[str, tuple[object, object]]:
    """Every dotted key of a run config (and of a sweep file's `report:`) -> (annotation with its field's
    constraints, default), in the models' own order."""
    found: dict[str, tuple[object, object]] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{prefix}{name}.")
                continue
            if field.metadata:
                annotation = _constrained(annotation, field.metadata)
            found[prefix + name] = (annotation, field.get_default(call_default_factory=True))

    walk(RunConfig, "")
    walk(ReportConfig, "report.")
    return found


def _constrained(annotation: object, metadata: list) -> object:
    """`annotation` with a field's constraints, put on the value's type (`int | None` -> `int (>= 1) or unset`)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [arg for arg in args if arg is not type(None)]
        return typing.Annotated[(inner[0], *metadata)] | None if len(inner) == 1 else annotation
    return typing.Annotated[(annotation, *metadata)]


def describe_type(annotation: object) -> str:
    """`int, 1..10000`, `float > 0`, a Literal's values, ... from an annotation and its constraints."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _bounded(describe_type(args[0]), args[1:])
    if origin is typing.Literal:
        return " \\| ".join(f"`{value}`" for value in args)
    if origin in (typing.Union, types.UnionType):
        shown = [describe_type(arg) for arg in args if arg is not type(None)]
        return " or ".join(shown) + (" or unset" if type(None) in args else "")
    if origin is tuple:
        return "[" + ", ".join(describe_type(arg) for arg in args) + "]"
    if origin is list:
        return f"list of {describe_type(args[0])}"
    return getattr(annotation, "__name__", str(annotation))


def _bounded(base: str, metadata: tuple) -> str:
    lower = upper = None
    for item in metadata:
        for constraint in getattr(item, "metadata", [item]):  # a FieldInfo holds its constraints
            if isinstance(constraint, at.Gt):
                lower = f"> {constraint.gt}"
            elif isinstance(constraint, at.Ge):
                lower = f">= {constraint.ge}"
            elif isinstance(constraint, at.Lt):
                upper = f"< {constraint.lt}"
            elif isinstance(constraint, at.Le):
                upper = "<= 2^63 - 1" if constraint.le == 2**63 - 1 else f"<= {constraint.le:,}".replace(",", "_")
    bounds = ", ".join(bound for bound in (lower, upper) if bound)
    return f"{base} ({bounds})" if bounds else base


def describe_default(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(item) for item in value) + "]"
    return str(value)


def table() -> str:
    rows = ["| key | type and range | default | meaning |", "|---|---|---|---|"]
    for key, (annotation, default) in keys().items():
        rows.append(f"| `{key}` | {describe_type(annotation)} | {describe_default(default)} | "
                    f"{MEANINGS.get(key, '(no meaning written: add it to docs/gen_keys.py MEANINGS)')} |")
    return "\n".join(rows)


def rewritten(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    text = PAGE.read_text(encoding="utf-8")
    new = rewritten(text)
    if "--check" in argv:
        if new != text:
            print("docs/configs.md: the keys table is stale: run python docs/gen_keys.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
