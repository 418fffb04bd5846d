"""`normexp export DIR --to tensorboard OUT`: a sweep folder's verified runs as TensorBoard runs.

Each run is the folder `OUT/<name>/`, named as `--run-name` says (by default the keys that vary across the
sweep: `post-d8-lr0.001-s0`, names.py), holding one event file, `events.out.tfevents.normexp`:
- the scalars of every recorded step, tagged `<group>/<column>`: `loss/loss` and the other loss columns
  (`loss/val_loss`, `loss/z_loss`), `metrics/acc`, `metrics/lr`, `metrics/grad_norm` (`metrics/val_acc`),
  `sharpness/<column>` (runs with `train.log_sharpness`), and at the last step `result/final_loss`,
  `result/min_loss`, `result/final_acc`, `result/diverged`, `result/trained` (1 or 0: completed with a final
  loss under the folder's trained rule, as summary.csv's `trained`). TensorBoard orders its charts by tag and
  groups them by the part before the first `/` (opening the first two groups), so the groups are named to
  read in that order: `loss` first, the one-point `result/` charts after the curves;
- per step, each column of blocks.csv (runs with `train.log_blocks`) as one histogram over the model's
  blocks, `per_block/<column>` (its Histograms and Distributions tabs); with `block_scalars` also one
  scalar per block, `per_block/<column>/<block>`;
- a text summary `run_id` (the Text tab), and the HParams plugin's session: every config key, and the
  group of its configuration (the same for each seed, so that HParams aggregates them: TensorBoard shows a
  group's hparams as its first session's, so the seed is left out of the sessions of a group of seeds).

`OUT/events.out.tfevents.normexp` defines the HParams experiment: every config key with its type, its domain
(the values seen, or their interval for many numbers) and whether it varies, so that the HParams table opens
on the grid's axes, against the `result/` metrics. `OUT/.normexp-export.json` records which folder holds which
run id, and which sweep folder exported it: a re-export that names a run otherwise, or a run that no longer
verifies, removes the event file normexp wrote before (and its folder, if nothing else is in it), never another
file, nor the export of a run id another sweep folder shares (and whose copy of it may still verify).
Scalars are float32 `simple_value`s, as TensorBoard's own writers make them (the exact numbers stay in the run
folder). Every message is serialised deterministically and a run's wall time is its done.json's modification
time, so a re-export, in any process, writes the same bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from normexp.config import flatten
from normexp.export.names import DEFAULT_SHORT, value_text
from normexp.export.runs import (
    FINAL,
    ExportedRun,
    ExportResult,
    display_names,
    hparam_value,
    missing_extra,
    read_folder,
    varying_first,
)
from normexp.folder import DONE_FILE

EVENTS_FILE = "events.out.tfevents.normexp"  # a fixed name: a re-export replaces it, and only it
MANIFEST = ".normexp-export.json"  # run id -> folder, of every run exported into OUT
DISCRETE_NUMBERS = 12  # a number key with at most this many values has them as its domain, else their interval
SEED_NOTE = ("The runs of a row (a session group: one configuration) differ in their seed alone: the row shows "
             "their metrics averaged, and no seed; each run's folder name has its seed.")
GROUPS = {"final": "result", "blocks": "per_block"}  # runs.scalars()' prefixes, as TensorBoard's tags group them


def to_tensorboard(run_dir: Path, out_dir: Path, run_name: str | None = None,
                   block_scalars: bool = False) -> ExportResult:
    """Write the TensorBoard export of `run_dir` into `out_dir` (see the module docstring); `run_name` is
    a names.py template. The event file an earlier export wrote for a run that no longer verifies, or
    under another name, is removed."""
    _, runs, left = read_folder(Path(run_dir))
    try:
        from tensorboard.compat.proto.event_pb2 import Event  # noqa: F401 - checks the package is there
    except ImportError:
        raise missing_extra("tensorboard", "tensorboard") from None
    out_dir, source = Path(out_dir), str(Path(run_dir).resolve())
    names = display_names(runs, run_name)
    manifest, sources = _read_manifest(out_dir)
    # a run id this folder shares with another folder, whose export holds it: that run is there's, and stays
    left_here = [rid for rid in left if sources.get(rid, source) == source
                 or not (Path(sources[rid]) / rid / DONE_FILE).is_file()]  # (that folder moved, or the run gone)
    folders = _folders(out_dir, names, {rid: f for rid, f in manifest.items() if rid not in left_here})
    out_dir.mkdir(parents=True, exist_ok=True)
    replaced, dropped = _clear_earlier(out_dir, manifest, folders, [r.run_id for r in runs] + left_here)
    keys = varying_first(runs)
    flats = [flatten(r.cfg) for r in runs]
    kinds = _hparam_kinds(flats, keys)
    _write_events(out_dir / EVENTS_FILE, min((r.time_s for r in runs), default=0.0),
                  [(0, _experiment_summary(flats, keys, kinds))])
    groups = _groups([r.run_id for r in runs], flats)
    for run, flat in zip(runs, flats):
        (out_dir / folders[run.run_id]).mkdir(exist_ok=True)
        seeds = list(groups.values()).count(groups[run.run_id]) > 1  # a row of several seeds: it shows none
        hparams = {k: _typed(flat[k], kinds[k]) for k in keys if not (seeds and k == "seed")}
        events = [(0, _session_start(run, hparams, groups[run.run_id])),
                  (0, _text("run_id", run.run_id, "The run's folder in the sweep (normexp's run id)."))]
        events += _run_events(run, block_scalars)
        events.sort(key=lambda e: e[0])  # by step, each tag's points in order
        _write_events(out_dir / folders[run.run_id] / EVENTS_FILE, run.time_s, events)
    _write_manifest(out_dir, {**manifest, **folders},
                    {**{rid: f for rid, f in sources.items() if rid in manifest}, **dict.fromkeys(folders, source)})
    return ExportResult([r.run_id for r in runs], replaced=replaced, dropped=dropped, left=left)


def _clear_earlier(out_dir: Path, manifest: dict[str, str], folders: dict[str, str],
                   run_ids: list[str]) -> tuple[dict[str, str], list[str]]:
    """Remove the earlier export of each of `run_ids` whose folder is not its folder now (`folders`, none for
    a run no longer verified finished), taking it off `manifest`: (run id -> why) of those moved, and the run
    ids of those dropped. Before anything is written: a name can move from one run to another."""
    replaced, dropped = {}, []
    for rid in run_ids:
        old, new = manifest.pop(rid, rid), folders.get(rid)  # an export without the manifest: by run id
        if old == new or not (out_dir / old / EVENTS_FILE).is_file():
            continue
        if old not in folders.values():
            _remove(out_dir / old)
        if new is not None:
            replaced[rid] = f"now {new}, was {old}"
        else:
            dropped.append(rid)  # no longer verified finished: its copy goes, the folder is its truth
    return replaced, dropped


def tag(name: str) -> str:
    """A scalar of runs.scalars() as TensorBoard's tag: `loss/<column>` for metrics.csv's loss columns,
    `metrics/<column>` for its others, `result/` for `final/`, `per_block/` for `blocks/`."""
    group, _, rest = name.partition("/")
    if rest:
        return f"{GROUPS.get(group, group)}/{rest}"
    return f"loss/{name}" if name == "loss" or name.endswith("_loss") else f"metrics/{name}"


def _run_events(run: ExportedRun, block_scalars: bool) -> list[tuple[int, Any]]:
    """(step, Summary) of every scalar, and of each block column's histogram per step."""
    events = []
    for name, points in run.scalars().items():
        if block_scalars or not name.startswith("blocks/"):
            events += [(step, _scalar(tag(name), value)) for step, value in points]
    columns: dict[str, dict[int, list[float]]] = {}
    for row in run.blocks or []:  # blocks.csv: per step, the blocks in order
        for column, value in row.items():
            if column not in ("step", "block"):
                columns.setdefault(column, {}).setdefault(int(row["step"]), []).append(value)
    for column, steps in columns.items():
        for step, values in steps.items():
            finite = [v for v in values if math.isfinite(v)]  # inf, nan (diverged, not measured): in no bucket
            if finite:
                events.append((step, _histogram(f"per_block/{column}", finite, len(values))))
    return events


