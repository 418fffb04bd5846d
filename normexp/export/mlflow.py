"""`normexp export DIR URI --to mlflow`: a sweep folder's verified runs (read by export/runs.py) as
MLflow runs.

MLflow (`pip install 'normexp[mlflow]'`, which brings `mlflow ui`; a `sqlite:///path.db` URI, a tracking
server's `http://HOST:PORT`, or a local `file:` store, which MLflow 3 keeps in maintenance mode and allows
here): experiment = the sweep's name (or `--experiment`; a deleted one is refused, not restored). The folder is
one parent run (named by the sweep, tag `normexp.role` = `sweep`) holding the sweep's files as artifacts
(`SWEEP_ARTIFACTS`: sweep.yaml, summary.csv, report.html, the figures), and each normexp run one MLflow run
nested under it (tag `mlflow.parentRunId`), named by `--run-name` or the keys that vary (export/names.py),
with `config.yaml` and `metrics.csv` as artifacts. Params: the flattened config (`optim.lr`, ...; null as
"None"), metrics: `ExportedRun.scalars()`'s names (metrics.csv's columns, `blocks/<column>/<block>`,
`sharpness/*`, `final/*`; TensorBoard files the same values under loss/, metrics/, per_block/, result/) with
their step, tags: `normexp.run_id`, `normexp.folder`
(the folder's absolute path), `normexp.sweep`, `normexp.engine`, `normexp.status`, `normexp.trained`,
`normexp.threads`, `normexp.device`, `normexp.config_hash`, `normexp.done_checksum`, `normexp.mlflow_version`
(the MLflow that wrote it) and `normexp.provenance.*` (commit, CPU, torch build, command). A new experiment in
a `sqlite:///` store keeps its artifacts beside the database (`mlartifacts/`), not in the current folder.

Re-exporting is idempotent, keyed by folder and run id: a run this folder exported with the same done.json
checksum and verdict is left as it is (renamed if its name changed; its artifacts logged if an earlier release
exported it without); one whose result changed (a --force rerun), whose verdict did (another
report.trained_below), or that an interrupted export left unfinished (a run is marked FINISHED last) is
deleted in MLflow and exported again, and named. The parent run is replaced only where the sweep's files
changed. A stop signal ends an export at once, in one line. An unreachable tracking server fails after 3 tries
of at most 20 s each (HTTP_LIMITS), in one line. Another folder's MLflow runs are never touched (an earlier
release's, which carry no folder tag, only adopted where their done.json checksum is this run's). MLflow's SQL
store keeps +-inf as +-1.79e308 (its documented limit); NaN stays NaN. A run this folder exported before that
no longer verifies has its MLflow run removed, and named.

A `sqlite:///` database is readable only by an MLflow whose schema migrations know it: one written by a newer
MLflow than the one installed is refused before anything is written (`newer_store_problem`), and the success
line names the viewer to install (`viewer`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from normexp import stopping
from normexp.config import ConfigError, flatten
from normexp.export.runs import (
    ExportedRun,
    ExportResult,
    display_names,
    hparam_value,
    missing_extra,
    read_folder,
    run_count,
    varying_first,
)
from normexp.folder import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, SWEEP_FILE

MLFLOW_BATCH = 1000  # MLflow's limit of metrics per log_batch call (params: 100)
RUN_ARTIFACTS = (CONFIG_FILE, METRICS_FILE)  # each run's, from its folder
SQLITE_HEADER = b"SQLite format 3\x00"  # the first bytes of every SQLite database file
SWEEP_ARTIFACTS = (SWEEP_FILE, SUMMARY_FILE, "report.html", "*.png", "*.svg", "*.pdf")  # the parent run's


# MLflow's HTTP client retries a request 7 times over about 4 minutes, each try waiting up to 120 s: an
# export to a tracking server that is down or unreachable fails, here, after 3 tries of at most 20 s each
# and 1 + 2 s of backoff (a closed port: about 3 s). A variable the user set is theirs, and kept.
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


@dataclass
class MlflowExport(ExportResult):
    """What an export did (ExportResult), and where it went: the experiment's id."""

    experiment_id: str = ""

    def viewer(self, uri: str) -> str:
        """How to look at the export: the tracking server's page, or the `mlflow ui` command for the store
        and the MLflow it needs (one at least as new as the one that wrote it)."""
        if uri.startswith(("http://", "https://")):
            return f"open {uri.rstrip('/')}/#/experiments/{self.experiment_id}"
        store = uri if "://" in uri or uri.startswith("file:") else Path(uri).resolve().as_uri()
        allow = "MLFLOW_ALLOW_FILE_STORE=true " if store.startswith("file:") else ""
        return (f"{allow}mlflow ui --backend-store-uri {shlex.quote(store)} (MLflow {installed_version()} or newer: "
                f"pip install 'mlflow>={installed_version()}')")


