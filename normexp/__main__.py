"""The `normexp` command: `python -m normexp`, and the console script pyproject.toml installs.

No file is read before a Ctrl-C handler is in place: `os`, `sys` and `_signal` (the interpreter's own
signal module, under `signal`) are loaded at its start-up, while importing `signal` would read a file,
a moment in which a Ctrl-C printed a traceback from this module. A Ctrl-C while the CLI's modules load
(typer, rich, pydantic: about a second) or while the command line is read ends the process at once,
with one line and exit code 130. Raised as KeyboardInterrupt inside an import it would print a
traceback, or be swallowed by code that catches too much. Commands that write install their own
handlers (`normexp sweep` stops cleanly and keeps finished runs).

The threading defaults of normexp's processes are set next, before anything loads torch
(`environment.set_thread_defaults`). A command that loaded torch ends without the interpreter's teardown
(`end_now`).
"""

import _signal
import os
import sys


def _interrupted(signum: int, frame: object) -> None:
    os.write(2, b"interrupted\n")
    os._exit(128 + signum)


def main(args: list[str] | None = None, prog_name: str | None = None) -> None:
    """Run the command line: sys.argv, or `args` under `prog_name` where another entry gives them
    (`python -m normexp.studies`: normexp/studies/__main__.py)."""
    _signal.signal(_signal.SIGINT, _interrupted)
    from normexp.environment import set_thread_defaults

    set_thread_defaults()
    from normexp.cli import main as run

    try:
        run(args, prog_name)
    except SystemExit as exc:
        if "torch" in sys.modules:
            end_now(exc.code)
        raise


def end_now(code: object) -> None:
    """Exit with `code` (as `sys.exit` takes it), skipping the interpreter's teardown once torch is
    loaded: about a second on a 2-core machine, for nothing (the cyclic collector walks every object
    torch made, then torch's operator registry unwinds). What teardown does that matters is done
    first: atexit handlers run and standard output is flushed. While another (non-daemon) thread
    still runs, or output cannot be flushed, the usual exit does both as usual."""
    import atexit
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.current_thread()):
        sys.exit(code)  # the interpreter waits for them
    status = code if isinstance(code, int) else 0 if code is None else 1
    if not isinstance(code, int | None) and sys.stderr is not None:
        print(code, file=sys.stderr)  # what sys.exit does with a message
    atexit._run_exitfuncs()  # noqa: SLF001 - what teardown runs first (CPython, every version since 3.0)
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:  # None: its descriptor was closed when the process started (`>&-`)
                stream.flush()
    except (OSError, ValueError):  # a closed pipe: the interpreter reports it, as always
        sys.exit(code)
    os._exit(status)


if __name__ == "__main__":
    main()
