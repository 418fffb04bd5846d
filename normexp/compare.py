"""Several sweep folders read as one, for `normexp report DIR1 DIR2 ...` and `normexp plot DIR1 DIR2 ...`.

Each folder is read and verified as `results.load_folder` reads one; their summaries and metrics are
stacked with a `sweep` column (the folder's name, or its path where two folders share a name) in front.
A run is keyed by its sweep and its config, so that the same config run in two sweeps (another engine,
another machine, another normexp) stays two runs, side by side, never one mean: `sweep` is a config key
of the stacked table (`results.config_columns`), so the table's columns and the figures' facets separate
the sweeps like any other axis that varies. A run's `run_id` becomes `<sweep>/<run_id>`.

The stacked folder's `sweep` (its report section, notes and tags) is the first folder's; its trained rule is
the folders' common one (`Sweeps.trained_rule`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from normexp.results import Folder, ResultsError, load_folder

SWEEP_COLUMN = "sweep"


@dataclass
class Sweeps(Folder):
    """Folders stacked into one `Folder` (see the module's docstring)."""

    folders: list[tuple[str, Folder]] = field(default_factory=list)

    def metrics(self, all_config: bool = False, only_last: bool = False) -> pd.DataFrame:
        key = ("metrics", True, only_last)
        if key not in self._tables:  # every config column, whatever `all_config`: the sweeps' keys differ
            self._tables[key] = _stack([(name, f.metrics(True, only_last)) for name, f in self.folders])
        copy = self._tables[key].copy()
        copy.attrs = dict(self._tables[key].attrs)
        return copy

    def blocks(self, all_config: bool = False) -> pd.DataFrame:
        key = ("blocks", True, False)
        if key not in self._tables:
            self._tables[key] = _stack([(name, f.blocks(True)) for name, f in self.folders])
        return self._tables[key].copy()

    def sharpness(self, all_config: bool = False) -> pd.DataFrame:
        key = ("sharpness", True, False)
        if key not in self._tables:
            self._tables[key] = _stack([(name, f.sharpness(True)) for name, f in self.folders if f.has_sharpness()])
        return self._tables[key].copy()

    def trained_rule(self, trained_below: float | None = None) -> float | None:
        """One rule for every folder: refused (ResultsError) where their `report.trained_below` differ and
        no --trained-below overrides them, so that no run is judged by another sweep's rule."""
        if trained_below is not None:
            return trained_below
        rules = {name: f.sweep.report.trained_below for name, f in self.folders}
        if len(set(rules.values())) > 1:
            said = ", ".join(f"{name}: {'ln(C)/10' if rule is None else rule}" for name, rule in rules.items())
            raise ResultsError(f"the sweeps judge trained by different rules (report.trained_below: {said}); "
                               "give --trained-below LOSS to compare them under one")
        return next(iter(rules.values()))


def sweep_names(paths: Sequence[Path]) -> list[str]:
    """Each folder's name, or its whole path where two folders share a name."""
    names = [Path(p).name or str(p) for p in paths]
    return [name if names.count(name) == 1 else str(path) for name, path in zip(names, paths)]


def load_folders(paths: Sequence[str | Path]) -> Folder:
    """One folder as `load_folder` reads it; several stacked as `Sweeps`. ResultsError names a folder
    given twice, or one that cannot be read."""
    paths = [Path(p) for p in paths]
    if len(paths) == 1:
        return load_folder(paths[0])
    resolved = [p.resolve() for p in paths]
    twice = [str(p) for p, r in zip(paths, resolved) if resolved.count(r) > 1]
    if twice:
        raise ResultsError(f"{twice[0]}: given twice; name each sweep folder once")
    folders = list(zip(sweep_names(paths), (load_folder(p) for p in paths)))
    first = folders[0][1]
    summary = _stack([(name, f.summary) for name, f in folders])
    latest = _stack([(name, f.latest) for name, f in folders])
    for table in (summary, latest):  # where each sweep's runs are, for the note naming missing ones
        table.attrs["folders"] = {name: str(path) for (name, _), path in zip(folders, paths)}
    label = Path(" + ".join(name for name, _ in folders))
    return Sweeps(label, first.sweep, summary, latest, folders=folders)


def _stack(frames: list[tuple[str, pd.DataFrame]]) -> pd.DataFrame:
    """The frames one under the other, each with its sweep's name in front and its run ids prefixed by it."""
    stacked = []
    unfinished: dict[str, str] = {}
    for name, frame in frames:
        frame = frame.copy()
        frame.insert(0, SWEEP_COLUMN, name)
        if "run_id" in frame:
            frame["run_id"] = name + "/" + frame["run_id"].astype(str)
        unfinished.update({f"{name}/{rid}": status for rid, status in frame.attrs.get("unfinished", {}).items()})
        stacked.append(frame)
    out = pd.concat(stacked, ignore_index=True)
    out.attrs["unfinished"] = unfinished
    return out
