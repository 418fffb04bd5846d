"""What a run folder is, and whether it can be trusted: its files' names, its run id, and `inspect_run`.

A finished run is verified, not trusted. Its done.json vouches for config.yaml and metrics.csv with their
SHA-256 and row counts, and for itself with a checksum over its own canonical text; the metrics must also
give back done.json's numbers, and config.yaml the run's id. Anything else is not finished: the sweep
redoes it. A done.json of release 0.1 has no checksums: such a run is re-read (config, metrics and numbers
must agree, as above) and, if it holds, stamped with them once (`store.stamp_run`), so an upgrade retrains
nothing that is intact.

This module reads and checks; it writes nothing. Writing a run folder (atomically, swapped in whole),
the summary, the history and the lock are `normexp/store.py`'s, which re-exports these names.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import io
import json
import math
import os
import re
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from normexp import __version__
from normexp.config import (
    METRIC_COLUMNS,
    STOP_REASONS,
    ConfigError,
    NormKind,
    Placement,
    RunConfig,
    mixln_post_count,
    parse_yaml,
    section_cache,
    validate_run,
)
from normexp.registry import PLUGIN_PREFIX, short_name

SWEEP_FILE = "sweep.yaml"



HISTORY_FILE = "history.jsonl"



SUMMARY_FILE = "summary.csv"



VERIFIED_FILE = ".verified.json"  # which done.json texts passed every check (`Verified`): a cache



LOCK_FILE = ".lock"



CONFIG_FILE = "config.yaml"



METRICS_FILE = "metrics.csv"



BLOCKS_FILE = "blocks.csv"



FAILED_FILE = "failed.json"



DONE_FILE = "done.json"



METRIC_HEADER = METRIC_COLUMNS  # metrics.csv's first columns



VOUCHED_FILES = (CONFIG_FILE, METRICS_FILE)  # the files a done.json records checksums of



FINISHED_STATUSES = ("completed", "diverged")



SUMMARY_STATS = ("status", "final_loss", "min_loss", "final_acc", "diverged", "steps_done", "wall_s",
                 "threads", "engine")



class StoreError(RuntimeError):
    """A problem with the output folder (in use, unwritable, disk full). The CLI exits 2 on it."""



IN_THE_WAY_REMEDY = "move it and rerun"



class InTheWay(StoreError):
    """Something normexp did not write (a file, a symbolic link) stands where a run folder must go: it is
    left as it is, and the sweep records that run as failed. `problem`: what it is, and what to do."""

    def __init__(self, run_dir: Path, what: str) -> None:
        self.problem = f"{what}; {IN_THE_WAY_REMEDY}"
        super().__init__(f"{run_dir}: {self.problem}")



# The keys a run id covered when run ids were defined (release 0.1): they are always hashed, as then.
# A key added since enters the hash only where a run sets it away from its declared default, so a release
# that adds a defaulted key keeps the id, and the folder, of every finished run that leaves it there.
# Never edit this set. A new key's declared default must be the value it means (not a None that a
# validator resolves from other keys), or its runs could not be told apart from the old ones.
HASHED_SINCE_0_1 = frozenset({
    "model.depth", "model.width", "model.hidden_mult", "model.n_classes", "model.final_norm", "model.init",
    "norm.placement", "norm.kind", "norm.eps", "norm.peri_input_norm", "norm.mixln_fraction",
    "norm.deepnorm_alpha", "norm.deepnorm_beta", "norm.prms_fraction", "data.task", "data.n_samples",
    "optim.name", "optim.lr", "optim.betas", "optim.eps", "optim.weight_decay", "optim.momentum",
    "schedule.kind", "schedule.warmup_steps", "schedule.min_lr_ratio", "train.steps", "train.threads",
    "train.stop_on_nonfinite", "seed",
})



@functools.cache
def _declared_default(model: type[BaseModel], name: str) -> Any:
    return to_jsonable_python(model.model_fields[name].get_default(call_default_factory=True))


@section_cache
def _section_view(section: str, value: BaseModel) -> dict[str, Any] | None:
    """The hashed part of one config section (see `hashed_config`); None where nothing of it is hashed.
    Cached: the 10,000 runs of a grid hold a few dozen distinct sections (a copy is handed out)."""
    values = value.model_dump(mode="json")
    model = type(value)
    kept = {key: v for key, v in values.items()
            if f"{section}.{key}" in HASHED_SINCE_0_1 or v != _declared_default(model, key)}
    if kept or any(key.startswith(f"{section}.") for key in HASHED_SINCE_0_1):
        return kept
    return None



# Placements whose definition normexp revised to the authors' own (docs/sources.md), with what changed.
# A run that the revision changes hashes {"definition": {placement: 2}} as well, so it gets a new id and
# no run trained under the earlier definition is reused or reported as the new one; every other run
# keeps its id. A folder of the earlier definition is recognised (`earlier_run_id`) and named as such.
REVISED_DEFINITIONS = {
    "b2t": "B2T now rescales the layer weights by N^(-1/2) at init (the authors' rescaling_init)",
    "resdual": "ResiDual's dual stream now starts at the embedding and has no final norm after it",
    "admin": "Admin now profiles omega from measured variances, sublayer by sublayer (Transformer-Clinic)",
    "rezero": "ReZero's Transformer layers now share one gate between attention and FFN",
    "deepnorm": "DeepNorm on the FFN toy now counts one sublayer per block: N^(1/4), (4N)^(-1/4)",
    "mixln": "Mix-LN now makes floor(f * N) layers Post-LN, not round(f * N)",
}



def revised_definition(cfg: RunConfig) -> str | None:
    """The placement of REVISED_DEFINITIONS whose revision changes how `cfg` trains, else None."""
    norm, arch, placement = cfg.norm, cfg.model.arch, cfg.norm.placement
    if placement == "resdual":
        return placement
    if placement == "b2t" and cfg.model.depth > 1:  # one layer: N^(-1/2) = 1 rescales nothing
        return placement
    if placement == "admin" and (arch == "transformer" or cfg.model.depth > 1):  # one FFN block: omega = 1 either way
        return placement
    if placement == "rezero" and arch == "transformer":  # an FFN block had one gate already
        return placement
    if placement == "deepnorm" and arch == "ffn" and (norm.deepnorm_alpha is None or norm.deepnorm_beta is None):
        return placement
    depth, fraction = cfg.model.depth, norm.mixln_fraction
    if placement == "mixln" and mixln_post_count(depth, fraction) != round(fraction * depth):
        return placement
    return None



def hashed_config(cfg: RunConfig, revised: bool = True) -> dict[str, Any]:
    """The part of a resolved config that its run id covers: every 0.1 key, and later keys off their
    default; and, for a run whose placement's definition was revised, the revision (`revised` False:
    the view before it, the one normexp's earlier definition hashed)."""
    view: dict[str, Any] = {}
    for section in type(cfg).model_fields:
        value = getattr(cfg, section)
        if isinstance(value, BaseModel):  # a grid's runs share their sections: each is viewed once
            try:
                kept = _section_view(section, value)
            except TypeError:  # an unhashable section value: viewed here
                kept = _section_view.__wrapped__(section, value)
            if kept is not None:
                view[section] = dict(kept)
            continue
        values = to_jsonable_python(value)
        if section in HASHED_SINCE_0_1 or values != _declared_default(RunConfig, section):
            view[section] = values
    placement = revised_definition(cfg)
    if revised and placement is not None:
        view["definition"] = {placement: 2}
    return view



