"""Processes and signals: SIGTERM and SIGHUP stop a sweep like Ctrl-C, a second signal exits at once,
workers die with their coordinator (also after `kill -9`), a dying worker costs only its own unit,
a signal while torch loads is never swallowed. Real processes, each sweep in its own session, so that
every process it started can be found afterwards."""

from __future__ import annotations

import ast
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO, done_markers

from normexp.folder import SweepLock
from normexp.results import load_summary

SWEEP = """\
name: sig
base:
  model: {depth: 4, width: 8}
  train: {steps: 40}
grid:
  norm.placement: [post, pre]
seeds: [0, 1, 2, 3]
"""
RUNS = 8


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _end_what_a_failed_test_left():
    yield
    while STARTED:
        kill_session(STARTED.pop())


def start(config: Path, out: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """A reference-engine sweep in a session of its own (as a terminal's job would be)."""
    proc = subprocess.Popen([sys.executable, "-m", "normexp", "sweep", str(config), "--out", str(out),
                             "--engine", "reference", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    STARTED.append(proc)
    return proc


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "sig.yaml"
    path.write_text(SWEEP)
    return path


def wait_for(condition, what: str, timeout: float = 300, proc: subprocess.Popen | None = None) -> None:
    """Wait for `condition`; with `proc`, fail at once (with its stderr) if that sweep ends first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the sweep ended (exit {proc.returncode}) before {what}: {proc.stderr.read()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def done_count(out: Path) -> int:
    return len(done_markers(out))


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: state, ppid, pgrp, session, ..."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def session_processes(session: int) -> list[int]:
    """Live (not zombie) processes of a session."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = stat_fields(int(entry.name))
            if fields and int(fields[3]) == session and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def kill_session(proc: subprocess.Popen) -> str:
    """Kill every process of `proc`'s session; its stderr (read to the end)."""
    for pid in session_processes(proc.pid):
        os.kill(pid, signal.SIGKILL)
    return proc.communicate()[1] or ""


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def pool_workers(coordinator: int) -> list[int]:
    """The coordinator's pool workers (not the multiprocessing resource tracker), oldest first."""
    children = [pid for pid in session_processes(coordinator)
                if (fields := stat_fields(pid)) and int(fields[1]) == coordinator]
    workers = [pid for pid in children if "spawn_main" in cmdline(pid)]
    return sorted(workers, key=lambda pid: int(stat_fields(pid)[19]))  # start time


def assert_no_process_left(session: int, timeout: float = 30) -> None:
    wait_for(lambda: not session_processes(session), "the sweep's processes to end", timeout)


def assert_stopped_cleanly(proc: subprocess.Popen, out: Path, signum: int, stderr: str) -> None:
    assert proc.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr and "Resume with: normexp sweep" in stderr
    assert len(stderr.strip().splitlines()) <= 3, stderr
    summary = load_summary(out)  # written, so report and resume work
    assert set(summary["status"]) <= {"completed", "interrupted"} and "interrupted" in set(summary["status"])
    assert not list(out.glob("**/.*.tmp-*"))
    with SweepLock(out):  # released
        pass


def with_sitecustomize(tmp_path: Path, source: str) -> dict[str, str]:
    """The environment of a sweep whose Python runs `source` at start-up (its sitecustomize, in a folder of its
    own under `tmp_path`)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(source)
    return {"PYTHONPATH": str(site)}


GATED_RESULTS = """\
import os, sys, threading, time

gate, at = os.environ.get("SIG_TEST_GATE"), os.environ.get("SIG_TEST_GATE_AT")
owner = int(os.environ.get("SIG_TEST_OWNER") or 0)  # the test's process (Gate sets it)
worker = "--multiprocessing-fork" in sys.argv  # a pool worker (not the resource tracker, nor the coordinator)


def wait_for_a_ticket(stop=None):
    waiting = os.path.join(gate, f"waiting-{os.getpid()}-{threading.get_ident()}")
    deadline = time.monotonic() + 600
    try:
        open(waiting, "w").close()
        while stop is None or not stop.is_set():
            if owner <= 0 or time.monotonic() > deadline:
                os._exit(1)
            os.kill(owner, 0)
            for name in sorted(os.listdir(gate)):
                if name.startswith("ticket-"):
                    try:
                        os.rename(os.path.join(gate, name), os.path.join(gate, "used-" + name))
                    except FileNotFoundError:
                        continue  # another process or thread took it
                    os.remove(waiting)
                    return
            time.sleep(0.01)
        os.remove(waiting)
    except OSError:  # the test or its folder is gone: nothing else would end a sweep held here
        os._exit(1)


if gate and at == "workers" and worker:  # each result a pool worker sends
    from multiprocessing import connection

    send = connection.Connection.send

    def send_with_a_ticket(self, obj):
        wait_for_a_ticket()
        return send(self, obj)

    connection.Connection.send = send_with_a_ticket

if gate and at == "in-process" and not worker:  # each unit the sweep's own process trains, before it starts
    class GateTheTraining:
        def find_spec(self, name, path=None, target=None):
            if name != "normexp.executors":
                return None
            import importlib.util

            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)
                run_unit = module.run_unit

                def run_unit_with_a_ticket(unit, stop=None):
                    wait_for_a_ticket(stop)  # or, once the sweep stops its runs, at once: it stops at its first step
                    return run_unit(unit, stop)

                module.run_unit = run_unit_with_a_ticket

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, GateTheTraining())
"""


class Gate:
    """A sweep that goes only as far as the test lets it, whatever this machine's pace, so that a test that stops
    it, or kills a worker, after its first runs never finds it finished already: each result a pool worker sends
    (`at` "workers"), or each unit an in-process sweep trains (`at` "in-process"), waits for a ticket from the test
    (GATED_RESULTS, the sweep's sitecustomize). A held process ends itself if the test is gone."""

    def __init__(self, tmp_path: Path, at: str) -> None:
        self.folder = tmp_path / "gate"
        self.folder.mkdir()
        self.env = {**with_sitecustomize(tmp_path, GATED_RESULTS), "SIG_TEST_GATE": str(self.folder),
                    "SIG_TEST_GATE_AT": at, "SIG_TEST_OWNER": str(os.getpid())}
        self._tickets = itertools.count()

    def let_through(self, results: int) -> None:
        for _ in range(results):
            (self.folder / f"ticket-{next(self._tickets):03d}").touch()

    def holding(self, pids: list[int]) -> bool:
        """Whether each of `pids` waits for a ticket (a worker: with a result it has not delivered)."""
        return all(any(self.folder.glob(f"waiting-{pid}-*")) for pid in pids)

    def delivered(self) -> int:
        return len(list(self.folder.glob("used-*")))


@pytest.fixture
def gate(tmp_path: Path) -> Gate:
    """Pool workers' results gated."""
    return Gate(tmp_path, "workers")


def start_held(config: Path, out: Path, gate: Gate, *extra: str) -> subprocess.Popen:
    """A quiet sweep (`start`) on `gate`, its first 2 runs let through and finished, and no more: it cannot have
    finished when the test acts."""
    proc = start(config, out, "-q", *extra, env=gate.env)
    gate.let_through(2)
    wait_for(lambda: done_count(out) >= 2, "2 finished runs", proc=proc)
    return proc


@pytest.mark.process
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_stop_like_ctrl_c(config, tmp_path, signum):
    out, gate = tmp_path / "out", Gate(tmp_path, "in-process")
    proc = start_held(config, out, gate)
    wait_for(lambda: gate.holding([proc.pid]), "the sweep to wait to train its next unit", proc=proc)
    proc.send_signal(signum)
    try:
        _, stderr = proc.communicate(timeout=60)  # a stop takes well under a second; held, the sweep never ends
    except subprocess.TimeoutExpired:
        pytest.fail(f"the sweep did not stop on signal {signum}: {kill_session(proc)}")
    assert_stopped_cleanly(proc, out, signum, stderr)
    assert f"2 of {RUNS} runs finished" in stderr and done_count(out) == 2
    assert list(load_summary(out)["status"]).count("completed") == 2


@pytest.mark.process
def test_sigterm_stops_the_workers_too(config, tmp_path, gate):
    out = tmp_path / "out"
    proc = start_held(config, out, gate, "--workers", "2")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert_stopped_cleanly(proc, out, signal.SIGTERM, stderr)
    assert_no_process_left(proc.pid)


@pytest.mark.process
def test_two_ctrl_c_with_workers_exit_at_once(config, tmp_path, gate):
    out = tmp_path / "out"
    proc = start_held(config, out, gate, "--workers", "2")
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole foreground group
    time.sleep(0.05)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    assert_no_process_left(proc.pid)


@pytest.mark.process
def test_workers_die_with_a_killed_coordinator(config, tmp_path, gate):
    out = tmp_path / "out"
    proc = start_held(config, out, gate, "--workers", "2")
    assert len(pool_workers(proc.pid)) == 2
    proc.kill()
    proc.communicate(timeout=60)  # the workers hold its pipes open: a worker that outlived it fails here
    assert_no_process_left(proc.pid)  # workers and the resource tracker: none under PID 1


@pytest.mark.process
def test_a_dying_worker_costs_only_its_own_unit(config, tmp_path, gate):
    """Each victim dies holding a result it never delivered (`Gate`), so its unit must be retried on a
    replacement, and the other worker's units go on."""
    out = tmp_path / "out"
    proc = start(config, out, "-q", "--workers", "2", env=gate.env)
    for finished, victim in ((2, -1), (4, 0)):  # the newest worker, then the oldest (another unit)
        gate.let_through(2)
        wait_for(lambda n=finished: done_count(out) >= n, f"{finished} finished runs", proc=proc)
        wait_for(lambda: len(workers := pool_workers(proc.pid)) == 2 and gate.holding(workers),
                 "two workers, each holding a result (a replacement starts in seconds)", proc=proc)
        workers = pool_workers(proc.pid)
        os.kill(workers[victim], signal.SIGKILL)
        wait_for(lambda pid=workers[victim]: pid not in pool_workers(proc.pid), "the worker to go")
    gate.let_through(2 * RUNS)  # every unit's result: the rest, and the two lost ones trained again
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert list(load_summary(out)["status"]) == ["completed"] * RUNS
    assert gate.delivered() == RUNS  # a result delivered per run: the victims' never were


SWALLOWING_IMPORT = """\
import os, signal, sys, time

class Swallow:
    '''Ctrl-C arrives while torch loads, inside code that catches too much.'''
    fired = False

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not Swallow.fired and sys.argv[1:2] == ["sweep"]:
            Swallow.fired = True
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
            except BaseException:
                pass
        return None

sys.meta_path.insert(0, Swallow())
"""


@pytest.mark.process
def test_ctrl_c_while_torch_loads_is_never_swallowed(config, tmp_path):
    out = tmp_path / "out"
    proc = start(config, out, env=with_sitecustomize(tmp_path, SWALLOWING_IMPORT))
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "nothing was written" in stderr
    assert done_count(out) == 0


@pytest.mark.process
@pytest.mark.slow
def test_ctrl_c_with_a_local_dask_cluster_is_quiet(config, tmp_path):
    pytest.importorskip("distributed")
    out = tmp_path / "out"
    proc = start(config, out, "-q", "--cluster", "local:2")
    wait_for(lambda: done_count(out) >= 2, "2 finished runs")
    proc.send_signal(signal.SIGINT)  # the coordinator only: Dask's own workers still print on a group's Ctrl-C
    _, stderr = proc.communicate(timeout=300)
    assert_stopped_cleanly(proc, out, signal.SIGINT, stderr)
    assert_no_process_left(proc.pid, timeout=60)


@pytest.mark.process
def test_a_terminals_ctrl_c_stops_workers_cleanly(config, tmp_path, gate):
    out = tmp_path / "out"
    proc = start_held(config, out, gate, "--workers", "2")
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the coordinator and every worker
    _, stderr = proc.communicate(timeout=300)
    assert_stopped_cleanly(proc, out, signal.SIGINT, stderr)
    assert_no_process_left(proc.pid)


@pytest.mark.process
def test_a_terminals_ctrl_c_while_workers_start_is_one_line(config, tmp_path):
    """A terminal's Ctrl-C as the first `--workers` process appears, and moments later while the workers
    load normexp: the sweep's own lines and exit 130 (or 0, had it finished), never a worker's traceback
    (KeyboardInterrupt inside an import, or EOFError from a worker whose start-up the coordinator cut
    short), and no process left."""
    for attempt, delay in enumerate((0.0, 0.1, 0.3)):
        out = tmp_path / f"out{attempt}"
        proc = start(config, out, "-q", "--workers", "2")
        wait_for(lambda p=proc: pool_workers(p.pid) or p.poll() is not None, "the first worker", timeout=120)
        time.sleep(delay)
        with contextlib.suppress(ProcessLookupError):  # a sweep that already finished
            os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode in (0, 130) and "Traceback" not in stderr, (delay, stderr)
        assert proc.returncode == 0 or "Resume with: normexp sweep" in stderr, (delay, stderr)
        assert len(stderr.strip().splitlines()) <= 2, (delay, stderr)
        assert_no_process_left(proc.pid)


@pytest.mark.process
@pytest.mark.slow
def test_a_terminals_ctrl_c_with_a_local_dask_cluster_is_quiet(config, tmp_path):
    pytest.importorskip("distributed")
    out = tmp_path / "out"
    proc = start(config, out, "-q", "--cluster", "local:2")
    wait_for(lambda: done_count(out) >= 2, "2 finished runs")
    os.killpg(proc.pid, signal.SIGINT)  # Dask's worker processes too: they leave it to the coordinator
    _, stderr = proc.communicate(timeout=300)
    assert_stopped_cleanly(proc, out, signal.SIGINT, stderr)
    assert f"{done_count(out)} of {RUNS} runs finished" in stderr
    assert_no_process_left(proc.pid, timeout=60)


@pytest.mark.process
@pytest.mark.slow
def test_ctrl_c_while_a_local_dask_cluster_starts(config, tmp_path):
    pytest.importorskip("distributed")
    out = tmp_path / "out"
    proc = start(config, out, "-q", "--cluster", "local:2")
    wait_for(lambda: any(int(stat_fields(pid)[1]) == proc.pid for pid in session_processes(proc.pid)
                         if pid != proc.pid and stat_fields(pid)), "the cluster's first process")
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    assert len(stderr.strip().splitlines()) <= 3, stderr
    assert_no_process_left(proc.pid, timeout=60)


def _commands() -> list[list[str]]:
    """The installed console script (where this environment has one) and `python -m normexp`."""
    script = Path(sys.executable).parent / "normexp"
    return ([[str(script)]] if script.exists() else []) + [[sys.executable, "-m", "normexp"]]


@pytest.mark.process
@pytest.mark.parametrize("command", _commands(), ids=lambda c: "python-m" if len(c) > 1 else "script")
def test_ctrl_c_while_the_cli_loads_is_one_line(config, tmp_path, command):
    """Ctrl-C at any moment of start-up (typer, rich, pydantic, then torch): exit 130 and no traceback.
    The first tens of milliseconds are Python's own start-up (its `site` module, the console script's
    own imports), out of normexp's reach: a traceback from there, with no normexp frame in it, is let
    pass."""
    out = tmp_path / "out"
    for delay in (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8):
        proc = subprocess.Popen([*command, "sweep", str(config), "--out", str(out), "--engine", "reference", "-q"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        STARTED.append(proc)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
        if "Traceback" in stderr and "/normexp/" not in stderr:
            continue  # the interpreter's start-up, before any normexp code ran
        assert proc.returncode in (0, 130) and "Traceback" not in stderr, (delay, stderr)
        assert len(stderr.strip().splitlines()) <= 3, (delay, stderr)


@pytest.mark.process
def test_the_command_reads_no_file_before_its_ctrl_c_handler():
    """What normexp/__main__.py imports at its top is what the interpreter loaded at start-up (a
    builtin such as `_signal`, or `os`): a Ctrl-C before the handler goes in can only land in Python's
    own start-up. (Importing `signal` there read a file first, and a Ctrl-C in it printed a traceback.)"""
    tree = ast.parse((REPO / "normexp" / "__main__.py").read_text())
    top = [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]
    top += [node.module for node in tree.body if isinstance(node, ast.ImportFrom)]
    started = subprocess.run([sys.executable, "-c", "import sys; print(' '.join(sys.modules))"],
                             capture_output=True, text=True, check=True).stdout.split()
    assert "_signal" in top and set(top) <= set(started), (top, started)


def test_a_stop_signal_during_a_runs_write_takes_effect_once_the_folder_is_in_place(tmp_path, monkeypatch):
    """A Ctrl-C that lands while the coordinator writes a run folder waits for the folder: no half-built
    `.RUN.tmp-PID` is left behind, and the run is recorded whole."""
    from normexp import sweep
    from normexp.config import RunConfig
    from normexp.engines.reference import train_run
    from normexp.folder import FinishedRun, inspect_run, run_id, stray_paths, write
    from normexp.units import UnitResult, plan_units

    cfg = RunConfig.model_validate({"model": {"depth": 2, "width": 4}, "train": {"steps": 2}})
    result = train_run(cfg)
    run = FinishedRun(result.metrics, result.status, result.wall_s, result.threads, "reference", "cpu")
    real_write = write.atomic_write

    def write_and_get_interrupted(path, text):
        os.kill(os.getpid(), signal.SIGINT)  # a terminal's Ctrl-C, in the middle of the folder's files
        real_write(path, text)

    def stop(signum, frame):
        raise KeyboardInterrupt

    monkeypatch.setattr(write, "atomic_write", write_and_get_interrupted)
    previous = signal.signal(signal.SIGINT, stop)
    try:
        outcome = sweep.SweepOutcome(tmp_path, total=1)
        with pytest.raises(KeyboardInterrupt):
            sweep._record_unit(UnitResult(plan_units([cfg], "reference", "cpu", 1)[0], (run,)), tmp_path,
                               outcome, lambda event: None)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert stray_paths(tmp_path) == []
    assert inspect_run(tmp_path / run_id(cfg), cfg).finished
    assert outcome.statuses == {run_id(cfg): "completed"}


@pytest.mark.process
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_make_studies_stops_cleanly_and_resumes_what_it_kept(tmp_path, signum):
    """`make studies` (one worker per core) under a terminal's Ctrl-C or a SIGTERM to its whole process
    group while the first study trains: one line, exit 128 + signal, no process left, finished runs kept."""
    out = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "normexp.studies", "--quick", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    STARTED.append(proc)
    wait_for(lambda: done_count(out / "warmup") >= 1, "a finished run of the first study")
    os.killpg(proc.pid, signum)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr and "studies stopped" in stderr and "Run the same command again" in stderr
    assert_no_process_left(proc.pid)
    kept = done_count(out / "warmup")
    assert kept >= 1 and not list(out.glob("**/.*.tmp-*"))
    with SweepLock(out / "warmup"):  # released
        pass


@pytest.mark.process
def test_make_studies_ctrl_c_while_it_loads_and_a_bad_out_are_one_line(tmp_path):
    """`python -m normexp.studies`: a Ctrl-C while its modules load (pandas, pydantic) ends it with one
    line and 130, not a KeyboardInterrupt traceback; an --out that is a file, or a study folder that
    holds another sweep, is an error line and exit 2 (as `normexp sweep`), not a traceback."""
    command = [sys.executable, "-m", "normexp.studies", "--quick", "--out"]
    for delay in (0.2, 0.35, 0.5):
        proc = subprocess.Popen([*command, str(tmp_path / "runs")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        STARTED.append(proc)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
        if "Traceback" in stderr and "/normexp/" not in stderr:
            continue  # the interpreter's own start-up
        assert proc.returncode == 130 and "Traceback" not in stderr, (delay, stderr)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    other = tmp_path / "other"
    (other / "depth").mkdir(parents=True)  # the third study's folder: refused before the first trains
    (other / "depth" / "sweep.yaml").write_text("name: not-depth\nbase: {}\ngrid: {}\nseeds: [0]\n")
    for out in (a_file, other):
        proc = subprocess.run([*command, str(out)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "--force" not in proc.stderr  # the studies have no --force
    assert not (other / "warmup").exists()


# ----------------------------------------------------------------------------- while a pool sweep imports torch


# Runs `normexp sweep` as `python -m normexp` does, on 2 cores whatever the machine (a compiled fast sweep
# then trains in a pool: `sweep.fast_pool`), and sends this process SIGTERM from inside its first import of
# numpy, which torch._C makes from C++ as torch loads: the coordinator's own torch import, which a pool
# sweep leaves until after its workers start.
SIGNAL_IN_TORCH_IMPORT = textwrap.dedent("""
    import os, signal, sys
    class SignalInImport:
        def find_spec(self, name, path=None, target=None):
            if name == "numpy" and "torch" in sys.modules:
                sys.meta_path.remove(self)
                os.write(2, b"signal sent\\n")
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # the handler runs here, inside the import
                    pass
            return None
    sys.meta_path.insert(0, SignalInImport())
    from normexp import executors
    executors.usable_cores = lambda: 2
    sys.argv = ["normexp", "sweep", sys.argv[1], "--engine", "fast", "--compile", "--out", sys.argv[2], "-q"]
    from normexp.__main__ import main
    main()
""")


@pytest.mark.process
def test_a_stop_signal_while_a_pool_sweeps_coordinator_imports_torch_stops_it_writing_nothing(write_yaml, tmp_path):
    """A SIGTERM (or Ctrl-C) that arrives while the coordinator of a pool sweep imports torch stops the sweep:
    exit 143, nothing written, no worker left. Raised as KeyboardInterrupt inside torch's import, it vanished
    (torch._C imports numpy from C++ and drops the error): the sweep trained every run and exited 0."""
    config = write_yaml("name: tiny\nbase:\n  model: {depth: 2, width: 8}\n  train: {steps: 3}\nseeds: [0, 1]\n")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "NORMEXP_CACHE_DIR": str(tmp_path / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    process = subprocess.Popen([sys.executable, "-c", SIGNAL_IN_TORCH_IMPORT, str(config), str(out)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=300)
    finally:
        left = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(process.pid)], capture_output=True, text=True)
        alive = [line.split()[0] for line in left.stdout.splitlines() if not line.split()[1].startswith("Z")]
        for pid in alive:  # what this test started and left behind (a zombie is only not yet reaped)
            os.kill(int(pid), signal.SIGKILL)
    assert "signal sent" in stderr, stderr
    assert process.returncode == 128 + signal.SIGTERM, (process.returncode, stderr)
    assert "Traceback" not in stderr and "nothing was written" in stderr, stderr
    assert not out.exists() or not any(out.glob("*/done.json"))
    assert alive == []
