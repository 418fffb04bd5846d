"""`make install` takes a CPU torch unless TORCH=cuda, never waits on an index without a timeout, keeps
the torch it installed while installing normexp, and refuses an unknown TORCH= in one line.
(Dry runs, `make -n`: nothing is installed.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = [pytest.mark.process,  # `make -n` in a process
              pytest.mark.skipif(shutil.which("make") is None, reason="needs make")]


def dry_run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """`make -n install ARGS` into a virtualenv that does not exist yet (so the torch step shows), as a
    top-level make: under `make test` the parent's MAKELEVEL/MAKEFLAGS would make it print its folder."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    return subprocess.run(["make", "-n", "install", f"VENV={tmp_path / 'venv'}", *args], cwd=REPO,
                          capture_output=True, text=True, env=env)


def pip_installs(output: str) -> list[str]:
    return [line for line in output.splitlines() if "-m pip install" in line]


@pytest.mark.parametrize("value", ["gpu", "CPU", "cuda12", "rocm"])
def test_an_unknown_torch_value_is_refused_in_one_line(tmp_path, value):
    done = dry_run(tmp_path, f"TORCH={value}")
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert f"TORCH={value}: must be cpu (the default) or cuda" in done.stderr
    assert done.stdout == ""  # nothing ran


def test_the_default_is_the_cpu_build(tmp_path):
    done = dry_run(tmp_path)
    assert done.returncode == 0, done.stderr
    torch_lines = [line for line in pip_installs(done.stdout) if "torch==" in line and " -c " not in line]
    assert torch_lines and all("+cpu" in line for line in torch_lines)  # no CUDA wheel has a +cpu version
    assert "download.pytorch.org/whl/cpu" in done.stdout
    assert "timeout=5" in done.stdout  # the CPU index is probed before pip is pointed at it
    assert "cuda is None" in done.stdout  # and the build in place is checked after the install


def test_cuda_is_opt_in(tmp_path):
    done = dry_run(tmp_path, "TORCH=cuda")
    assert done.returncode == 0, done.stderr
    torch_lines = [line for line in pip_installs(done.stdout) if "torch==" in line and " -c " not in line]
    assert torch_lines and not any("+cpu" in line for line in torch_lines)


@pytest.mark.parametrize("torch_choice", ["cpu", "cuda"])
def test_every_pip_call_has_a_timeout_and_normexp_keeps_the_installed_torch(tmp_path, torch_choice):
    done = dry_run(tmp_path, f"TORCH={torch_choice}")
    installs = pip_installs(done.stdout)
    assert installs and all("--timeout" in line and "--retries" in line for line in installs)
    normexp = [line for line in installs if "-e ." in line]
    assert normexp and all("-c " in line and "torch-constraint.txt" in line for line in normexp)
    assert "--no-index" not in done.stdout  # it hides torch's dependencies


def test_pip_skips_byte_compiling_and_normexp_s_own_imports_are_compiled_instead(tmp_path):
    done = dry_run(tmp_path)
    installs = pip_installs(done.stdout)
    assert installs and all("--no-compile" in line for line in installs)
    warm = [line for line in done.stdout.splitlines() if "PYTHONDONTWRITEBYTECODE" in line]
    assert len(warm) == 1 and warm[0].startswith("env -u PYTHONDONTWRITEBYTECODE ")
    # its code, run here: it imports every normexp module (so torch and pandas) and runs no command
    code = warm[0].split(' -c "', 1)[1].removesuffix('"')
    check = "; import sys; print(all(m in sys.modules for m in ('normexp.report', 'normexp.engines.fast', 'torch')))"
    ran = subprocess.run([sys.executable, "-c", code + check], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "True\n"


def test_make_docs_installs_the_docs_extra_not_the_dev_toolchain(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    done = subprocess.run(["make", "-n", "docs", f"VENV={tmp_path / 'venv'}"], cwd=REPO, capture_output=True,
                          text=True, env=env)
    assert done.returncode == 0, done.stderr
    extras = [line for line in pip_installs(done.stdout) if '-e ".[' in line]
    assert extras and all('-e ".[docs]"' in line for line in extras), extras
    assert "mkdocs build --strict" in done.stdout
