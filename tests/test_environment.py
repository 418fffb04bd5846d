"""`normexp doctor` prints what a bug report needs, as plain `key: value` lines."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from normexp import __version__
from normexp.cli import app
from normexp.environment import describe, torch_build


def doctor_lines() -> dict[str, str]:
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert all(": " in line for line in lines), lines  # plain text, nothing but key: value
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def test_doctor_reports_versions_build_threads_devices_and_extras():
    facts = doctor_lines()
    assert facts["normexp"] == __version__
    assert facts["python"].startswith(platform.python_version() + " ")
    assert facts["torch"].startswith(torch.__version__ + " ")
    assert facts["torch build"] == ("CPU" if torch.version.cuda is None else f"CUDA {torch.version.cuda}")
    assert facts["threads"].startswith(f"{torch.get_num_threads()} intra-op")
    assert facts["devices"].split(", ")[0] == "cpu"
    assert facts["dask extra"].startswith(("installed (", "not installed ("))
    assert platform.machine() in facts["platform"]


@given(cuda=st.one_of(st.none(), st.from_regex(r"1[0-9]\.[0-9]", fullmatch=True)))
def test_torch_build_names_the_cuda_version(cuda):
    assert torch_build(cuda) == ("CPU" if cuda is None else f"CUDA {cuda}")


def test_a_cuda_build_with_devices_is_reported():
    with mock.patch.object(torch.version, "cuda", "12.4"), \
            mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "device_count", return_value=2), \
            mock.patch.object(torch.cuda, "get_device_name", side_effect=lambda i: f"GPU{i}"):
        facts = dict(describe().lines)
    assert facts["torch build"] == "CUDA 12.4"
    assert facts["devices"] == "cpu, cuda:0 GPU0, cuda:1 GPU1"


def test_a_missing_dask_extra_is_reported():
    real = metadata.version

    def version(dist: str) -> str:
        if dist == "distributed":
            raise metadata.PackageNotFoundError(dist)
        return real(dist) if dist != "dask-jobqueue" else "0.9.0"

    pytest.importorskip("dask")
    with mock.patch("normexp.environment.metadata.version", version):
        facts = dict(describe().lines)
    assert facts["dask extra"].startswith("not installed (")
    assert "distributed missing" in facts["dask extra"]


def test_an_unimportable_torch_is_reported_not_raised():
    with mock.patch.dict("sys.modules", {"torch": None}):
        facts = dict(describe().lines)
    assert facts["torch"].startswith("not importable (ModuleNotFoundError")
    assert "torch build" not in facts


THREAD_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_DYNAMIC")


def doctor_facts(env: dict[str, str]) -> dict[str, str]:
    """`normexp doctor`'s lines, run as a fresh command with `env`: the variables its process ran with."""
    doctor = subprocess.run([sys.executable, "-m", "normexp", "doctor"], env=env, capture_output=True, text=True,
                            check=True).stdout
    return {key: value.strip() for key, _, value in (line.partition(":") for line in doctor.splitlines())}


@pytest.mark.process
@pytest.mark.parametrize(("variable", "default"), [("OMP_WAIT_POLICY", "PASSIVE"), ("MKL_DYNAMIC", "FALSE")])
@pytest.mark.parametrize("given", [None, "", "TRUE"])
def test_the_command_sets_the_threading_defaults_unless_the_environment_says(variable, default, given):
    """Idle OpenMP threads sleep (PASSIVE); MKL never picks fewer threads on its own (MKL_DYNAMIC off)."""
    env = {k: v for k, v in os.environ.items() if k != variable}
    if given is not None:
        env[variable] = given
    assert doctor_facts(env)[variable] == (given or default)


@pytest.mark.process
@pytest.mark.parametrize(("policy", "spin", "expected"), [
    (None, None, "2000"), (None, "", "2000"), (None, "50", "50"), ("ACTIVE", None, None), ("PASSIVE", None, None)])