def config_hash(cfg: RunConfig, revised: bool = True) -> str:
    """A stable hash of the resolved config (see `hashed_config`): equal configs, equal hashes, anywhere.
    The SHA-256 of `_canonical(hashed_config(cfg, revised))`, written a section at a time (`_canonical_view`),
    once per config object while it lives (`_HASHES`: a command of 10,000 runs asks for each several times)."""
    key = (id(cfg), revised)
    known = _HASHES.get(key)
    if known is not None and known[0]() is cfg:
        return known[1]
    value = hashlib.sha256(_canonical_view(cfg, revised).encode()).hexdigest()
    _HASHES[key] = (weakref.ref(cfg, lambda _, key=key: _HASHES.pop(key, None)), value)
    return value


# config_hash's values by config object (a RunConfig is frozen: its hash never changes), each entry dropped
# when its object is (the weak reference's callback runs before the object's id can be reused)
_HASHES: dict[tuple[int, bool], tuple[weakref.ref, str]] = {}


def _canonical(value: Any) -> str:
    """The one JSON text that a hashed view is hashed as: keys sorted, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _canonical_view(cfg: RunConfig, revised: bool) -> str:
    """`_canonical(hashed_config(cfg, revised))`, the same text, from each section's text (`_section_text`,
    each distinct section written once): JSON writes an object's members one after the other, so the
    sorted members' texts joined are its text. A 10,000-run grid hashes in a tenth of the time."""
    members = {}
    for section in type(cfg).model_fields:
        value = getattr(cfg, section)
        if isinstance(value, BaseModel):
            try:
                text = _section_text(section, value)
            except TypeError:  # an unhashable section value: written here
                text = _section_text.__wrapped__(section, value)
            if text is not None:
                members[section] = text
            continue
        values = to_jsonable_python(value)
        if section in HASHED_SINCE_0_1 or values != _declared_default(RunConfig, section):
            members[section] = _canonical(values)
    placement = revised_definition(cfg)
    if revised and placement is not None:
        members["definition"] = _canonical({placement: 2})
    # the members' names are identifiers (sections, "definition"): JSON writes each as itself in quotes
    return "{" + ",".join(f'"{name}":{members[name]}' for name in sorted(members)) + "}"


