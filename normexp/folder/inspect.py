"""Whether a run folder can be trusted: `inspect_run`, and `verified_states` for a sweep folder's runs.

A finished run is verified, not trusted. Its done.json vouches for config.yaml and metrics.csv with their
SHA-256 and row counts, and for itself with a checksum over its own canonical text; the metrics must also
give back done.json's numbers, and config.yaml the run's id. Anything else is not finished: the sweep
redoes it. A done.json of release 0.1 has no checksums: such a run is re-read (config, metrics and numbers
must agree, as above) and, if it holds, stamped with them once (`write.stamp_run`), so an upgrade retrains
nothing that is intact.

This module reads and checks; it writes nothing but the folder's record of what passed (`verified`).
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
from pathlib import Path
from typing import Any

from normexp.config import STOP_REASONS, ConfigError, RunConfig, parse_yaml, validate_run
from normexp.folder.ids import config_hash, earlier_run_id, run_id, superseded_problem
from normexp.folder.layout import (
    BLOCKS_FILE,
    CONFIG_FILE,
    DONE_FILE,
    FAILED_FILE,
    FINISHED_STATUSES,
    METRIC_HEADER,
    METRICS_FILE,
    SHARPNESS_FILE,
    SUMMARY_STATS,
    VOUCHED_FILES,
    RunState,
    config_yaml,
    encode_done,
    file_record,
    in_the_way,
    read_json,
    run_stats,
    sha256_hex,
)
from normexp.folder.verified import Verified, file_stamps, read_verified, save_verified, settled


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
    verified.record(run_dir.name, state, stamps if stamps is not None and settled(stamps, taken) else None)
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
    digest = sha256_hex(raw)
    state = _passed_before(run_dir, raw, cfg) if verified.passed(run_dir.name, digest) else \
        _checked(run_dir, raw, cfg, thorough)
    return RunState(state.kind, state.problem, state.done, state.failed, digest)


def _same_config(done: dict[str, Any], cfg: RunConfig | None) -> RunState | None:
    """A corrupt state where `cfg` is not the config `done` was written for, else None."""
    if cfg is not None and config_hash(cfg) != done["config_hash"]:
        return RunState("corrupt", f"{DONE_FILE}: written for another config than this run's")
    return None


def other_threads(done: dict[str, Any], threads: int) -> str | None:
    """Why a finished run must be redone to sit in a sweep that trains with `threads` torch threads:
    the thread count changes the last bits of CPU kernels, and one sweep never mixes thread counts.
    None when its done.json records the same count."""
    recorded = done.get("threads")
    if recorded == threads:
        return None
    return f"trained with {recorded} torch threads, this sweep uses {threads}: redone"


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
    and sharpness.csv too, where the run logged them) has the SHA-256 and rows it records."""
    texts = {name: read_text(run_dir / name) for name in VOUCHED_FILES}
    if stamped:
        _check_records(done["files"], texts)
        for name in (BLOCKS_FILE, SHARPNESS_FILE):
            if name in done["files"]:  # vouched for where the run logged it
                _check_records(done["files"], {name: read_text(run_dir / name)})
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


def _without_done(run_dir: Path, cfg: RunConfig | None) -> RunState:
    failed = read_json(run_dir / FAILED_FILE)
    if failed is not None and (cfg is None or failed.get("config_hash") == config_hash(cfg)):
        return RunState("failed", str(failed.get("error", "")), failed=failed)
    return RunState("unfinished", f"no {DONE_FILE}")


def read_text(path: Path) -> str:
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


def verified_states(out_dir: Path, runs: dict[str, RunConfig], record: bool = False,
                    trust_stamps: bool = True) -> dict[str, RunState]:
    """Each run of `runs` (by run id), as `inspect_run` finds it in `out_dir`, thoroughly, where the
    folder's .verified.json does not say it passed before unchanged (`verified.Verified`: by the SHA-256
    of its files, or, with `trust_stamps`, their stamps). With `record` (a command that writes the folder:
    a sweep, `verify --fix`), what passes now is recorded there for the next command (`save_verified`);
    readers leave the folder as it is."""
    if not runs:
        return {}
    verified = read_verified(out_dir, trust_stamps, stamping=record)
    states = {rid: inspect_run(out_dir / rid, cfg, thorough=True, verified=verified) for rid, cfg in runs.items()}
    if record and verified.changed:
        save_verified(out_dir, verified)
    return states
