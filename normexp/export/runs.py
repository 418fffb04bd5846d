"""The runs an export sends out: every run of a sweep folder that `folder.inspect_run` verifies finished,
read once (config, done.json, metrics.csv's columns, blocks.csv's and sharpness.csv's rows), and what an
export did (`ExportResult`). The folder is only read. A folder whose runs name a plug-in (a user's placement
or kind) that cannot be imported here is refused before anything is written, naming the runs.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from normexp.config import ConfigError, RunConfig, chance_classes, flatten, trained_threshold
from normexp.export.names import run_names
from normexp.folder import (
    BLOCKS_FILE,
    DONE_FILE,
    METRICS_FILE,
    SHARPNESS_FILE,
    folder_runs,
    inspect_run,
    read_sweep,
    run_id,
    trained_rule,
)
from normexp.registry import PluginError, is_plugin, load_plugin, references_unchecked

FINAL = ("final_loss", "min_loss", "final_acc", "diverged", "trained")


@dataclass(frozen=True)
class ExportedRun:
    """One verified run, as read from its folder."""

    run_id: str
    cfg: RunConfig
    done: dict[str, Any]
    metrics: dict[str, list[float]]  # metrics.csv's columns, `step` as ints
    blocks: list[dict[str, float]] | None  # blocks.csv's rows
    time_s: float  # done.json's modification time: the run's wall time in the exports
    checksum: str  # sha256 of done.json's bytes (which vouch for the other files): changes with the result
    threshold: float  # the folder's trained rule for this run (report.trained_below, else ln(C)/10)
    sharpness: list[dict[str, float]] | None = None  # sharpness.csv's rows

    @property
    def trained(self) -> bool:
        final = self.done.get("final_loss")
        return (self.done.get("status") == "completed" and isinstance(final, (int, float))
                and final < self.threshold)

    def final(self) -> dict[str, float]:
        """The `final/` metrics: the done.json's numbers, diverged and trained as 1.0 or 0.0."""
        return {"final_loss": float(self.done["final_loss"]), "min_loss": float(self.done["min_loss"]),
                "final_acc": float(self.done["final_acc"]), "diverged": float(bool(self.done["diverged"])),
                "trained": float(self.trained)}

    def scalars(self) -> dict[str, list[tuple[int, float]]]:
        """Every exported scalar: name -> (step, value) in step order."""
        steps = [int(s) for s in self.metrics["step"]]
        series = {name: list(zip(steps, values)) for name, values in self.metrics.items() if name != "step"}
        for row in self.blocks or []:
            for column, value in row.items():
                if column not in ("step", "block"):
                    series.setdefault(f"blocks/{column}/{int(row['block']):02d}", []).append((int(row["step"]), value))
        for row in self.sharpness or []:  # nan (no preconditioned value at step 0, SGD) and inf (lr 0) left out
            for column, value in row.items():
                if column != "step" and math.isfinite(value):
                    series.setdefault(f"sharpness/{column}", []).append((int(row["step"]), value))
        last = steps[-1] if steps else 0
        return {**series, **{f"final/{name}": [(last, value)] for name, value in self.final().items()}}


@dataclass
class ExportResult:
    """What an export did: the run ids exported now, how many were there already unchanged, the earlier
    exports it replaced (run id -> why) and those it removed because their run no longer verifies, and
    the ids of the folder's runs not exported (missing, failed or corrupt)."""

    exported: list[str]
    kept: int = 0
    replaced: dict[str, str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)

    def notes(self, run_dir: Path) -> list[str]:
        """The lines that name what the export replaced or removed (none where it did neither)."""
        lines = []
        if self.replaced:
            lines.append(f"replaced this folder's earlier export of {run_count(self.replaced)}: "
                         + ", ".join(f"{rid} ({why})" for rid, why in self.replaced.items()))
        if self.dropped:
            lines.append(f"removed this folder's earlier export of {run_count(self.dropped)} that no longer "
                         f"verif{'ies' if len(self.dropped) == 1 else 'y'}: {', '.join(self.dropped)} "
                         f"(normexp verify {shlex.quote(str(run_dir))})")
        return lines


