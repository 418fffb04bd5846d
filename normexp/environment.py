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
import sys
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType

from normexp import __version__

# Environment variables that change torch's threads or the devices it sees.
RELEVANT_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "MKL_DYNAMIC", "CUDA_VISIBLE_DEVICES")


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
        ("python", f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"),
        ("platform", f"{platform.platform()} {platform.machine()}, {os.cpu_count()} CPUs"),
    ]
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
