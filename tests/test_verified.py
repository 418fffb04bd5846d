"""The record of verified runs (.verified.json): a folder of 10,000 runs is not checked from scratch by every
command, and still no changed or damaged run is ever counted as a result.

A sweep (and `verify --fix`) records, per run, the SHA-256 of the done.json that passed every check and its
files' stamps; readers read it and write nothing. A run whose files changed in any way is checked again in
full; `verify` re-reads every byte whatever the stamps say. Stamps taken within SETTLED_NS of a file's last
change are not recorded (a change in the same clock tick could keep them): the tests that exercise stamps
record with SETTLED_NS at 0, then wait a clock tick before changing a file.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from conftest import fresh_copy, trained_sweep
from typer.testing import CliRunner

from normexp.cli import app
from normexp.folder import inspect, inspect_run, verified
from normexp.folder.layout import VERIFIED_FILE, sha256_hex
from normexp.report import build_report, to_markdown
from normexp.results import load_metrics, load_summary
from normexp.verify import verify_sweep

SWEEP = """\
name: recorded
base: {model: {depth: 2, width: 8}, train: {steps: 3, threads: 1}}
grid: {norm.placement: [post, pre], optim.lr: [0.01, 0.02]}
seeds: [0, 1]
"""
RUNS = 8
TICK = 0.05  # longer than a file system's clock tick (ext4: 1 ns to 10 ms), so a change gets a new ctime


def normexp(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return trained_sweep(tmp_path_factory, "recorded", SWEEP, "-q").parent


@pytest.fixture
def out(pristine, tmp_path, monkeypatch) -> Path:
    """A copy of the sweep whose record holds every run with its stamps (recorded by `verify --fix`)."""
    _, out = fresh_copy(pristine, tmp_path)
    monkeypatch.setattr(verified, "SETTLED_NS", 0)
    assert normexp("verify", out, "--fix").exit_code == 0
    monkeypatch.undo()
    time.sleep(TICK)
    return out


def record(out: Path) -> dict:
    return json.loads((out / VERIFIED_FILE).read_text().partition("\n")[2])["runs"]


def run_dirs(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.is_dir())


def reads(monkeypatch) -> list[str]:
    """The names of the files of run folders read from now on (by `inspect_run`'s checks)."""
    seen: list[str] = []
    real = inspect.read_text
    monkeypatch.setattr(inspect, "read_text", lambda path: seen.append(path.name) or real(path))
    return seen


def test_a_sweep_records_its_runs_and_stamps_only_settled_files(pristine, tmp_path, monkeypatch):
    _, copy = fresh_copy(pristine, tmp_path)
    runs = record(pristine / "out")
    assert len(runs) == RUNS and all(entry["done"]["status"] == "completed" for entry in runs.values())
    assert not any("stamps" in entry for entry in runs.values())  # written moments before: not settled
    for run_dir in run_dirs(copy):
        raw = (run_dir / "done.json").read_bytes()
        assert record(copy)[run_dir.name]["sha256"] == sha256_hex(raw)
    monkeypatch.setattr(verified, "SETTLED_NS", 0)
    assert normexp("verify", copy, "--fix").exit_code == 0  # a writer: records the stamps now
    assert all(len(entry["stamps"]) == len(verified.STAMPED_FILES) for entry in record(copy).values())


def test_an_unchanged_run_is_not_read_again_and_reads_the_same(out, pristine, monkeypatch):
    expected = to_markdown(build_report(pristine / "out"))
    seen = reads(monkeypatch)
    assert to_markdown(build_report(out)) == expected
    assert seen == []  # every run's stamps held: no file of a run read to verify it
    assert load_summary(out).equals(load_summary(pristine / "out"))


def test_readers_write_nothing_and_a_folder_without_a_record_reads_the_same(out, pristine):
    (out / VERIFIED_FILE).unlink()
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    assert to_markdown(build_report(out)) == to_markdown(build_report(pristine / "out"))
    assert normexp("report", out).exit_code == 0 and normexp("verify", out).exit_code == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before and not (out / VERIFIED_FILE).exists()


# the damage a run can take after it was recorded; each leaves the file the same size where it can
DAMAGE = {
    "metrics digit": lambda d: _replace(d / "metrics.csv", "0.", "1.", count=1),
    "metrics cut": lambda d: (d / "metrics.csv").write_text((d / "metrics.csv").read_text()[:30]),
    "metrics deleted": lambda d: (d / "metrics.csv").unlink(),
    "done number": lambda d: _replace(d / "done.json", '"threads": 1', '"threads": 2'),
    "done deleted": lambda d: (d / "done.json").unlink(),
    "config digit": lambda d: _replace(d / "config.yaml", "depth: 2", "depth: 3"),
    "metrics digit, mtime put back": lambda d: _keeping_mtime(d / "metrics.csv", "0.", "1."),
    "folder replaced by a copy of another run": lambda d: _swapped(d),
}


def _replace(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, count))