@section_cache
def _section_text(section: str, value: BaseModel) -> str | None:
    kept = _section_view(section, value)
    return None if kept is None else _canonical(kept)



def run_id(cfg: RunConfig, revised: bool = True) -> str:
    """A readable, unique folder name: `post-layernorm-s0-1a2b3c4d5e` (a user's own placement or kind
    reads `ext_<attribute>`; its whole reference is in the hash)."""
    norm = cfg.norm
    return f"{short_name(norm.placement)}-{short_name(norm.kind)}-s{cfg.seed}-{config_hash(cfg, revised)[:10]}"



def _one_of(names: tuple[str, ...]) -> str:
    return "(?:" + "|".join(re.escape(name) for name in names) + ")"



# The names `run_id` makes, and only those: a folder so named may be normexp's (verify --fix removes it when
# it is broken and holds normexp's files alone: `remove_run_folder`); any other is a user's and never
# touched. Built from the config's own names, so a placement or norm kind added there is matched here.
_OWN = rf"{re.escape(PLUGIN_PREFIX)}[a-z0-9_]+"  # a user's placement or kind (registry.short_name)



RUN_ID = re.compile(rf"(?:{_one_of(get_args(Placement))}|{_OWN})-(?:{_one_of(get_args(NormKind))}|{_OWN})"
                    r"-s(?:0|[1-9][0-9]*)-[0-9a-f]{10}")



def is_run_id(name: str) -> bool:
    """Whether `name` has the form of a run id (`run_id`): `post-layernorm-s0-1a2b3c4d5e`."""
    return RUN_ID.fullmatch(name) is not None



def earlier_run_id(cfg: RunConfig) -> str | None:
    """The id `cfg` had under normexp's earlier definition of its placement, if its revision changed it."""
    return run_id(cfg, revised=False) if revised_definition(cfg) is not None else None



def superseded_problem(cfg: RunConfig) -> str:
    """What a folder trained under the earlier definition of `cfg`'s placement is, for verify and report."""
    placement = revised_definition(cfg)
    return (f"trained under normexp's earlier definition of {placement} ({REVISED_DEFINITIONS[placement]}): "
            f"rerun to retrain")



def read_json(path: Path) -> dict | None:
    """A JSON file's content, or None if it is missing or unreadable (e.g. written by a crashed run)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None



def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()



def file_record(name: str, text: str) -> dict[str, Any]:
    """What done.json vouches for about one file: its SHA-256 and its rows (metrics.csv: the lines
    after the header, one per recorded step; config.yaml: its lines)."""
    data = text.encode("utf-8")
    lines = data.count(b"\n")
    return {"sha256": _sha256(data), "rows": lines - 1 if name == METRICS_FILE else lines}



def encode_done(done: dict[str, Any]) -> str:
    """done.json's one canonical text: its fields, then a checksum of them (any other text is corrupt)."""
    body = {k: v for k, v in done.items() if k != "checksum"}
    checksum = _sha256(json.dumps(body, indent=2, allow_nan=True).encode())
    return json.dumps({**body, "checksum": checksum}, indent=2, allow_nan=True) + "\n"



TOP_FILES = (SWEEP_FILE, HISTORY_FILE, SUMMARY_FILE, VERIFIED_FILE)  # the files `atomic_write` writes in a sweep folder



RUN_DIR_FILES = (CONFIG_FILE, METRICS_FILE, BLOCKS_FILE, FAILED_FILE, DONE_FILE)  # ... and in a run folder



def _real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()



def _what(path: Path) -> str:
    return "symbolic link" if path.is_symlink() else "folder" if path.is_dir() else "file"



def in_the_way(run_dir: Path) -> str | None:
    """What stands at `run_dir` that normexp did not write and so never replaces, removes or follows to
    delete: a symbolic link (normexp makes none: the link and its target are the user's), anything that
    is not a folder, or, in a folder, something not a file under one of the names normexp writes there
    (it could not be carried into the new run folder beside normexp's file). Or a folder that is not
    normexp's (`not_normexp_s`) holding a file under one of those names: the user's, which a new run
    folder would replace. None where a run folder may go."""
    if run_dir.is_symlink() or (os.path.lexists(run_dir) and not run_dir.is_dir()):
        return f"a {_what(run_dir)} normexp did not write is in the way"
    for name in RUN_DIR_FILES:
        entry = run_dir / name
        if os.path.lexists(entry) and (entry.is_symlink() or not entry.is_file()):
            return f"{name} in it: a {_what(entry)} normexp did not write is in the way"
    named = [name for name in RUN_DIR_FILES if (run_dir / name).is_file()]
    if named and not_normexp_s(run_dir):
        return (f"a folder normexp did not write (files of yours with {', '.join(named)}, but no {DONE_FILE} "
                f"or {FAILED_FILE}) is in the way")
    return None



