"""`normexp export DIR --to tensorboard OUT` and `--to mlflow URI`: a sweep folder's verified runs, for
browsing and comparing in the tools researchers already use. Only the runs `folder.inspect_run`
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

MLflow (`pip install 'normexp[mlflow]'`; a `sqlite:///path.db` URI, or a local `file:` store, which
MLflow 3 keeps in maintenance mode and allows here): experiment = the sweep's name (or `--experiment`), one MLflow
run per normexp run, named by its run id. Params: the flattened config (`optim.lr`, ...; null as "None"),
metrics: the same names as TensorBoard's with their step, tags: `normexp.run_id`, `normexp.sweep`,
`normexp.engine`, `normexp.status`, `normexp.trained`, `normexp.threads`, `normexp.device`,
`normexp.config_hash`, `normexp.done_checksum` and `normexp.provenance.*` (commit, CPU, torch build,
command). Re-exporting is idempotent: a run already exported with the same done.json checksum and verdict is
left as it is; one whose result changed (a --force rerun) or whose verdict did (another report.trained_below)
is deleted in MLflow and exported again. MLflow's SQL
store keeps +-inf as +-1.79e308 (its documented limit); NaN stays NaN.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from normexp.config import ConfigError, RunConfig, chance_classes, flatten, trained_threshold
from normexp.folder import (
    BLOCKS_FILE,
    DONE_FILE,
    METRICS_FILE,
    folder_runs,
    inspect_run,
    read_sweep,
    run_id,
    trained_rule,
)
from normexp.registry import references_unchecked

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


def _columns(path: Path) -> list[dict[str, float]]:
    with open(path, encoding="utf-8", newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def read_runs(run_dir: Path) -> tuple[str, list[ExportedRun]]:
    """The sweep's name and every run of `run_dir` verified finished, in the folder's order. A user's
    placement or kind is read as written, never imported."""
    with references_unchecked():
        return _read_runs(run_dir)


def _read_runs(run_dir: Path) -> tuple[str, list[ExportedRun]]:
    sweep = read_sweep(run_dir)
    rule = trained_rule(run_dir)  # summary.csv's: each run is judged as its `trained` column judges it
    runs = []
    for cfg in folder_runs(run_dir, sweep):
        rid = run_id(cfg)
        state = inspect_run(run_dir / rid, cfg)
        if not state.finished:
            continue
        rows = _columns(run_dir / rid / METRICS_FILE)
        metrics = {name: [row[name] for row in rows] for name in (rows[0] if rows else {"step": 0})}
        blocks = _columns(run_dir / rid / BLOCKS_FILE) if (run_dir / rid / BLOCKS_FILE).is_file() else None
        done_bytes = (run_dir / rid / DONE_FILE).read_bytes()
        runs.append(ExportedRun(rid, cfg, state.done or {}, metrics, blocks,
                                os.stat(run_dir / rid / DONE_FILE).st_mtime, hashlib.sha256(done_bytes).hexdigest(),
                                rule if rule is not None else trained_threshold(chance_classes(cfg))))
    return sweep.name, runs


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


def to_tensorboard(run_dir: Path, out_dir: Path) -> list[str]:
    """Write the TensorBoard export of `run_dir` into `out_dir` (see the module docstring); the run ids."""
    _, runs = read_runs(Path(run_dir))
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
    return [r.run_id for r in runs]


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


def to_mlflow(run_dir: Path, uri: str, experiment: str | None = None) -> tuple[list[str], int]:
    """Export `run_dir` into the MLflow tracking store at `uri` (see the module docstring). Returns the
    run ids exported now and how many were already there, unchanged."""
    name, runs = read_runs(Path(run_dir))
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise _missing("mlflow", "mlflow (or mlflow-skinny)") from None
    with _file_store_allowed(uri):
        return _export_mlflow(MlflowClient(tracking_uri=uri), name, runs, experiment)


@contextlib.contextmanager
def _file_store_allowed(uri: str) -> Iterator[None]:
    """MLflow 3 refuses a local file store (`file:` or a path) unless MLFLOW_ALLOW_FILE_STORE is set: asked
    for by name here, it is allowed while the export runs."""
    local = uri.startswith("file:") or "://" not in uri
    before = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    if local and before is None:
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        if local and before is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)


def _export_mlflow(client, name: str, runs: list[ExportedRun], experiment: str | None) -> tuple[list[str], int]:
    from mlflow.entities import Metric, Param, RunTag

    found = client.get_experiment_by_name(experiment or name)
    exp_id = found.experiment_id if found is not None else client.create_experiment(experiment or name)
    exported, kept = [], 0
    for run in runs:
        checksum = run.checksum
        earlier = client.search_runs([exp_id], f"tags.`normexp.run_id` = '{run.run_id}'")
        if any(r.data.tags.get("normexp.done_checksum") == checksum
               and r.data.tags.get("normexp.trained") == str(run.trained).lower() for r in earlier):
            kept += 1
            continue
        for old in earlier:  # the run's result changed since: its old MLflow run goes
            client.delete_run(old.info.run_id)
        time_ms = int(run.time_s * 1000)
        created = client.create_run(exp_id, start_time=time_ms - int(1000 * float(run.done.get("wall_s", 0))),
                                    tags={"mlflow.runName": run.run_id}, run_name=run.run_id)
        rid = created.info.run_id
        flat = flatten(run.cfg)
        params = [Param(k, str(_hparam_value(flat[k]))) for k in varying_first(runs)]
        metrics = [Metric(key, float(value), time_ms, step) for key, points in run.scalars().items()
                   for step, value in points]
        for i in range(0, len(params), 100):
            client.log_batch(rid, params=params[i:i + 100])
        for i in range(0, len(metrics), MLFLOW_BATCH):
            client.log_batch(rid, metrics=metrics[i:i + MLFLOW_BATCH])
        client.log_batch(rid, tags=[RunTag(k, v) for k, v in _tags(run, name, checksum).items()])
        client.set_terminated(rid, "FINISHED", end_time=time_ms)
        exported.append(run.run_id)
    return exported, kept


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
