"""The `normexp` command: `python -m normexp`, and the console script pyproject.toml installs.

Only `os` and `signal` load before a Ctrl-C handler is in place: a Ctrl-C while the CLI's modules load
(typer, rich, pydantic: about a second) or while the command line is read ends the process at once,
with one line and exit code 130. Raised as KeyboardInterrupt inside an import it would print a
traceback, or be swallowed by code that catches too much. Commands that write install their own
handlers (`normexp sweep` stops cleanly and keeps finished runs).
"""

import os
import signal


def _interrupted(signum: int, frame: object) -> None:
    os.write(2, b"interrupted\n")
    os._exit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGINT, _interrupted)
    from normexp.cli import main as run

    run()


if __name__ == "__main__":
    main()
