"""Seeded toy tasks. Drawn from torch's global generator right after the model is built (SPEC §1).

`random_labels` is the article's task: X ~ randn(n_samples, d), y ~ randint(0, n_classes), learnt
full-batch. A model can only lower the loss below ln(n_classes) by memorising the 64 pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from normexp.config import DataConfig, ModelConfig


@dataclass(frozen=True)
class Task:
    x: torch.Tensor  # (n_samples, width) float32
    y: torch.Tensor  # (n_samples,) int64 class labels


def make_task(data: DataConfig, model: ModelConfig) -> Task:
    """Draw the task from the global generator, X first, then y (the article's order)."""
    x = torch.randn(data.n_samples, model.width)
    y = torch.randint(0, model.n_classes, (data.n_samples,))
    return Task(x, y)
