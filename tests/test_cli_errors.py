"""The command line misused: a malformed or empty option, an --out that is a file, a dangling link or a link
loop, a folder of another sweep, a step never recorded, a name too long to read. Each is one line naming
the option or path, printed as written (never read as Rich markup), exit 2, in bounded time, and nothing
is written."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import TINY
from typer.testing import CliRunner

from normexp.cli import app

runner = CliRunner()


@pytest.mark.process
@pytest.mark.parametrize("address", ["foo", "LOCAL", "local:abc", "local:", "local:1.5", "local:99999",
                                     "tcp://127.0.0.1:notaport", "tcp://:8786", "http://127.0.0.1:8786",
                                     "tcp://127.0.0.1:70000"])
def test_malformed_cluster_addresses_are_refused(write_yaml, tmp_path, address):
    out = tmp_path / "out"
    result = runner.invoke(app, ["sweep", str(write_yaml(TINY)), "--out", str(out), "--cluster", address])
    assert result.exit_code == 2 and "expected local, local:N" in result.output, result.output
    assert "Traceback" not in result.output and not out.exists()


@pytest.mark.process
@pytest.mark.parametrize("address", ["local:0", "local:-1"])
def test_a_cluster_of_no_workers_is_refused_at_once(write_yaml, tmp_path, address):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "normexp", "sweep", str(write_yaml(TINY)), "--out", str(out),
                           "--cluster", address], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "N must be a whole number from 1" in proc.stderr, proc.stderr
    assert not out.exists()  # the folder's lock was never taken


def test_empty_out_is_refused(write_yaml, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_yaml(TINY)
    for command in (["sweep"], ["gradnorm"]):
        result = runner.invoke(app, [*command, str(config), "--out", ""])
        assert result.exit_code == 2 and "--out: empty" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]


def test_a_dangling_symlink_as_out_is_named(write_yaml, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    result = runner.invoke(app, ["sweep", str(write_yaml(TINY)), "--out", str(link)])
    assert result.exit_code == 2 and "does not exist" in result.output and "File exists" not in result.output


def test_a_symlink_loop_is_called_a_loop(write_yaml, tmp_path):
    """ELOOP: a link that leads back to itself is no missing file; as CONFIG, as --out or on their way."""
    config = write_yaml(TINY)
    loop, dangling = tmp_path / "loop", tmp_path / "dangling"
    loop.symlink_to(loop)
    dangling.symlink_to(tmp_path / "gone")
    for args in (["validate", str(loop)], ["sweep", str(loop / "x.yaml")], ["sweep", str(config), "--out", str(loop)],
                 ["gradnorm", str(config), "--out", str(loop)], ["sweep", str(config), "--out", str(loop / "out")]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "a symbolic link loop (too many levels of symbolic links)" in result.output
        assert "does not exist" not in result.output and "Errno" not in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
    result = runner.invoke(app, ["validate", str(dangling)])  # a dangling link keeps its message
    assert result.exit_code == 2 and result.output == f"error: {dangling}: no such file\n", result.output
    result = runner.invoke(app, ["validate", str(tmp_path)])  # a folder: the reason, without errno's repr
    assert result.exit_code == 2 and result.output == f"error: {tmp_path}: cannot read: Is a directory\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "loop", "sweep.yaml"]


@pytest.mark.parametrize("command", ["sweep", "gradnorm"])
def test_a_file_as_out_is_refused(write_yaml, tmp_path, command):
    file = tmp_path / "file"
    file.write_text("keep me")
    result = runner.invoke(app, [command, str(write_yaml(TINY)), "--out", str(file)])
    assert result.exit_code == 2 and "is a file, not a folder" in result.output
    assert "Traceback" not in result.output and file.read_text() == "keep me"


def test_pivot_on_one_key_twice_is_refused(finished):
    result = runner.invoke(app, ["report", str(finished[1]), "--pivot", "norm.placement,norm.placement"])
    assert result.exit_code == 2 and "must differ" in result.output


def test_report_of_a_step_never_recorded_says_so(finished):
    result = runner.invoke(app, ["report", str(finished[1]), "--steps", "1,99"])
    assert result.exit_code == 2 and "--steps 99: not recorded" in result.output and "0 to 3" in result.output
    assert runner.invoke(app, ["report", str(finished[1]), "--steps", "1,3"]).exit_code == 0


def test_a_second_sweep_of_another_config_into_one_folder_is_refused(finished, write_yaml, tmp_path):
    config, out = finished
    other = write_yaml(TINY.replace("name: t", "name: other") + "seeds: [5]\n", "other.yaml")
    before = (out / "summary.csv").read_text(), (out / "sweep.yaml").read_text()
    result = runner.invoke(app, ["sweep", str(other), "--out", str(out)])
    assert result.exit_code == 2 and "holds sweep 't', not 'other'" in result.output and "--force" in result.output
    assert ((out / "summary.csv").read_text(), (out / "sweep.yaml").read_text()) == before
    assert runner.invoke(app, ["sweep", str(config), "--out", str(out), "-q"]).exit_code == 0  # resuming is fine
    extended = write_yaml(TINY + "grid: {norm.placement: [post, pre]}\nseeds: [0, 1, 2]\n", "more.yaml")
    assert runner.invoke(app, ["sweep", str(extended), "--out", str(out), "-q"]).exit_code == 0  # so is adding


def test_max_runs_must_be_at_least_one(write_yaml, tmp_path):
    result = runner.invoke(app, ["sweep", str(write_yaml(TINY)), "--out", str(tmp_path / "o"), "--max-runs", "0"])
    assert result.exit_code == 2 and "--max-runs" in result.output and not (tmp_path / "o").exists()


def test_max_runs_counts_distinct_runs(write_yaml, tmp_path):
    """Repeated grid values, and values of a key that a run does not use, make one run each."""
    config = write_yaml(TINY + "grid: {optim.lr: [0.01, 0.01, 0.010], norm.placement: [pre, post, mixln],"
                               " norm.mixln_fraction: [0.25, 0.5]}\n")
    result = runner.invoke(app, ["sweep", str(config), "--dry-run", "--max-runs", "4"])
    assert result.exit_code == 0 and "4 runs" in result.output, result.output
    result = runner.invoke(app, ["sweep", str(config), "--dry-run", "--max-runs", "3"])
    assert result.exit_code == 2 and "more than --max-runs 3 distinct runs (18 combinations)" in result.output


@pytest.mark.parametrize(("option", "shown"), [
    (["--cluster", "local:-1"], "--cluster local:-1: N must be"),  # ":-1:" is an emoji code to Rich
    (["--cluster", "[bold]x[/bold]"], "--cluster [bold]x[/bold]: expected"),  # markup to Rich
    (["--engine", ":smile:"], "--engine: must be one of auto, reference, batched, fast, got ':smile:'"),
])
def test_errors_print_user_text_literally(write_yaml, tmp_path, option, shown):
    result = runner.invoke(app, ["sweep", str(write_yaml(TINY)), "--out", str(tmp_path / "o"), *option])
    assert result.exit_code == 2 and shown in result.output, result.output


def test_a_path_in_brackets_prints_literally(tmp_path):
    folder = tmp_path / "[bold]runs"
    folder.mkdir()
    result = runner.invoke(app, ["report", str(folder)])
    assert result.exit_code == 2 and "[bold]runs" in result.output, result.output


@pytest.mark.parametrize(("args", "named"), [
    (["report", "{out}", "--steps", ""], "--steps"),
    (["report", "{out}", "--steps", "1,"], "--steps"),
    (["report", "{out}", "--by", ""], "--by"),
    (["report", "{out}", "--by", " , "], "--by"),
    (["report", ""], "RUN_DIR"),
    (["plot", " "], "RUN_DIR"),
    (["verify", ""], "DIR"),
])
def test_empty_options_are_refused_by_name(finished, args, named):
    result = runner.invoke(app, [arg.format(out=finished[1]) for arg in args])
    assert result.exit_code == 2 and named in result.output and "Traceback" not in result.output, result.output


@pytest.mark.parametrize("command", [["report"], ["report", "--lr-sensitivity"],
                                     ["report", "--pivot", "optim.lr,seed"], ["plot"]])
def test_a_folder_name_too_long_to_read_is_one_error_line(tmp_path, command):
    too_long = str(tmp_path / ("x" * 300))
    result = runner.invoke(app, [command[0], too_long, *command[1:]])
    assert result.exit_code == 2 and "cannot read: File name too long" in result.output, result.output
    assert "Traceback" not in result.output and "cannot write" not in result.output
