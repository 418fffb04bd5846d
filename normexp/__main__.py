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
    # MKL may otherwise pick fewer threads than torch's count for a call, on its own judgement (Intel
    # lists this "dynamic" mode among its causes of run-to-run differences); the exact engines promise
    # the same bits for the same thread count. Read when MKL first runs; workers inherit it.
    os.environ.setdefault("MKL_DYNAMIC", "FALSE")
    from normexp.cli import main as run

    run()


if __name__ == "__main__":
    main()
