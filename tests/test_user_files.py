"""What normexp did not write, it never removes, moves or hides: a file or a link where a run folder
should be, a user's files inside a run folder, a user's folder named like a run. Tiny sweeps, in-process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from normexp import store
from normexp.cli import app
from normexp.config import build_sweep, parse_yaml
from normexp.results import load_summary
from normexp.store import inspect_run
from normexp.verify import verify_sweep

runner = CliRunner()

SWEEP = """\
name: mine
base: {model: {depth: 2, width: 4}, train: {steps: 2, threads: 1}}
seeds: [0, 1, 2, 3]
"""
IDS = [store.run_id(cfg) for cfg in build_sweep(parse_yaml(SWEEP)).runs]
IN_THE_WAY = "is in the way; move it and rerun"


def normexp(*args: object):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """The sweep, trained once; tests change copies of it."""
    folder = tmp_path_factory.mktemp("pristine")
    (folder / "sweep.yaml").write_text(SWEEP)
    result = normexp("sweep", folder / "sweep.yaml", "--out", folder / "out", "-q")
    assert result.exit_code == 0, result.output
    return folder


@pytest.fixture
def sweep_dir(pristine, tmp_path) -> tuple[Path, Path]:
    """(config, out): a fresh copy of the pristine sweep."""
    shutil.copytree(pristine, tmp_path / "copy", symlinks=True)
    return tmp_path / "copy" / "sweep.yaml", tmp_path / "copy" / "out"


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def hidden(out: Path) -> list[str]:
    """Entries a writer hides under a temporary name, anywhere in the sweep folder."""
    return sorted(str(p.relative_to(out)) for p in out.rglob(".*") if p.name != ".lock")


def done_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "done.json").read_text())


def no_traceback(result) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output, result.output


# ----------------------------------------------------------------------------- A: a file or link at a run id


def put_obstacle(out: Path, rid: str, kind: str, outside: Path) -> None:
    shutil.rmtree(out / rid)
    if kind == "link-to-folder":
        outside.mkdir()
        (outside / "precious.txt").write_text("keep")
        (out / rid).symlink_to(outside)
    elif kind == "dangling-link":
        (out / rid).symlink_to(outside / "gone")
    else:
        (out / rid).write_text("a file of mine")


def obstacle_state(path: Path) -> tuple[bool, str]:
    return path.is_symlink(), str(path.readlink()) if path.is_symlink() else path.read_text()


@pytest.mark.parametrize("kind", ["link-to-folder", "dangling-link", "file"])
@pytest.mark.parametrize("mode", ["resume", "force"])
@pytest.mark.parametrize("engine", ["reference", "batched"])
def test_a_file_or_link_at_a_run_id_fails_that_run_only(sweep_dir, pristine, tmp_path, kind, mode, engine):
    """The link or file stays exactly as it is (its target too), that run fails with the reason, every
    other run trains and is recorded, summary.csv is written; exit 1, no traceback."""
    config, out = sweep_dir
    victim, *retrained, kept = IDS
    outside = tmp_path / "outside"
    put_obstacle(out, victim, kind, outside)
    if mode == "resume":  # runs the resume must train beside the blocked one (two: a batch)
        for rid in retrained:
            shutil.rmtree(out / rid)
    before, target = obstacle_state(out / victim), snapshot(outside) if outside.is_dir() else None
    args = ["--force"] if mode == "force" else []
    result = normexp("sweep", config, "--out", out, "--engine", engine, *args)
    no_traceback(result)
    assert result.exit_code == 1, result.output
    assert obstacle_state(out / victim) == before
    assert (snapshot(outside) if outside.is_dir() else None) == target
    assert hidden(out) == []
    summary = load_summary(out).set_index("run_id")
    assert summary.loc[victim, "status"] == "failed" and IN_THE_WAY in summary.loc[victim, "error"]
    assert IN_THE_WAY in " ".join(result.output.split())
    for rid in IDS[1:]:
        assert inspect_run(out / rid).finished and summary.loc[rid, "status"] == "completed"
    trained = {rid for rid in IDS[1:] if done_of(out / rid) != done_of(pristine / "out" / rid)}
    assert trained == ({*retrained, kept} if mode == "force" else set(retrained))
    assert {done_of(out / rid)["engine"] for rid in trained} == {engine}
    assert (out / "summary.csv").read_text() == store.summary_csv(out, build_sweep(parse_yaml(SWEEP)).runs)


@pytest.mark.parametrize("kind", ["link-to-folder", "dangling-link", "file"])
def test_verify_names_a_file_or_link_at_a_run_id_and_leaves_it(sweep_dir, tmp_path, kind):
    _, out = sweep_dir
    victim = IDS[0]
    put_obstacle(out, victim, kind, tmp_path / "outside")
    before = obstacle_state(out / victim)
    found = verify_sweep(out)
    finding = next(f for f in found.findings if f.path == victim)
    assert finding.severity == "problem" and "in the way" in finding.problem and "missing" not in finding.problem
    assert "move it" in finding.remedy
    for args in (["verify", out], ["verify", out, "--fix"]):
        result = normexp(*args)
        no_traceback(result)
        assert result.exit_code == 1 and "in the way" in result.output and "missing" not in result.output
    assert obstacle_state(out / victim) == before and hidden(out) == []


def test_a_writer_refuses_a_link_at_the_run_folder(sweep_dir, tmp_path):
    """Where the link appears between the sweep's look and the write, the store refuses it too."""
    from normexp.config import load_run_config

    _, out = sweep_dir
    victim = out / IDS[0]
    cfg = load_run_config(victim / "config.yaml")
    put_obstacle(out, IDS[0], "link-to-folder", tmp_path / "outside")
    metrics = {"step": [0, 1, 2], "loss": [1.0] * 3, "acc": [0.5] * 3, "lr": [0.01] * 3, "grad_norm": [1.0] * 3}
    with pytest.raises(store.InTheWay, match="in the way"):
        store.write_run(victim, cfg, store.FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu"))
    with pytest.raises(store.InTheWay, match="in the way"):
        store.write_failed(victim, cfg, "failed", "boom")
    assert victim.is_symlink() and hidden(out) == [] and snapshot(tmp_path / "outside") == {"precious.txt": b"keep"}


def test_a_link_that_appears_while_its_run_trains_fails_that_run_only(sweep_dir, tmp_path, monkeypatch):
    """Found only when the run's result is written: the run is not recorded, the link stays, the sweep goes on."""
    from normexp.engines import reference

    config, out = sweep_dir
    real, outside = reference.train_run, tmp_path / "outside"

    def train_run(cfg, **kwargs):
        if store.run_id(cfg) == IDS[0]:
            put_obstacle(out, IDS[0], "link-to-folder", outside)
        return real(cfg, **kwargs)

    monkeypatch.setattr(reference, "train_run", train_run)
    result = normexp("sweep", config, "--out", out, "--force", "--engine", "reference")
    no_traceback(result)
    assert result.exit_code == 1 and IN_THE_WAY in " ".join(result.output.split())
    assert (out / IDS[0]).is_symlink() and snapshot(outside) == {"precious.txt": b"keep"} and hidden(out) == []
    assert list(load_summary(out)["status"]) == ["failed", "completed", "completed", "completed"]


def test_fail_fast_stops_at_a_file_in_the_way(sweep_dir, pristine):
    config, out = sweep_dir
    put_obstacle(out, IDS[0], "file", out)
    result = normexp("sweep", config, "--out", out, "--force", "--fail-fast")
    no_traceback(result)
    assert result.exit_code == 1 and (out / IDS[0]).read_text() == "a file of mine"
    assert all(done_of(out / rid) == done_of(pristine / "out" / rid) for rid in IDS[1:])  # none retrained
