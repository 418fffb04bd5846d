"""`normexp export DIR --to tensorboard OUT` and `--to mlflow URI`: a sweep folder's verified runs, for
browsing and comparing in the tools researchers already use. Only the runs `runfolder.inspect_run`
verifies finished are exported; the folder is only read.

TensorBoard: one run per run folder, `OUT/<run_id>/events.out.tfevents.normexp`, holding per recorded step
every column of metrics.csv (loss, acc, lr, grad_norm; val_loss, val_acc for sequence tasks) as a scalar of
that name, the per-block columns of blocks.csv as `blocks/<column>/<block>` (runs with `train.log_blocks`),
and at the last step `final/final_loss`, `final/min_loss`, `final/final_acc`, `final/diverged` and
`final/trained` (1 or 0: completed with a final loss under the folder's trained rule, report.trained_below or
ln(C)/10, as summary.csv's `trained`). Scalars are float32 `simple_value`s, as TensorBoard's own writers and
torch's SummaryWriter make them (its default data loader shows no float64 scalar), so a value reads back as
the CSV's rounded to float32 (the exact numbers stay in the run folder, and go to MLflow as float64). The
HParams plugin's summaries go with them: `OUT/events.out.tfevents.normexp` defines the experiment (every
config key, the varying ones first, against the `final/` metrics), each run states its config, so the HParams
dashboard shows the grid's axes against final loss and trained. A re-export rewrites the same files (each
run's wall times come from its done.json's modification time): the same bytes.

MLflow (`pip install 'normexp[mlflow]'`; a `sqlite:///path.db` URI, or a local `file:` store, which MLflow 3
keeps in maintenance mode and allows here): experiment = the sweep's name (or `--experiment`; a deleted one is
refused, not restored), one MLflow run per normexp run, named by its run id. Params: the flattened config
(`optim.lr`, ...; null as "None"), metrics: the same names as TensorBoard's with their step, tags:
`normexp.run_id`, `normexp.folder` (the folder's absolute path), `normexp.sweep`, `normexp.engine`,
`normexp.status`, `normexp.trained`, `normexp.threads`, `normexp.device`, `normexp.config_hash`,
`normexp.done_checksum` and `normexp.provenance.*` (commit, CPU, torch build, command). Re-exporting is
idempotent, keyed by folder and run id: a run this folder exported with the same done.json checksum and
verdict is left as it is; one whose result changed (a --force rerun), whose verdict did (another
report.trained_below), or that an interrupted export left unfinished (a run is marked FINISHED last) is
deleted in MLflow and exported again, and named. A stop signal ends an export at once, in one line. An
unreachable tracking server fails after 3 tries of at most 20 s each (HTTP_LIMITS), in one line. Another
folder's MLflow runs are never touched (an earlier release's, which carry no folder tag, only adopted where
their done.json checksum is this run's). A run exported before that no longer verifies has its export removed
(TensorBoard: its event file), and named. MLflow's SQL store keeps +-inf as +-1.79e308 (its documented limit);
NaN stays NaN.

A folder whose runs name a plug-in (a user's placement or kind) that cannot be imported here is refused
before anything is written, naming the runs.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import shlex
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from normexp import stopping
from normexp.config import ConfigError, RunConfig, chance_classes, flatten, trained_threshold
from normexp.registry import PluginError, is_plugin, load_plugin, references_unchecked
from normexp.runfolder import BLOCKS_FILE, DONE_FILE, METRICS_FILE, inspect_run, run_id
from normexp.store import folder_runs, read_sweep, trained_rule

TARGETS = ("tensorboard", "mlflow")
EVENTS_FILE = "events.out.tfevents.normexp"  # a fixed name: a re-export replaces it
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
            lines.append(f"replaced this folder's earlier export of {_count(self.replaced)}: "
                         + ", ".join(f"{rid} ({why})" for rid, why in self.replaced.items()))
        if self.dropped:
            lines.append(f"removed this folder's earlier export of {_count(self.dropped)} that no longer "
                         f"verif{'ies' if len(self.dropped) == 1 else 'y'}: {', '.join(self.dropped)} "
                         f"(normexp verify {shlex.quote(str(run_dir))})")
        return lines


def _count(ids: Any) -> str:
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
            problems.append(f"{_count(ids)} ({shown}) use{'s' if len(ids) == 1 else ''} the plug-in {ref}, "
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
        blocks = _columns(run_dir / rid / BLOCKS_FILE) if (run_dir / rid / BLOCKS_FILE).is_file() else None
        done_bytes = (run_dir / rid / DONE_FILE).read_bytes()
        runs.append(ExportedRun(rid, cfg, state.done or {}, metrics, blocks,
                                os.stat(run_dir / rid / DONE_FILE).st_mtime, hashlib.sha256(done_bytes).hexdigest(),
                                rule if rule is not None else trained_threshold(chance_classes(cfg))))
    return runs, left


def _missing(target: str, package: str) -> ConfigError:
    return ConfigError(f"--to {target} needs {package}, which is not installed: pip install 'normexp[{target}]'")


def _hparam_value(value: Any) -> Any:
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
    varying = [k for k in keys if len({json.dumps(_hparam_value(f[k])) for f in flats}) > 1]
    return varying + [k for k in keys if k not in varying]


# ----------------------------------------------------------------------------- TensorBoard


def to_tensorboard(run_dir: Path, out_dir: Path) -> ExportResult:
    """Write the TensorBoard export of `run_dir` into `out_dir` (see the module docstring). The event file
    an earlier export wrote for a run that no longer verifies is removed."""
    _, runs, left = read_folder(Path(run_dir))
    try:
        from tensorboard.compat.proto.event_pb2 import Event  # noqa: F401 - checks the package is there
    except ImportError:
        raise _missing("tensorboard", "tensorboard") from None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = varying_first(runs)
    kinds = _hparam_kinds(runs, keys)
    _write_events(out_dir / EVENTS_FILE, min((r.time_s for r in runs), default=0.0),
                  [(0, _experiment_summary(keys, kinds))])
    for run in runs:
        (out_dir / run.run_id).mkdir(exist_ok=True)
        flat = flatten(run.cfg)
        events = [(0, _session_start(run, {k: _typed(flat[k], kinds[k]) for k in keys}))]
        for name, points in run.scalars().items():
            events += [(step, _scalar(name, value)) for step, value in points]
        events.sort(key=lambda e: e[0])  # by step, each scalar's points in order
        _write_events(out_dir / run.run_id / EVENTS_FILE, run.time_s, events)
    dropped = []
    for rid in left:  # exported before, and no longer verified finished: its copy goes, the folder is its truth
        stale = out_dir / rid / EVENTS_FILE
        if stale.is_file():
            stale.unlink()
            with contextlib.suppress(OSError):
                (out_dir / rid).rmdir()  # only if nothing of the user's is in it
            dropped.append(rid)
    return ExportResult([r.run_id for r in runs], dropped=dropped, left=left)


def _hparam_kinds(runs: list[ExportedRun], keys: list[str]) -> dict[str, str]:
    """Per key: bool, number or string, as its values across the runs allow (mixed: string)."""
    flats = [flatten(r.cfg) for r in runs]
    kinds = {}
    for key in keys:
        values = [_hparam_value(f[key]) for f in flats]
        if all(isinstance(v, bool) for v in values):
            kinds[key] = "bool"
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            kinds[key] = "number"
        else:
            kinds[key] = "string"
    return kinds


def _typed(value: Any, kind: str) -> Any:
    value = _hparam_value(value)
    return value if kind != "string" or isinstance(value, str) else json.dumps(value)


def _experiment_summary(keys: list[str], kinds: dict[str, str]):
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    types = {"bool": api_pb2.DATA_TYPE_BOOL, "number": api_pb2.DATA_TYPE_FLOAT64, "string": api_pb2.DATA_TYPE_STRING}
    experiment = api_pb2.Experiment(
        hparam_infos=[api_pb2.HParamInfo(name=k, type=types[kinds[k]]) for k in keys],
        metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=f"final/{m}")) for m in FINAL])
    return _hparams_summary("experiment", plugin_data_pb2.HParamsPluginData(experiment=experiment))


def _session_start(run: ExportedRun, hparams: dict[str, Any]):
    from tensorboard.plugins.hparams import plugin_data_pb2

    info = plugin_data_pb2.SessionStartInfo(start_time_secs=run.time_s, group_name=run.run_id)
    for key, value in hparams.items():
        if isinstance(value, bool):
            info.hparams[key].bool_value = value
        elif isinstance(value, (int, float)):
            info.hparams[key].number_value = value
        else:
            info.hparams[key].string_value = value
    return _hparams_summary("session_start_info", plugin_data_pb2.HParamsPluginData(session_start_info=info))


def _hparams_summary(which: str, data):
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import metadata

    tag = metadata.EXPERIMENT_TAG if which == "experiment" else metadata.SESSION_START_INFO_TAG
    return Summary(value=[Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(data),
                                        tensor=metadata.NULL_TENSOR)])


def _scalar(name: str, value: float):
    """A scalar as TensorBoard's writers (and torch's SummaryWriter.add_scalar) make one: `simple_value`,
    read by EventAccumulator.Scalars and by every TensorBoard loader."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=name, simple_value=value)])