def display_names(runs: list[ExportedRun], template: str | None = None) -> dict[str, str]:
    """run id -> the name each tool shows for `runs` (`--run-name` `template`, else the keys that vary: names.py)."""
    return run_names([r.cfg for r in runs], [r.run_id for r in runs], template)


def run_count(ids: Any) -> str:
    return f"{len(ids)} run{'s' if len(ids) != 1 else ''}"


def _columns(path: Path) -> list[dict[str, float]]:
    with open(path, encoding="utf-8", newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def read_runs(run_dir: Path) -> tuple[str, list[ExportedRun]]:
    """The sweep's name and every run of `run_dir` verified finished, in the folder's order. A user's
    placement or kind is read as written, never imported."""
    name, runs, _ = read_folder(run_dir)
    return name, runs


def read_folder(run_dir: Path) -> tuple[str, list[ExportedRun], list[str]]:
    """`read_runs`, and the ids of the folder's runs that are not verified finished (missing, failed,
    corrupt). ConfigError, before anything is written, where runs name a placement or kind of a
    plug-in that cannot be imported here (`plugin_problems`)."""
    with references_unchecked():
        sweep = read_sweep(run_dir)
        configs = folder_runs(run_dir, sweep)
    problems = plugin_problems(configs)
    if problems:
        raise ConfigError(f"{run_dir}: not exported, nothing written: " + "; ".join(problems)
                          + "; install the plug-in's package (on PYTHONPATH) and export again")
    with references_unchecked():
        return (sweep.name, *_read_runs(run_dir, configs))


def plugin_problems(configs: list[RunConfig]) -> list[str]:
    """Per plug-in (a user's placement or kind, by reference) that cannot be imported here: which runs
    name it and why. An export names each run's placement and kind as they trained; one whose code is
    not here cannot be told from a typo, nor exported as what it is."""
    users: dict[str, list[str]] = {}
    for cfg in configs:
        for ref in dict.fromkeys((cfg.norm.placement, cfg.norm.kind)):
            if is_plugin(ref):
                users.setdefault(ref, []).append(run_id(cfg))
    problems = []
    for ref, ids in users.items():
        try:
            load_plugin(ref)
        except PluginError as exc:
            shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
            problems.append(f"{run_count(ids)} ({shown}) use{'s' if len(ids) == 1 else ''} the plug-in {ref}, "
                            f"which is not installed ({exc})")
    return problems


def _read_runs(run_dir: Path, configs: list[RunConfig]) -> tuple[list[ExportedRun], list[str]]:
    rule = trained_rule(run_dir)  # summary.csv's: each run is judged as its `trained` column judges it
    runs, left = [], []
    for cfg in configs:
        rid = run_id(cfg)
        state = inspect_run(run_dir / rid, cfg)
        if not state.finished:
            left.append(rid)
            continue
        rows = _columns(run_dir / rid / METRICS_FILE)
        metrics = {name: [row[name] for row in rows] for name in (rows[0] if rows else {"step": 0})}
        blocks, sharpness = (_columns(run_dir / rid / name) if (run_dir / rid / name).is_file() else None
                             for name in (BLOCKS_FILE, SHARPNESS_FILE))
        done_bytes = (run_dir / rid / DONE_FILE).read_bytes()
        runs.append(ExportedRun(rid, cfg, state.done or {}, metrics, blocks,
                                os.stat(run_dir / rid / DONE_FILE).st_mtime, hashlib.sha256(done_bytes).hexdigest(),
                                rule if rule is not None else trained_threshold(chance_classes(cfg)), sharpness))
    return runs, left


def missing_extra(target: str, package: str) -> ConfigError:
    return ConfigError(f"--to {target} needs {package}, which is not installed: pip install 'normexp[{target}]'")


def hparam_value(value: Any) -> Any:
    """A config value as the HParams plugin and MLflow show it: bools, numbers and strings as they are,
    null as "None", a list as its JSON."""
    if value is None:
        return "None"
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value))
    return value


def varying_first(runs: list[ExportedRun]) -> list[str]:
    """Config keys, those whose value varies across `runs` first (the grid's axes, seed last of them)."""
    flats = [flatten(r.cfg) for r in runs]
    keys = list(flats[0]) if flats else []
    varying = [k for k in keys if len({json.dumps(hparam_value(f[k])) for f in flats}) > 1]
    return varying + [k for k in keys if k not in varying]
