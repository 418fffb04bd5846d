"""`sweep --launcher local` (normexp/launch.py) under stop signals and failed runs. Real processes: the
sweep in a session of its own, its array's processes found afterwards by the folder their command lines
name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, done_markers

pytest.importorskip("submitit")

SWEEP = """\
name: arr
base:
  model: {depth: 4, width: 8}
  train: {steps: 150, threads: 1}
grid:
  norm.placement: [post, pre]
seeds: [0, 1, 2, 3, 4, 5, 6, 7]
"""
RUNS = 16

STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _end_what_a_failed_test_left(tmp_path):
    yield
    while STARTED:
        proc = STARTED.pop()
        for pid in array_processes(tmp_path):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


def launch(config: Path, out: Path, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "normexp", "sweep", str(config), "--out", str(out), "--launcher",
                             "local", "--shards", "2", "--engine", "reference"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    STARTED.append(proc)
    return proc


def array_processes(folder: Path) -> list[int]:
    """Live processes whose command line names `folder` (the shards' --out, the controllers' and tasks'
    submitit folder in it), wherever their session: the shards run in sessions of their own."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if str(folder) in command and state != "Z" and "pytest" not in command:
                found.append(int(entry.name))
    return found


def wait_for(condition, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stopped_mid_way(tmp_path: Path, signum: int, group: bool, twice: bool = False) -> tuple[subprocess.Popen, str]:
    config = tmp_path / "arr.yaml"
    config.write_text(SWEEP)
    out = tmp_path / "out"
    proc = launch(config, out)
    wait_for(lambda: len(done_markers(out)) >= 2, "2 finished runs")
    (os.killpg if group else os.kill)(proc.pid, signum)
    if twice:
        time.sleep(0.2)
        os.kill(proc.pid, signum)
    _, stderr = proc.communicate(timeout=120)
    return proc, stderr


@pytest.mark.parametrize(("signum", "group"), [
    (signal.SIGTERM, False),  # kill PID: it exited 143 silently, and the whole array went on training
    pytest.param(signal.SIGHUP, False, marks=pytest.mark.slow),
    pytest.param(signal.SIGTERM, True, marks=pytest.mark.slow),  # `timeout`: the whole process group
    (signal.SIGINT, True),  # a terminal's Ctrl-C: two submitit tracebacks, no resume line
])
def test_a_stop_signal_stops_the_array_says_so_and_resumes(tmp_path, signum, group):
    proc, stderr = stopped_mid_way(tmp_path, signum, group)
    out = tmp_path / "out"
    assert proc.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 3, stderr
    name = {signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP)"}.get(signum, "interrupted")
    lines = stderr.strip().splitlines()
    assert lines[0].startswith(f"{name}: stopping the array's 2 tasks cleanly")
    kept = len(done_markers(out))
    assert lines[1] == f"{name}: the array's tasks stopped; {kept} of {RUNS} runs finished and kept in {out}."
    assert lines[2].startswith("Resume with: normexp sweep ") and "--launcher local --shards 2" in lines[2]
    assert array_processes(tmp_path) == []  # nothing left training
    time.sleep(1.0)
    assert len(done_markers(out)) == kept < RUNS  # and nothing wrote on after the command ended
    if signum != signal.SIGTERM or group:
        return
    again = launch(tmp_path / "arr.yaml", out)  # the resume line's command finishes it
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert len(done_markers(out)) == RUNS and array_processes(tmp_path) == []


def test_a_second_signal_kills_the_array_at_once(tmp_path):
    proc, stderr = stopped_mid_way(tmp_path, signal.SIGTERM, False, twice=True)
    assert proc.returncode == 143 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "terminated (SIGTERM) again: killed the array's tasks"
    wait_for(lambda: array_processes(tmp_path) == [], "the array's processes to end", 10)


FAILING = '''
class Boom:
    stackable = True

    @staticmethod
    def build(block, norm):
        block.norm = norm()

    @staticmethod
    def forward(block, x):
        raise RuntimeError("boom: this placement always fails")
'''


def test_failed_runs_give_the_sweeps_exit_code_and_are_named(tmp_path):
    """It exited 0 when runs failed, a failed task's error being only a log path."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "boomnorms.py").write_text(FAILING)
    config = tmp_path / "boom.yaml"
    config.write_text("name: boom\nbase: {model: {depth: 2, width: 8}, data: {n_samples: 16}, train: {steps: 4}}\n"
                      "grid: {norm.placement: [pre, 'boomnorms:Boom']}\nseeds: [0, 1]\n")
    proc = launch(config, tmp_path / "out", env={"PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path / "pkg")])})
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    failed = sorted(p.name for p in (tmp_path / "out").iterdir() if (p / "failed.json").is_file())
    assert len(failed) == 2 and "2 shards ran into" in stdout
    for rid in failed:
        assert f"failed: {rid}: RuntimeError: boom: this placement always fails" in stderr, stderr
    assert "2 of 4 runs finished, 2 runs failed" in stderr and "Traceback" not in stderr
    assert array_processes(tmp_path) == []