def not_normexp_s(folder: Path) -> bool:
    """Whether a real folder named by a run id is not one normexp wrote: it holds files normexp does
    not write, and neither done marker. normexp builds a run folder aside and swaps it in whole (with
    done.json or failed.json), so no run it left unfinished looks so; a folder of normexp's own files
    alone is what a killed older release could leave."""
    if not _real_dir(folder) or any(os.path.lexists(folder / name) for name in (DONE_FILE, FAILED_FILE)):
        return False
    return bool(foreign_entries(folder))



def _own_entry(entry: Path) -> bool:
    """Whether `entry`, in a run folder (or one being built or replaced), is a file normexp writes there:
    one of RUN_DIR_FILES, or its temporary name (`.done.json.tmp-PID`). Anything else is the user's."""
    match = _STRAY.fullmatch(entry.name)
    named = entry.name in RUN_DIR_FILES or (match is not None and match["what"] == "tmp"
                                            and match["name"] in RUN_DIR_FILES)
    return named and entry.is_file() and not entry.is_symlink()



@dataclass(frozen=True)
class RunState:
    """What a run folder holds, once checked.

    finished: done.json's checksums and numbers hold. unstamped: a done.json of release 0.1 (no
    checksums) whose files re-read consistently. absent: no folder. failed: failed.json (retried by
    the next sweep). unfinished: a folder without a done marker. corrupt: `problem` says what does not
    hold. superseded: intact, but trained under normexp's earlier definition of its placement (its
    folder has the id that definition gave; `problem` says which). blocked: a file or symbolic link
    normexp did not write stands at the run folder's path (`in_the_way`; a link to a folder holding a
    finished run is read as that run). Only finished and unstamped runs have results."""

    kind: RunStateKind
    problem: str = ""
    done: dict[str, Any] | None = None
    failed: dict[str, Any] | None = None
    sha256: str = ""  # of the done.json read, where it was checked for a `Verified` record

    @property
    def finished(self) -> bool:
        return self.kind in ("finished", "unstamped")



class Corrupt(Exception):
    """Raised inside the checks of `inspect_run`: the message says which file and what is wrong."""



class Superseded(Exception):
    """Raised inside the checks of `inspect_run`: a run of normexp's earlier definition (the message says so)."""



def inspect_run(run_dir: Path, cfg: RunConfig | None = None, thorough: bool = False,
                verified: Verified | None = None) -> RunState:
    """Check a run folder against its done.json (and against `cfg`, the config asked for, if given).

    config.yaml is parsed, and its run id compared with the folder's, where no checksum vouches for it
    (release 0.1) or when `thorough` (`normexp verify`); otherwise its SHA-256 and done.json's config
    hash stand for it, since parsing YAML is what a check of thousands of runs would spend its time on.
    With `verified` (the folder's record of done.json texts that passed), a done.json that passed
    before is checked as `Verified` says, and any other thoroughly, its verdict recorded there.
    A folder swapped in while it was read (a --force rerun) is read again, so that files of the old
    and the new folder are never judged together."""
    done = verified.unchanged(run_dir) if verified is not None else None
    if done is not None:  # the file system says no file of the run changed since it passed: nothing is read
        return _same_config(done, cfg) or RunState("finished", done=done)
    for _ in range(3):
        before = _identity(run_dir)
        state = _inspect_once(run_dir, cfg, thorough, verified)
        if state.finished or _identity(run_dir) == before:
            break
    return state



