"""Shared fixtures: small configs that train in milliseconds, and the article transcription."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# CI draws the same hypothesis examples on every run, so a red CI is a reproducible defect and never a
# draw's luck; a developer's run keeps drawing new examples (and keeps the failures it finds).
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

sys.path.insert(0, str(Path(__file__).parent))  # tests/article_toy.py

REPO = Path(__file__).resolve().parents[1]


def done_markers(out: Path) -> list[Path]:
    """The done.json of every run folder swapped in, while a sweep may still be writing: a folder
    being built (hidden, `.<run_id>.tmp-<pid>`) is not a finished run yet."""
    return [p for p in out.glob("*/done.json") if not p.parent.name.startswith(".")]


@pytest.fixture
def write_yaml(tmp_path: Path):
    """Write a YAML string to a file under tmp_path and return its path."""

    def write(text: str, name: str = "sweep.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


SMALL_SWEEP = """\
name: small
base:
  model: {depth: 4, width: 8}
  optim: {name: adam, lr: 0.01}
  train: {steps: 5}
grid:
  norm.placement: [post, pre]
  norm.kind: [layernorm, rmsnorm]
seeds: [0, 1]
report: {steps: [0, 1, 5]}
"""
