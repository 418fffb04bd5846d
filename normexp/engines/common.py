"""What every engine shares: a run's result, its seeded start, its loss, its batches, its threads.

Each engine (reference, batched, fast) builds a run's model and task with `seeded_init` (the article's
order of random draws), computes the loss with `loss_and_acc`, draws minibatches with `batch_order` (a text
task's windows: `minibatches`), scores the held-out split with `held_out` (at the steps `evaluates` names:
every train.eval_every steps, the last, and the step at which a run stops), and returns one `RunResult` per
run. Nothing here imports an engine, the store, the sweep or an executor.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from normexp.config import (
    METRIC_COLUMNS,
    TEXT_TASKS,
    VAL_COLUMNS,
    Z_LOSS_COLUMN,
    RunConfig,
    chance_classes,
    trained_threshold,
)
from normexp.data import Task, make_task, read_windows, window_starts
from normexp.models.ffn import Net
from normexp.models.transformer import Transformer

STALL_TOLERANCE = 1e-3  # stop_when: stalled: an improvement counts if it beats the best loss by this fraction
DIVERGE_FACTOR = 10.0  # stop_when: diverged: a loss above this many times the first step's loss


@dataclass
class EarlyStop:
    """`train.stop_when`'s rule, the one definition the three engines share (through `RunResult.check_loss`).
    `observe(loss)` takes each recorded step's training loss in order and returns True at the step where
    the run stops: the step at which the condition has held for `patience` consecutive steps.

    - trained: the loss is below `below` (train.stop_below, else the default trained rule ln(C)/10).
    - stalled: the loss is not below best * (1 - STALL_TOLERANCE), best the lowest loss that counted as
      an improvement so far (Keras' EarlyStopping with a relative min_delta); the first step always
      counts. A non-finite loss is no improvement.
    - diverged: the loss is above DIVERGE_FACTOR x the first step's loss, or non-finite."""

    when: str
    patience: int
    below: float = math.inf
    steps: int = 0  # train.steps: a rule that fires at the last step stops nothing (the run ran every step)
    first: float | None = None
    best: float = math.inf
    streak: int = 0

    @classmethod
    def of(cls, cfg: RunConfig) -> EarlyStop | None:
        """The run's rule, or None without train.stop_when."""
        train = cfg.train
        if train.stop_when is None:
            return None
        below = train.stop_below if train.stop_below is not None else trained_threshold(chance_classes(cfg))
        return cls(train.stop_when, train.stop_patience, below, train.steps)

    def holds(self, loss: float) -> bool:
        """Whether the condition holds at this step (updating the first and best losses)."""
        if self.first is None:
            self.first = loss
        if self.when == "trained":
            return loss < self.below
        if self.when == "diverged":
            return not loss <= DIVERGE_FACTOR * self.first
        if math.isfinite(loss) and (self.best == math.inf or loss < self.best - STALL_TOLERANCE * abs(self.best)):
            self.best = loss
            return False
        return True

    def observe(self, loss: float) -> bool:
        self.streak = self.streak + 1 if self.holds(loss) else 0
        return self.streak >= self.patience


@dataclass
class RunResult:
    """What one run produced: its metric columns (one entry per recorded step) and how it ended."""

    metrics: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in METRIC_COLUMNS})
    diverged: bool = False
    wall_s: float = 0.0
    threads: int = 1
    engine: str = "reference"
    blocks: dict[str, list[float]] | None = None  # blocks.csv's columns, with train.log_blocks
    sharpness: dict[str, list[float]] | None = None  # sharpness.csv's columns (normexp/sharpness.py), log_sharpness
    early_stop: EarlyStop | None = None  # train.stop_when's rule (`EarlyStop.of`), None without it
    stopped_at: int | None = None  # the step at which train.stop_when stopped the run
    stop_reason: str | None = None  # and why: train.stop_when (a `diverged` stop marks the run diverged)

    @property
    def losses(self) -> list[float]:
        return self.metrics["loss"]

    @property
    def status(self) -> str:
        return "diverged" if self.diverged else "completed"

    def check_loss(self, loss: float, stop_on_nonfinite: bool) -> bool:
        """Note a non-finite loss (the run is then diverged); True if the run stops at this step."""
        finite = math.isfinite(loss)
        self.diverged |= not finite
        return not finite and stop_on_nonfinite

    def check_early_stop(self, step: int, loss: float) -> bool:
        """Feed train.stop_when's rule this step's loss; True (and the stop noted) if the run stops after
        recording this step. Called for a step that goes on past `check_loss`."""
        if self.early_stop is None or not self.early_stop.observe(loss) or step >= self.early_stop.steps:
            return False
        self.stopped_at, self.stop_reason = step, self.early_stop.when
        self.diverged |= self.stop_reason == "diverged"
        return True

    def record(self, step: int, loss: float, acc: float, lr: float, grad_norm: float,
               val: tuple[float, float] | None = None, z: float | None = None) -> None:
        """One recorded step; `val` (val_loss, val_acc) for a sequence task, whose columns then follow, and
        `z` (the z-loss term, with train.z_loss) after them."""
        for column, value in zip(METRIC_COLUMNS, (step, loss, acc, lr, grad_norm)):
            self.metrics[column].append(value)
        if val is not None:
            for column, value in zip(VAL_COLUMNS, val):
                self.metrics.setdefault(column, []).append(value)
        if z is not None:
            self.metrics.setdefault(Z_LOSS_COLUMN, []).append(z)

    def score_stop(self, val: tuple[float, float]) -> None:
        """Write `val` (val_loss, val_acc) into the last recorded step, the one at which the run stopped: an
        engine learns of a stop from the step's loss, after the step was recorded (`evaluates`' stop)."""
        for column, value in zip(VAL_COLUMNS, val):
            self.metrics[column][-1] = value