def _write_events(path: Path, time_s: float, events: list[tuple[int, Any]]) -> None:
    """An event file of `events` (step, Summary), written aside and renamed into place."""
    import io

    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    buffer = io.BytesIO()
    writer = RecordWriter(buffer)
    writer.write(Event(wall_time=time_s, file_version="brain.Event:2").SerializeToString())
    for step, summary in events:
        writer.write(Event(wall_time=time_s, step=step, summary=summary).SerializeToString())
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(buffer.getvalue())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- MLflow

MLFLOW_BATCH = 1000  # MLflow's limit of metrics per log_batch call (params: 100)


# MLflow's HTTP client retries a request 7 times over about 4 minutes, each try waiting up to 120 s: an
# export to a tracking server that is down or unreachable fails, here, after 3 tries of at most 20 s each
# and 1 + 2 s of backoff (a closed port: about 3 s). A variable the user set is theirs, and kept.
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


def to_mlflow(run_dir: Path, uri: str, experiment: str | None = None) -> ExportResult:
    """Export `run_dir` into the MLflow tracking store at `uri` (see the module docstring). ConfigError,
    in one line, where the store cannot be reached or refuses the export."""
    if experiment is not None and not experiment.strip():
        raise ConfigError("--experiment: empty; name an MLflow experiment, or leave the option out for the "
                          "sweep's name")
    name, runs, left = read_folder(Path(run_dir))
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise _missing("mlflow", "mlflow (or mlflow-skinny)") from None
    folder = str(Path(run_dir).resolve())
    done = ExportResult([], left=left)
    with _file_store_allowed(uri), _environ(HTTP_LIMITS), _stopped_says(done, len(runs)):
        try:
            client = MlflowClient(tracking_uri=uri)
            _export_mlflow(client, _experiment_id(client, experiment or name, uri), folder, name, runs, left, done)
        except MlflowException as exc:
            raise ConfigError(_mlflow_problem(uri, exc, done)) from None
    return done