def _keeping_mtime(path: Path, old: str, new: str) -> None:
    """A change whose writer restores the file's mtime (as `touch -d` or a copy tool would): its ctime moves."""
    stat = path.stat()
    _replace(path, old, new)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns


def _swapped(run_dir: Path) -> None:
    other = next(p for p in run_dirs(run_dir.parent) if p != run_dir)
    for name in ("config.yaml", "metrics.csv", "done.json"):
        (run_dir / name).write_bytes((other / name).read_bytes())


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_run_changed_after_it_was_recorded_is_checked_again_and_never_counted(out, damage):
    victim = run_dirs(out)[1]
    DAMAGE[damage](victim)
    summary = load_summary(out).set_index("run_id")
    assert summary.loc[victim.name, "status"] in ("corrupt", "pending"), summary.loc[victim.name, "error"]
    assert (summary["status"] == "completed").sum() == RUNS - 1
    tidy = load_metrics(out)
    assert victim.name not in set(tidy["run_id"])
    assert f"1 run missing, failed or corrupt, not counted: {victim.name}" in build_report(out).missing
    result = normexp("report", out)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert not verify_sweep(out).clean


def test_a_run_touched_but_unchanged_is_read_again_and_still_counts(out, monkeypatch):
    victim = run_dirs(out)[2]
    (victim / "metrics.csv").write_bytes((victim / "metrics.csv").read_bytes())  # same bytes, a new ctime
    seen = reads(monkeypatch)
    assert (load_summary(out)["status"] == "completed").sum() == RUNS
    assert seen == ["config.yaml", "metrics.csv"]  # that run's files, read and hashed; none parsed again


def test_what_a_stamp_cannot_see_verify_does(out, monkeypatch):
    """Bytes changed under the file system (a failing disk) keep every stamp: readers trusting stamps
    would count the run, as documented; `normexp verify` reads every byte and finds it."""
    victim = run_dirs(out)[3]
    stamps = record(out)[victim.name]["stamps"]
    _replace(victim / "metrics.csv", "0.", "1.")
    real = verified.file_stamps
    monkeypatch.setattr(verified, "file_stamps",  # as if the file system had not seen the change
                        lambda run_dir, like=None: stamps if run_dir == victim else real(run_dir, like))
    assert (load_summary(out)["status"] == "completed").sum() == RUNS  # the limit of a stamp
    found = verify_sweep(out)
    assert not found.clean and any(f.path == victim.name and "metrics.csv" in f.problem for f in found.findings)


def test_a_stamp_taken_as_its_file_changed_is_not_recorded(pristine, tmp_path):
    """A file changed within SETTLED_NS of its stamp could change again in the same clock tick, unseen: such a
    run keeps no stamps, and is read (its files hashed) by the next command."""
    _, copy = fresh_copy(pristine, tmp_path)
    victim = run_dirs(copy)[0]
    (victim / "metrics.csv").write_bytes((victim / "metrics.csv").read_bytes())
    assert normexp("verify", copy, "--fix").exit_code == 0
    assert "stamps" not in record(copy)[victim.name]
    _replace(victim / "metrics.csv", "0.", "1.")  # at once: possibly in the same tick
    assert load_summary(copy).set_index("run_id").loc[victim.name, "status"] == "corrupt"


