"""`sweep --launcher local` (normexp/launch.py) under stop signals and failed runs, and the checkpoint that
submitit's requeue under `--launcher slurm` relies on. Real processes: the sweep in a session of its own,
its array's processes found afterwards by the folder their command lines name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO, done_markers

pytest.importorskip("submitit")
pytestmark = pytest.mark.process  # every test runs `normexp sweep --launcher local` or a shard in a process

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


def test_the_slurm_checkpoint_stops_the_shard_cleanly_and_requeues_it_as_itself(tmp_path):
    """Slurm's --signal=USR2@90 reaches every process of the job. The shard's normexp died of it (no handler:
    SIGUSR2 terminates), its run in progress and summary lost, and submitit's handler in the task then
    killed it anyway. Now the shard ignores SIGUSR2 and the task's checkpoint stops it with SIGTERM (a clean
    stop: finished runs kept), then submitit requeues the same task, which resumes the shard."""
    config = tmp_path / "arr.yaml"
    config.write_text(SWEEP)
    out, logs = tmp_path / "out", tmp_path / "logs"
    logs.mkdir()
    script = textwrap.dedent(f"""
        import os, signal, threading, time
        from pathlib import Path
        os.environ.update(SUBMITIT_EXECUTOR="local", SUBMITIT_LOCAL_JOB_ID="7", SUBMITIT_LOCAL_NTASKS="1",
                          SUBMITIT_LOCAL_GLOBALID="0", SUBMITIT_LOCAL_LOCALID="0", SUBMITIT_FOLDER={str(logs)!r})
        from submitit.core import job_environment, utils
        from normexp.launch import ShardTask, task_argv

        task = ShardTask(task_argv(Path({str(config)!r}), [], Path({str(out)!r}), "reference"), 2)
        delayed = utils.DelayedSubmission(task, 0)
        delayed.set_timeout(1, 3)
        env = job_environment.JobEnvironment()
        env._handle_signals(env.paths, delayed)  # what submitit's _submit does before running the task

        def slurm_warns():
            while len(list(Path({str(out)!r}).glob("*/done.json"))) < 2:
                time.sleep(0.05)
            os.kill(task._child.pid, signal.SIGUSR2)  # every process of the job
            os.kill(os.getpid(), signal.SIGUSR2)

        threading.Thread(target=slurm_warns, daemon=True).start()
        delayed.result()
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 144, done.stderr  # LocalJobEnvironment's requeue: the same code Slurm's sees
    kept = len(done_markers(out))
    assert f"terminated (SIGTERM): {kept} of 8 runs finished and kept in {out}" in done.stderr, done.stderr
    assert array_processes(tmp_path) == []
    from submitit.core import utils

    again = utils.DelayedSubmission.load(logs / "7_submitted.pkl")
    assert type(again.function).__name__ == "ShardTask" and again.args == (0,)
    assert again.function.command(0)[-2:] == ["--shard", "0/2"]
    assert again.result() == 0  # the requeued task resumes the shard and finishes it
    assert len(done_markers(out)) == 8 > kept
