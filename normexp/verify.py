"""Check a sweep's output folder file by file (`normexp verify DIR`) and, asked to, repair it.

What is checked, each problem one `Finding`:

- every run the folder holds (`folder.folder_runs`: its latest sweep's, listed by sweep.yaml, and
  the verified runs of earlier invocations), with `folder.inspect_run`: done.json's own
  checksum, the SHA-256 and row counts of config.yaml and metrics.csv, config.yaml against the run
  id, the metrics against done.json's numbers; runs missing, failed or left unfinished;
- folders holding a run that is neither (not verified, of no run of the latest sweep), and runs
  trained under normexp's earlier definition of a placement (`folder.ids.REVISED_DEFINITIONS`): named as
  such, never counted as results and never removed (rerunning the sweep retrains them under new ids);
- temporary files and folders that only a killed writer leaves (`folder.stray_paths`);
- summary.csv against the table rebuilt from the verified run folders.

`fix` removes what can be redone (corrupt and unfinished run folders, unverifiable folders of other
sweeps, that hold normexp's files alone; temporary files; a run folder caught mid-swap is put back),
stamps runs of release 0.1 that re-read consistently, and rebuilds summary.csv. Nothing else is
deleted: verified runs of every invocation stay, and missing runs are left for the sweep to redo. Only
what normexp writes is ever removed: folders named by a run id (`folder.ids.RUN_ID`) that hold normexp's own
files alone (`folder.remove_run_folder`), and its own temporary names (`folder.stray_paths`). A user's
folder (`my_analysis/` holding a `config.yaml`), a folder named by a run id that holds anything else (a
user's notes: no part of it is removed) and any symbolic link are left alone, at most named in a note (a
file, link or user's folder where a run of the sweep belongs is a problem, in that run's way, and left
alone too). `fix` holds the folder's lock; a plain check refuses a folder a sweep is writing. Nothing
here prints: the CLI renders the result.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from normexp.config import RunConfig
from normexp.folder import (
    DONE_FILE,
    FAILED_FILE,
    HISTORY_DAMAGE_EFFECT,
    HISTORY_FILE,
    IN_THE_WAY_REMEDY,
    SUMMARY_FILE,
    VOUCHED_FILES,
    RunState,
    StoreError,
    SweepLock,
    cached_statuses,
    folder_runs,
    foreign_entries,
    history_damage,
    inspect_run,
    is_run_id,
    lock_owner,
    not_normexp_s,
    read_sweep,
    recover_strays,
    remove_run_folder,
    run_id,
    stamp_run,
    stray_paths,
    summary_csv,
    superseded_folder,
    superseded_problem,
    verified_states,
    write_summary,
)
from normexp.registry import references_unchecked

RUN_FILES = (*VOUCHED_FILES, DONE_FILE, FAILED_FILE)  # a folder holding any of these is a run folder
REDO = "rerun the sweep to redo it"


@dataclass(frozen=True)
class Finding:
    """One thing wrong (or, as a note, worth knowing) in the folder, and what fixes it."""

    path: str  # relative to the sweep folder
    problem: str
    remedy: str  # what `fix` does, or did; or what the user should do
    severity: Literal["problem", "note"] = "problem"


@dataclass
class Verification:
    """The outcome of `verify_sweep`: what was found (and, with `fix`, done) and what still stands."""

    out_dir: Path
    runs: int  # runs the folder holds (its latest sweep's, and verified runs of earlier invocations)
    verified: int  # of those, with a verified result (after the fixes, with `fix`)
    findings: list[Finding] = field(default_factory=list)
    fixed: bool = False
    remaining: int = 0  # problems left after the fixes (with `fix`), else the problems found

    @property
    def clean(self) -> bool:
        return self.remaining == 0

    @property
    def next_step(self) -> str:
        """What mends the problems left: `--fix` where it has something to do, then (or else) rerunning the
        sweep, which redoes the runs missing, failed or removed."""
        rerun = f"rerun the sweep (normexp sweep {self.out_dir / 'sweep.yaml'} --out {self.out_dir})"
        problems = [f for f in self.findings if f.severity == "problem"]
        redo = any(REDO in f.remedy for f in problems)
        # a rerun rewrites summary.csv too: --fix is for what a rerun leaves (strays, corrupt runs, ...)
        mendable = not self.fixed and any("--fix" in f.remedy and not (redo and f.path == SUMMARY_FILE)
                                          for f in problems)
        if not mendable:
            return rerun
        return f"normexp verify {self.out_dir} --fix" + (f", then {rerun}" if redo else "")


def verify_sweep(out_dir: str | Path, fix: bool = False) -> Verification:
    """Check `out_dir` (see the module docstring); with `fix`, repair what can be. StoreError if the
    folder is not a sweep's output or a sweep is writing to it. A user's placement or kind is read as
    written, never imported: verifying needs neither their package nor their code."""
    with references_unchecked():
        return _verify(Path(out_dir), fix)


def _verify(out_dir: Path, fix: bool) -> Verification:
    sweep = read_sweep(out_dir)
    if not fix:
        owner = lock_owner(out_dir)
        if owner is not None:
            raise StoreError(f"{out_dir}: a sweep is writing here ({owner}); verify it when it has finished")
        runs = folder_runs(out_dir, sweep)
        findings, verified = _check(out_dir, runs, fix=False)
        return Verification(out_dir, len(runs), verified, findings, False, _problems(findings))
    with SweepLock(out_dir):
        runs = folder_runs(out_dir, sweep)  # read once: a run the fixes find corrupt is still listed
        findings, _ = _check(out_dir, runs, fix=True)
        remaining, verified = _check(out_dir, runs, fix=False)
    return Verification(out_dir, len(runs), verified, findings, True, _problems(remaining))


def _problems(findings: list[Finding]) -> int:
    return sum(f.severity == "problem" for f in findings)


def _check(out_dir: Path, runs: list[RunConfig], fix: bool) -> tuple[list[Finding], int]:
    """Every finding, in folder order (fixing each as it goes with `fix`), and the verified runs."""
    findings = _strays(out_dir, fix) + _history_finding(out_dir)
    ids = {run_id(cfg): cfg for cfg in runs}
    states = verified_states(out_dir, ids, record=fix, trust_stamps=False)  # every byte read; plain: writes nothing
    verified, earlier, engines = 0, set(), {}
    for rid, cfg in ids.items():
        state = states[rid]
        old = superseded_folder(out_dir, cfg) if state.kind == "absent" else None
        if old is not None:
            earlier.add(old.name)
            findings.append(Finding(old.name, f"{superseded_problem(cfg)} (not counted as a result; this "
                                    f"sweep's run is {rid})", f"left in place; {REDO} under the new definition"))
            continue
        finding = _run_finding(out_dir / rid, state, fix)
        verified += finding is None or finding.severity == "note"
        findings += [finding] if finding else []
        if state.finished and state.done:
            engines[rid] = str(state.done.get("engine"))
    findings += _mixed_engines(engines)
    findings += _foreign(out_dir, set(ids) | earlier, fix)
    findings += _summary(out_dir, runs, fix, None if fix else states)  # fixed runs are inspected again
    return findings, verified


def _history_finding(out_dir: Path) -> list[Finding]:
    """A problem where history.jsonl is damaged: --fix cannot restore the invocations it lost (their
    unfinished runs go uncounted), so the folder does not verify clean until it is restored."""
    damage = history_damage(out_dir)
    if not damage:
        return []
    return [Finding(HISTORY_FILE, f"damaged ({'; '.join(damage)})",
                    f"{HISTORY_DAMAGE_EFFECT} (--fix cannot repair it)")]


def _mixed_engines(engines: dict[str, str]) -> list[Finding]:
    """A note when the sweep's verified runs come from the fast engine and from an exact one: every
    cell that holds both averages approximate numbers with exact ones (`report` names those cells)."""
    fast = [rid for rid, engine in engines.items() if engine == "fast"]
    if not fast or len(fast) == len(engines):
        return []
    exact = ", ".join(sorted({e for e in engines.values() if e != "fast"}))
    return [Finding(".", f"runs of two engines: {len(fast)} of {len(engines)} by the fast engine (close to the "
                    f"reference's numbers, not equal), the others by {exact}, e.g. {fast[0]}",
                    "for one engine throughout, rerun the sweep with --engine batched (it redoes the fast runs) "
                    "or with --engine fast --force", "note")]


def _strays(out_dir: Path, fix: bool) -> list[Finding]:
    strays = [str(p.relative_to(out_dir)) for p in stray_paths(out_dir)]
    if not strays:
        return []
    if fix:
        return [Finding(line.split(": ", 1)[0], "left by a killed writer", line.split(": ", 1)[1])
                for line in recover_strays(out_dir)]
    return [Finding(path, "left by a killed writer", "--fix removes it (or puts back a run folder caught "
                    "mid-replacement; files of yours in it go back into the run folder)") for path in strays]


def _run_finding(run_dir: Path, state: RunState, fix: bool) -> Finding | None:
    """The finding for one run of the sweep, fixing it with `fix` where that is possible."""
    name = run_dir.name
    if state.kind == "finished":
        return None
    if state.kind == "unstamped":
        if fix:
            stamp_run(run_dir, state)
        return Finding(name, "no checksums (written by release 0.1); re-read and consistent",
                       "stamped with checksums" if fix else "--fix stamps it with checksums")
    if state.kind == "absent":
        return Finding(name, "missing", REDO)
    if state.kind == "failed":
        return Finding(name, f"failed: {state.problem.splitlines()[-1] if state.problem else ''}", REDO)
    if state.kind == "superseded":  # never removed: it is a result, of the earlier definition
        return Finding(name, state.problem, f"left in place; {REDO} under the new definition")
    if state.kind == "blocked":  # a file or link: the user's, and what a link points to as well
        return Finding(name, state.problem, f"left alone: {IN_THE_WAY_REMEDY} the sweep")
    what = f"corrupt: {state.problem}" if state.kind == "corrupt" else f"unfinished: {state.problem}"
    if foreign_entries(run_dir):  # some of it is the user's: no part of it is removed
        whose = "not normexp's" if not_normexp_s(run_dir) else "holds files normexp did not write"
        return Finding(name, what, f"{whose}: left in place; {REDO} (your files move into its new folder)")
    if fix:
        remove_run_folder(run_dir)
    return Finding(name, what, f"removed; {REDO}" if fix else f"--fix removes it; {REDO}")


def _foreign(out_dir: Path, ids: set[str], fix: bool) -> list[Finding]:
    """Folders that hold a run, but no run of this sweep. Only a folder named by a run id is normexp's:
    any other that holds a file named like a run's (a user's `my_analysis/config.yaml`, a renamed run
    folder, a symbolic link) is named in a note, never touched."""
    findings = []
    for folder in sorted(p for p in out_dir.iterdir() if p.is_dir() and p.name not in ids):
        if folder.name.startswith(".") or not any((folder / f).exists() for f in RUN_FILES):
            continue
        if folder.is_symlink() or not is_run_id(folder.name):
            findings.append(Finding(folder.name, "holds files named like a run's, but is no run folder normexp "
                                    "wrote (" + ("a symbolic link" if folder.is_symlink() else "not named by a run id")
                                    + "): not a result", "left alone", "note"))
            continue
        state = inspect_run(folder, thorough=True)
        if state.finished:
            findings.append(Finding(folder.name, "a verified run of another sweep (not in this sweep's results)",
                                    "left in place", "note"))
            continue
        if state.kind == "superseded":
            findings.append(Finding(folder.name, f"{state.problem} (a run of another sweep, not in this "
                                    "sweep's results)", "left in place", "note"))
            continue
        if foreign_entries(folder):  # some of it is the user's: no part of it is removed
            findings.append(Finding(folder.name, "named like a run folder, but holds files normexp did not write "
                                    "and no verified run", "not normexp's: left in place", "note"))
            continue
        if fix:
            remove_run_folder(folder)
        findings.append(Finding(folder.name, f"a run folder of no run of this sweep, {state.kind}: {state.problem}",
                                "removed" if fix else "--fix removes it"))
    return findings


def _summary_difference(found: str, expected: str) -> str:
    """How a summary.csv differs from the rebuilt one: 'does not match the run folders', or where its
    every row agrees on the columns it has and it only lacks later columns (a folder of an earlier
    release: summary.csv gained `threshold`, `trained` and new config keys since), that it is older."""
    old, new = list(csv.DictReader(io.StringIO(found))), list(csv.DictReader(io.StringIO(expected)))
    have = list(old[0]) if old else next(csv.reader(io.StringIO(found)), [])
    wanted = next(csv.reader(io.StringIO(expected)), [])
    lacking = [column for column in wanted if column not in have]
    if (not lacking or set(have) - set(wanted) or len(old) != len(new)
            or any(row != {column: fresh[column] for column in have} for row, fresh in zip(old, new))):
        return "does not match the run folders"
    return f"written by an earlier normexp: agrees with the run folders but lacks {', '.join(lacking)}"


def _summary(out_dir: Path, runs: list[RunConfig], rebuild: bool,
             found: dict[str, RunState] | None = None) -> list[Finding]:
    """summary.csv must be the table rebuilt from the verified run folders (`found`: those just inspected)."""
    statuses = cached_statuses(out_dir)
    expected = summary_csv(out_dir, runs, statuses, found)
    try:
        found = (out_dir / SUMMARY_FILE).read_bytes().decode("utf-8")
    except FileNotFoundError:
        found, problem = None, "missing"
    except (OSError, UnicodeDecodeError):
        found, problem = None, "unreadable"
    else:
        problem = _summary_difference(found, expected)
    if rebuild and (found != expected or found is None):
        write_summary(out_dir, runs, statuses)
    if found == expected:
        return []
    older = problem.startswith("written by an earlier")  # a consistent cache, short of the new columns: a note
    return [Finding(SUMMARY_FILE, problem, "rebuilt from the verified run folders" if rebuild
                    else "--fix rebuilds it from the verified run folders", "note" if older else "problem")]