def _folders(out_dir: Path, names: dict[str, str], manifest: dict[str, str]) -> dict[str, str]:
    """run id -> its folder in `out_dir`: its name, made a folder name; with its run id's hash appended where
    another run id of the manifest holds that folder, or a folder normexp did not write has that name (or it
    is cut short: a name over 200 bytes)."""
    folders = {}
    for rid, name in names.items():
        folder = re.sub(r"[/\\\x00-\x1f]", "_", name)
        folder = "_" + folder if folder.startswith(".") or folder in ("", EVENTS_FILE) else folder
        others = {f for r, f in manifest.items() if r != rid and r not in names} | set(folders.values())
        if len(folder.encode()) > 200:  # a file name's limit is 255 bytes
            folder = folder.encode()[:180].decode(errors="ignore") + "-" + rid.rsplit("-", 1)[-1][:6]
        elif folder in others or (manifest.get(rid) != folder and not _ours(out_dir / folder)):
            folder = f"{folder}-{rid.rsplit('-', 1)[-1][:6]}"
        folders[rid] = folder
    return folders


def _ours(folder: Path) -> bool:
    """Whether `folder` is missing, or holds nothing but an event file normexp wrote."""
    return not folder.exists() or (folder.is_dir() and {p.name for p in folder.iterdir()} <= {EVENTS_FILE})


