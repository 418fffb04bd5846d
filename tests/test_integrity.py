"""A finished run is verified, not trusted: checksums in done.json, corrupt runs redone, readers that
never count a missing or corrupt run, `normexp verify`, and --force that swaps a run folder in whole."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fresh_copy, trained_sweep
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from normexp import folder
from normexp.cli import app
from normexp.config import build_sweep, parse_yaml
from normexp.folder import FinishedRun, inspect_run, run_id, write_run, write_summary
from normexp.report import build_pivot, build_report, pivot_to_markdown, to_markdown
from normexp.results import ResultsError, load_metrics, load_summary
from normexp.verify import verify_sweep

runner = CliRunner()

SWEEP = """\
name: integrity
base: {model: {depth: 2, width: 8}, train: {steps: 3, threads: 1}}
grid: {norm.placement: [post, pre], optim.lr: [0.01, 0.02]}
seeds: [0, 1]
"""
RUNS = 8


def normexp(*args: object):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A small sweep, trained once; tests damage copies of it."""
    return trained_sweep(tmp_path_factory, "pristine", SWEEP, "-q").parent


@pytest.fixture
def sweep_dir(pristine, tmp_path) -> tuple[Path, Path]:
    """(config, out): a fresh copy of the pristine sweep."""
    return fresh_copy(pristine, tmp_path)


def run_dirs(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.is_dir())


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def make_legacy(run_dir: Path) -> None:
    """Rewrite a run's done.json as release 0.1 wrote it: no checksums."""
    done = json.loads((run_dir / "done.json").read_text())
    for key in ("files", "checksum"):
        done.pop(key)
    (run_dir / "done.json").write_text(json.dumps(done, indent=2, allow_nan=True) + "\n")


def edit_done(run_dir: Path, **fields) -> None:
    done = json.loads((run_dir / "done.json").read_text())
    (run_dir / "done.json").write_text(json.dumps({**done, **fields}, indent=2) + "\n")


# ----------------------------------------------------------------------------- what done.json vouches for


def test_done_json_vouches_for_the_bytes_on_disk(sweep_dir):
    _, out = sweep_dir
    for run_dir in run_dirs(out):
        done = json.loads((run_dir / "done.json").read_text())
        for name in ("config.yaml", "metrics.csv"):
            data = (run_dir / name).read_bytes()
            assert done["files"][name]["sha256"] == hashlib.sha256(data).hexdigest()
        assert done["files"]["metrics.csv"]["rows"] == 4  # steps 0..3
        assert done["files"]["config.yaml"]["rows"] == (run_dir / "config.yaml").read_text().count("\n")
        assert inspect_run(run_dir).kind == "finished"


# ----------------------------------------------------------------------------- damage, resume and readers

DAMAGE = {
    "metrics truncated": lambda d: (d / "metrics.csv").write_text((d / "metrics.csv").read_text()[:40]),
    "metrics deleted": lambda d: (d / "metrics.csv").unlink(),
    "metrics header LOSS": lambda d: (d / "metrics.csv").write_text(
        (d / "metrics.csv").read_text().replace("loss", "LOSS", 1)),
    "metrics one extra row": lambda d: (d / "metrics.csv").write_text(
        (d / "metrics.csv").read_text() + "4,0.5,0.5,0.01,1.0\n"),
    "done cut to its hash": lambda d: (d / "done.json").write_text(
        json.dumps({"config_hash": json.loads((d / "done.json").read_text())["config_hash"]})),
    "done status weird": lambda d: edit_done(d, status="weird"),
    "done final_loss oops": lambda d: edit_done(d, final_loss="oops"),
    "done final_loss edited": lambda d: edit_done(d, final_loss=0.001),
    "config deleted": lambda d: (d / "config.yaml").unlink(),
    "config garbled": lambda d: (d / "config.yaml").write_text("model: {depth: [\n"),
    "config edited": lambda d: (d / "config.yaml").write_text(
        (d / "config.yaml").read_text().replace("lr: 0.0", "lr: 0.5")),
}


