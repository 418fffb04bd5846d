"""The run-directory contract (SPEC §6): atomic writes, done markers, resume, and the sweep lock.

    <out>/
      sweep.yaml              the resolved sweep (after --set), loadable again
      summary.csv             one row per run of the sweep, rebuilt from the run folders every time
      .lock                   held (flock) while a sweep writes here; holds the owner's PID and host
      <run_id>/config.yaml    the resolved run config: `normexp sweep <run_id>/config.yaml` reruns it
                              alone (a sweep of one run, into runs/<run_id> unless --out)
      <run_id>/metrics.csv    step, loss, acc, lr, grad_norm: one row per recorded step, floats as repr()
      <run_id>/blocks.csv     with train.log_blocks only: one row per logged step and block (blocklog.py)
      <run_id>/failed.json    only for a run that raised: the error (the run is retried next time)
      <run_id>/done.json      written last: the run is complete (+ summary numbers, timings, versions)

Every file is written to a temporary name, fsynced and renamed, so a reader (or a rerun after
`kill -9`) never sees half a file. A run counts as finished only when its `done.json` exists and
its `config_hash` matches the config being asked for; anything else in its folder is removed and the
run is redone from scratch.
"""

from __future__ import annotations

import csv
import errno
import fcntl
import hashlib
import io
import json
import math
import os
import platform
import shutil
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from normexp.config import RunConfig, flatten

SWEEP_FILE = "sweep.yaml"
SUMMARY_FILE = "summary.csv"
LOCK_FILE = ".lock"
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.csv"
BLOCKS_FILE = "blocks.csv"
FAILED_FILE = "failed.json"
DONE_FILE = "done.json"

SUMMARY_STATS = ("status", "final_loss", "min_loss", "final_acc", "diverged", "steps_done", "wall_s",
                 "threads", "engine")


class StoreError(RuntimeError):
    """A problem with the output folder (in use, unwritable, disk full). The CLI exits 2 on it."""


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


def _declared_default(model: type[BaseModel], name: str) -> Any:
    return to_jsonable_python(model.model_fields[name].get_default(call_default_factory=True))


def hashed_config(cfg: RunConfig) -> dict[str, Any]:
    """The part of a resolved config that its run id covers: every 0.1 key, and later keys off their default."""
    view: dict[str, Any] = {}
    for section, values in cfg.model_dump(mode="json").items():
        if not isinstance(values, dict):
            if section in HASHED_SINCE_0_1 or values != _declared_default(RunConfig, section):
                view[section] = values
            continue
        model = type(getattr(cfg, section))
        kept = {key: value for key, value in values.items()
                if f"{section}.{key}" in HASHED_SINCE_0_1 or value != _declared_default(model, key)}
        if kept or any(key.startswith(f"{section}.") for key in HASHED_SINCE_0_1):
            view[section] = kept
    return view


