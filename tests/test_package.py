"""normexp works from a wheel installed outside the checkout: `normexp studies` finds its study configs
(package data), and nothing reads the repository through `__file__`."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.process  # pip builds and installs a wheel; normexp runs from it


def test_studies_run_from_a_wheel_installed_outside_the_checkout(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(REPO)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = wheels.glob("normexp-*.whl")
    shipped = zipfile.ZipFile(wheel).namelist()
    for config in (REPO / "configs").rglob("*.yaml"):
        assert f"normexp/configs/{config.relative_to(REPO / 'configs').as_posix()}" in shipped
    assert {"normexp/page/page.js", "normexp/page/page.css"} <= set(shipped)  # the report page's script and style
    for text in ("shakespeare_char.txt.gz", "README.md", "LICENSE.txt"):  # the real-text task's text, source, licence
        assert f"normexp/texts/{text}" in shipped
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site),
                    str(wheel)], check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = subprocess.run([sys.executable, "-m", "normexp", "studies", "--help"], capture_output=True, text=True,
                         env=env, cwd=elsewhere)
    assert run.returncode == 0 and "REPORT.md" in run.stdout, run.stderr
    code = ("import normexp, normexp.studies.run as s; from normexp.config import load_sweep; "
            "print(normexp.__file__); print(len([load_sweep(p, []) for p in (s.CONFIGS / 'studies').glob('*.yaml')])); "
            "import normexp.corpus as c; print(len(c.text()))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=elsewhere)
    assert found.returncode == 0, found.stderr
    where, count, chars = found.stdout.split()
    assert Path(where).is_relative_to(site) and int(count) == len(list((REPO / "configs" / "studies").glob("*.yaml")))
    assert int(chars) == 5_057_198  # the installed package's own text, checked against its sha256 as it loads
