"""What this installation is, as a bug report needs it: `normexp doctor` prints `describe()`.

One `Environment` holds normexp's, Python's and torch's versions, the torch build (CPU, or the CUDA
version it was built for), torch's thread counts, the devices torch can see, whether the Dask extra is
installed, and the platform. Plain text, one `key: value` line each, so it pastes into an issue as it
is. A torch that fails to import is reported as such (a broken install is what a bug report is about),
not raised.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import ModuleType

from normexp import __version__

# Environment variables that change torch's threads or the devices it sees.
RELEVANT_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "MKL_DYNAMIC",
                      "CUDA_VISIBLE_DEVICES", "NORMEXP_MKL_PATH")


def set_thread_defaults() -> None:
    """Three threading defaults, set where the environment leaves them unset, by each process of normexp's own
    before it loads torch (the command, a pool or Dask worker, the benchmarks; OpenMP reads them once, as
    torch loads it). None changes a result; they keep the speed from depending on the machine's load:
    - `MKL_DYNAMIC=FALSE`: MKL may otherwise run a call on fewer threads than torch's count, on its own
      judgement (Intel lists this "dynamic" mode among its causes of run-to-run differences); the exact
      engines promise the same bits for the same thread count.
    - `OMP_WAIT_POLICY=PASSIVE` with `GOMP_SPINCOUNT=2000`: an idle OpenMP thread spins briefly (2,000
      pause loops, tens of microseconds: the gap between a step's parallel regions), then sleeps. Spinning
      long starves the thread that holds the work on a machine that other work loads (torch's default, a
      300,000-loop spin: a 2-thread run of the article's model took 15-99 s instead of 1.1 s); sleeping at
      once makes every parallel region wait for a wake-up, which on a virtual machine can cost more than
      the work (an Intel Xeon VM, 2 threads: 30 ms per model-step asleep at once, 8 ms after a short spin,
      7 ms with 1 thread; 25 ms under a full load of other work, 16 ms asleep at once, 86 ms after a
      10,000-loop spin: docs/performance.md). GOMP_SPINCOUNT is set only where neither it nor
      OMP_WAIT_POLICY is: a policy the user chose is theirs.
    Importing normexp sets none of them: a library's import leaves its importer's environment alone.
    Where the user asks for it (`NORMEXP_MKL_PATH=intel`), MKL's Intel code path is taken too
    (`take_mkl_intel_path`: every normexp process of a sweep, its workers included, inherits the variable)."""
    if not os.environ.get("OMP_WAIT_POLICY") and not os.environ.get("GOMP_SPINCOUNT"):
        os.environ["GOMP_SPINCOUNT"] = "2000"  # libgomp: overrides the policy's spin count (PASSIVE alone: none)
    for variable, value in (("MKL_DYNAMIC", "FALSE"), ("OMP_WAIT_POLICY", "PASSIVE")):
        if not os.environ.get(variable):  # unset or empty: the library's own default
            os.environ[variable] = value
    if os.environ.get(MKL_PATH_VARIABLE, "").strip().lower() == "intel":
        take_mkl_intel_path()


# ----------------------------------------------------------------------------- MKL's code path on other CPUs

MKL_PATH_VARIABLE = "NORMEXP_MKL_PATH"
# The question MKL asks once per process, at its first call, before it picks its kernels: "is this an Intel
# CPU?". On any other it takes its generic path whatever the CPU's ISA (on an AMD Zen 4 with AVX-512: AVX2
# "zen" kernels that copy both operands of every small product first; docs/performance.md).
_MKL_SHIM = "int mkl_serv_intel_cpu_true(void) { ++normexp_mkl_asked; return 1; }\n"
_MKL_SHIM_HEAD = "long normexp_mkl_asked = 0;\n"
_MKL_SHIM_LOADED: list[str] = []  # the library's path, once this process loaded it


def take_mkl_intel_path() -> str | None:
    """Have MKL take its Intel code path on this CPU whatever its vendor: a one-function library (built once
    with the C compiler into a per-user temporary folder: `mkl_intel_library`) loaded into the process's global
    scope before torch, so that MKL's own vendor check, which torch's MKL calls through its symbol table, finds
    its answer there. MKL then picks its kernels by the CPU's ISA (AVX-512 on a Zen 4), as it does on an Intel
    CPU. Every result that goes through MKL may change in its last bits (another order of summation in another
    kernel), the exact engines' included, so it is the user's choice (`NORMEXP_MKL_PATH=intel`), never a default
    but in a compiled fast sweep's workers where measured faster (engines/fast/mkl_path.py). Returns why it was
    not taken (torch loaded already, not Linux, no C compiler, the build failed), or None."""
    if _MKL_SHIM_LOADED:
        return None
    if "torch" in sys.modules:
        return "torch is loaded already (MKL chose its path at its first call)"
    library = mkl_intel_library()
    if isinstance(library, str):
        return library
    import ctypes

    try:
        ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL | os.RTLD_NOW)
    except OSError as exc:
        return f"loading its library failed ({exc})"
    _MKL_SHIM_LOADED.append(str(library))
    return None


def mkl_intel_library() -> Path | str:
    """The library that answers MKL's vendor question, built once with the C compiler into a per-user temporary
    folder (not loaded); or why there is none (not Linux, no C compiler, the build failed)."""
    if not sys.platform.startswith("linux"):
        return f"not on {sys.platform} (Linux only)"
    import hashlib
    import shutil
    import tempfile

    compiler = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if compiler is None:
        return "no C compiler (cc, gcc) to build its library"
    source = _MKL_SHIM_HEAD + _MKL_SHIM
    folder = Path(tempfile.gettempdir()) / f"normexp-{os.getuid()}"
    library = folder / f"mkl-intel-path-{hashlib.sha256(source.encode()).hexdigest()[:12]}.so"
    if not library.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        c_file = library.with_suffix(f".{os.getpid()}.c")
        built = library.with_suffix(f".{os.getpid()}.tmp")
        try:
            c_file.write_text(source)
            done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(built), str(c_file)],
                                  capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                return f"{compiler} failed: {(done.stderr.strip().splitlines() or [''])[0][:200]}"
            os.replace(built, library)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"building its library failed ({type(exc).__name__}: {exc})"
        finally:
            for stray in (c_file, built):
                stray.unlink(missing_ok=True)
    return library


def mkl_path(torch: ModuleType) -> str:
    """What `normexp doctor` says of MKL's code path in this process (after one matrix product, MKL's first
    call): taken as Intel's, with whether MKL asked the library loaded for it, or MKL's own choice."""
    if not _MKL_SHIM_LOADED:
        return f"MKL's own choice ({MKL_PATH_VARIABLE}=intel: its Intel code path on any CPU)"
    import ctypes

    torch.ones(64, 64) @ torch.ones(64, 64)
    asked = ctypes.c_long.in_dll(ctypes.CDLL(_MKL_SHIM_LOADED[0]), "normexp_mkl_asked").value
    return f"Intel's, on any CPU ({MKL_PATH_VARIABLE}=intel; MKL asked {asked} times so far)"


@dataclass(frozen=True)
class Environment:
    """The facts `normexp doctor` prints, in its order."""

    lines: list[tuple[str, str]] = field(default_factory=list)

    def as_text(self) -> str:
        width = max(len(key) for key, _ in self.lines)
        return "".join(f"{key + ':':<{width + 1}} {value}\n" for key, value in self.lines)


def describe() -> Environment:
    """Collect the facts of this process's installation (imports torch)."""
    lines = [
        ("normexp", __version__),
        ("commit", git_commit() or "unknown (not run from a git checkout)"),
        ("python", f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"),
        ("platform", f"{platform.platform()} {platform.machine()}, {os.cpu_count()} CPUs"),
    ]
    cpu = cpu_info()
    lines += [("cpu", cpu.model), *([("cpu id", cpu.ident)] if cpu.ident else []),
              ("cpu features", cpu.features_text())]
    lines += _torch_lines()
    lines.append(("dask extra", _dask_extra()))
    lines += [(name, os.environ[name]) for name in RELEVANT_VARIABLES if name in os.environ]
    return Environment(lines)


def _torch_lines() -> list[tuple[str, str]]:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken torch is the report
        return [("torch", f"not importable ({type(exc).__name__}: {exc})")]
    return [
        ("torch", f"{torch.__version__} ({os.path.dirname(torch.__file__)})"),
        ("torch build", torch_build(torch.version.cuda, getattr(torch.version, "hip", None))),
        ("torch cpu kernels", torch_cpu_capability(torch)),
        ("torch blas", torch_blas(torch)),
        ("mkl path", mkl_path(torch)),
        ("threads", f"{torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op"),
        ("devices", visible_devices(torch)),
    ]


def torch_build(cuda: str | None, hip: str | None = None) -> str:
    """`CPU`, `CUDA 12.4` or `ROCm 6.1`: what the torch wheel was built for."""
    if cuda:
        return f"CUDA {cuda}"
    if hip:
        return f"ROCm {hip}"
    return "CPU"


def visible_devices(torch: ModuleType) -> str:
    """`cpu`, plus each accelerator torch can use now, by index and name."""
    devices = ["cpu"]
    cuda = torch.cuda
    if cuda.is_available():
        devices += [f"cuda:{i} {cuda.get_device_name(i)}" for i in range(cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append("mps")
    return ", ".join(devices)


def _dask_extra() -> str:
    """`installed (dask X, distributed Y, dask-jobqueue Z)` or `not installed (...)`."""
    found = {}
    for dist in ("dask", "distributed", "dask-jobqueue"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    listed = ", ".join(f"{dist} {version or 'missing'}" for dist, version in found.items())
    if all(found.values()):
        return f"installed ({listed})"
    return f"not installed ({listed}; pip install 'normexp[dask]' for --cluster)"


# ----------------------------------------------------------------------------- the CPU and the checkout

# The instruction-set features that decide which kernels torch's BLAS and vectorised ops take (and so
# the last bits of a result): x86-64's AVX2 and FMA, each AVX-512 subset, AMX; ARM's NEON (asimd), SVE.
KERNEL_FEATURES = (
    "sse4_2", "fma", "avx", "avx2", "avx_vnni", "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl",
    "avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_vnni", "avx512_bitalg", "avx512_vpopcntdq",
    "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
    "neon", "asimd", "asimdhp", "asimddp", "sve", "sve2", "bf16", "i8mm", "sme",
)


@dataclass(frozen=True)
class CpuInfo:
    model: str  # the processor's name, or "unknown"
    features: tuple[str, ...] = ()  # of KERNEL_FEATURES, those this CPU has, in that order
    source: str = ""  # where they were read: /proc/cpuinfo, sysctl, or nothing
    ident: str = ""  # vendor, family and model numbers ("AuthenticAMD family 25 model 17"), where given

    def isa_text(self) -> str:
        """The features a reader of a speed figure asks about first: `avx2 avx512f amx_tile`, with `no
        avx512f` / `no amx` said where the CPU lacks them (an x86-64 CPU; elsewhere `features_text`)."""
        if not any(f in self.features for f in ("sse4_2", "avx", "avx2")):
            return self.features_text()
        named = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile") if f in self.features]
        missing = [f"no {f}" for f, lead in (("avx512f", "avx512f"), ("amx", "amx_tile")) if lead not in self.features]
        return " ".join(named + missing)

    def features_text(self) -> str:
        if self.features:
            return " ".join(self.features)
        return f"none of {', '.join(KERNEL_FEATURES)}" if self.source else "unknown (nothing to read them from)"


def cpu_info(cpuinfo: str | None = None, sysctl: dict[str, str] | None = None) -> CpuInfo:
    """This machine's CPU model and kernel-changing features: from /proc/cpuinfo (Linux), else macOS's
    sysctl; `CpuInfo("unknown")` where neither answers (never raises). The arguments stand in for
    the two sources in tests."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    if cpuinfo.strip():
        return _from_cpuinfo(cpuinfo)
    if sysctl is None:
        sysctl = _sysctl() if sys.platform == "darwin" else {}
    if sysctl:
        model = sysctl.get("machdep.cpu.brand_string") or "unknown"
        flags = " ".join(sysctl.get(k, "") for k in ("machdep.cpu.features", "machdep.cpu.leaf7_features"))
        found = {f.lower().replace(".", "_") for f in flags.split()}
        if sysctl.get("hw.optional.neon") == "1" or sysctl.get("hw.optional.AdvSIMD") == "1":
            found.add("neon")
        if "avx2_0" in found:
            found.add("avx2")
        return CpuInfo(model, tuple(f for f in KERNEL_FEATURES if f in found), "sysctl")
    return CpuInfo(platform.processor() or "unknown", (), "")


def _from_cpuinfo(text: str) -> CpuInfo:
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    model = fields.get("model name") or fields.get("Hardware") or fields.get("Model") or ""
    if not model and "CPU part" in fields:  # ARM Linux names no model: give its implementer and part
        model = f"ARM implementer {fields.get('CPU implementer', '?')} part {fields['CPU part']}"
    found = set((fields.get("flags") or fields.get("Features") or "").split())
    ident = " ".join(f"{name} {fields[key]}" if name else fields[key]
                     for key, name in (("vendor_id", ""), ("cpu family", "family"), ("model", "model"))
                     if fields.get(key))
    return CpuInfo(model or "unknown", tuple(f for f in KERNEL_FEATURES if f in found), "/proc/cpuinfo", ident)


def _sysctl() -> dict[str, str]:
    keys = ("machdep.cpu.brand_string", "machdep.cpu.features", "machdep.cpu.leaf7_features",
            "hw.optional.neon", "hw.optional.AdvSIMD")
    values = {}
    for key in keys:
        try:
            done = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return values
        if done.returncode == 0:
            values[key] = done.stdout.strip()
    return values


def torch_blas(torch: ModuleType) -> str:
    """The BLAS torch's CPU matrix products call and the oneDNN beside it, with their versions, from the build's
    own description (`MKL 2024.2, oneDNN 3.12.0`; `OpenBLAS`...): MKL takes another code path on a CPU that
    is not Intel's (docs/performance.md)."""
    try:
        text = torch.__config__.show()
    except Exception:  # noqa: BLE001 - an older or a broken torch: say so, never raise
        return "unknown"
    found = []
    mkl = re.search(r"Math Kernel Library Version ([\w.]+)", text)
    if mkl:
        found.append(f"MKL {mkl.group(1)}")
    else:
        blas = re.search(r"BLAS_INFO=(\w+)", text)
        found.append(blas.group(1) if blas else "no BLAS named")
    dnn = re.search(r"MKL-DNN v([\w.]+)", text)
    if dnn:
        found.append(f"oneDNN {dnn.group(1)}")
    return ", ".join(found)


def cpu_summary() -> str:
    """One line naming the machine a speed figure was measured on: the CPU, its ISA, torch and its BLAS
    (imports torch). `make bench` prints it beside every figure."""
    import torch

    cpu = cpu_info()
    ident = f", {cpu.ident}" if cpu.ident else ""
    return (f"{cpu.model}{ident}, {os.cpu_count()} CPUs, {cpu.isa_text()}; torch {torch.__version__} "
            f"({torch_cpu_capability(torch)} kernels), {torch_blas(torch)}")


def torch_cpu_capability(torch: ModuleType) -> str:
    """The vector ISA torch dispatches its CPU kernels for (`AVX512`, `AVX2`, `DEFAULT`...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - an older torch has no such call
        return "unknown"


_COMMIT = re.compile(r"[0-9a-f]{40}")


def git_commit(where: str | None = None) -> str | None:
    """The commit of the checkout normexp runs from, `+dirty` where its tracked files have changes;
    None where it is not a git checkout or git is missing (never raises)."""
    where = where or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0 or not _COMMIT.fullmatch(head.stdout.strip()):
            return None
        status = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    dirty = status.returncode != 0 or bool(status.stdout.strip())
    return head.stdout.strip()[:12] + ("+dirty" if dirty else "")


_PROVENANCE: dict[str, str] = {}


def provenance() -> dict[str, str]:
    """What a result records of what made it: normexp's version and commit, the CPU, torch's build.
    Computed once per process (git is asked once)."""
    if not _PROVENANCE:
        import torch

        cpu = cpu_info()
        _PROVENANCE.update({
            "normexp": __version__,
            "commit": git_commit() or "unknown",
            "cpu": cpu.model,
            "cpu_features": " ".join(cpu.features),
            "torch": torch.__version__,
            "torch_build": torch_build(torch.version.cuda, getattr(torch.version, "hip", None)),
            "torch_cpu_kernels": torch_cpu_capability(torch),
        })
    return dict(_PROVENANCE)