def test_idle_openmp_threads_spin_briefly_unless_the_user_chose_how_they_wait(policy, spin, expected):
    """GOMP_SPINCOUNT=2000 (a short spin, then sleep) only where neither it nor OMP_WAIT_POLICY is set: on
    a VM, sleeping at once made a 2-thread run 4x slower; a policy or spin count the user set stays theirs."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update({name: value for name, value in (("OMP_WAIT_POLICY", policy), ("GOMP_SPINCOUNT", spin))
                if value is not None})
    facts = doctor_facts(env)
    assert [facts.get("GOMP_SPINCOUNT", "-"), facts["OMP_WAIT_POLICY"]] == [expected or "-", policy or "PASSIVE"]


@pytest.mark.process
def test_importing_normexp_leaves_the_importers_environment_as_it_was():
    """A library's import changes nothing of its importer's: the threading defaults are set where normexp's
    own processes start (the command, a pool or Dask worker), not on `import normexp`. Checked in a fresh
    process that has none of them, importing the package, the fast engine and what a sweep runs on."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    code = ("import os; before = dict(os.environ)\n"
            "import normexp, normexp.engines.fast, normexp.engines.fast.train, normexp.sweep, normexp.executors\n"
            "print(sorted(set(os.environ.items()) ^ set(before.items())))")
    ran = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "[]"


@pytest.mark.process
def test_a_pool_worker_sets_the_threading_defaults_itself(monkeypatch):
    """A sweep's worker process (spawned: a fresh interpreter) sets the defaults before its first unit loads
    torch, where the process that started it did not (a sweep run from a library, not the command)."""
    import multiprocessing

    from normexp import executors

    for name in THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    worker = context.Process(target=executors._worker_main, args=(theirs, os.getpid()), daemon=True)
    worker.start()
    try:
        seen = {}
        for name in THREAD_VARIABLES:
            mine.send((os.getenv, name))  # the worker answers task(unit): os.getenv(name), in its own process
            seen[name] = mine.recv()
    finally:
        worker.kill()
        worker.join()
    assert seen == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "2000", "MKL_DYNAMIC": "FALSE"}
    assert not any(name in os.environ for name in THREAD_VARIABLES)  # and this process is left alone


XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse4_2 fma avx avx2 avx512f avx512bw avx512_vnni amx_tile amx_bf16 ht

processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse4_2 fma avx avx2 avx512f avx512bw avx512_vnni amx_tile amx_bf16 ht
"""
EPYC = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse4_2 fma avx avx2 sha_ni\n"
GRAVITON = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes sve sve2 i8mm bf16\n" \
           "CPU implementer\t: 0x41\nCPU part\t: 0xd4f\n"


@pytest.mark.parametrize("text,model,features", [
    (XEON, "Intel(R) Xeon(R) Processor", "sse4_2 fma avx avx2 avx512f avx512bw avx512_vnni amx_tile amx_bf16"),
    (EPYC, "AMD EPYC 7B13", "sse4_2 fma avx avx2"),
    (GRAVITON, "ARM implementer 0x41 part 0xd4f", "asimd sve sve2 bf16 i8mm"),
])
def test_cpu_info_names_the_model_and_the_features_that_change_kernels(text, model, features):
    from normexp.environment import cpu_info

    found = cpu_info(text)
    assert (found.model, found.features_text()) == (model, features)


ZEN4 = ("vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
        "flags\t\t: fpu sse4_2 fma avx avx2 avx512f avx512bw avx512_bf16\n")


@pytest.mark.parametrize("text,ident,isa", [
    (ZEN4, "AuthenticAMD family 25 model 17", "avx2 fma avx512f avx512_bf16 no amx"),
    (XEON, "GenuineIntel", "avx2 fma avx512f amx_tile"),
    (EPYC, "", "avx2 fma no avx512f no amx"),
    (GRAVITON, "", "asimd sve sve2 bf16 i8mm"),
])
def test_cpu_info_names_family_and_model_and_what_a_speed_figure_depends_on(text, ident, isa):
    from normexp.environment import cpu_info

    found = cpu_info(text)
    assert (found.ident, found.isa_text()) == (ident, isa)


def test_torch_blas_names_mkl_or_the_blas_of_the_build_and_onednn():
    from types import SimpleNamespace

    from normexp.environment import torch_blas

    def fake(text: str) -> SimpleNamespace:
        return SimpleNamespace(__config__=SimpleNamespace(show=lambda: text))

    mkl = ("  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605 for Intel(R) 64\n"
           "  - Intel(R) MKL-DNN v3.12.0 (Git Hash 80afa71)\n  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release\n")
    assert torch_blas(fake(mkl)) == "MKL 2024.2, oneDNN 3.12.0"
    assert torch_blas(fake("  - Build settings: BLAS_INFO=open, LAPACK_INFO=open\n")) == "open"
    assert torch_blas(fake("")) == "no BLAS named"
    assert torch_blas(SimpleNamespace()) == "unknown"  # no __config__: said, not raised
    assert torch_blas(torch).startswith(("MKL", "open", "accelerate", "no BLAS", "blis", "eigen"))


def test_cpu_info_reads_macos_sysctl_and_never_fails_without_a_source():
    from normexp.environment import cpu_info

    mac = cpu_info("", {"machdep.cpu.brand_string": "Apple M2", "hw.optional.AdvSIMD": "1"})
    assert (mac.model, mac.features) == ("Apple M2", ("neon",))
    nothing = cpu_info("", {})
    assert nothing.features == () and nothing.features_text().startswith("unknown")


@given(st.text())
def test_cpu_info_survives_any_cpuinfo_text(text):
    from normexp.environment import cpu_info

    assert cpu_info(text, {}).model


@pytest.mark.process
def test_doctor_names_the_cpu_torch_s_kernels_and_the_commit(tmp_path):
    from normexp.environment import cpu_info, git_commit

    facts = doctor_lines()
    assert facts["cpu"] == cpu_info().model and facts["cpu"] != ""
    assert facts["cpu features"] == cpu_info().features_text()
    assert facts["torch cpu kernels"] == torch.backends.cpu.get_cpu_capability()
    assert facts["torch blas"] != "" and facts.get("cpu id", cpu_info().ident) == cpu_info().ident
    commit = git_commit()
    assert facts["commit"] == (commit or "unknown (not run from a git checkout)")
    assert git_commit(str(tmp_path)) is None  # not a checkout: no commit, no error
    with mock.patch("subprocess.run", side_effect=FileNotFoundError("git")):
        assert git_commit() is None  # no git installed


def test_mkl_s_intel_path_is_refused_once_torch_is_loaded():
    """MKL picks its path at its first call: a library loaded after torch could answer nothing in time."""
    from normexp.environment import take_mkl_intel_path

    assert "torch" in sys.modules
    assert "torch is loaded already" in (take_mkl_intel_path() or "")


@pytest.mark.process
def test_mkl_takes_its_intel_path_only_where_the_user_asks():
    """NORMEXP_MKL_PATH=intel: every normexp process loads, before torch, the library that answers MKL's
    vendor question, and MKL asks it (its count moves at the first product); without it, nothing is loaded."""
    from normexp.environment import torch_blas

    if not torch_blas(torch).startswith("MKL") or not sys.platform.startswith("linux"):
        pytest.skip("torch's BLAS here is not MKL on Linux")
    if not any(shutil.which(cc) for cc in ("cc", "gcc")):
        pytest.skip("no C compiler")
    env = {k: v for k, v in os.environ.items() if k != "NORMEXP_MKL_PATH"}
    asked = subprocess.run([sys.executable, "-m", "normexp", "doctor"], capture_output=True, text=True, check=True,
                           env={**env, "NORMEXP_MKL_PATH": "intel"}).stdout
    line = next(line for line in asked.splitlines() if line.startswith("mkl path:"))
    assert "Intel's" in line and int(line.split("asked ")[1].split()[0]) > 0, line
    left = subprocess.run([sys.executable, "-m", "normexp", "doctor"], capture_output=True, text=True, check=True,
                          env=env).stdout
    assert "MKL's own choice" in next(line for line in left.splitlines() if line.startswith("mkl path:"))