def to_mlflow(run_dir: Path, uri: str, experiment: str | None = None, run_name: str | None = None) -> MlflowExport:
    """Export `run_dir` into the MLflow tracking store at `uri` (see the module docstring), each run named by
    the template `run_name` (else by the keys that vary). ConfigError, in one line, where the store cannot
    be reached or refuses the export, or where a database was written by a newer MLflow."""
    if experiment is not None and not experiment.strip():
        raise ConfigError("--experiment: empty; name an MLflow experiment, or leave the option out for the "
                          "sweep's name")
    name, runs, left = read_folder(Path(run_dir))
    names = display_names(runs, run_name)
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise missing_extra("mlflow", "mlflow") from None
    problem = sqlite_problem(uri) or newer_store_problem(uri)
    if problem is not None:
        raise ConfigError(problem)
    folder = str(Path(run_dir).resolve())
    done = MlflowExport([], left=left)
    with _file_store_allowed(uri), _environ(HTTP_LIMITS), _stopped_says(done, len(runs)):
        try:
            client = MlflowClient(tracking_uri=uri)
            done.experiment_id = _experiment_id(client, experiment or name, uri)
            parent = _sweep_run(client, done.experiment_id, Path(run_dir), folder, name) if runs else None
            _export_mlflow(client, done.experiment_id, Path(run_dir), folder, name, runs, names, parent, left, done)
        except MlflowException as exc:
            raise ConfigError(_mlflow_problem(uri, exc, done)) from None
    return done


def installed_version() -> str:
    import mlflow

    return mlflow.__version__


def sqlite_problem(uri: str) -> str | None:
    """Where `uri` is a `sqlite:///` database MLflow cannot open (a folder, a file that is not an SQLite
    database, a database or a folder for it that cannot be written), the line that says so; MLflow's client
    retries opening it for about 100 s, then raises SQLAlchemy's error. None for any other store."""
    path = sqlite_path(uri)
    if path is None:
        return None
    if path.is_dir():
        return (f"MLflow at {uri}: {path} is a folder, not a database file; name a file in it "
                f"(sqlite:///{path}/mlflow.db)")
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except FileNotFoundError:
        head = None
    except OSError as exc:
        return f"MLflow at {uri}: cannot read {path}: {exc.strerror}"
    if head and head != SQLITE_HEADER:
        return f"MLflow at {uri}: {path} is not an SQLite database; export into another file"
    # sqlite writes its journal beside the database; a missing database is made in the nearest folder there is
    there = path.parent if head is not None else next(p for p in [path.parent, *path.parent.parents] if p.exists())
    if not (there.is_dir() and os.access(there, os.W_OK | os.X_OK)) or (head is not None
                                                                       and not os.access(path, os.W_OK)):
        return f"MLflow at {uri}: cannot write {path} (a read-only file system, or no permission)"
    return None


def newer_store_problem(uri: str) -> str | None:
    """Where `uri` is a `sqlite:///` database whose schema revision the installed MLflow's migrations do not
    know (written by a newer MLflow), the line that says so and which MLflow to install (the newest
    `normexp.mlflow_version` tag in it, where an export wrote one). MLflow's own error would say to
    `mlflow db upgrade` it, which cannot work. None for any other store."""
    path = sqlite_path(uri)
    if path is None or not path.is_file():
        return None
    revision, wrote = _schema_and_writers(path)
    if revision is None or revision in _known_revisions():
        return None
    newest = max(wrote, key=_version_key, default=None)
    if newest is not None and _version_key(newest) <= _version_key(installed_version()):
        newest = None  # migrated since by an MLflow that left no tag: which one is not known
    by = f"MLflow {newest}" if newest else "a newer MLflow"
    need = f"pip install 'mlflow>={newest}'" if newest else "pip install --upgrade mlflow"
    return (f"MLflow at {uri}: the database was written by {by} (schema revision {revision}, unknown to the "
            f"installed mlflow {installed_version()}); an older MLflow cannot read or write it: {need}, or "
            "export into another database")