def _remove(folder: Path) -> None:
    """Remove normexp's event file from `folder`, and the folder if nothing else is in it."""
    (folder / EVENTS_FILE).unlink()
    with contextlib.suppress(OSError):
        folder.rmdir()  # only if nothing of the user's is in it


def exported_folders(out_dir: Path) -> dict[str, str]:
    """run id -> the folder of `out_dir` that holds its TensorBoard run (as exports recorded them)."""
    return _read_manifest(Path(out_dir))[0]


def _read_manifest(out_dir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The manifest's two maps: run id -> its folder in OUT, and run id -> the sweep folder whose export holds
    it (none for an export made before the manifest said). Empty where the file is missing or unreadable."""
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}, {}

    def part(key: str) -> dict[str, str]:
        found = manifest.get(key) if isinstance(manifest, dict) else None
        return {str(rid): str(folder) for rid, folder in found.items()} if isinstance(found, dict) else {}

    return part("runs"), part("sources")


def _write_manifest(out_dir: Path, folders: dict[str, str], sources: dict[str, str]) -> None:
    text = json.dumps({"runs": dict(sorted(folders.items())), "sources": dict(sorted(sources.items()))},
                      indent=1) + "\n"
    _replace(out_dir / MANIFEST, text.encode("utf-8"))


def _groups(run_ids: list[str], flats: list[dict[str, Any]]) -> dict[str, str]:
    """run id -> its session group: one per configuration, its seeds together, named by the keys other than
    the seed that vary (`post-d8`), the configuration's hash appended where that names two."""
    texts = [json.dumps({k: v for k, v in f.items() if k != "seed"}, sort_keys=True, default=str) for f in flats]
    keys = [k for k in (flats[0] if flats else {})
            if k != "seed" and len({json.dumps(f[k], sort_keys=True, default=str) for f in flats}) > 1]
    shown = {text: "-".join(DEFAULT_SHORT.get(k, k.rsplit(".", 1)[-1] + "=") + value_text(f[k]) for k in keys)
             or f"{value_text(f['norm.placement'])}-{value_text(f['norm.kind'])}" for text, f in zip(texts, flats)}
    alike = list(shown.values())
    named = {text: f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:6]}" if alike.count(name) > 1 else name
             for text, name in shown.items()}
    return {rid: named[text] for rid, text in zip(run_ids, texts)}


def _hparam_kinds(flats: list[dict[str, Any]], keys: list[str]) -> dict[str, str]:
    """Per key: bool, number or string, as its values across the runs allow (mixed: string)."""
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


