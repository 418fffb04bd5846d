"""How the `normexp` process ends: once torch is loaded, without the interpreter's teardown (about a
second), yet with its exit code, its flushed output and its atexit handlers; otherwise as usual."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, SMALL_SWEEP

pytestmark = pytest.mark.process  # each test ends a Python process of its own

# A module-level object whose __del__ runs only in the interpreter's teardown.
TEARDOWN_WITNESS = ("class Witness:\n    def __del__(self):\n        print('teardown ran', flush=True)\n"
                    "witness = Witness()\n")
# Output buffered as a user's is: with PYTHONUNBUFFERED set (as some shells and CI images do) every print
# reaches the pipe at once, and a missing flush could not fail a test.
BUFFERED = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=BUFFERED)


@pytest.mark.parametrize(("code", "status", "stderr"), [(None, 0, ""), (0, 0, ""), (3, 3, ""), (130, 130, ""),
                                                        ("a message", 1, "a message\n")])
def test_end_now_exits_like_sys_exit_with_output_flushed_and_atexit_run(code, status, stderr):
    result = python("import atexit, sys, torch\nfrom normexp.__main__ import end_now\n"
                    f"{TEARDOWN_WITNESS}"
                    "atexit.register(lambda: print(' and atexit ran', end=''))\n"
                    f"print('buffered output', end='')\nend_now({code!r})\n")
    assert result.returncode == status
    assert result.stdout == "buffered output and atexit ran"  # flushed, handlers run, no teardown
    assert result.stderr == stderr


def test_end_now_waits_for_a_running_thread_as_the_interpreter_does():
    result = python("import threading, time, torch\nfrom normexp.__main__ import end_now\n"
                    "threading.Thread(target=lambda: (time.sleep(0.5), print('thread finished'))).start()\n"
                    "end_now(4)\n")
    assert (result.returncode, result.stdout) == (4, "thread finished\n")


@pytest.mark.parametrize(("imports", "teardown"), [("import torch", False), ("pass", True)])
def test_the_command_skips_teardown_only_once_torch_is_loaded(imports, teardown):
    """`normexp doctor` after torch was imported ends at once; `--help` (no torch) ends as usual."""
    command = "doctor" if imports != "pass" else "--help"
    result = python(f"{imports}\nimport sys\n{TEARDOWN_WITNESS}sys.argv = ['normexp', {command!r}]\n"
                    "from normexp.__main__ import main\nmain()\n")
    assert result.returncode == 0, result.stderr
    assert ("teardown ran" in result.stdout) == teardown
    assert ("torch build:" if command == "doctor" else "Usage:") in result.stdout  # the command's output, whole


ONE_RUN = "name: one\nbase:\n  model: {depth: 2, width: 4}\n  train: {steps: 2}\ngrid: {}\nseeds: [0]\n"


@pytest.mark.parametrize("closed", [1, 2])
def test_a_sweep_run_with_an_output_stream_closed_ends_as_before(tmp_path, closed):
    """`normexp sweep ... >&-` (or `2>&-`): Python starts with that stream as None; the sweep still
    ends with 0, its run written and the other stream whole, as it did before `end_now`."""
    (tmp_path / "one.yaml").write_text(ONE_RUN)
    result = subprocess.run([sys.executable, "-m", "normexp", "sweep", "one.yaml", "--out", "out"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120, env=BUFFERED,
                            preexec_fn=lambda: os.close(closed))
    shown = result.stderr if closed == 1 else result.stdout
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in shown
    assert closed == 1 or "1 ran, 0 already done, 0 failed" in shown
    assert closed == 2 or shown == ""
    assert (tmp_path / "out" / "summary.csv").is_file()


def test_end_now_with_stderr_closed_keeps_its_message_off_stdout():
    """sys.exit('a message') with no stderr drops the message; print(file=None) would write it to stdout."""
    result = subprocess.run([sys.executable, "-c", "import torch\nfrom normexp.__main__ import end_now\n"
                             "print('output', end='')\nend_now('a message')\n"],
                            capture_output=True, text=True, cwd=REPO, timeout=120, env=BUFFERED,
                            preexec_fn=lambda: os.close(2))
    assert (result.returncode, result.stdout) == (1, "output")


def test_doctor_with_stdout_closed_ends_with_0():
    result = subprocess.run([sys.executable, "-m", "normexp", "doctor"], capture_output=True, text=True, cwd=REPO,
                            timeout=120, env=BUFFERED, preexec_fn=lambda: os.close(1))
    assert (result.returncode, result.stderr) == (0, "")


# ----------------------------------------------------------------------------- output that cannot be written


def normexp_process(*args: object, cwd: Path, stdout: object = subprocess.PIPE,
                    stderr: object = subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "normexp", *map(str, args)], stdout=stdout, stderr=stderr,
                          text=True, cwd=cwd, timeout=120, env=BUFFERED)


@pytest.mark.parametrize("command", ["sweep", "gradnorm"])
def test_an_out_name_too_long_for_the_file_system_is_one_error_line(tmp_path, command):
    """ENAMETOOLONG: one `error:` line naming the path, exit 2, nothing written."""
    (tmp_path / "one.yaml").write_text(ONE_RUN)
    name = "x" * 300
    result = normexp_process(command, "one.yaml", "--out", name, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --out ") and name in lines[0], result.stderr
    assert "File name too long" in lines[0] and result.stdout == ""
    assert [p.name for p in tmp_path.iterdir()] == ["one.yaml"]


@pytest.mark.parametrize("stderr_too", [False, True], ids=["stdout", "stdout-and-stderr"])
def test_a_sweep_whose_output_cannot_be_written_trains_on_and_says_so(tmp_path, stderr_too):
    """`normexp sweep CONFIG > /dev/full`: the progress lines and the report are lost, the sweep is not.
    Every run is trained and verified, summary.csv written, the exit code is the runs' (0), and stderr
    (where it can be written) says that the output could not be."""
    from normexp.verify import verify_sweep

    (tmp_path / "small.yaml").write_text(SMALL_SWEEP)
    with open("/dev/full", "w") as full:
        result = normexp_process("sweep", "small.yaml", "--out", "out", cwd=tmp_path, stdout=full,
                                 stderr=full if stderr_too else subprocess.PIPE)
    assert result.returncode == 0, result.stderr
    found = verify_sweep(tmp_path / "out")
    assert found.clean and found.verified == found.runs == 8
    assert (tmp_path / "out" / "summary.csv").is_file()
    if not stderr_too:
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and "cannot write the output: No space left on device" in lines[0], result.stderr
        assert "8 ran, 0 already done, 0 failed" in lines[0]


@pytest.fixture(scope="module")
def small_out(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("small")
    (folder / "small.yaml").write_text(SMALL_SWEEP)
    assert normexp_process("sweep", "small.yaml", "--out", "out", "-q", cwd=folder).returncode == 0
    return folder / "out"


@pytest.mark.parametrize("command", [["report", "OUT"], ["report", "OUT", "--format", "csv"], ["verify", "OUT"],
                                     ["doctor"]])
def test_a_command_whose_output_cannot_be_written_says_so_in_one_line(small_out, command):
    """`normexp report DIR > /dev/full`, `normexp doctor > /dev/full`: one `error:` line, exit 2."""
    args = [small_out if arg == "OUT" else arg for arg in command]
    with open("/dev/full", "w") as full:
        result = normexp_process(*args, cwd=small_out.parent, stdout=full)
    assert result.returncode == 2, result.stderr
    assert result.stderr == "error: cannot write the output: No space left on device\n"