def _schema_and_writers(path: Path) -> tuple[str | None, list[str]]:
    """A sqlite database's schema revision (None where it is not an MLflow database, yet) and the MLflow
    versions its runs' `normexp.mlflow_version` tags name. Only read."""
    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
            row = db.execute("SELECT version_num FROM alembic_version").fetchone()
            try:
                wrote = [v for (v,) in db.execute("SELECT DISTINCT value FROM tags WHERE key = ?", (VERSION_TAG,))]
            except sqlite3.Error:  # no tags table: the versions are not known
                wrote = []
    except sqlite3.Error:  # not an MLflow database, or unreadable: MLflow's own message says what it is
        return None, []
    return (row[0] if row else None), wrote


def sqlite_path(uri: str) -> Path | None:
    """The file of a `sqlite:///path` URI (`sqlite:////abs` or `sqlite:///rel`), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(unquote(urlparse(uri).path[1:]))


def _known_revisions() -> set[str]:
    """The schema revisions the installed MLflow's migrations know (`revision = "..."` in each script)."""
    from mlflow.store import db_migrations

    found = set()
    for script in (Path(db_migrations.__file__).parent / "versions").glob("*.py"):
        match = REVISION.search(script.read_text(encoding="utf-8"))
        if match:
            found.add(match.group(1))
    return found


def _version_key(text: str) -> tuple:
    from packaging.version import InvalidVersion, Version

    try:
        return (1, Version(text))
    except InvalidVersion:
        return (0, text)


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
        db = sqlite_path(uri)  # MLflow's default for a database: ./mlruns in whatever folder the export runs in
        where = None if db is None else (db.resolve().parent / "mlartifacts" / _slug(name)).as_uri()
        return client.create_experiment(name, artifact_location=where)
    if found.lifecycle_stage != "active":
        raise ConfigError(f"MLflow at {uri}: experiment {name!r} (id {found.experiment_id}) is deleted; restore it "
                          f"(mlflow experiments restore --experiment-id {found.experiment_id}) or export into "
                          "another with --experiment NAME")
    return found.experiment_id


def _export_mlflow(client, exp_id: str, run_dir: Path, folder: str, name: str, runs: list[ExportedRun],
                   names: dict[str, str], parent: str | None, left: list[str], done: ExportResult) -> None:
    """Export `runs` of the folder `folder` into the experiment `exp_id` under the parent run `parent`,
    filling `done` as it goes. Each MLflow run is tagged with its folder and run id from its creation, and
    marked FINISHED last: an earlier export of this folder's run that is unfinished (interrupted), or whose
    result or verdict changed, is replaced; another folder's runs are never touched."""
    from mlflow.entities import Metric, Param, RunTag

    keys = varying_first(runs)
    for run in runs:
        trained = str(run.trained).lower()
        earlier = _earlier(client, exp_id, folder, run.run_id)
        same = [r for r in earlier if r.info.status == "FINISHED" and r.data.tags.get(DONE_TAG) == run.checksum
                and r.data.tags.get("normexp.trained") == trained]
        if same:
            _bring_up_to_date(client, same[0], run_dir / run.run_id, folder, names[run.run_id], parent)
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
        tags = {"mlflow.runName": names[run.run_id], RUN_TAG: run.run_id, FOLDER_TAG: folder,
                **({PARENT_TAG: parent} if parent else {})}
        created = client.create_run(exp_id, start_time=time_ms - int(1000 * float(run.done.get("wall_s", 0))),
                                    tags=tags, run_name=names[run.run_id])
        rid = created.info.run_id
        flat = flatten(run.cfg)
        params = [Param(k, str(hparam_value(flat[k]))) for k in keys]
        metrics = [Metric(key, float(value), time_ms, step) for key, points in run.scalars().items()
                   for step, value in points]
        for i in range(0, len(params), 100):
            client.log_batch(rid, params=params[i:i + 100])
        for i in range(0, len(metrics), MLFLOW_BATCH):
            client.log_batch(rid, metrics=metrics[i:i + MLFLOW_BATCH])
        _log_files(client, rid, [run_dir / run.run_id / f for f in RUN_ARTIFACTS])
        client.log_batch(rid, tags=[RunTag(k, v) for k, v in _tags(run, name, run.checksum).items()])
        client.set_terminated(rid, "FINISHED", end_time=time_ms)  # last: a run not FINISHED is half-made
        done.exported.append(run.run_id)
    for rid in left:  # exported before, and no longer verified finished: its copy goes
        stale = [r for r in _earlier(client, exp_id, folder, rid) if FOLDER_TAG in r.data.tags]
        for old in stale:
            client.delete_run(old.info.run_id)
        if stale:
            done.dropped.append(rid)