def _experiment_summary(flats: list[dict[str, Any]], keys: list[str], kinds: dict[str, str]):
    """The HParams experiment: per key its type, domain and whether it varies (`differs`: TensorBoard's
    HParams table shows those first, backend_context._sort_and_reduce_to_hparams_limit, and opens on the
    first five), against the `result/` metrics."""
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    types = {"bool": api_pb2.DATA_TYPE_BOOL, "number": api_pb2.DATA_TYPE_FLOAT64, "string": api_pb2.DATA_TYPE_STRING}
    infos = []
    for key in keys:
        values = sorted({_typed(f[key], kinds[key]) for f in flats})
        info = api_pb2.HParamInfo(name=key, type=types[kinds[key]], differs=len(values) > 1,
                                  description=SEED_NOTE if key == "seed" else "")
        if kinds[key] != "number" or (len(values) <= DISCRETE_NUMBERS and all(map(math.isfinite, values))):
            info.domain_discrete.extend(values)
        elif all(map(math.isfinite, values)):  # an inf or nan would not pass the plugin's JSON
            info.domain_interval.min_value, info.domain_interval.max_value = values[0], values[-1]
        infos.append(info)
    experiment = api_pb2.Experiment(
        hparam_infos=infos, metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag(f"final/{m}")))
                                          for m in FINAL])
    return _hparams_summary("experiment", plugin_data_pb2.HParamsPluginData(experiment=experiment))


def _session_start(run: ExportedRun, hparams: dict[str, Any], group: str):
    from tensorboard.plugins.hparams import plugin_data_pb2

    info = plugin_data_pb2.SessionStartInfo(start_time_secs=run.time_s, group_name=group)
    for key, value in hparams.items():
        if isinstance(value, bool):
            info.hparams[key].bool_value = value
        elif isinstance(value, (int, float)):
            info.hparams[key].number_value = value
        else:
            info.hparams[key].string_value = value
    return _hparams_summary("session_start_info", plugin_data_pb2.HParamsPluginData(session_start_info=info))


def _hparams_summary(which: str, data):
    """The summary holding the HParams plugin's `data`, its content serialised deterministically (a session's
    hparams are a protobuf map, whose order is otherwise the process's: metadata.create_summary_metadata's)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import metadata

    data.version = metadata.PLUGIN_DATA_VERSION
    plugin = SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME,
                                        content=data.SerializeToString(deterministic=True))
    tag_ = metadata.EXPERIMENT_TAG if which == "experiment" else metadata.SESSION_START_INFO_TAG
    return Summary(value=[Summary.Value(tag=tag_, metadata=SummaryMetadata(plugin_data=plugin),
                                        tensor=metadata.NULL_TENSOR)])


def _scalar(name: str, value: float):
    """A scalar as TensorBoard's writers (and torch's SummaryWriter.add_scalar) make one: `simple_value`,
    read by EventAccumulator.Scalars and by every TensorBoard loader."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=name, simple_value=value)])


def _histogram(name: str, values: list[float], blocks: int):
    """A histogram of `values` as TensorBoard's histogram_pb makes one (its 30 buckets over their range)."""
    from tensorboard.plugins.histogram.summary_v2 import histogram_pb

    column = name.rsplit("/", 1)[-1]
    return histogram_pb(name, values, description=f"blocks.csv's `{column}` over the run's {blocks} blocks, "
                                                  "per step (its non-finite values left out: a diverged block's, or "
                                                  "nan where the placement has no such norm)")


def _text(name: str, text: str, description: str):
    from tensorboard.plugins.text.summary_v2 import text_pb

    return text_pb(name, text, description)


def _write_events(path: Path, time_s: float, events: list[tuple[int, Any]]) -> None:
    """An event file of `events` (step, Summary), each serialised deterministically."""
    import io

    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    buffer = io.BytesIO()
    writer = RecordWriter(buffer)
    writer.write(Event(wall_time=time_s, file_version="brain.Event:2").SerializeToString(deterministic=True))
    for step, summary in events:
        writer.write(Event(wall_time=time_s, step=step, summary=summary).SerializeToString(deterministic=True))
    _replace(path, buffer.getvalue())


def _replace(path: Path, data: bytes) -> None:
    """Write `data` aside and rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