@contextlib.contextmanager
def _file_store_allowed(uri: str) -> Iterator[None]:
    """MLflow 3 refuses a local file store (`file:` or a path) unless MLFLOW_ALLOW_FILE_STORE is set: asked
    for by name here, it is allowed while the export runs."""
    local = uri.startswith("file:") or "://" not in uri
    with _environ({"MLFLOW_ALLOW_FILE_STORE": "true"} if local else {}):
        yield


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set each of `values` that the environment does not already set, for the block."""
    added = [key for key in values if key not in os.environ]
    os.environ.update({key: values[key] for key in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@contextlib.contextmanager
def _stopped_says(done: ExportResult, total: int) -> Iterator[None]:
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) during the export ends it at once, saying how far it got
    and that the same command finishes it: the MLflow run it was writing is left unfinished, and the
    next export replaces it. (In the main thread only, which alone runs signal handlers.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        os.write(2, (f"{stopping.signal_name(signum)}: export stopped after {len(done.exported) + done.kept} of "
                     f"{total} runs; the same command finishes it (a run left half-written is replaced)\n").encode())
        os._exit(128 + signum)

    previous = stopping.on_stop_signals(stop)
    try:
        yield
    finally:
        stopping.on_stop_signals(previous)


def _mlflow_problem(uri: str, exc: Exception, done: ExportResult) -> str:
    """One line for an error MLflow raised: an unreachable server, or the store's own message."""
    text = " ".join(str(getattr(exc, "message", exc)).split())
    if "Max retries exceeded" in text or "Failed to establish a new connection" in text or "timed out" in text:
        retries, timeout = (os.environ.get(key, HTTP_LIMITS[key]) for key in
                            ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"))
        tries = int(retries) + 1 if retries.strip().isdigit() else f"1 + {retries}"
        reason = ("connection refused" if "refused" in text.lower() else "timed out" if "timed out" in text
                  else "no connection")
        text = (f"cannot reach the tracking server ({reason}; {tries} tries of at most {timeout} s each: "
                "MLFLOW_HTTP_REQUEST_MAX_RETRIES and MLFLOW_HTTP_REQUEST_TIMEOUT to change)")
    elif len(text) > 300:
        text = text[:300] + " ..."
    so_far = f"; {_count(done.exported)} exported before it" if done.exported else ""
    return f"MLflow at {uri}: {text}{so_far}"


def _experiment_id(client, name: str, uri: str) -> str:
    """The experiment's id, made if it does not exist. A deleted one is not restored behind its owner's
    back: ConfigError, saying how to restore it or choose another."""
    found = client.get_experiment_by_name(name)
    if found is None:
        return client.create_experiment(name)
    if found.lifecycle_stage != "active":
        raise ConfigError(f"MLflow at {uri}: experiment {name!r} (id {found.experiment_id}) is deleted; restore it "
                          f"(mlflow experiments restore --experiment-id {found.experiment_id}) or export into "
                          "another with --experiment NAME")
    return found.experiment_id


def _export_mlflow(client, exp_id: str, folder: str, name: str, runs: list[ExportedRun], left: list[str],
                   done: ExportResult) -> None:
    """Export `runs` of the folder `folder` into the experiment `exp_id`, filling `done` as it goes. Each
    MLflow run is tagged with its folder and run id from its creation, and marked FINISHED last: an
    earlier export of this folder's run that is unfinished (interrupted), or whose result or verdict
    changed, is replaced; another folder's runs are never touched."""
    from mlflow.entities import Metric, Param, RunTag

    keys = varying_first(runs)
    for run in runs:
        trained = str(run.trained).lower()
        earlier = _earlier(client, exp_id, folder, run.run_id)
        same = [r for r in earlier if r.info.status == "FINISHED" and r.data.tags.get(DONE_TAG) == run.checksum
                and r.data.tags.get("normexp.trained") == trained]
        if same:
            if FOLDER_TAG not in same[0].data.tags:  # an export of an earlier release, of this very result
                client.set_tag(same[0].info.run_id, FOLDER_TAG, folder)
            for old in earlier:
                if old is not same[0] and FOLDER_TAG in old.data.tags:
                    client.delete_run(old.info.run_id)
            done.kept += 1
            continue
        for old in earlier:
            if FOLDER_TAG in old.data.tags:  # this folder's own: replaced (an earlier release's is left alone)
                client.delete_run(old.info.run_id)
                done.replaced.setdefault(run.run_id, _why(old, run.checksum))
        time_ms = int(run.time_s * 1000)
        created = client.create_run(exp_id, start_time=time_ms - int(1000 * float(run.done.get("wall_s", 0))),
                                    tags={"mlflow.runName": run.run_id, RUN_TAG: run.run_id, FOLDER_TAG: folder},
                                    run_name=run.run_id)
        rid = created.info.run_id
        flat = flatten(run.cfg)
        params = [Param(k, str(_hparam_value(flat[k]))) for k in keys]
        metrics = [Metric(key, float(value), time_ms, step) for key, points in run.scalars().items()
                   for step, value in points]
        for i in range(0, len(params), 100):
            client.log_batch(rid, params=params[i:i + 100])
        for i in range(0, len(metrics), MLFLOW_BATCH):
            client.log_batch(rid, metrics=metrics[i:i + MLFLOW_BATCH])
        client.log_batch(rid, tags=[RunTag(k, v) for k, v in _tags(run, name, run.checksum).items()])
        client.set_terminated(rid, "FINISHED", end_time=time_ms)  # last: a run not FINISHED is half-made
        done.exported.append(run.run_id)
    for rid in left:  # exported before, and no longer verified finished: its copy goes
        stale = [r for r in _earlier(client, exp_id, folder, rid) if FOLDER_TAG in r.data.tags]
        for old in stale:
            client.delete_run(old.info.run_id)
        if stale:
            done.dropped.append(rid)


RUN_TAG, FOLDER_TAG, DONE_TAG = "normexp.run_id", "normexp.folder", "normexp.done_checksum"


def _earlier(client, exp_id: str, folder: str, rid: str) -> list:
    """The experiment's MLflow runs of the run `rid` exported from `folder`, and those an earlier release
    exported (no folder tag: whose folder is not known)."""
    found = client.search_runs([exp_id], f"tags.`{RUN_TAG}` = '{rid}'", max_results=1000)
    return [r for r in found if r.data.tags.get(FOLDER_TAG, folder) == folder]


def _why(old, checksum: str) -> str:
    if old.info.status != "FINISHED" or DONE_TAG not in old.data.tags:
        return "left unfinished by an interrupted export"
    return "its result changed" if old.data.tags[DONE_TAG] != checksum else "its verdict changed"


def _tags(run: ExportedRun, sweep: str, checksum: str) -> dict[str, str]:
    done = run.done
    tags = {"normexp.run_id": run.run_id, "normexp.sweep": sweep, "normexp.engine": str(done.get("engine", "")),
            "normexp.status": str(done.get("status", "")), "normexp.trained": str(run.trained).lower(),
            "normexp.threads": str(done.get("threads", "")), "normexp.device": str(done.get("device", "")),
            "normexp.config_hash": str(done.get("config_hash", "")), "normexp.done_checksum": checksum}
    for key, value in (done.get("provenance") or {}).items():
        text = value if isinstance(value, str) else json.dumps(value)
        tags[f"normexp.provenance.{key}"] = text[:5000]  # MLflow's tag value limit is 8000
    return tags