StepCallback = Callable[[int, float], None]


# Seeding and drawing use torch's global generator: runs started from several threads of one process
# (a Dask worker with several threads, the sweep's paired runs) take turns, so each run sees exactly
# its own draws.
INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """Run with `threads` intra-op threads (None: leave torch's setting); yields the count in force."""
    before = torch.get_num_threads()
    if threads is not None and threads != before:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def grad_norm(params: list[torch.nn.Parameter]) -> float:
    """The global L2 norm of all gradients (what clip_grad_norm_ would see): each tensor's norm (one
    `_foreach_norm` call, the per-tensor `vector_norm` kernel), then the norm of those norms."""
    grads = [p.grad for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).item() if grads else 0.0


def build_model(cfg: RunConfig) -> Net | Transformer:
    """The run's model (`model.arch`): the article's FFN toy, or the causal Transformer."""
    if cfg.model.arch == "transformer":
        return Transformer(cfg.model, cfg.norm, cfg.data)
    return Net(cfg.model, cfg.norm)


def seeded_init(cfg: RunConfig) -> tuple[Net | Transformer, Task]:
    """The run's model and task, drawn in the article's order from `cfg.seed` (on the CPU, so every
    device and engine starts from the same weights); then Admin's profiling on the task's inputs."""
    with INIT_LOCK:
        torch.manual_seed(cfg.seed)
        model = build_model(cfg)
        task = make_task(cfg.data, cfg.model)
    model.profile_at_init(init_batch(cfg, task)[0])  # Admin only, after both draws; draws nothing itself
    return model, task