def config_hash(cfg: RunConfig) -> str:
    """A stable hash of the resolved config (see `hashed_config`): equal configs, equal hashes, anywhere."""
    canonical = json.dumps(hashed_config(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def run_id(cfg: RunConfig) -> str:
    """A readable, unique folder name: `post-layernorm-s0-1a2b3c4d5e`."""
    return f"{cfg.norm.placement}-{cfg.norm.kind}-s{cfg.seed}-{config_hash(cfg)[:10]}"


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` so that `path` holds either the old content or all of the new."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def format_float(value: float) -> str:
    """repr() round-trips a float exactly; nan/inf stay readable for pandas and csv."""
    return repr(float(value))


def metrics_csv(metrics: dict[str, list[float]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    columns = list(metrics)
    writer.writerow(columns)
    for row in zip(*(metrics[c] for c in columns)):
        writer.writerow([str(v) if isinstance(v, int) else format_float(v) for v in row])
    return buffer.getvalue()


def read_json(path: Path) -> dict | None:
    """A JSON file's content, or None if it is missing or unreadable (e.g. written by a crashed run)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_done(run_dir: Path, cfg: RunConfig) -> bool:
    done = read_json(run_dir / DONE_FILE)
    return done is not None and done.get("config_hash") == config_hash(cfg)


def other_threads(run_dir: Path, threads: int) -> str | None:
    """Why a finished run must be redone to sit in a sweep that trains with `threads` torch threads:
    the thread count changes the last bits of CPU kernels, and one sweep never mixes thread counts.
    None when its done.json records the same count."""
    done = read_json(run_dir / DONE_FILE) or {}
    recorded = done.get("threads")
    if recorded == threads:
        return None
    return f"trained with {recorded} torch threads, this sweep uses {threads}: redone"


def reset_run_dir(run_dir: Path) -> None:
    """Remove whatever an unfinished or stale run left, and make the folder afresh."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)


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


def versions() -> dict[str, str]:
    import torch

    from normexp import __version__

    return {"normexp": __version__, "torch": torch.__version__, "python": platform.python_version()}


@dataclass(frozen=True)
class FinishedRun:
    """A finished run's outcome, as a worker or engine hands it to the store."""

    metrics: dict[str, list[float]]
    status: str  # completed | diverged
    wall_s: float
    threads: int
    engine: str
    device: str
    blocks: dict[str, list[float]] | None = None  # blocks.csv's columns, for a run with train.log_blocks


def write_run(run_dir: Path, cfg: RunConfig, run: FinishedRun) -> dict[str, Any]:
    """Write one finished run's folder: config, metrics (and blocks), then the done marker. Returns done.json."""
    reset_run_dir(run_dir)
    atomic_write(run_dir / CONFIG_FILE, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    atomic_write(run_dir / METRICS_FILE, metrics_csv(run.metrics))
    if run.blocks is not None:
        atomic_write(run_dir / BLOCKS_FILE, metrics_csv(run.blocks))
    done = {
        "run_id": run_dir.name,
        "config_hash": config_hash(cfg),
        **run_stats(run.metrics, run.status),
        "wall_s": run.wall_s,
        "threads": run.threads,
        "engine": run.engine,
        "device": run.device,
        "host": socket.gethostname(),
        "versions": versions(),
    }
    atomic_write(run_dir / DONE_FILE, json.dumps(done, indent=2, allow_nan=True) + "\n")
    return done


def write_failed(run_dir: Path, cfg: RunConfig, status: str, error: str) -> None:
    """Record a run that raised or crashed; it has no done.json, so the next sweep retries it."""
    reset_run_dir(run_dir)
    atomic_write(run_dir / CONFIG_FILE, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    record = {"run_id": run_dir.name, "config_hash": config_hash(cfg), "status": status, "error": error}
    atomic_write(run_dir / FAILED_FILE, json.dumps(record, indent=2) + "\n")


def summary_row(out_dir: Path, cfg: RunConfig, pending_status: str = "pending") -> dict[str, Any]:
    """One summary.csv row for `cfg`, read from its run folder."""
    rid = run_id(cfg)
    row: dict[str, Any] = {"run_id": rid, **flatten(cfg)}
    done = read_json(out_dir / rid / DONE_FILE)
    if done is not None and done.get("config_hash") == config_hash(cfg):
        return {**row, **{k: done.get(k) for k in SUMMARY_STATS}, "error": ""}
    failed = read_json(out_dir / rid / FAILED_FILE)
    if failed is not None and failed.get("config_hash") == config_hash(cfg):
        return {**row, "status": failed.get("status", "failed"), "error": failed.get("error", "")}
    return {**row, "status": pending_status, "error": ""}


def write_summary(out_dir: Path, runs: Sequence[RunConfig], statuses: dict[str, str] | None = None) -> Path:
    """Rebuild summary.csv from the run folders (`statuses` names unfinished runs' state)."""
    statuses = statuses or {}
    rows = [summary_row(out_dir, cfg, statuses.get(run_id(cfg), "pending")) for cfg in runs]
    columns = list(dict.fromkeys(["run_id", *flatten(runs[0]), *SUMMARY_STATS, "error"])) if runs else []
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n", restval="")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (format_float(v) if isinstance(v, float) else _cell(v)) for k, v in row.items()})
    path = out_dir / SUMMARY_FILE
    atomic_write(path, buffer.getvalue())
    return path


def sweep_name(out_dir: Path) -> str | None:
    """The name in `out_dir`'s sweep.yaml (None if there is none or it is unreadable)."""
    try:
        data = yaml.safe_load((out_dir / SWEEP_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    name = data.get("name") if isinstance(data, dict) else None
    return name if isinstance(name, str) else None


def _cell(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return json.dumps(value)
    return "" if value is None else value


class SweepLock:
    """An exclusive, advisory lock on an output folder (flock on `<out>/.lock`).

    The kernel drops a flock when its process dies, so a lock left by a killed sweep is simply taken
    over; the file's content (PID, host) only serves the message shown to a second sweep.
    """

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> SweepLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StoreError(f"{self.path.parent}: cannot use as the output folder: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise StoreError(f"{self.path.parent}: another sweep is writing here ({self.owner()}); "
                                 "wait for it to finish or choose another --out") from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"pid={os.getpid()} host={socket.gethostname()}\n".encode())
        self._fd = fd
        return self

    def owner(self) -> str:
        try:
            return self.path.read_text().strip() or "owner unknown"
        except OSError:
            return "owner unknown"

    def __exit__(self, *exc_info: object) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