def _identity(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino



def _inspect_once(run_dir: Path, cfg: RunConfig | None, thorough: bool, verified: Verified | None) -> RunState:
    state = _inspect_folder(run_dir, cfg, thorough, verified)
    if state.finished or state.kind == "superseded":
        return state  # a result counts, read through a link too: reading is harmless
    blocked = in_the_way(run_dir)
    return state if blocked is None else RunState("blocked", blocked)



def _inspect_folder(run_dir: Path, cfg: RunConfig | None, thorough: bool, verified: Verified | None) -> RunState:
    if not run_dir.is_dir():
        return RunState("absent")
    if verified is None:
        return _read_and_check(run_dir, cfg, thorough)
    taken = time.time_ns()
    stamps = file_stamps(run_dir) if verified.stamping else None  # before the files are read: a later change is seen
    state = _read_and_check(run_dir, cfg, True, verified)
    verified.record(run_dir.name, state, stamps if stamps is not None and _settled(stamps, taken) else None)
    return state



def _read_and_check(run_dir: Path, cfg: RunConfig | None, thorough: bool, verified: Verified | None = None) -> RunState:
    """Read the run's done.json and check it (`_checked`), or, where `verified` records that this very text
    passed before, check only that the files it vouches for are still those (`_passed_before`)."""
    try:
        raw = (run_dir / DONE_FILE).read_bytes()
    except FileNotFoundError:
        return _without_done(run_dir, cfg)
    except OSError as exc:
        return RunState("corrupt", f"{DONE_FILE}: cannot read: {exc.strerror}")
    if verified is None:
        return _checked(run_dir, raw, cfg, thorough)
    digest = _sha256(raw)
    state = _passed_before(run_dir, raw, cfg) if verified.passed(run_dir.name, digest) else \
        _checked(run_dir, raw, cfg, thorough)
    return RunState(state.kind, state.problem, state.done, state.failed, digest)



def _same_config(done: dict[str, Any], cfg: RunConfig | None) -> RunState | None:
    """A corrupt state where `cfg` is not the config `done` was written for, else None."""
    if cfg is not None and config_hash(cfg) != done["config_hash"]:
        return RunState("corrupt", f"{DONE_FILE}: written for another config than this run's")
    return None



def _checked(run_dir: Path, raw: bytes, cfg: RunConfig | None, thorough: bool) -> RunState:
    """Every check of `inspect_run`, `raw` being the folder's done.json."""
    try:
        done, stamped = _read_done(raw, run_dir.name)
        texts = _vouched_texts(run_dir, done, stamped)
        if cfg is not None and config_hash(cfg) != done["config_hash"]:
            raise Corrupt(f"{DONE_FILE}: written for another config than this run's")
        if thorough or not stamped or cfg is None:
            cfg = _check_config(texts[CONFIG_FILE], done, run_dir.name, cfg if stamped else None)
        _check_metrics(texts[METRICS_FILE], done, cfg.train.steps, cfg.train.stop_when)
    except Corrupt as exc:
        return RunState("corrupt", str(exc))
    except Superseded as exc:
        return RunState("superseded", str(exc), done=done)
    return RunState("finished" if stamped else "unstamped", done=done)



def _vouched_texts(run_dir: Path, done: dict[str, Any], stamped: bool) -> dict[str, str]:
    """config.yaml and metrics.csv, read; where done.json is stamped, each file it vouches for (blocks.csv
    too, where the run logged blocks) has the SHA-256 and rows it records."""
    texts = {name: _read_text(run_dir / name) for name in VOUCHED_FILES}
    if stamped:
        _check_records(done["files"], texts)
        if BLOCKS_FILE in done["files"]:  # vouched for where the run logged blocks
            _check_records(done["files"], {BLOCKS_FILE: _read_text(run_dir / BLOCKS_FILE)})
    return texts



def _passed_before(run_dir: Path, raw: bytes, cfg: RunConfig | None) -> RunState:
    """A run whose done.json, byte for byte, passed every check before (`Verified`): the files it vouches
    for must still be the ones it records, and `cfg` the config it was written for."""
    try:
        done = json.loads(raw)
    except ValueError:  # a record written on purpose for this text: it is checked after all
        done = None
    if not isinstance(done, dict) or not _valid_records(done.get("files")) or "config_hash" not in done:
        return _checked(run_dir, raw, cfg, thorough=True)
    try:
        _vouched_texts(run_dir, done, stamped=True)
    except Corrupt as exc:
        return RunState("corrupt", str(exc))
    return _same_config(done, cfg) or RunState("finished", done=done)



class Verified:
    """What a sweep folder's runs were when they last passed every check of `inspect_run` (thorough), so
    that a command reading 10,000 runs does not check each again from scratch: per run id, the SHA-256
    of its done.json, its fields, and the stamps of its files (`file_stamps`: size, mtime, ctime, inode).
    The folder keeps it in .verified.json (`store.verified_states`); `checks_version` says whose checks
    wrote it.

    Two levels, and what each can prove:

    - **Its content** (always): a run whose done.json is byte for byte one that passed is not checked
      field by field again, but its config.yaml and metrics.csv (and blocks.csv) are read and must have
      the SHA-256 and rows done.json vouches for. Any change to any byte of the run is seen (a changed
      done.json has another SHA-256 and is checked in full). What is not redone is re-deriving, from the
      same bytes, the verdict they earned; what it cannot cover is a record written on purpose to vouch
      for a done.json that fails (a damaged record names no done.json there is).
    - **Its stamps** (`trust_stamps`: `report`, `plot`, a sweep; never `verify`): where every file of the
      run still has the stamp it had when it passed, nothing is read. A stamp shows that no one asked
      the file system to change the file since: a write, a rename over it, a `touch` all change its
      ctime, which no program can set back. It cannot show that the bytes on the disk are still those:
      corruption under the file system (a failing disk, bit rot) changes no stamp. `normexp verify`
      re-reads and re-hashes every file, stamps or not. A stamp taken within `SETTLED_NS` of the
      file's last change is not recorded (a change in the same clock tick could keep it), nor one in
      the future (another machine's clock): such a run is read again next time."""

    def __init__(self, runs: dict[str, dict[str, Any]] | None = None, trust_stamps: bool = False,
                 stamping: bool = True) -> None:
        self.runs = dict(runs or {})
        self.trust_stamps = trust_stamps
        self.stamping = stamping  # whether `record` gets the files' stamps (a record that is not kept needs none)
        self.forgotten: set[str] = set()  # runs recorded before that no longer pass
        self.changed = False

    @classmethod
    def from_data(cls, data: Any, trust_stamps: bool = False, stamping: bool = True) -> Verified:
        """The record `data()` gave (read back from JSON); empty where it is of other checks, and without
        any entry that is not as `record` writes it."""
        runs = data.get("runs") if isinstance(data, dict) and data.get("checks") == checks_version() else None
        return cls({rid: entry for rid, entry in runs.items() if _valid_entry(entry)} if isinstance(runs, dict)
                   else {}, trust_stamps, stamping)

    def data(self) -> dict[str, Any]:
        return {"checks": checks_version(), "runs": self.runs}

    def unchanged(self, run_dir: Path) -> dict[str, Any] | None:
        """The done.json fields of the run in `run_dir` where its files' stamps are those it passed with
        (and stamps are trusted), else None."""
        entry = self.runs.get(run_dir.name)
        if not self.trust_stamps or entry is None or "stamps" not in entry:
            return None
        # the files it passed with (a file that was not there then, blocks.csv, is vouched for by no done.json)
        return entry["done"] if file_stamps(run_dir, entry["stamps"]) == entry["stamps"] else None

    def passed(self, rid: str, digest: str) -> bool:
        """Whether `digest` is the SHA-256 of the done.json with which run `rid` passed."""
        entry = self.runs.get(rid)
        return entry is not None and entry["sha256"] == digest

    def record(self, rid: str, state: RunState, stamps: list[list[int] | None] | None) -> None:
        """The outcome of checking run `rid`, whose files had `stamps` before they were read (None: too
        recent to be trusted, `_settled`)."""
        if state.kind != "finished":
            self.changed |= self.runs.pop(rid, None) is not None
            self.forgotten.add(rid)
            return
        entry = {"sha256": state.sha256, "done": state.done, **({"stamps": stamps} if stamps is not None else {})}
        if self.runs.get(rid) != entry:
            self.runs[rid], self.changed = entry, True
        self.forgotten.discard(rid)



def _valid_entry(entry: Any) -> bool:
    if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and isinstance(entry.get("done"), dict)
            and isinstance(entry["done"].get("config_hash"), str)):
        return False
    stamps = entry.get("stamps", [])
    return isinstance(stamps, list) and all(stamp is None or (isinstance(stamp, list) and len(stamp) == 4)
                                            for stamp in stamps)



