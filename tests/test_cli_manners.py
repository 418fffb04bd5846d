"""The command line's manners (issue 49): --version, -h, shell completion, hints for the names and
argument shapes other tools taught their users."""

from __future__ import annotations

from typer.testing import CliRunner

import normexp
from normexp.cli import app

runner = CliRunner()


def normexp_cli(*args: str, **kwargs):
    return runner.invoke(app, [str(a) for a in args], **kwargs)


def test_version_prints_normexps_version():
    for flag in ("--version", "-V"):
        result = normexp_cli(flag)
        assert result.exit_code == 0 and result.stdout.strip() == f"normexp {normexp.__version__}"


def test_h_is_help_on_every_command():
    for args in ([], ["sweep"], ["report"], ["plot"], ["verify"], ["norms", "props"], ["studies"]):
        short, long = normexp_cli(*args, "-h"), normexp_cli(*args, "--help")
        assert short.exit_code == 0 and short.stdout == long.stdout and "Usage:" in short.stdout


def test_show_completion_prints_a_bash_script():
    result = runner.invoke(app, ["--show-completion", "bash"], prog_name="normexp")
    assert result.exit_code == 0 and "_NORMEXP_COMPLETE" in result.stdout and "complete " in result.stdout