@pytest.mark.parametrize("damage", ["garbled", "checksum", "other checks", "forged entry"])
def test_a_damaged_or_foreign_record_is_set_aside(out, pristine, damage):
    path = out / VERIFIED_FILE
    first, _, body = path.read_text().partition("\n")
    if damage == "garbled":
        path.write_text(first + "\n" + body[:len(body) // 2])
    elif damage == "checksum":  # a record edited by hand: its checksum line no longer holds
        path.write_text(first + "\n" + body.replace('"completed"', '"diverged"', 1))
    elif damage == "other checks":  # written by another normexp: its verdicts are not these checks'
        data = json.loads(body)
        text = json.dumps({**data, "checks": "0" * 64}) + "\n"
        path.write_text(f"{verified.VERIFIED_CHECKSUM}{sha256_hex(text.encode())}\n{text}")
    else:  # an entry that names another done.json than the run's: the run is checked in full
        data = json.loads(body)
        victim = run_dirs(out)[4]
        data["runs"][victim.name]["sha256"] = "0" * 64
        data["runs"][victim.name].pop("stamps")
        text = json.dumps(data) + "\n"
        path.write_text(f"{verified.VERIFIED_CHECKSUM}{sha256_hex(text.encode())}\n{text}")
        _replace(victim / "metrics.csv", "0.", "1.")
    summary = load_summary(out).set_index("run_id")
    if damage == "forged entry":
        assert summary.loc[run_dirs(out)[4].name, "status"] == "corrupt"
    else:
        assert summary.equals(load_summary(pristine / "out").set_index("run_id"))


def test_a_file_of_the_users_under_the_records_name_is_left_alone(out, pristine, tmp_path):
    config, _ = fresh_copy(pristine, tmp_path / "again")
    (out / VERIFIED_FILE).write_text("my notes\n")
    assert normexp("verify", out, "--fix").exit_code == 0
    assert normexp("sweep", config, "--out", out, "-q").exit_code == 0
    assert (out / VERIFIED_FILE).read_text() == "my notes\n"
    assert (load_summary(out)["status"] == "completed").sum() == RUNS


def test_a_resumed_sweep_records_the_runs_it_adds(out, pristine, tmp_path):
    config, _ = fresh_copy(pristine, tmp_path / "again")
    result = normexp("sweep", config, "--out", out, "--set", "seeds=0,1,2", "-q")
    assert result.exit_code == 0, result.output
    runs = record(out)
    assert len(runs) == RUNS + RUNS // 2 and set(runs) == {p.name for p in run_dirs(out)}
    assert (load_summary(out)["status"] == "completed").sum() == RUNS + RUNS // 2
    victim = max(run_dirs(out), key=lambda p: p.stat().st_mtime_ns)  # one of the new runs
    DAMAGE["metrics digit"](victim)
    assert load_summary(out).set_index("run_id").loc[victim.name, "status"] == "corrupt"


def test_a_run_redone_after_damage_is_recorded_again(out, pristine, tmp_path):
    config, _ = fresh_copy(pristine, tmp_path / "again")
    victim = run_dirs(out)[5]
    DAMAGE["metrics cut"](victim)
    assert normexp("sweep", config, "--out", out, "-q").exit_code == 0
    raw = (victim / "done.json").read_bytes()
    assert record(out)[victim.name]["sha256"] == sha256_hex(raw)
    assert inspect_run(victim).finished and verify_sweep(out).clean


PACKAGE = Path(verified.__file__).resolve().parents[1]  # normexp/


def _sources_imported(paths: list[Path]) -> set[Path]:
    """The source files of normexp that `paths` import, directly or through others (ast: lazy imports too)."""
    seen: set[Path] = set()
    todo = list(paths)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module, *(f"{node.module}.{a.name}" for a in node.names)] \
                if isinstance(node, ast.ImportFrom) and node.module else []
            for name in (n for n in names if n.split(".")[0] == "normexp"):
                where = PACKAGE.parent.joinpath(*name.split("."))
                todo += [p for p in (where.with_suffix(".py"), where / "__init__.py") if p.is_file()]
    return seen


def test_checks_version_hashes_every_file_that_decides_a_verdict():
    """A change to the code that decides whether a run is trusted sets every folder's record aside: what
    `checks_version` hashes holds every file of folder/ and every module of normexp that the checks import,
    directly or not (normexp/__init__.py enters as its version)."""
    hashed = set(verified.trusted_sources(PACKAGE))
    assert set((PACKAGE / "folder").glob("*.py")) <= hashed
    deciding = _sources_imported([PACKAGE / "folder" / "inspect.py", PACKAGE / "folder" / "verified.py"])
    assert {PACKAGE / "folder" / "ids.py", PACKAGE / "folder" / "layout.py", PACKAGE / "registry.py",
            PACKAGE / "config" / "schema.py"} <= deciding  # what the closure must find, or it finds nothing
    assert deciding - {PACKAGE / "__init__.py"} <= hashed


def test_an_edit_to_any_file_it_hashes_changes_checks_version(tmp_path):
    copy = tmp_path / "normexp"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert verified.checks_digest(copy) == verified.checks_version()
    for path in verified.trusted_sources(copy):
        before, text = verified.checks_digest(copy), path.read_bytes()
        path.write_bytes(text + b"# edited\n")
        assert verified.checks_digest(copy) != before, path.relative_to(copy)
        path.write_bytes(text)


def test_checks_version_is_hashed_once_per_process_until_reset(tmp_path, monkeypatch):
    """A process hashes the checks' sources once; `reset` forgets it, as a fresh process starts, and the next
    call reads the files as they are then (normexp.__file__ pointed at a copy that is edited)."""
    import normexp

    copy = tmp_path / "normexp"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(normexp, "__file__", str(copy / "__init__.py"))
    verified.reset()
    before = verified.checks_version()
    with open(copy / "folder" / "inspect.py", "a") as f:
        f.write("# edited\n")
    assert verified.checks_version() == before
    verified.reset()
    assert verified.checks_version() == verified.checks_digest(copy) != before
