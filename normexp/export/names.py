"""A run's name where a user reads it: TensorBoard's and W&B's run lists, MLflow's run table, a Slurm job.

`--run-name TEMPLATE` names each run from its config: `{norm.placement}-d{model.depth}-lr{optim.lr}-s{seed}`
gives `post-d8-lr0.001-s0`. A field is any flattened config key (`normexp config` lists them) or `run_id`;
numbers read as `%g` (`0.001`, `1e-05`), null as `None`, a list as its JSON. By default (no template) the name
is made of the keys that vary across the sweep's runs, each shortened (`DEFAULT_SHORT`): `post-d8-lr0.001-s0`
for a placement x depth x lr x seeds grid; a sweep of one run, or one whose runs vary in nothing but their
seed, is named by placement, kind and seed. Two runs that a template names alike get their run id's hash
appended (`...-1a2b3c`), so that no tool shows two runs under one name. Names are labels only: run ids (the
folders, the exports' keys for idempotence) never change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from normexp.config import ConfigError, RunConfig, flatten

FIELD = re.compile(r"\{([^{}]*)\}")

# How a varying key reads in a default name: a prefix before its value ("" for keys whose values name
# themselves, such as placements and kinds). Keys not listed read `<last part of the key>=<value>`.
DEFAULT_SHORT = {
    "norm.placement": "", "norm.kind": "", "model.arch": "", "data.task": "", "optim.name": "",
    "schedule.kind": "", "model.depth": "d", "model.width": "w", "model.n_heads": "h", "optim.lr": "lr",
    "schedule.warmup_steps": "wu", "optim.weight_decay": "wd", "optim.clip_norm": "clip",
    "train.z_loss": "z", "seed": "s",
}


def value_text(value: Any) -> str:
    """A config value as a name shows it: numbers as %g, bools as true/false, null as None, lists as JSON."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def check_template(template: str, keys: Iterable[str]) -> None:
    """ConfigError naming `--run-name` and the field where `template` names no config key (or is empty)."""
    if not template.strip():
        raise ConfigError("--run-name: empty; give a template such as '{norm.placement}-d{model.depth}-s{seed}'")
    known = {*keys, "run_id"}
    if template.count("{") != template.count("}"):
        raise ConfigError(f"--run-name: unbalanced braces in {template!r}")
    for name in FIELD.findall(template):
        if name not in known:
            close = sorted(k for k in known if k.endswith("." + name) or k.split(".")[-1] == name.split(".")[-1])
            hint = f" (did you mean {', '.join('{' + k + '}' for k in close[:3])}?)" if close else ""
            raise ConfigError(f"--run-name: {{{name}}} is not a config key{hint}; `normexp config` lists them")


def varying_keys(flats: Sequence[dict[str, Any]]) -> list[str]:
    """The keys whose value differs between the runs, in config order, seed last; a key whose value follows
    from an earlier one's (heads from width in a listed sample, qk_norm_eps from qk_norm) is left out."""
    if not flats:
        return []
    texts = [{k: json.dumps(v, sort_keys=True) for k, v in f.items()} for f in flats]
    keys = [k for k in texts[0] if len({t.get(k) for t in texts}) > 1]
    kept: list[str] = []
    for key in [k for k in keys if k != "seed"]:
        if not any(_follows(texts, key, earlier) for earlier in kept):
            kept.append(key)
    return kept + (["seed"] if "seed" in keys else [])


def _follows(texts: Sequence[dict[str, str]], key: str, earlier: str) -> bool:
    """Whether `key`'s value is a function of `earlier`'s across the runs."""
    seen: dict[str | None, str | None] = {}
    return all(seen.setdefault(t.get(earlier), t.get(key)) == t.get(key) for t in texts)


def default_template(varying: Sequence[str]) -> str:
    """The template a sweep's runs are named by when none is given (see the module docstring)."""
    axes = [k for k in varying if k != "seed"]
    if not axes:
        return "{norm.placement}-{norm.kind}-s{seed}"
    parts = [DEFAULT_SHORT.get(k, k.rsplit(".", 1)[-1] + "=") + "{" + k + "}" for k in axes]
    return "-".join(parts) + "-s{seed}"


def render(template: str, flat: dict[str, Any], run_id: str) -> str:
    """`template` with each `{key}` replaced by the run's value (`value_text`)."""
    values = {**flat, "run_id": run_id}
    return FIELD.sub(lambda m: value_text(values[m.group(1)]), template)


def run_names(cfgs: Sequence[RunConfig], run_ids: Sequence[str], template: str | None = None) -> dict[str, str]:
    """run id -> display name for a sweep's runs (`template`, else `default_template` of the keys that vary
    across them). ConfigError for a template naming no config key. Names made alike get their run id's
    hash appended."""
    flats = [flatten(cfg) for cfg in cfgs]
    if template is not None:
        check_template(template, flats[0] if flats else ())
    chosen = template if template is not None else default_template(varying_keys(flats))
    names = {rid: render(chosen, flat, rid) for rid, flat in zip(run_ids, flats)}
    counts: dict[str, int] = {}
    for name in names.values():
        counts[name] = counts.get(name, 0) + 1
    return {rid: name if counts[name] == 1 else f"{name}-{rid.rsplit('-', 1)[-1][:6]}" for rid, name in names.items()}