@pytest.mark.parametrize("legacy", [False, True], ids=["stamped", "release-0.1"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_run_is_not_finished_and_is_named(sweep_dir, damage, legacy):
    _, out = sweep_dir
    victim = run_dirs(out)[1]
    if legacy:
        make_legacy(victim)
    DAMAGE[damage](victim)
    assert not inspect_run(victim).finished
    summary = load_summary(out).set_index("run_id")
    assert summary.loc[victim.name, "status"] in ("corrupt", "pending")
    assert (summary["status"] == "completed").sum() == RUNS - 1
    tidy = load_metrics(out)
    assert victim.name not in set(tidy["run_id"]) and tidy.attrs["unfinished"] == {
        victim.name: summary.loc[victim.name, "status"]}
    report = build_report(out)
    assert f"1 run missing, failed or corrupt, not counted: {victim.name}" in report.missing
    assert report.missing in to_markdown(report)
    pivot = build_pivot(out, "optim.lr", "norm.placement")
    assert victim.name in pivot_to_markdown(pivot)
    assert sum(int(n.sum().sum()) for _, _, _, n, _ in pivot.panels) == RUNS - 1


@pytest.mark.parametrize("damage", ["metrics truncated", "metrics deleted", "done status weird",
                                    "done final_loss oops", "config garbled"])
def test_resume_redoes_a_corrupt_run_and_says_so(sweep_dir, pristine, damage):
    config, out = sweep_dir
    victim = run_dirs(out)[2]
    DAMAGE[damage](victim)
    result = normexp("sweep", config, "--out", out)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert f"{victim.name} corrupt, redone" in said
    assert f"1 ran, {RUNS - 1} already done, 0 failed, 1 found corrupt and redone" in said
    assert snapshot(victim) .keys() == snapshot(pristine / "out" / victim.name).keys()
    assert (victim / "metrics.csv").read_bytes() == (pristine / "out" / victim.name / "metrics.csv").read_bytes()
    assert normexp("verify", out).exit_code == 0


def test_report_pivot_and_plot_survive_damage_without_tracebacks(sweep_dir, tmp_path):
    _, out = sweep_dir
    first, second = run_dirs(out)[:2]
    edit_done(first, final_loss="oops")
    shutil.rmtree(second)
    for args in (["report", out], ["report", out, "--pivot", "optim.lr,norm.placement"],
                 ["plot", out, "-o", tmp_path / "p.png"]):
        result = normexp(*args)  # what exists is printed; the exit code says runs are missing
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert "2 runs missing, failed or corrupt" in result.output and "normexp verify" in result.output


@pytest.mark.parametrize("summary_text", ["garbage\x00,,\n\"unclosed", "", None])
def test_summary_csv_is_a_cache_not_a_source(sweep_dir, pristine, summary_text):
    """Readers rebuild the summary from the verified folders: an edited, garbage or deleted summary.csv
    changes no number, and the table and the pivot agree."""
    _, out = sweep_dir
    clean_report, clean_pivot = to_markdown(build_report(pristine / "out")), build_pivot(
        pristine / "out", "optim.lr", "norm.placement")
    if summary_text is None:
        (out / "summary.csv").unlink()
    else:
        (out / "summary.csv").write_text(summary_text)
    assert to_markdown(build_report(out)) == to_markdown(build_report(pristine / "out"))
    assert pivot_to_markdown(build_pivot(out, "optim.lr", "norm.placement")) == pivot_to_markdown(clean_pivot)
    assert clean_report == to_markdown(build_report(out))


def test_an_edited_summary_changes_nothing(sweep_dir, pristine):
    _, out = sweep_dir
    lines = (out / "summary.csv").read_text().splitlines()
    header = lines[0].split(",")
    cells = lines[1].split(",")
    cells[header.index("final_loss")] = "0.0001"
    (out / "summary.csv").write_text("\n".join([lines[0], ",".join(cells), *lines[2:]]) + "\n")
    assert load_summary(out).equals(load_summary(pristine / "out"))
    assert pivot_to_markdown(build_pivot(out, "optim.lr", "norm.placement")) == pivot_to_markdown(
        build_pivot(pristine / "out", "optim.lr", "norm.placement"))


def test_interrupted_status_survives_the_rebuild(sweep_dir):
    _, out = sweep_dir
    victim = run_dirs(out)[0]
    shutil.rmtree(victim)
    sweep = build_sweep(parse_yaml(SWEEP))
    write_summary(out, sweep.runs, {victim.name: "interrupted"})
    assert load_summary(out).set_index("run_id").loc[victim.name, "status"] == "interrupted"


def test_no_finished_run_names_the_missing_ones(sweep_dir):
    _, out = sweep_dir
    for run_dir in run_dirs(out):
        (run_dir / "metrics.csv").write_text("step,loss\n")
    with pytest.raises(ResultsError, match=f"no finished runs yet; {RUNS} runs missing, failed or corrupt"):
        load_metrics(out)
    result = normexp("report", out)
    assert result.exit_code == 2 and "Traceback" not in result.output


# ----------------------------------------------------------------------------- release 0.1 folders


def test_an_upgrade_retrains_nothing_intact_and_stamps_it(sweep_dir, pristine):
    config, out = sweep_dir
    dirs = run_dirs(out)
    for run_dir in dirs:
        make_legacy(run_dir)
    DAMAGE["metrics one extra row"](dirs[0])  # a 0.1 run that does not hold up is redone
    metrics = {d.name: (d / "metrics.csv").read_bytes() for d in dirs[1:]}
    assert [inspect_run(d).kind for d in dirs[1:]] == ["unstamped"] * (RUNS - 1)
    result = normexp("sweep", config, "--out", out)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert (f"1 ran, {RUNS - 1} already done, 0 failed, 1 found corrupt and redone, {RUNS - 1} of an earlier "
            "release verified and stamped") in said
    assert {d.name: (d / "metrics.csv").read_bytes() for d in dirs[1:]} == metrics  # not retrained
    assert all(inspect_run(d).kind == "finished" for d in dirs)
    assert snapshot(out / dirs[0].name)["metrics.csv"] == snapshot(pristine / "out" / dirs[0].name)["metrics.csv"]
    assert "0 ran" in normexp("sweep", config, "--out", out).output


# ----------------------------------------------------------------------------- normexp verify


def test_verify_a_clean_folder(sweep_dir):
    _, out = sweep_dir
    before = snapshot(out)
    result = normexp("verify", out)
    assert result.exit_code == 0, result.output
    assert f"{RUNS} of {RUNS} runs verified" in " ".join(result.output.split()) and "clean" in result.output
    assert snapshot(out) == before


def test_verify_names_an_earlier_releases_summary_as_older_not_as_wrong(sweep_dir):
    """summary.csv without the columns added since (threshold, trained, a new config key) but agreeing on
    the rest is an earlier release's, said so; one cell edited besides is a mismatch."""
    import csv
    import io

    _, out = sweep_dir
    rows = list(csv.DictReader(io.StringIO((out / "summary.csv").read_text())))
    dropped = ["threshold", "trained", "model.qk_norm"]
    kept = [column for column in rows[0] if column not in dropped]

    def write(rows: list[dict]) -> None:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=kept, lineterminator="\n", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        (out / "summary.csv").write_text(buffer.getvalue())

    write(rows)
    [finding] = verify_sweep(out).findings
    assert finding.severity == "note" and finding.problem.startswith("written by an earlier normexp")
    assert all(column in finding.problem for column in dropped), finding.problem
    assert normexp("verify", out).exit_code == 0
    write([{**rows[0], "final_loss": "0.0001"}, *rows[1:]])
    [finding] = verify_sweep(out).findings
    assert finding.severity == "problem" and finding.problem == "does not match the run folders"
    assert normexp("verify", out, "--fix").exit_code == 0 and not verify_sweep(out).findings


@pytest.mark.parametrize("target", ["empty", "file", "nowhere", "garbled"])
def test_verify_refuses_a_folder_that_is_not_a_sweep(tmp_path, sweep_dir, target):
    path = {"empty": tmp_path / "empty", "file": tmp_path / "f.txt", "nowhere": tmp_path / "nope",
            "garbled": sweep_dir[1]}[target]
    if target == "empty":
        path.mkdir()
    elif target == "file":
        path.write_text("x")
    elif target == "garbled":
        (path / "sweep.yaml").write_text("name: [\n")
    result = normexp("verify", path)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "sweep.yaml" in result.output and len(result.output.strip().splitlines()) <= 3


def test_verify_finds_everything_and_changes_nothing_without_fix(sweep_dir, pristine, tmp_path):
    config, out = sweep_dir
    dirs = run_dirs(out)
    DAMAGE["metrics truncated"](dirs[0])
    shutil.rmtree(dirs[1])
    make_legacy(dirs[2])
    (dirs[3] / "done.json").unlink()  # unfinished
    (out / ".summary.csv.tmp-4242").write_text("half")
    (dirs[4] / ".metrics.csv.tmp-4242").write_text("half")
    shutil.copytree(dirs[5], out / f".{dirs[5].name}.tmp-77")  # a run folder being built
    other = normexp("sweep", config, "--out", tmp_path / "other", "--set", "optim.lr=0.03", "-q")
    assert other.exit_code == 0
    foreign = run_dirs(tmp_path / "other")
    shutil.copytree(foreign[0], out / foreign[0].name)  # a verified run of another grid: the folder's now
    shutil.copytree(foreign[1], out / foreign[1].name)
    DAMAGE["metrics deleted"](out / foreign[1].name)  # and a broken one
    shutil.copytree(dirs[6], out / "post-layernorm-s9-0123456789")  # a run under another run's id
    before = snapshot(out)

    found = verify_sweep(out)
    assert not found.clean and found.verified == RUNS - 4 + 1 and found.runs == RUNS + 1
    problems = {f.path: f.problem for f in found.findings}
    assert problems == {
        ".summary.csv.tmp-4242": "left by a killed writer",
        f"{dirs[4].name}/.metrics.csv.tmp-4242": "left by a killed writer",
        f".{dirs[5].name}.tmp-77": "left by a killed writer",
        dirs[0].name: "corrupt: metrics.csv: 0 rows, done.json vouches for 4",
        dirs[1].name: "missing",
        dirs[2].name: "no checksums (written by release 0.1); re-read and consistent",
        dirs[3].name: "unfinished: no done.json",
        foreign[1].name: "a run folder of no run of this sweep, corrupt: metrics.csv: missing",
        "post-layernorm-s9-0123456789": "a run folder of no run of this sweep, corrupt: done.json: run_id "
                                         f"'{dirs[6].name}' is not the folder's name",
        "summary.csv": "does not match the run folders",
    }
    result = normexp("verify", out)
    assert result.exit_code == 1 and "--fix" in result.output and "Traceback" not in result.output
    assert snapshot(out) == before  # nothing changed without --fix

    result = normexp("verify", out, "--fix")
    assert result.exit_code == 1  # runs are missing: the sweep must redo them
    assert "rerun the sweep" in result.output
    assert not folder.stray_paths(out)
    assert not (out / dirs[0].name).exists() and not (out / dirs[3].name).exists()
    assert inspect_run(dirs[2]).kind == "finished"  # stamped
    assert (out / foreign[0].name).exists() and not (out / foreign[1].name).exists()
    assert not (out / "post-layernorm-s9-0123456789").exists()
    summary = load_summary(out)
    assert (out / "summary.csv").read_text() == folder.summary_csv(
        out, folder.folder_runs(out, build_sweep(parse_yaml(SWEEP))))
    assert (summary["status"] == "completed").sum() == RUNS - 3 + 1  # the other grid's verified run counts

    resumed = normexp("sweep", config, "--out", out)
    assert resumed.exit_code == 0 and f"3 ran, {RUNS - 3} already done" in resumed.output
    after = normexp("verify", out)
    assert after.exit_code == 0, after.output
    assert verify_sweep(out).findings == []
    assert load_metrics(out, only_last=True).equals(load_metrics(pristine / "out"))
    assert foreign[0].name in set(load_metrics(out)["run_id"])


def test_verify_refuses_a_folder_a_sweep_is_writing(sweep_dir):
    _, out = sweep_dir
    with folder.SweepLock(out):
        for args in (["verify", out], ["verify", out, "--fix"]):
            result = normexp(*args)
            assert result.exit_code == 2 and "sweep is writing here" in result.output


# ----------------------------------------------------------------------------- what verify --fix may remove

# Folders a user may keep in a sweep folder, none of them named by a run id (`folder.ids.RUN_ID`): the run id's
# shape with one part off (case, hex digits, a seed's leading zero, a norm kind the config has not, a suffix).
USER_FOLDERS = ["my_analysis", "post-layernorm-s0-notahexid", "post-layernorm-s0-0123456789a",
                "post-layernorm-s0-012345678", "Post-layernorm-s0-0123456789", "post-layernorm-s01-0123456789",
                "post-layernorm-s0-0123456789.bak", "post-groupnorm-s0-0123456789", "post-layernorm-0-0123456789",
                "x-post-layernorm-s0-0123456789", "post-layernorm-s0-ABCDEF0123", "post--s0-0123456789"]


@pytest.mark.parametrize("run_file", ["config.yaml", "metrics.csv", "done.json", "failed.json"])
@pytest.mark.parametrize("name", USER_FOLDERS)
def test_verify_fix_leaves_a_folder_not_named_by_a_run_id_alone(sweep_dir, name, run_file):
    """A user's folder holding a file named like a run's (`my_analysis/config.yaml`) is not normexp's:
    verify names it in a note at most, and --fix never touches it."""
    _, out = sweep_dir
    folder = out / name
    folder.mkdir()
    (folder / run_file).write_text("{}\n" if run_file.endswith(".json") else "my: notes\n")
    (folder / "notes.txt").write_text("weeks of work")
    (folder / ".draft.tmp-12").write_text("a draft")
    before = snapshot(folder)
    found = verify_sweep(out)
    assert found.clean and all(f.severity == "note" for f in found.findings if f.path.startswith(name))
    result = normexp("verify", out, "--fix")
    assert result.exit_code == 0, result.output
    assert snapshot(folder) == before


def test_only_normexp_s_own_temporary_names_are_tidied(sweep_dir, tmp_path):
    """A killed writer leaves `.summary.csv.tmp-PID`, `.<run_id>.tmp-PID/`, `<run_id>/.done.json.tmp-PID`:
    those go. Whatever else is named `.NAME.tmp-N` (a user's draft, in a user's folder or in a run
    folder, a hidden user folder, a symbolic link) stays, and so does what a link points to."""
    _, out = sweep_dir
    rid = run_dirs(out)[0].name
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep")
    own = [out / ".summary.csv.tmp-4242", out / rid / ".done.json.tmp-4242", out / f".{rid}.tmp-77"]
    shutil.copytree(out / rid, own[2])  # a run folder being built: normexp's files (a user's go in at the swap)
    user = ["my_analysis/.draft.tmp-12", "my_analysis/.config.yaml.tmp-12", "my_analysis/.x.old-3/notes.txt",
            ".draft.tmp-12/notes.txt", ".notes.txt.tmp-5", f"{rid}/.notes.txt.tmp-5", f"{rid}/.draft.old-5/a.txt"]
    for path in user:
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text("mine")
    (out / f".{rid}.tmp-9").symlink_to(outside)
    (out / ".summary.csv.tmp-9").symlink_to(outside / "precious.txt")
    (out / "my_analysis" / "metrics.csv").write_text("step,loss\n")
    own[0].write_text("half")
    own[1].write_text("half")
    before = {path: (out / path).read_bytes() for path in user}
    assert sorted(folder.stray_paths(out)) == sorted(own)
    assert normexp("verify", out, "--fix").exit_code == 0
    folder.recover_strays(out)  # what a sweep does first
    assert not any(path.exists() for path in own)
    assert {path: (out / path).read_bytes() for path in user} == before
    assert (out / f".{rid}.tmp-9").is_symlink() and (out / ".summary.csv.tmp-9").is_symlink()
    assert (outside / "precious.txt").read_text() == "keep" and normexp("verify", out).exit_code == 0


@pytest.mark.parametrize("of_this_sweep", [False, True], ids=["another-id", "this-sweep-s-id"])
def test_verify_fix_never_removes_through_a_symlink_named_like_a_run_id(sweep_dir, tmp_path, of_this_sweep):
    """A symbolic link is never normexp's: whatever the link's name and whatever its target holds (a
    broken run), --fix leaves the link and its target as they are."""
    _, out = sweep_dir
    outside = tmp_path / "outside"
    if of_this_sweep:
        link = run_dirs(out)[0]
        shutil.move(link, outside)
        DAMAGE["metrics truncated"](outside)
    else:
        link = out / "post-layernorm-s7-abcdef0123"
        outside.mkdir()
        (outside / "config.yaml").write_text("model: {depth: [\n")
        (outside / "done.json").write_text("{}\n")
    (outside / "precious.txt").write_text("keep")
    link.symlink_to(outside)
    before = snapshot(outside)
    result = normexp("verify", out, "--fix")
    assert result.exit_code == (1 if of_this_sweep else 0), result.output  # the run is not verified: a problem
    assert link.is_symlink() and snapshot(outside) == before


def test_every_run_id_matches_the_run_id_pattern():
    """`folder.ids.RUN_ID` is what tells a run folder from a user's: every id `run_id` can make matches it."""
    from typing import get_args

    from pydantic import ValidationError

    from normexp.config import NormKind, Placement, RunConfig

    made = 0
    for placement in get_args(Placement):
        for kind in get_args(NormKind):
            assert folder.is_run_id(f"{placement}-{kind}-s0-0123456789")
            for seed in (0, 7, 2**63 - 1):
                try:
                    cfg = RunConfig.model_validate({"norm": {"placement": placement, "kind": kind}, "seed": seed})
                except ValidationError:
                    continue
                assert folder.is_run_id(run_id(cfg)) and folder.is_run_id(run_id(cfg, revised=False))
                made += 1
    assert made > 200
    assert not any(folder.is_run_id(name) for name in USER_FOLDERS)


# ----------------------------------------------------------------------------- random damage (property)

FAKE = """\
name: fake
base: {model: {depth: 2, width: 4}, train: {steps: 4}}
grid: {norm.placement: [post, pre]}
"""


@pytest.fixture(scope="module")
def fake_sweep(tmp_path_factory) -> Path:
    """Two finished runs written through the store (no training), one of them diverged."""
    out = tmp_path_factory.mktemp("fake") / "out"
    out.mkdir()
    sweep = build_sweep(parse_yaml(FAKE))
    (out / "sweep.yaml").write_text(sweep.to_yaml())
    for cfg, losses, status in zip(sweep.runs, ([2.3, 2.0, 1.5, 1.0, 0.5], [2.3, 9.0, float("nan")]),
                                   ("completed", "diverged")):
        n = len(losses)
        metrics = {"step": list(range(n)), "loss": losses, "acc": [0.125 * i for i in range(n)],
                   "lr": [0.01] * n, "grad_norm": [1.5] * n}
        write_run(out / run_id(cfg), cfg, FinishedRun(metrics, status, 0.25, 1, "reference", "cpu"))
    write_summary(out, sweep.runs)
    return out


def test_the_fake_sweep_verifies(fake_sweep):
    assert verify_sweep(fake_sweep).clean
    assert list(load_summary(fake_sweep)["status"]) == ["completed", "diverged"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), run=st.integers(0, 1), name=st.sampled_from(["config.yaml", "metrics.csv", "done.json"]),
       flip=st.booleans())
def test_any_truncation_or_byte_flip_of_a_run_file_is_detected(fake_sweep, tmp_path_factory, data, run, name, flip):
    out = tmp_path_factory.mktemp("damaged") / "out"
    shutil.copytree(fake_sweep, out)
    victim = run_dirs(out)[run]
    raw = bytearray((victim / name).read_bytes())
    at = data.draw(st.integers(0, len(raw) - 1), label="position")
    if flip:
        raw[at] ^= data.draw(st.integers(1, 255), label="xor mask")
    else:
        del raw[at:]
    (victim / name).write_bytes(bytes(raw))

    result = verify_sweep(out)
    assert not result.clean and victim.name in {f.path for f in result.findings}
    assert not inspect_run(victim).finished
    assert load_summary(out).set_index("run_id").loc[victim.name, "status"] not in ("completed", "diverged")


# ----------------------------------------------------------------------------- --force swaps folders in whole


def test_force_keeps_a_finished_result_if_the_rerun_fails(sweep_dir, monkeypatch):
    from normexp.engines import reference

    config, out = sweep_dir
    before = snapshot(out)
    real = reference.train_run
    monkeypatch.setattr(reference, "train_run", lambda cfg, **kw: (_ for _ in ()).throw(RuntimeError("boom")))
    result = normexp("sweep", config, "--out", out, "--force", "--engine", "reference")
    assert result.exit_code == 1 and "the earlier finished result is kept" in result.output
    kept = ("summary", "history")  # the summary is rebuilt, the history records the invocation
    assert {k: v for k, v in snapshot(out).items() if not k.startswith(kept)} == {
        k: v for k, v in before.items() if not k.startswith(kept)}
    monkeypatch.setattr(reference, "train_run", real)
    assert normexp("verify", out).exit_code == 0


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_crash_inside_the_swap_loses_no_result(sweep_dir, monkeypatch, exchange):
    """The new folder replaces the old in one step (then the old one is removed from its hidden name), or,
    where the file system cannot swap, the old one waits under a hidden name between two renames. A crash
    at either point leaves a finished run in place (or one the next sweep puts back), never none."""
    from normexp.config import load_run_config

    config, out = sweep_dir
    victim = run_dirs(out)[0]
    before = snapshot(victim)
    if not exchange:
        monkeypatch.setattr(folder.write, "_exchange", lambda a, b: False)
    real_replace, real_rmtree = folder.write.os.replace, folder.write.shutil.rmtree

    def replace(src, dst):
        if Path(src).name.startswith(f".{victim.name}.tmp-"):
            raise KeyboardInterrupt  # the process dies between the two renames
        real_replace(src, dst)

    def rmtree(path, *args, **kwargs):
        if Path(path).name.startswith(f".{victim.name}."):
            raise KeyboardInterrupt  # the process dies before the old folder is removed
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(folder.write.os, "replace", replace)
    monkeypatch.setattr(folder.write.shutil, "rmtree", rmtree)
    cfg = load_run_config(victim / "config.yaml")
    metrics = {"step": [0, 1, 2, 3], "loss": [1.0] * 4, "acc": [0.5] * 4, "lr": [0.01] * 4, "grad_norm": [1.0] * 4}
    with pytest.raises(KeyboardInterrupt):
        write_run(victim, cfg, FinishedRun(metrics, "completed", 0.1, 1, "reference", "cpu"))
    monkeypatch.undo()
    assert folder.stray_paths(out)
    assert inspect_run(victim).finished == exchange  # swapped: the new result; between renames: none yet
    result = normexp("sweep", config, "--out", out)
    assert result.exit_code == 0 and f"0 ran, {RUNS} already done" in result.output
    assert inspect_run(victim).finished and not folder.stray_paths(out)
    new = (victim / "metrics.csv").read_text().splitlines()[1].startswith("0,1.0,")
    assert new == exchange and (exchange or snapshot(victim) == before)


FORCE_STEPS = 120  # long enough that a reader's load, slow on a loaded machine, falls inside the rewrite
FORCE_SWEEP = f"""\
name: force
base: {{model: {{depth: 4, width: 16}}, train: {{steps: {FORCE_STEPS}, threads: 1}}}}
grid: {{norm.placement: [post, pre]}}
seeds: [0, 1, 2, 3, 4, 5]
"""


@pytest.mark.process
def test_readers_see_every_run_while_force_rewrites_them(tmp_path):
    """--force builds each run folder aside and swaps it in: a reader never finds a run missing or
    half-written, before, during or after."""
    config = tmp_path / "force.yaml"
    config.write_text(FORCE_SWEEP)
    out = tmp_path / "out"
    assert normexp("sweep", config, "--out", out, "-q", "--engine", "reference").exit_code == 0
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/done.json")}
    proc = subprocess.Popen([sys.executable, "-m", "normexp", "sweep", str(config), "--out", str(out), "--force",
                             "--engine", "reference", "-q"], stderr=subprocess.PIPE, text=True)
    reads = []
    while proc.poll() is None:
        tidy = load_metrics(out)
        reads.append(sum(p.stat().st_mtime_ns != stamps[p] for p in stamps if p.exists()))
        assert tidy["run_id"].nunique() == 12 and not tidy.attrs["unfinished"]
    assert proc.returncode == 0, proc.stderr.read()
    assert any(0 < n < 12 for n in reads)  # some reads came while runs were being replaced
    assert all(p.stat().st_mtime_ns != t for p, t in stamps.items())  # every run was redone
    assert len(load_metrics(out)) == 12 * (FORCE_STEPS + 1)


@pytest.mark.parametrize("cut", ["lines", "bytes", "edit"])
def test_a_damaged_sweep_yaml_is_refused_not_obeyed(sweep_dir, cut):
    """sweep.yaml cut at a line boundary is still a valid sweep with fewer axes or seeds: read as it
    stands it would silently drop finished runs from every table. Its checksum line refuses it."""
    _, out = sweep_dir
    path = out / "sweep.yaml"
    text = path.read_text()
    assert text.startswith(folder.sweepfiles.SWEEP_CHECKSUM)
    damaged = {"lines": "".join(text.splitlines(True)[:-8]), "bytes": text[:len(text) // 2],
               "edit": text.replace("0.02", "0.03")}[cut]
    assert damaged != text
    path.write_text(damaged)
    before = snapshot(out)
    for command in (["report", out], ["verify", out], ["verify", out, "--fix"], ["plot", out]):
        result = normexp(*command)
        assert result.exit_code == 2, (command, result.output)
        assert "sweep.yaml" in result.output and "Traceback" not in result.output
    assert snapshot(out) == before
    with pytest.raises(ResultsError, match="sweep.yaml"):
        load_summary(out)


def test_a_sweep_yaml_without_a_checksum_line_is_read_as_release_0_1_wrote_it(sweep_dir):
    _, out = sweep_dir
    path = out / "sweep.yaml"
    path.write_text(path.read_text().partition("\n")[2])
    result = normexp("report", out)
    assert result.exit_code == 0, result.output
    assert len(load_summary(out)) == RUNS


def test_a_folder_written_before_provenance_resumes_without_retraining(sweep_dir):
    """done.json records the commit, CPU and command line since this release; a checksummed done.json
    without them (the release before) stays verified, and a sweep over it retrains nothing."""
    config, out = sweep_dir
    for run_dir in run_dirs(out):
        done = json.loads((run_dir / "done.json").read_text())
        assert {"commit", "cpu", "torch_build", "command"} <= set(done.pop("provenance"))
        (run_dir / "done.json").write_text(folder.layout.encode_done(done))
        assert inspect_run(run_dir).kind == "finished"
    before = snapshot(out)
    result = normexp("sweep", config, "--out", out)
    assert result.exit_code == 0 and f"0 ran, {RUNS} already done" in result.output, result.output
    after = snapshot(out)
    assert {k: v for k, v in after.items() if k.endswith("done.json")} == \
        {k: v for k, v in before.items() if k.endswith("done.json")}
    assert normexp("verify", out).exit_code == 0


def test_a_run_of_an_earlier_invocation_deleted_or_damaged_is_missing_not_silently_gone(tmp_path):
    """history.jsonl records every invocation's grid: an earlier invocation's run that was deleted or
    damaged since is named missing or corrupt by report (exit 1), plot and verify, never dropped unsaid."""
    config = tmp_path / "lr.yaml"
    config.write_text("name: lr\nbase: {model: {depth: 2, width: 4}, train: {steps: 2}}\n"
                      "grid: {norm.placement: [post], optim.lr: [0.01, 0.001]}\nseeds: [0, 1]\n")
    out = tmp_path / "out"
    assert normexp("sweep", config, "--out", out, "-q").exit_code == 0
    assert normexp("sweep", config, "--set", "seeds=2", "--set", "norm.placement=pre", "--out", out,
                   "-q").exit_code == 0
    gone, damaged = sorted(out.glob("post-layernorm-s0-*"))
    shutil.rmtree(gone)
    (damaged / "metrics.csv").write_text("step,loss\n")
    shown = normexp("report", out)
    assert shown.exit_code == 1 and gone.name in shown.output and damaged.name in shown.output, shown.output
    assert "(0 of 2 seeds; 1 missing)" in shown.output
    assert normexp("plot", out, "-o", tmp_path / "p.png").exit_code == 1
    checked = normexp("verify", out)
    assert checked.exit_code != 0 and gone.name in checked.output and damaged.name in checked.output


@pytest.mark.parametrize("damage", ["not-utf8", "digit", "newline"])
def test_a_damaged_history_is_named_and_fails_report_and_verify(tmp_path, damage):
    """One damaged byte in history.jsonl silently dropped an earlier invocation's runs: its deleted run
    went uncounted, report exited 0 a cell short and verify --fix said clean. The damage is named, both
    exit 1, and the earlier invocation's runs that still verify are still reported."""
    config = tmp_path / "lr.yaml"
    config.write_text("name: lr\nbase: {model: {depth: 2, width: 4}, train: {steps: 2}}\n"
                      "grid: {norm.placement: [post], optim.lr: [0.01]}\nseeds: [0, 1]\n")
    out = tmp_path / "out"
    assert normexp("sweep", config, "--out", out, "-q").exit_code == 0
    assert normexp("sweep", config, "--set", "norm.placement=pre", "--out", out, "-q").exit_code == 0
    kept, gone = sorted(out.glob("post-layernorm-s*"))
    shutil.rmtree(gone)
    history = out / "history.jsonl"
    data = bytearray(history.read_bytes())
    first = data.index(b"\n")
    if damage == "not-utf8":
        data[first // 2] = 0xFF
    elif damage == "digit":  # still JSON, still a sweep: lr 0.01 -> 0.02 in the first line's resolved text
        at = data.index(b"0.01", 0, first)
        data[at + 3] = ord("2")
    else:
        data[first] = ord(" ")  # two lines run together
    history.write_bytes(bytes(data))
    shown = normexp("report", out)
    assert shown.exit_code == 1 and "history.jsonl: damaged (line 1" in " ".join(shown.output.split()), shown.output
    assert "Post" in shown.output  # the post run that still verifies is still reported
    for args in (("verify", out), ("verify", out, "--fix")):
        checked = normexp(*args)
        assert checked.exit_code == 1 and "history.jsonl" in checked.output, checked.output
    assert history.read_bytes() == bytes(data)  # evidence kept
    again = normexp("sweep", config, "--set", "norm.placement=pre", "--out", out, "-q")
    assert again.exit_code == 0 and history.read_bytes().startswith(bytes(data))