def init_batch(cfg: RunConfig, task: Task) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets a measurement at init reads (Admin's profile, gradients at init): the
    training split whole, or a text task's first minibatch (its split is millions of characters)."""
    return next(minibatches(cfg, task)) if cfg.data.task in TEXT_TASKS else (task.x, task.y)


def loss_and_acc(logits: torch.Tensor, y: torch.Tensor,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy and accuracy. Sequence tasks: logits (n, T, vocab) are read at the answer
    `positions` only, against the answers y (n, A), every answer token counting once."""
    if positions is not None:
        logits, y = answer_logits(logits, positions), y.flatten()
    return F.cross_entropy(logits, y), (logits.argmax(-1) == y).float().mean()


def answer_logits(logits: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """The logits the loss reads, (tokens, classes): a sequence task's answer positions, flattened."""
    return logits[:, positions].flatten(0, 1) if positions is not None else logits


def z_loss(logits: torch.Tensor, positions: torch.Tensor | None, coef: float) -> torch.Tensor:
    """`train.z_loss`'s term, coef * mean(log(Z)^2) over the tokens the loss reads, Z = sum(exp(logits)) the
    softmax normaliser (PaLM; t5x losses.py `cross_entropy_with_logits`; OLMo train.py `cross_entropy_loss`'s
    `logits.logsumexp(-1).pow(2)`). The mean over the tokens read is the one OLMo's trainer takes; OLMo's
    `cross_entropy_loss` itself, with reduction "mean", zeroes the ignored positions and divides by all of them."""
    return coef * answer_logits(logits, positions).logsumexp(-1).pow(2).mean()


def batch_order(n_samples: int, batch_size: int, seed: int, steps: int) -> list[torch.Tensor]:
    """The training indices of steps 0..steps with minibatches (`data.batch_size`): epochs of a fresh
    permutation each, drawn from a generator seeded with the run's seed (not the global one, so the
    model and task keep their draws); an epoch's incomplete last batch is dropped."""
    generator = torch.Generator().manual_seed(seed)
    per_epoch = n_samples // batch_size
    order: list[torch.Tensor] = []
    while len(order) < steps + 1:
        perm = torch.randperm(n_samples, generator=generator)
        order += [perm[i * batch_size:(i + 1) * batch_size] for i in range(per_epoch)]
    return order[:steps + 1]


def minibatches(cfg: RunConfig, task: Task) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's training inputs and targets, step 0 first: the whole split (no data.batch_size);
    `batch_order`'s seeded epochs; or, for a text task, data.batch_size random windows of its train split
    a step (nanoGPT's get_batch) at `text_starts`, drawn from a generator seeded with the run's seed (not
    the global one: the model keeps its draws), one draw a step."""
    data = cfg.data
    if data.task in TEXT_TASKS:
        for starts in text_starts(cfg, task):
            yield read_windows(task.x, task.y, starts, len(task.positions))
    if data.batch_size is None:
        while True:
            yield task.x, task.y
    for index in batch_order(data.n_samples, data.batch_size, cfg.seed, cfg.train.steps):
        yield task.x[index], task.y[index]


def text_starts(cfg: RunConfig, task: Task) -> Iterator[torch.Tensor]:
    """A text task's window starts, step after step from step 0, (data.batch_size,) each: `window_starts`
    from a generator seeded with the run's seed, one draw a step (`minibatches` reads them; the fast
    engine draws them ahead)."""
    generator = torch.Generator().manual_seed(cfg.seed)
    while True:
        yield window_starts(len(task.x), len(task.positions), cfg.data.batch_size, generator)


NOT_EVALUATED = (math.nan, math.nan)  # val_loss, val_acc of a step between two of train.eval_every's


def held_out(model: torch.nn.Module, task: Task, cfg: RunConfig, step: int) -> tuple[float, float] | None:
    """(val_loss, val_acc) at the steps `evaluates` names, NOT_EVALUATED at the others; None for a task
    without a held-out split. A text task's windows go through the model data.batch_size at a time."""
    if task.val_x is None:
        return None
    if not evaluates(cfg, step):
        return NOT_EVALUATED
    return validate(model, task, validation_rows(cfg))


def evaluates(cfg: RunConfig, step: int) -> bool:
    """Whether the held-out split is scored at `step` by the schedule: 0, k, 2k, ... (k = train.eval_every)
    and the last. The step at which a run stops before its last (train.stop_when fired there, or its loss is
    non-finite under train.stop_on_nonfinite) is scored too, where the schedule did not, so that a run's last
    recorded step always carries its score: an engine learns of a stop from the step's loss, and scores that
    step then (`RunResult.score_stop`), on the weights the step's loss was taken on, before any update."""
    return step % cfg.train.eval_every == 0 or step == cfg.train.steps


def validation_rows(cfg: RunConfig) -> int | None:
    """How many held-out sequences go through the model at once: a text task's data.batch_size, else all."""
    return cfg.data.batch_size if cfg.data.task in TEXT_TASKS else None


@torch.no_grad()
def validate(model: torch.nn.Module, task: Task, rows: int | None = None) -> tuple[float, float] | None:
    """(val_loss, val_acc) on the held-out split, or None for a task without one; `rows`: that many
    sequences a forward, the loss and accuracy then summed over every token and divided once."""
    if task.val_x is None:
        return None
    if rows is None:
        loss, acc = loss_and_acc(model(task.val_x), task.val_y, task.positions)
        return loss.item(), acc.item()
    loss_sum, correct = 0.0, 0.0
    for start in range(0, len(task.val_x), rows):
        logits = answer_logits(model(task.val_x[start:start + rows]), task.positions)
        y = task.val_y[start:start + rows].flatten()
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
    return loss_sum / task.val_y.numel(), correct / task.val_y.numel()


# ----------------------------------------------------------------------------- the loops' shared skeleton
#
# The three loops record, stop and time runs alike, and do so here. Each keeps its own step, because
# exactness allows no shared one: the reference runs torch's own ops for one run (the definition of
# correct); the batched engine stacks runs in the reference's very kernels (per-run losses summed, per-run
# gradient norms in the reference's memory order) to keep its bits; the fast engine steps vmap'd
# functional gradients and its own fused optimizer, within its contract of the reference.


def record_live(results: list[RunResult], live: list[bool], step: int, losses: list[float], accs: list[float],
                lrs: list[float], norms: list[float], stop_on_nonfinite: bool,
                vals: list[tuple[float, float] | None] | None = None, zs: list[float] | None = None) -> list[int]:
    """Record step `step` of each run still `live`; a run whose loss is non-finite is diverged, and with
    `stop_on_nonfinite` it stops there: its gradient norm is recorded as nan and it is live no more. A run
    that train.stop_when stops (`RunResult.check_early_stop`) records this step whole, and is live no more.
    Returns the runs that stopped at this step (their held-out score is the caller's: `evaluates`)."""
    stopped = []
    for r, result in enumerate(results):
        if live[r]:
            stop = result.check_loss(losses[r], stop_on_nonfinite)
            result.record(step, losses[r], accs[r], lrs[r], math.nan if stop else norms[r],
                          vals[r] if vals is not None else None, zs[r] if zs is not None else None)
            live[r] = not stop and not result.check_early_stop(step, losses[r])
            if not live[r]:
                stopped.append(r)
    return stopped


def share_wall_time(results: list[RunResult], start: float) -> list[RunResult]:
    """Give each run of a batch an equal share of the time since `start` (perf_counter); return them."""
    wall = (time.perf_counter() - start) / len(results)
    for result in results:
        result.wall_s = wall
    return results