SETTLED_NS = 2_000_000_000  # a stamp is recorded once its file is this old (file systems' clock ticks: 1 ns to 2 s)



def file_stamps(run_dir: Path, like: list[list[int] | None] | None = None) -> list[list[int] | None]:
    """The stamp of each file a run folder's result is read from (None: not there): size, mtime, ctime
    and inode, in nanoseconds. `like`: only of the files these stamps have (the others: None, unread)."""
    stamps = []
    for i, name in enumerate(STAMPED_FILES):
        if like is not None and (i >= len(like) or like[i] is None):
            stamps.append(None)
            continue
        try:
            stat = os.stat(os.path.join(run_dir, name))
        except OSError:
            stamps.append(None)
            continue
        stamps.append([stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino])
    return stamps



STAMPED_FILES = (DONE_FILE, CONFIG_FILE, METRICS_FILE, BLOCKS_FILE)



def _settled(stamps: list[list[int] | None], taken: int) -> bool:
    """Whether every file was last changed (mtime, ctime) at least SETTLED_NS before `taken` (the time
    its stamp was taken, in the same nanoseconds), and so not in the future either."""
    return all(stamp is None or max(stamp[1], stamp[2]) <= taken - SETTLED_NS for stamp in stamps)



@functools.cache
def checks_version() -> str:
    """What a .verified.json holds for: normexp's version and the source of the code that decides a
    verdict (this module, the config's validation, the names of users' placements), hashed."""
    here = Path(__file__).parent
    digest = hashlib.sha256(__version__.encode())
    for path in [Path(__file__), *sorted((here / "config").glob("*.py")), here / "registry.py"]:
        try:
            digest.update(path.read_bytes())
        except OSError:  # installed without its sources: the version alone
            continue
    return digest.hexdigest()



def _without_done(run_dir: Path, cfg: RunConfig | None) -> RunState:
    failed = read_json(run_dir / FAILED_FILE)
    if failed is not None and (cfg is None or failed.get("config_hash") == config_hash(cfg)):
        return RunState("failed", str(failed.get("error", "")), failed=failed)
    return RunState("unfinished", f"no {DONE_FILE}")