def _bring_up_to_date(client, found, run_folder: Path, folder: str, name: str, parent: str | None) -> None:
    """A run exported before, unchanged: its labels follow this export (folder, name, parent run), and
    an earlier release's export, made without artifacts, gets them. Nothing is set that is already so."""
    tags = found.data.tags
    rid = found.info.run_id
    if FOLDER_TAG not in tags:  # an export of an earlier release, of this very result
        client.set_tag(rid, FOLDER_TAG, folder)
    if tags.get("mlflow.runName") != name:
        client.set_tag(rid, "mlflow.runName", name)
    if parent and tags.get(PARENT_TAG) != parent:
        client.set_tag(rid, PARENT_TAG, parent)
    if tags.get(ARTIFACTS_TAG) != ",".join(RUN_ARTIFACTS):
        _log_files(client, rid, [run_folder / f for f in RUN_ARTIFACTS])
        client.set_tag(rid, ARTIFACTS_TAG, ",".join(RUN_ARTIFACTS))


def _sweep_run(client, exp_id: str, run_dir: Path, folder: str, name: str) -> str:
    """The id of the folder's parent run, holding the sweep's files (`sweep_files`). One exported before
    with the same files is kept; otherwise (new, changed files, or left unfinished) the folder's earlier
    parent runs are deleted and a new one is made, its files logged, FINISHED last."""
    from mlflow.entities import RunTag

    files = sweep_files(run_dir)
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        digest.update(path.read_bytes())
    checksum = digest.hexdigest()
    earlier = [r for r in client.search_runs([exp_id], f"tags.`{ROLE_TAG}` = 'sweep'", max_results=1000)
               if r.data.tags.get(FOLDER_TAG) == folder]
    same = [r for r in earlier if r.info.status == "FINISHED" and r.data.tags.get(FILES_TAG) == checksum]
    for old in earlier:
        if not same or old is not same[0]:
            client.delete_run(old.info.run_id)
    if same:
        return same[0].info.run_id
    created = client.create_run(exp_id, tags={"mlflow.runName": name, ROLE_TAG: "sweep", FOLDER_TAG: folder},
                                run_name=name)
    rid = created.info.run_id
    _log_files(client, rid, files)
    client.log_batch(rid, tags=[RunTag(k, v) for k, v in {
        "normexp.sweep": name, FILES_TAG: checksum, VERSION_TAG: installed_version(),
        "mlflow.note.content": f"normexp sweep {name}: {folder}"}.items()])
    client.set_terminated(rid, "FINISHED")
    return rid


def sweep_files(run_dir: Path) -> list[Path]:
    """The sweep's files that its parent run holds: `SWEEP_ARTIFACTS` that are in the folder, in order."""
    found: dict[Path, None] = {}
    for pattern in SWEEP_ARTIFACTS:
        for path in sorted(run_dir.glob(pattern)):
            if path.is_file() and not path.is_symlink():
                found.setdefault(path)
    return list(found)


def _log_files(client, rid: str, paths: list[Path]) -> None:
    for path in paths:
        if path.is_file():
            client.log_artifact(rid, str(path))


def _slug(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name).strip("._") or "experiment"


RUN_TAG, FOLDER_TAG, DONE_TAG = "normexp.run_id", "normexp.folder", "normexp.done_checksum"
ROLE_TAG, FILES_TAG, PARENT_TAG = "normexp.role", "normexp.files_checksum", "mlflow.parentRunId"
VERSION_TAG, ARTIFACTS_TAG = "normexp.mlflow_version", "normexp.artifacts"
REVISION = re.compile(r"""^revision\s*=\s*["']([0-9a-zA-Z_]+)["']""", re.MULTILINE)


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
            "normexp.config_hash": str(done.get("config_hash", "")), "normexp.done_checksum": checksum,
            VERSION_TAG: installed_version(), ARTIFACTS_TAG: ",".join(RUN_ARTIFACTS)}
    for key, value in (done.get("provenance") or {}).items():
        text = value if isinstance(value, str) else json.dumps(value)
        tags[f"normexp.provenance.{key}"] = text[:5000]  # MLflow's tag value limit is 8000
    return tags
