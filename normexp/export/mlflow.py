"""`normexp export DIR URI --to mlflow`: a sweep folder's verified runs (read by export/runs.py) as
MLflow runs.

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
their done.json checksum is this run's). MLflow's SQL store keeps +-inf as +-1.79e308 (its documented limit);
NaN stays NaN. A run this folder exported before that no longer verifies has its MLflow run removed, and
named.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from normexp import stopping
from normexp.config import ConfigError, flatten
from normexp.export.runs import (
    ExportedRun,
    ExportResult,
    hparam_value,
    missing_extra,
    read_folder,
    run_count,
    varying_first,
)

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
        raise missing_extra("mlflow", "mlflow (or mlflow-skinny)") from None
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
    so_far = f"; {run_count(done.exported)} exported before it" if done.exported else ""
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
        params = [Param(k, str(hparam_value(flat[k]))) for k in keys]
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
