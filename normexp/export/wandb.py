"""`normexp export DIR --to wandb OUT`: a sweep folder's verified runs (read by export/runs.py) as Weights &
Biases offline runs, written by wandb's own library with no network and no login: `wandb sync OUT/wandb`
uploads them.

One W&B run per run, in `OUT/wandb/offline-run-<time>-<id>/` (the layout `wandb.init(mode="offline")` makes):
its id is the run id (a character W&B refuses, or more than 64, gives a hash of it: `wandb_id`), so a run
synced twice is one W&B run; its project is the sweep's name (`wandb sync --project` to change it), its
display name the run's name (`--run-name`, names.py). Config: the run's config as nested sections
(`model.depth` shows as `model.depth`), and under `normexp` the run id, the sweep, the folder, config hash,
done.json's checksum, engine, threads, device and provenance (commit, CPU, torch build, command). History:
per recorded step (`_step` is normexp's step) the same scalars as MLflow's (metrics.csv's
columns, `blocks/<column>/<block>`, `sharpness/*`), and at the last step `final/final_loss`, `final/min_loss`,
`final/final_acc`, `final/diverged` and `final/trained` (1 or 0), which the summary holds with each metric's
last value. Tags: the run's status. NaN and +-inf go as they are (W&B shows them as such).

Re-exporting is idempotent, keyed by folder and run id (a `normexp-export.json` in each run's folder, written
by normexp; wandb sync leaves it alone): a run this folder exported with the same done.json checksum,
verdict, name and project is left as it is (so a synced run is not synced again); one whose result, verdict
or name changed, or that an interrupted export left unfinished (marked complete last), has its offline folder
replaced, and named. The offline folder of a run this folder exported that no longer verifies is removed,
and named. What normexp did not write (other runs, another folder's) is never touched. wandb's service
process runs while the export does, and is stopped after it; an offline folder an export made and did not
mark (stopped between wandb.init and the mark) is removed by the next export of the folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from normexp.config import ConfigError
from normexp.export.runs import ExportedRun, ExportResult, display_names, missing_extra, read_folder

MARKER = "normexp-export.json"  # in each offline run folder normexp wrote: whose run it is, and its result
PENDING = ".normexp-starting-"  # OUT/wandb/<this><W&B id>.json while wandb.init makes a run's folder

# While the export runs: offline whatever the user's environment says, quiet (no banner, no prompt), and
# no error reports sent.
ENVIRONMENT = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true",
               "WANDB_DISABLE_CODE": "true", "WANDB_ERROR_REPORTING": "false"}

# wandb.Settings for a run that records what normexp logs and nothing of this machine (it is not the run's).
SETTINGS = {"silent": True, "console": "off", "disable_git": True, "save_code": False, "disable_code": True,
            "x_disable_stats": True, "x_disable_meta": True, "x_disable_machine_info": True,
            "x_save_requirements": False, "init_timeout": 60.0}


def to_wandb(run_dir: Path, out_dir: Path, template: str | None = None) -> ExportResult:
    """Write the W&B offline runs of `run_dir` under `out_dir/wandb` (see the module docstring); runs named
    by `template` (`--run-name`, names.py). ConfigError, in one line, where wandb refuses a run."""
    sweep, runs, left = read_folder(Path(run_dir))
    try:
        import wandb
    except ImportError:
        raise missing_extra("wandb", "wandb") from None
    out_dir, folder = Path(out_dir), str(Path(run_dir).resolve())
    names = display_names(runs, template)
    project = re.sub(r"[/\\#?%:]", "-", sweep)[:128] or "normexp"
    wandb_dir = out_dir / "wandb"
    earlier = _earlier(wandb_dir, folder)
    done = ExportResult([], left=left)
    out_dir.mkdir(parents=True, exist_ok=True)
    _clear_unstarted(wandb_dir, folder)
    with _environ(ENVIRONMENT):
        try:
            for run in runs:
                mark = {"folder": folder, "run_id": run.run_id, "done_checksum": run.checksum,
                        "trained": run.trained, "name": names[run.run_id], "project": project}
                olds = earlier.pop(run.run_id, [])
                same = next((path for path, old in olds if old == {**mark, "complete": True}), None)
                for path, old in olds:
                    if path != same:
                        shutil.rmtree(path)
                        if same is None:
                            done.replaced.setdefault(run.run_id, _why(old, mark))
                if same is not None:
                    done.kept += 1
                    continue
                _write_run(wandb, out_dir, run, sweep, mark)
                done.exported.append(run.run_id)
        except wandb.errors.Error as exc:
            raise ConfigError(f"wandb: {' '.join(str(exc).split())[:300]}") from None
        finally:
            wandb.teardown()  # stops wandb's service process
            _clear_unstarted(wandb_dir, folder)
    for rid in left:  # exported before, and no longer verified finished: its copy goes
        for path, _ in earlier.pop(rid, []):
            shutil.rmtree(path)
            if rid not in done.dropped:
                done.dropped.append(rid)
    latest = wandb_dir / "latest-run"
    if latest.is_symlink() and not latest.exists():  # it named a folder replaced or removed
        latest.unlink()
    return done


def wandb_id(run_id: str) -> str:
    """The W&B id of a run: its run id, or where that holds a character W&B refuses in an id or is longer
    than 64, its readable part and a hash of it."""
    if re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", run_id):
        return run_id
    return re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:48] + "-" + hashlib.sha256(run_id.encode()).hexdigest()[:12]


def history(run: ExportedRun) -> list[tuple[int, dict[str, float]]]:
    """The run's scalars (`ExportedRun.scalars`) as W&B logs them: per step, in step order, every scalar
    recorded at it."""
    by_step: dict[int, dict[str, float]] = {}
    for name, points in run.scalars().items():
        for step, value in points:
            by_step.setdefault(step, {})[name] = value
    return sorted(by_step.items())


def _write_run(wandb, out_dir: Path, run: ExportedRun, sweep: str, mark: dict[str, Any]) -> None:
    """One offline run: config, history per step, finished; its folder marked as normexp's at once, and
    complete last."""
    done = run.done
    meta = {"run_id": run.run_id, "sweep": sweep, "folder": mark["folder"],
            "config_hash": done.get("config_hash"), "done_checksum": run.checksum, "engine": done.get("engine"),
            "threads": done.get("threads"), "device": done.get("device"), "provenance": done.get("provenance")}
    known = getattr(wandb.Settings, "model_fields", SETTINGS)
    settings = wandb.Settings(**{k: v for k, v in SETTINGS.items() if k in known})
    status = str(done.get("status", ""))
    wandb_dir, wid = out_dir / "wandb", wandb_id(run.run_id)
    wandb_dir.mkdir(exist_ok=True)
    note = wandb_dir / f"{PENDING}{wid}.json"
    note.write_text(json.dumps({"folder": mark["folder"], "id": wid, "before": sorted(
        p.name for p in wandb_dir.glob(f"offline-run-*-{wid}"))}) + "\n", encoding="utf-8")
    wb = wandb.init(mode="offline", dir=str(out_dir), id=wid, name=mark["name"],
                    project=mark["project"], config={**run.cfg.model_dump(mode="json"), "normexp": meta},
                    tags=[status] if status else None, settings=settings)
    path = Path(wb.settings.sync_dir)
    _mark(path, {**mark, "complete": False})
    note.unlink()
    for step, values in history(run):
        wb.log(values, step=step)
    wb.finish()
    _mark(path, {**mark, "complete": True})


def _mark(path: Path, mark: dict[str, Any]) -> None:
    tmp = path / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(mark, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path / MARKER)


def _clear_unstarted(wandb_dir: Path, folder: str) -> None:
    """Remove the offline folders an export of `folder` made and never marked (a Ctrl-C between wandb.init,
    which makes the folder, and normexp's mark: the CLI ends at once): the note `_write_run` leaves
    before wandb.init names the run's W&B id and the folders it had already. Unmarked, no export would
    know them as normexp's, and `wandb sync` would upload each beside its run's complete folder."""
    for note in wandb_dir.glob(f"{PENDING}*.json") if wandb_dir.is_dir() else []:
        try:
            pending = json.loads(note.read_text(encoding="utf-8"))
            if pending["folder"] != folder:
                continue
            made = set(wandb_dir.glob(f"offline-run-*-{pending['id']}")) - {wandb_dir / name
                                                                            for name in pending["before"]}
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for path in made:
            if path.name.split("-", 3)[-1] == pending["id"] and not (path / MARKER).exists():
                shutil.rmtree(path, ignore_errors=True)
        note.unlink(missing_ok=True)


def _earlier(wandb_dir: Path, folder: str) -> dict[str, list[tuple[Path, dict[str, Any]]]]:
    """run id -> the offline run folders under `wandb_dir` that normexp wrote for `folder`'s run, with
    their marks."""
    found: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    paths = sorted(wandb_dir.glob("offline-run-*")) if wandb_dir.is_dir() else []
    for path in paths:
        try:
            mark = json.loads((path / MARKER).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # not normexp's, or not readable as its: left alone
        if isinstance(mark, dict) and mark.get("folder") == folder and isinstance(mark.get("run_id"), str):
            found.setdefault(mark["run_id"], []).append((path, mark))
    return found


def _why(old: dict[str, Any], mark: dict[str, Any]) -> str:
    if not old.get("complete"):
        return "left unfinished by an interrupted export"
    if old.get("done_checksum") != mark["done_checksum"]:
        return "its result changed"
    if old.get("trained") != mark["trained"]:
        return "its verdict changed"
    return "its name changed" if old.get("name") != mark["name"] else "its project changed"


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set `values` in the environment for the block (over the user's own), and restore it after."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