def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise Corrupt(f"{path.name}: missing") from None
    except OSError as exc:
        raise Corrupt(f"{path.name}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise Corrupt(f"{path.name}: not UTF-8 text") from None



_NUMBER_FIELDS = ("final_loss", "min_loss", "final_acc", "wall_s")



_INT_FIELDS = ("steps_done", "threads")



def _read_done(raw: bytes, folder: str) -> tuple[dict[str, Any], bool]:
    """done.json's fields, checked; and whether it carries checksums (False: written by release 0.1)."""
    try:
        done = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise Corrupt(f"{DONE_FILE}: not valid JSON") from None
    if not isinstance(done, dict):
        raise Corrupt(f"{DONE_FILE}: not a JSON object")
    stamped = "files" in done or "checksum" in done
    if stamped and raw.decode("utf-8") != encode_done(done):
        raise Corrupt(f"{DONE_FILE}: checksum does not match its content")
    _check_fields(done, folder, stamped)
    return done, stamped



def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)



def _check_fields(done: dict[str, Any], folder: str, stamped: bool) -> None:
    missing = [k for k in ("run_id", "config_hash", *SUMMARY_STATS) if k not in done]
    if stamped and "files" not in done:
        missing.append("files")
    if missing:
        raise Corrupt(f"{DONE_FILE}: missing {', '.join(missing)}")
    if done["run_id"] != folder:
        raise Corrupt(f"{DONE_FILE}: run_id {done['run_id']!r} is not the folder's name")
    if done["status"] not in FINISHED_STATUSES:
        raise Corrupt(f"{DONE_FILE}: status {done['status']!r} is not one of {', '.join(FINISHED_STATUSES)}")
    wrong = [k for k in _NUMBER_FIELDS if not _is_number(done[k])]
    wrong += [k for k in _INT_FIELDS if not isinstance(done[k], int) or isinstance(done[k], bool)]
    wrong += [k for k in ("diverged",) if not isinstance(done[k], bool)]
    if "stopped_at" in done or "stop_reason" in done:  # train.stop_when stopped the run (absent: it did not)
        wrong += [k for k in ("stopped_at",) if not isinstance(done.get(k), int) or isinstance(done.get(k), bool)]
        wrong += [k for k in ("stop_reason",) if done.get(k) not in STOP_REASONS]
    wrong += [k for k in ("run_id", "config_hash", "engine") if not isinstance(done[k], str)]
    if stamped and not _valid_records(done["files"]):
        wrong.append("files")
    if wrong:
        raise Corrupt(f"{DONE_FILE}: {', '.join(wrong)}: wrong type")



def _valid_records(files: Any) -> bool:
    return isinstance(files, dict) and all(
        isinstance(files.get(name), dict) and isinstance(files[name].get("sha256"), str)
        and isinstance(files[name].get("rows"), int) for name in VOUCHED_FILES)



def _check_records(records: dict[str, Any], texts: dict[str, str]) -> None:
    for name, text in texts.items():
        found, expected = file_record(name, text), records[name]
        if found["rows"] != expected["rows"]:
            raise Corrupt(f"{name}: {found['rows']} rows, {DONE_FILE} vouches for {expected['rows']}")
        if found["sha256"] != expected["sha256"]:
            raise Corrupt(f"{name}: SHA-256 does not match {DONE_FILE}")



def config_yaml(cfg: RunConfig) -> str:
    """config.yaml's text: `yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)`, byte for byte.
    Written one section at a time, each distinct section dumped once (`_section_yaml`): a block-style
    mapping's entries are dumped independently, and the runs of a grid share most of their sections,
    so a 10,000-run sweep spends milliseconds here instead of a minute of YAML emitting."""
    parts = []
    for section in type(cfg).model_fields:
        value = getattr(cfg, section)
        try:
            parts.append(_section_yaml(section, value))
        except TypeError:  # an unhashable value: dumped here
            parts.append(_section_yaml.__wrapped__(section, value))
    return "".join(parts)


@section_cache
def _section_yaml(section: str, value: Any) -> str:
    dumped = value.model_dump(mode="json") if hasattr(value, "model_dump") else value
    return yaml.safe_dump({section: dumped}, sort_keys=False)


