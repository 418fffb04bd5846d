"""The `normexp` command line: the Typer app, with the commands of normexp/commands/ registered on it
(one module per group; normexp/commands/console.py says what the exit codes mean), and `main`, which
runs it.

torch and pandas are imported inside the commands that need them, so `normexp --help` stays instant.
"""

from __future__ import annotations

import contextlib
import errno
import sys

import typer

from normexp import output
from normexp.commands import read, sweep, tools
from normexp.commands.console import Exit, OverridingCommand, SectionedCommand, fail

app = typer.Typer(
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},  # every command's, inherited
    rich_markup_mode=None,
    pretty_exceptions_show_locals=False,
    help="Where and which normalization makes a deep residual network trainable without warmup.",
)
# registered in the order `normexp --help` lists them
app.command(cls=SectionedCommand)(sweep.sweep)  # --help in sections; key=value hinted
app.command()(read.report)
app.command()(read.plot)
app.command()(read.verify)
app.command(cls=OverridingCommand)(tools.gradnorm)
app.command()(tools.studies)
app.command(cls=OverridingCommand)(sweep.validate)
app.command()(read.export)
app.command()(read.merge)
app.command()(tools.doctor)
app.add_typer(tools.norms_app, name="norms")


def _print_version(value: bool) -> None:
    if value:
        from normexp import __version__

        typer.echo(f"normexp {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_print_version,
                                 help="Print normexp's version and exit."),
) -> None:
    """Where and which normalization makes a deep residual network trainable without warmup."""


def main(args: list[str] | None = None, prog_name: str | None = None) -> None:
    """Run the command line, sys.argv or `args` (normexp/__main__.py calls this once its Ctrl-C handler
    is in place). Output that cannot be written ends it as normexp/commands/console.py says; the last of
    it is flushed here, while that can still be said."""
    output.guard_streams()
    try:
        app(args=args, prog_name=prog_name)
    except output.OutputLost:
        pass  # the command ends here; said below
    finally:
        _exit_if_output_lost()


def _exit_if_output_lost() -> None:
    """Flush standard output; if it could not be written (now or before) and no command said so, end
    with one `error:` line and exit 2, or silently with 1 for a reader that closed its pipe on purpose
    (`| head`), as before."""
    with contextlib.suppress(output.OutputLost):
        if sys.stdout is not None:
            sys.stdout.flush()
    lost = output.take_loss(sys.stdout)
    if lost is None:
        return
    if lost.errno == errno.EPIPE:
        sys.exit(Exit.FAILED)
    fail(f"cannot write the output: {lost.strerror or lost}")
    sys.exit(Exit.USAGE)
