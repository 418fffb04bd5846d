"""`normexp export DIR --to tensorboard OUT`: a sweep folder's verified runs, for
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
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from normexp.config import flatten
from normexp.export.runs import (
    FINAL,
    ExportedRun,
    ExportResult,
    hparam_value,
    missing_extra,
    read_folder,
    varying_first,
)

EVENTS_FILE = "events.out.tfevents.normexp"  # a fixed name: a re-export replaces it


def to_tensorboard(run_dir: Path, out_dir: Path) -> ExportResult:
    """Write the TensorBoard export of `run_dir` into `out_dir` (see the module docstring). The event file
    an earlier export wrote for a run that no longer verifies is removed."""
    _, runs, left = read_folder(Path(run_dir))
    try:
        from tensorboard.compat.proto.event_pb2 import Event  # noqa: F401 - checks the package is there
    except ImportError:
        raise missing_extra("tensorboard", "tensorboard") from None
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
        values = [hparam_value(f[key]) for f in flats]
        if all(isinstance(v, bool) for v in values):
            kinds[key] = "bool"
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            kinds[key] = "number"
        else:
            kinds[key] = "string"
    return kinds


def _typed(value: Any, kind: str) -> Any:
    value = hparam_value(value)
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
