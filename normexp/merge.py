"""`normexp merge OUT DIR...`: join sweep folders (the shards of one sweep, each run into its own folder
with `--shard I/N`) into one.

Every verified finished run of each DIR (`folder.inspect_run`, thorough: checksums and row counts)
is copied into OUT, its own files only (config.yaml, metrics.csv, blocks.csv, done.json: the same bytes,
so done.json still vouches for them), built aside and swapped in as a sweep writes a run. A run OUT
already holds, verified, with the same results is kept as it is. Two folders (or a DIR and OUT) that hold
one run id with different results (config.yaml, metrics.csv or blocks.csv not byte for byte equal: other
thread counts, the fast engine against an exact one) are a conflict: the merge is refused, naming them,
before anything is written. Runs a DIR holds unfinished, failed or corrupt are not copied (the sweep's
next invocation into OUT trains them). Nothing is ever removed: a file of the user's in OUT's run folder
stays there (`folder.swap_in`), and the DIRs are only read.

OUT gets the first DIR's sweep.yaml (where it has none; a folder of another sweep is refused, and so is one
without sweep.yaml that holds a summary.csv or history.jsonl: the user's, not a sweep's), every
DIR's history.jsonl lines it does not already hold, one line saying what was merged, and its
summary.csv rebuilt from the run folders; then it is verified as `normexp verify` would.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from normexp.config import RunConfig
from normexp.folder import (
    BLOCKS_FILE,
    CONFIG_FILE,
    DONE_FILE,
    HISTORY_FILE,
    METRICS_FILE,
    SHARPNESS_FILE,
    SUMMARY_FILE,
    SWEEP_FILE,
    StoreError,
    SweepLock,
    append_history,
    atomic_write,
    folder_runs,
    inspect_run,
    lock_owner,
    read_history,
    read_sweep,
    read_text,
    run_id,
    staged,
    swap_in,
    sweep_name,
    sweep_yaml,
    write_summary,
)
from normexp.registry import references_unchecked
from normexp.verify import Verification, verify_sweep

# what must be equal for two copies to be one run
RESULT_FILES = (CONFIG_FILE, METRICS_FILE, BLOCKS_FILE, SHARPNESS_FILE)
COPIED_FILES = (*RESULT_FILES, DONE_FILE)


@dataclass
class MergeOutcome:
    out_dir: Path
    copied: list[str] = field(default_factory=list)  # run ids copied into OUT
    kept: int = 0  # runs OUT already held, with the same results
    unfinished: int = 0  # runs of the DIRs' sweeps that none of them holds finished (pending, failed, corrupt)
    verification: Verification | None = None


def _results(run_dir: Path) -> dict[str, str | None]:
    return {name: read_text(run_dir / name) if (run_dir / name).is_file() else None for name in RESULT_FILES}


def _differs(a: dict[str, str | None], b: dict[str, str | None]) -> str:
    return ", ".join(name for name in RESULT_FILES if a[name] != b[name])


def merge_folders(out_dir: Path, sources: Sequence[Path], command: str = "") -> MergeOutcome:
    """Merge `sources` into `out_dir` (see the module docstring). StoreError, before anything is written,
    for a source that is not a sweep folder or is being written, sweeps of two names, or a conflict. A
    user's placement or kind is read as written, never imported."""
    with references_unchecked():
        return _merge(Path(out_dir), [Path(s) for s in sources], command)


def _merge(out_dir: Path, sources: list[Path], command: str) -> MergeOutcome:
    if any(src.resolve() == out_dir.resolve() for src in sources):
        raise StoreError(f"{out_dir}: is also one of the folders to merge; merge into another folder")
    sweeps = [read_sweep(src) for src in sources]
    names = sorted({s.name for s in sweeps})
    if len(names) > 1:
        raise StoreError(f"the folders hold sweeps {', '.join(repr(n) for n in names)}: merge joins the shards of "
                         "one sweep")
    for src in sources:
        owner = lock_owner(src)
        if owner is not None:
            raise StoreError(f"{src}: a sweep is writing here ({owner}); merge it when it has finished")
    found: dict[str, tuple[Path, RunConfig, dict[str, str | None]]] = {}
    outcome = MergeOutcome(out_dir)
    conflicts, unfinished = [], set()
    for src, sweep in zip(sources, sweeps):
        for cfg in folder_runs(src, sweep):
            rid = run_id(cfg)
            if not inspect_run(src / rid, cfg, thorough=True).finished:
                unfinished.add(rid)
                continue
            results = _results(src / rid)
            if rid in found and _differs(found[rid][2], results):
                conflicts.append(f"{rid}: {found[rid][0]} and {src} hold different results "
                                 f"({_differs(found[rid][2], results)} differ)")
            found.setdefault(rid, (src, cfg, results))
    outcome.unfinished = len(unfinished - set(found))
    strays = [name for name in (SUMMARY_FILE, HISTORY_FILE) if not (out_dir / SWEEP_FILE).is_file()
              and (out_dir / name).exists()]
    if strays:  # a folder of the user's, not a sweep's: merging would replace its summary.csv
        raise StoreError(f"{out_dir}: holds {' and '.join(strays)} but no {SWEEP_FILE}: not a sweep folder normexp "
                         "wrote; merge into another folder")
    with SweepLock(out_dir):
        other = sweep_name(out_dir)
        if other is not None and other != names[0]:
            raise StoreError(f"{out_dir}: holds sweep '{other}', not '{names[0]}'; merge into another folder")
        to_copy = []
        for rid, (src, cfg, results) in found.items():
            if inspect_run(out_dir / rid, cfg, thorough=True).finished:
                differ = _differs(_results(out_dir / rid), results)
                if differ:
                    conflicts.append(f"{rid}: {out_dir} and {src} hold different results ({differ} differ)")
                outcome.kept += not differ
                continue
            to_copy.append((rid, src))
        if conflicts:
            raise StoreError("conflicting runs, nothing merged (one run id, two results: trained with other "
                             "thread counts or engines?):\n  " + "\n  ".join(conflicts))
        for rid, src in to_copy:
            _copy_run(src / rid, out_dir / rid)
            outcome.copied.append(rid)
        _write_top_files(out_dir, sources, sweeps[0], outcome, command)
    outcome.verification = verify_sweep(out_dir)
    return outcome


def _copy_run(src: Path, run_dir: Path) -> None:
    """Copy a verified run's own files (the same bytes), built aside and swapped in whole."""
    with staged(run_dir) as staging:
        for name in COPIED_FILES:
            if (src / name).is_file():
                atomic_write(staging / name, read_text(src / name))
        swap_in(staging, run_dir)


def _write_top_files(out_dir: Path, sources: list[Path], sweep, outcome: MergeOutcome, command: str) -> None:
    if not (out_dir / SWEEP_FILE).is_file():
        atomic_write(out_dir / SWEEP_FILE, sweep_yaml(sweep))
    held = {json.dumps(r, sort_keys=True) for r in read_history(out_dir)}
    for src in sources:
        for record in read_history(src):
            if json.dumps(record, sort_keys=True) not in held:
                held.add(json.dumps(record, sort_keys=True))
                append_history(out_dir, record)
    append_history(out_dir, {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command,
                             "merged": [str(src) for src in sources], "runs_copied": len(outcome.copied),
                             "runs_kept": outcome.kept})
    out_sweep = read_sweep(out_dir)
    write_summary(out_dir, folder_runs(out_dir, out_sweep))