def _check_config(text: str, done: dict[str, Any], folder: str, asked: RunConfig | None = None) -> RunConfig:
    """config.yaml must be a valid run config whose run id is the folder's (and done.json's). Where it is,
    byte for byte, what normexp writes for `asked` (the config the caller expects there), it is that
    config without being parsed: equal text parses to an equal config (parsing is what checking 10,000
    runs would spend its minutes on)."""
    if asked is not None and text == config_yaml(asked) and run_id(asked) == folder \
            and config_hash(asked) == done["config_hash"]:
        return asked
    try:
        on_disk = validate_run(parse_yaml(text, CONFIG_FILE))
    except ConfigError as exc:
        raise Corrupt(f"{CONFIG_FILE}: not a valid run config: {str(exc).splitlines()[0]}") from None
    if run_id(on_disk) != folder or config_hash(on_disk) != done["config_hash"]:
        # as written: a key the revision made inert (model.final_norm under resdual) is kept
        as_written = validate_run(parse_yaml(text, CONFIG_FILE), keep_inert=True)
        for earlier in (on_disk, as_written):
            if earlier_run_id(earlier) == folder and config_hash(earlier, revised=False) == done["config_hash"]:
                raise Superseded(superseded_problem(earlier))
        raise Corrupt(f"{CONFIG_FILE}: its run id is {run_id(on_disk)}, not the folder's")
    return on_disk



def _check_metrics(text: str, done: dict[str, Any], steps: int, stop_when: str | None = None) -> None:
    """metrics.csv must parse, count steps 0..n, give back done.json's numbers, and end where its
    status says: at the config's last step if completed, at a non-finite loss if diverged; or, for a run
    that train.stop_when stopped (done.json's stopped_at, stop_reason: the config's stop_when), there."""
    if done.get("stop_reason", stop_when) != stop_when:
        raise Corrupt(f"{DONE_FILE}: stop_reason {done['stop_reason']!r}, but the config's train.stop_when is "
                      f"{stop_when!r}")
    metrics = _parse_metrics(text)
    for key, value in run_stats(metrics, done["status"]).items():
        if not _same(value, done[key]):
            raise Corrupt(f"{METRICS_FILE}: {key} is {value!r}, {DONE_FILE} says {done[key]!r}")
    nonfinite = not all(math.isfinite(v) for v in metrics["loss"])
    stopped_diverged = done.get("stop_reason") == "diverged"  # train.stop_when: diverged, on finite losses
    if nonfinite != (done["status"] == "diverged") and not (stopped_diverged and done["status"] == "diverged"):
        raise Corrupt(f"{METRICS_FILE}: status {done['status']} but the losses are "
                      f"{'not ' if nonfinite else ''}all finite")
    last = metrics["step"][-1]
    end = done.get("stopped_at", steps)  # a run that train.stop_when stopped ends there
    if last > steps or (done["status"] == "completed" and last != end) or ("stopped_at" in done and last != end):
        raise Corrupt(f"{METRICS_FILE}: ends at step {last} of {steps} for a {done['status']} run"
                      + (f" stopped at step {end}" if "stopped_at" in done else ""))



def _parse_metrics(text: str) -> dict[str, list[float]]:
    rows = list(csv.reader(io.StringIO(text)))
    if not rows or tuple(rows[0][:len(METRIC_HEADER)]) != METRIC_HEADER:
        raise Corrupt(f"{METRICS_FILE}: the header is not {','.join(METRIC_HEADER)}")
    header = rows[0]
    try:
        columns = {name: [float(row[i]) for row in rows[1:]] for i, name in enumerate(header)}
    except (ValueError, IndexError):
        raise Corrupt(f"{METRICS_FILE}: a row is not {len(header)} numbers") from None
    if any(len(row) != len(header) for row in rows[1:]) or not rows[1:]:
        raise Corrupt(f"{METRICS_FILE}: no rows, or rows of the wrong length")
    if columns["step"] != list(range(len(rows) - 1)):
        raise Corrupt(f"{METRICS_FILE}: steps are not 0, 1, 2, ... in order")
    columns["step"] = [int(s) for s in columns["step"]]
    return columns



def _same(a: Any, b: Any) -> bool:
    """Equal, counting nan as equal to nan (a diverged run's final loss)."""
    both_nan = _is_number(a) and _is_number(b) and math.isnan(a) and math.isnan(b)
    return both_nan or a == b


def run_stats(metrics: dict[str, list[float]], status: str) -> dict[str, Any]:
    losses = metrics["loss"]
    finite = [v for v in losses if math.isfinite(v)]
    return {
        "status": status,
        "final_loss": losses[-1] if losses else math.nan,
        "min_loss": min(finite) if finite else math.nan,
        "final_acc": metrics["acc"][-1] if metrics["acc"] else math.nan,
        "diverged": status == "diverged",
        "steps_done": metrics["step"][-1] if metrics["step"] else 0,
    }



_STRAY = re.compile(r"\.(?P<name>.+)\.(?P<what>tmp|old)-\d+")



def foreign_entries(folder: Path) -> list[Path]:
    """The entries of a run folder that normexp did not write (a user's notes, folders, links)."""
    return [entry for entry in sorted(folder.iterdir()) if not _own_entry(entry)]



RunStateKind = Literal["finished", "unstamped", "absent", "failed", "unfinished", "corrupt", "superseded",
                       "blocked"]
