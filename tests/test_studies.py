"""`normexp studies NAME...`: the named studies alone (every study by default), `--list` names them,
an unknown NAME is one error line naming the studies and exit 2, and so is an output folder they cannot
use; `python -m normexp.studies` is the same command."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from conftest import REPO
from typer.testing import CliRunner

from normexp import stopping
from normexp.cli import app

# every sweep file shipped for the studies is a study, and so is the article's table (configs/warmup.yaml)
# and `norms` (the RMSNorm facts and speed: no config)
SHIPPED = {"warmup", "norms", *(path.stem for path in (REPO / "configs" / "studies").glob("*.yaml"))}


@pytest.fixture
def studies():
    """Run `normexp studies ARGS...` in this process; the stop-signal handlers it installs are put back."""
    previous = {signum: signal.getsignal(signum) for signum in stopping.STOP_SIGNALS}
    yield lambda *args: CliRunner().invoke(app, ["studies", *map(str, args)])
    stopping.on_stop_signals(previous)


def test_list_names_every_shipped_study_with_a_line_on_each(studies, tmp_path):
    result = studies("--list", "--out", tmp_path / "runs")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert {line.split()[0] for line in lines} == SHIPPED and len(lines) == len(SHIPPED)
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines)  # a name, then what it asks
    assert lines[0].startswith("warmup ") and lines[-1].startswith("norms ")  # the order they run in
    assert not (tmp_path / "runs").exists()  # nothing ran
    named = studies("--list", "norms", "depth").stdout.splitlines()
    assert [line.split()[0] for line in named] == ["depth", "norms"]  # the running order, not the order given


def test_an_unknown_study_is_one_error_line_with_the_names_and_exit_2(studies, tmp_path):
    result = studies("depth", "nosuch", "--quick", "--out", tmp_path / "runs")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "'nosuch'" in result.stderr and all(name in result.stderr for name in SHIPPED), result.stderr
    assert "Traceback" not in result.output and not (tmp_path / "runs").exists()


def test_only_the_named_studies_run_and_have_their_folders_checked(studies, tmp_path, monkeypatch):
    """`normexp studies norms` runs that one study into a folder whose depth/ holds another sweep (the
    depth study, not named, is neither run nor checked), and REPORT.md holds its section alone;
    `normexp studies depth` refuses the same folder before anything trains, as the whole set would."""
    from normexp import diagnostics

    measure = diagnostics.norm_speed  # timed once each, nothing compiled: the section is what is checked
    monkeypatch.setattr(diagnostics, "norm_speed", lambda shapes, repeats: measure(shapes, 1, False))
    out = tmp_path / "runs"
    (out / "depth").mkdir(parents=True)
    (out / "depth" / "sweep.yaml").write_text("name: not-depth\nbase: {}\ngrid: {}\nseeds: [0]\n")
    result = studies("norms", "--quick", "--out", out)
    assert result.exit_code == 0, result.output
    report = (out / "REPORT.md").read_text()
    assert [line for line in report.splitlines() if line.startswith("## ")] == ["## norms"]
    assert "Written by `normexp studies norms --quick` (1 of the 12 studies)" in report
    assert sorted(p.name for p in out.iterdir()) == ["REPORT.html", "REPORT.md", "depth"]
    refused = studies("depth", "norms", "--quick", "--out", out)
    assert refused.exit_code == 2 and "holds sweep 'not-depth'" in refused.stderr, refused.output
    assert (out / "REPORT.md").read_text() == report  # refused before the first study ran


@pytest.mark.process
def test_python_dash_m_normexp_studies_is_the_same_command(tmp_path):
    """One command line: the module's --list, --help and usage errors are `normexp studies`' own."""
    for args, code in ((["--list", "depth"], 0), (["--help"], 0), (["nosuch"], 2), (["--no-such-option"], 2)):
        shim = subprocess.run([sys.executable, "-m", "normexp.studies", *args], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120)
        command = subprocess.run([sys.executable, "-m", "normexp", "studies", *args], capture_output=True,
                                 text=True, cwd=tmp_path, timeout=120)
        assert (shim.returncode, shim.stdout, shim.stderr) == (command.returncode, command.stdout, command.stderr)
        assert shim.returncode == code, shim.stderr
    assert "[NAME]..." in shim.stderr  # the usage line of the command with its NAME arguments


# ----------------------------------------------------------------------------- an output folder they cannot use


def _studies(out, monkeypatch, capsys) -> tuple[int, str]:
    """`normexp studies --quick --out OUT` (python -m normexp.studies: the same command), in this process on
    one core: exit code and stderr."""
    from normexp import stopping
    from normexp.studies import run

    monkeypatch.setattr(run, "usable_cores", lambda: 1)  # no worker pool: it fails before training
    previous = {signum: signal.getsignal(signum) for signum in stopping.STOP_SIGNALS}
    try:
        with pytest.raises(SystemExit) as caught:
            app(["studies", "--quick", "--out", str(out)], prog_name="normexp")
    finally:
        stopping.on_stop_signals(previous)
    return caught.value.code, capsys.readouterr().err


def test_the_studies_exit_2_on_an_output_folder_they_cannot_use(tmp_path, monkeypatch, capsys):
    """As `normexp sweep`: an --out that is a file or a symbolic link loop, a study folder that holds
    another sweep or one that another sweep is writing is one `error:` line and exit 2 (bad usage), not 1
    (a run failed)."""
    from normexp.folder import SweepLock

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    other = tmp_path / "other"
    (other / "depth").mkdir(parents=True)
    (other / "depth" / "sweep.yaml").write_text("name: not-depth\nbase: {}\ngrid: {}\nseeds: [0]\n")
    busy, late, loop, dangling = tmp_path / "busy", tmp_path / "late", tmp_path / "loop", tmp_path / "dangling"
    loop.symlink_to(loop)
    dangling.symlink_to(tmp_path / "nowhere")
    with SweepLock(busy / "warmup"), SweepLock(late / "blocks"):  # the first study's folder, and the last's
        for out, said in ((a_file, "is a file, not a folder"), (other, "holds sweep 'not-depth'"),
                          (busy, "another sweep is writing here"), (late, "another sweep is writing here"),
                          (loop, "a symbolic link loop"), (dangling, "which does not exist"), ("", "--out: empty")):
            code, stderr = _studies(out, monkeypatch, capsys)
            assert code == 2 and stderr.startswith("error: ") and said in stderr, (code, stderr)
            assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr
    assert a_file.read_text() == "" and not (other / "warmup").exists()
    assert sorted(p.name for p in (busy / "warmup").iterdir()) == [".lock"]
    assert sorted(p.name for p in late.iterdir()) == ["blocks"]  # refused before the first study trained
