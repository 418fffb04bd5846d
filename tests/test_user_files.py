"""What normexp did not write, it never removes, moves or hides: a file or a link where a run folder
should be, a user's files inside a run folder, a user's folder named like a run. Tiny sweeps, in-process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import fresh_copy, trained_sweep
from typer.testing import CliRunner

from normexp import folder
from normexp.cli import app
from normexp.config import build_sweep, parse_yaml
from normexp.folder import inspect_run
from normexp.results import load_summary
from normexp.verify import verify_sweep

runner = CliRunner()

SWEEP = """\
name: mine
base: {model: {depth: 2, width: 4}, train: {steps: 2, threads: 1}}
seeds: [0, 1, 2, 3]
"""
IDS = [folder.run_id(cfg) for cfg in build_sweep(parse_yaml(SWEEP)).runs]
IN_THE_WAY = "is in the way; move it and rerun"


def normexp(*args: object):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """The sweep, trained once; tests change copies of it."""
    return trained_sweep(tmp_path_factory, "pristine", SWEEP, "-q").parent


@pytest.fixture
def sweep_dir(pristine, tmp_path) -> tuple[Path, Path]:
    """(config, out): a fresh copy of the pristine sweep."""
    return fresh_copy(pristine, tmp_path)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def hidden(out: Path) -> list[str]:
    """Entries a writer hides under a temporary name, anywhere in the sweep folder (not the lock, nor the
    record of verified runs: normexp's files under their own names)."""
    return sorted(str(p.relative_to(out)) for p in out.rglob(".*") if p.name not in (".lock", ".verified.json"))


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
    assert (out / "summary.csv").read_text() == folder.summary_csv(out, build_sweep(parse_yaml(SWEEP)).runs)


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
    with pytest.raises(folder.InTheWay, match="in the way"):
        folder.write_run(victim, cfg, folder.FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu"))
    with pytest.raises(folder.InTheWay, match="in the way"):
        folder.write_failed(victim, cfg, "failed", "boom")
    assert victim.is_symlink() and hidden(out) == [] and snapshot(tmp_path / "outside") == {"precious.txt": b"keep"}


def test_a_link_that_appears_while_its_run_trains_fails_that_run_only(sweep_dir, tmp_path, monkeypatch):
    """Found only when the run's result is written: the run is not recorded, the link stays, the sweep goes on."""
    from normexp.engines import reference

    config, out = sweep_dir
    real, outside = reference.train_run, tmp_path / "outside"

    def train_run(cfg, **kwargs):
        if folder.run_id(cfg) == IDS[0]:
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


# ----------------------------------------------------------------------------- B: a user's files in a run folder

USER_FILES = {"README.user": b"my notes\n", "sub/user.txt": b"weeks of work", ".notes.txt.tmp-5": b"a draft",
              ".config.yaml.tmp-5/inside.txt": b"a folder with normexp's temporary name"}


def add_user_files(run_dir: Path, outside: Path) -> None:
    for name, data in USER_FILES.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(data)
    outside.mkdir(exist_ok=True)
    (outside / "precious.txt").write_text("keep")
    (run_dir / "elsewhere").symlink_to(outside)


def assert_user_files(run_dir: Path, outside: Path) -> None:
    assert {name: (run_dir / name).read_bytes() for name in USER_FILES} == USER_FILES
    assert (run_dir / "elsewhere").is_symlink() and (run_dir / "elsewhere").readlink() == outside
    assert snapshot(outside) == {"precious.txt": b"keep"}


@pytest.mark.parametrize("how", ["force", "force-batched", "corrupt", "corrupt-and-fails"])
def test_a_replaced_run_folder_keeps_the_user_s_files(sweep_dir, pristine, tmp_path, monkeypatch, how):
    """--force, or the redo of a corrupt run (finished or failed), builds the run folder anew: every entry
    of the old one that normexp did not write goes into the new one, unchanged."""
    from normexp.engines import reference

    config, out = sweep_dir
    victim, outside = out / IDS[0], tmp_path / "outside"
    add_user_files(victim, outside)
    args = ["--engine", "batched" if how == "force-batched" else "reference"]
    if how.startswith("force"):
        args.append("--force")
    else:
        (victim / "metrics.csv").write_text("step,loss\n")
    if how == "corrupt-and-fails":
        monkeypatch.setattr(reference, "train_run", lambda cfg, **kw: (_ for _ in ()).throw(RuntimeError("boom")))
    result = normexp("sweep", config, "--out", out, *args)
    no_traceback(result)
    assert result.exit_code == (1 if how == "corrupt-and-fails" else 0), result.output
    assert_user_files(victim, outside)
    assert hidden(out) == [f"{IDS[0]}/.config.yaml.tmp-5", f"{IDS[0]}/.notes.txt.tmp-5"]  # the user's own
    if how == "corrupt-and-fails":
        assert inspect_run(victim).kind == "failed"
        return
    assert inspect_run(victim).finished and done_of(victim) != done_of(pristine / "out" / IDS[0])
    verified = normexp("verify", out)
    assert verified.exit_code == 0 and verify_sweep(out).findings == [], verified.output


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_full_disk_during_the_swap_leaves_the_user_s_files_in_the_finished_folder(sweep_dir, tmp_path,
                                                                                    monkeypatch, exchange):
    import errno

    from normexp.config import load_run_config

    _, out = sweep_dir
    victim, outside = out / IDS[0], tmp_path / "outside"
    add_user_files(victim, outside)
    before = snapshot(victim)
    real_replace = folder.write.os.replace

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device", str(victim))

    def replace(src, dst):
        if Path(src).name.startswith(f".{victim.name}.tmp-"):
            no_space()
        real_replace(src, dst)

    monkeypatch.setattr(folder.write, "_exchange", no_space if exchange else lambda a, b: False)
    monkeypatch.setattr(folder.write.os, "replace", replace)
    metrics = {"step": [0, 1, 2], "loss": [1.0] * 3, "acc": [0.5] * 3, "lr": [0.01] * 3, "grad_norm": [1.0] * 3}
    with pytest.raises(OSError, match="No space left"):
        folder.write_run(victim, load_run_config(victim / "config.yaml"),
                        folder.FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu"))
    monkeypatch.undo()
    assert snapshot(victim) == before and inspect_run(victim).finished
    assert_user_files(victim, outside)
    assert not list(out.glob(".*.tmp-*")) and not list(out.glob(".*.old-*"))


def built_copy(run_dir: Path, to: Path) -> Path:
    """A run folder as `write_run` builds it aside: a complete copy of normexp's own files."""
    to.mkdir()
    for name in ("config.yaml", "metrics.csv", "done.json"):
        shutil.copy2(run_dir / name, to / name)
    return to


@pytest.mark.parametrize("caught", ["before-the-swap", "after-the-exchange", "between-two-renames"])
def test_a_crash_while_a_run_folder_is_replaced_loses_none_of_the_user_s_files(sweep_dir, tmp_path, caught):
    """A sweep killed mid-replacement leaves the user's files in the folder being built or in the old one;
    the next sweep's tidying (`recover_strays`) puts them back into the run folder, and removes nothing of
    theirs."""
    config, out = sweep_dir
    victim, outside = out / IDS[0], tmp_path / "outside"
    add_user_files(victim, outside)
    staging = built_copy(victim, out / f".{IDS[0]}.tmp-99")
    user = [p for p in victim.iterdir() if p.name not in ("config.yaml", "metrics.csv", "done.json")]
    for entry in user:  # carried into the new folder, as write_run does before it swaps it in
        entry.rename(staging / entry.name)
    if caught == "after-the-exchange":  # the new folder is in place; the old one waits to be removed
        victim.rename(tmp_path / "old")
        staging.rename(victim)
        (tmp_path / "old").rename(staging)
    elif caught == "between-two-renames":  # the old folder waits under its .old name, none in place
        victim.rename(out / f".{IDS[0]}.old-99")
    assert folder.stray_paths(out)
    result = normexp("sweep", config, "--out", out)
    assert result.exit_code == 0 and "0 ran, 4 already done" in result.output, result.output
    assert_user_files(victim, outside)
    assert not folder.stray_paths(out) and not list(out.glob(f".{IDS[0]}.*"))
    assert normexp("verify", out).exit_code == 0


@pytest.mark.parametrize("name", ["config.yaml", "done.json"])
def test_a_user_s_folder_under_one_of_normexp_s_names_is_in_the_way(sweep_dir, name):
    """It could not be carried into the new run folder beside normexp's file of that name: the run fails
    with the reason, and the folder stays whole where it is."""
    config, out = sweep_dir
    victim = out / IDS[0]
    (victim / name).unlink()
    (victim / name).mkdir()
    (victim / name / "mine.txt").write_text("keep")
    before = snapshot(victim)
    for args in (["sweep", config, "--out", out], ["sweep", config, "--out", out, "--force"]):
        result = normexp(*args)
        no_traceback(result)
        assert result.exit_code == 1 and f"{name} in it: a folder normexp did not write {IN_THE_WAY}" in " ".join(
            result.output.split()), result.output
        assert snapshot(victim) == before and hidden(out) == []
    assert load_summary(out).set_index("run_id").loc[IDS[0], "status"] == "failed"


def test_a_stray_folder_whose_user_files_cannot_go_back_is_left_in_place(sweep_dir):
    """A folder being built whose entries of the user's have namesakes in the run folder: normexp would
    have to choose one and remove the other; it removes neither."""
    _, out = sweep_dir
    stray = built_copy(out / IDS[0], out / f".{IDS[0]}.tmp-77")
    (stray / "notes.txt").write_text("one")
    (out / IDS[0] / "notes.txt").write_text("the other")
    before = snapshot(out)
    assert folder.stray_paths(out) == []
    folder.recover_strays(out)
    assert normexp("verify", out, "--fix").exit_code == 0
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- C: a user's folder named like a run

OTHER_ID = "post-layernorm-s0-0123456789"  # named by a run id, of no run of this sweep
USER_FOLDERS = {
    "notes and a config": {"notes.txt": "weeks of work", "config.yaml": "my: settings\n"},
    "a config and a draft": {"config.yaml": "my: settings\n", ".draft.tmp-12": "a draft"},
    "metrics and a folder": {"metrics.csv": "step,loss\n0,1.0\n", "sub/x.txt": "mine"},
    "a done.json and notes": {"done.json": "{}\n", "notes.txt": "weeks of work"},
}


def make_folder(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


@pytest.mark.parametrize("files", list(USER_FOLDERS))
def test_verify_fix_leaves_a_folder_named_like_a_run_that_holds_the_user_s_files(sweep_dir, files):
    """normexp builds run folders aside and swaps them in whole: a folder named by a run id that holds
    anything normexp does not write is not its to remove, whatever else it holds."""
    _, out = sweep_dir
    make_folder(out / OTHER_ID, USER_FOLDERS[files])
    before = snapshot(out / OTHER_ID)
    found = verify_sweep(out)
    finding = next(f for f in found.findings if f.path == OTHER_ID)
    assert finding.severity == "note" and "not normexp's: left in place" in finding.remedy and found.clean
    result = normexp("verify", out, "--fix")
    assert result.exit_code == 0 and "not normexp's" in " ".join(result.output.split()), result.output
    assert snapshot(out / OTHER_ID) == before


def test_verify_fix_removes_a_folder_holding_only_normexp_s_files(sweep_dir):
    """What a killed older release could leave: a run folder without its done marker, normexp's files only."""
    _, out = sweep_dir
    make_folder(out / OTHER_ID, {"config.yaml": "model: {depth: 2}\n", "metrics.csv": "step,loss\n",
                                 ".done.json.tmp-5": "{"})
    assert not verify_sweep(out).clean
    assert normexp("verify", out, "--fix").exit_code == 0 and not (out / OTHER_ID).exists()


@pytest.mark.parametrize("files", ["notes only", "notes and a config"])
def test_a_user_s_folder_at_a_run_of_the_sweep_is_kept_by_verify_and_by_the_sweep(sweep_dir, files):
    """verify --fix leaves it; the sweep then moves the user's files into the run's folder, or, where the
    folder holds a file under one of normexp's names (the user's config.yaml), fails that run and
    leaves the folder as it is."""
    config, out = sweep_dir
    victim = out / IDS[0]
    shutil.rmtree(victim)
    theirs = {"notes.txt": "weeks of work", **({"config.yaml": "my: settings\n"} if files != "notes only" else {})}
    make_folder(victim, theirs)
    before = snapshot(victim)
    finding = next(f for f in verify_sweep(out).findings if f.path == IDS[0])
    assert finding.severity == "problem" and "missing" not in finding.problem
    assert "not normexp's: left in place" in finding.remedy or IN_THE_WAY.split(";")[0] in finding.problem
    result = normexp("verify", out, "--fix")
    no_traceback(result)
    assert result.exit_code == 1 and snapshot(victim) == before, result.output
    result = normexp("sweep", config, "--out", out)
    no_traceback(result)
    if files == "notes only":
        assert result.exit_code == 0 and "1 ran, 3 already done" in result.output, result.output
        assert inspect_run(victim).finished and (victim / "notes.txt").read_text() == "weeks of work"
        assert normexp("verify", out).exit_code == 0
    else:
        assert result.exit_code == 1 and IN_THE_WAY in " ".join(result.output.split()), result.output
        assert snapshot(victim) == before and hidden(out) == []
