"""Hostile review 8: a compiled fast sweep that starts its worker pool before its coordinator imports torch
(`PoolExecutor.start`, `commands/sweep._import_engines`), and the recording dispatch mode that torch no longer wraps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

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


def test_a_stop_signal_while_a_pool_sweeps_coordinator_imports_torch_stops_it_writing_nothing(write_yaml, tmp_path):
    """A SIGTERM (or Ctrl-C) that arrives while the coordinator of a pool sweep imports torch stops the sweep:
    exit 143, nothing written, no worker left. Raised as KeyboardInterrupt inside torch's import, it vanished
    (torch._C imports numpy from C++ and drops the error): the sweep trained every run and exited 0."""
    config = write_yaml("name: tiny\nbase:\n  model: {depth: 2, width: 8}\n  train: {steps: 3}\nseeds: [0, 1]\n")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NORMEXP_CACHE_DIR": str(tmp_path / "cache"),
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
