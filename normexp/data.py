"""Seeded tasks. Drawn from torch's global generator right after the model is built (SPEC §1).

`random_labels` is the article's task: X ~ randn(n_samples, d), y ~ randint(0, n_classes), learnt
full-batch. A model can only lower the loss below ln(n_classes) by memorising the 64 pairs.

The sequence tasks (`model.arch: transformer`; layouts in `normexp.config.sequence_shape`) draw
`n_samples` training sequences, then `n_val` held-out ones, all distinct, so the two splits never
share a sequence and the training split is the same whatever n_val. The model reads each sequence but
its last token and is scored at the answer positions only:

- `assoc_recall`: k1 v1 .. kP vP q1 a1 .. qP aP, keys distinct, queries a permutation of the keys;
  each answer is the value stored with its key (an induction-head task: it needs attention).
- `copy`: s1 .. sn 0 s1 .. sn; the answers are the copied half.
- `modular_add`: a + b = c with c = (a + b) mod p (Power et al. 2022, grokking): the p^2 sums shuffled,
  the first n_samples for training and the next n_val held out.

The text task, `shakespeare_char` (normexp/corpus.py: the shipped plays, by character, split 90/10), draws
nothing from the global generator. Its task holds the whole train split, x = train[:-1] and y = train[1:]
(y[i] is the character after x[i]), and each step reads `data.batch_size` windows of it, x[s:s+T] and
y[s:s+T] with T = data.seq_len, at starts drawn by `draw_windows` from the run's own generator (nanoGPT's
get_batch; normexp/engines/common.py `minibatches`). Its held-out set is `data.n_val` windows of the val
split at starts drawn from a generator seeded with VAL_SEED, whatever the run's seed: every run of a sweep
with the same seq_len and n_val is scored on the same characters. Every position is scored.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from normexp.config import TEXT_TASKS, DataConfig, ModelConfig, sequence_shape

VAL_SEED = 1_000_003  # the text task's held-out windows: one draw for every run, apart from the runs' seeds


@dataclass(frozen=True)
class Task:
    x: torch.Tensor  # random_labels: (n_samples, width) float32; sequence tasks: (n_samples, T) int64 tokens;
    # the text task: (n - 1,) int64, its train split but the last character
    y: torch.Tensor  # random_labels: (n_samples,) class labels; sequence tasks: (n_samples, A) answer tokens;
    # the text task: (n - 1,), the train split but the first character
    positions: torch.Tensor | None = None  # (A,) input positions whose next token is an answer
    val_x: torch.Tensor | None = None  # the held-out split, shaped like x and y
    val_y: torch.Tensor | None = None


def make_task(data: DataConfig, model: ModelConfig) -> Task:
    """Draw the task from the global generator (random_labels: X first, then y, the article's order)."""
    if data.task in TEXT_TASKS:
        return make_text_task(data)
    if data.task != "random_labels":
        return make_sequence_task(data)
    x = torch.randn(data.n_samples, model.width)
    y = torch.randint(0, model.n_classes, (data.n_samples,))
    return Task(x, y)


def make_sequence_task(data: DataConfig) -> Task:
    """Draw n_samples training sequences, then n_val held-out ones distinct from them (so the training
    split never depends on n_val), and cut each into input and answers."""
    shape = sequence_shape(data)
    if data.task == "modular_add":
        sums = _modular_add(data, data.n_samples + data.n_val)
        train, held = sums[:data.n_samples], sums[data.n_samples:]
    else:
        train = _distinct(data, data.n_samples, taken=set())
        held = _distinct(data, data.n_val, taken={tuple(row) for row in train.tolist()})
    positions = torch.tensor(shape.positions)
    return Task(train[:, :-1], train[:, positions + 1], positions, held[:, :-1], held[:, positions + 1])


def _distinct(data: DataConfig, wanted: int, taken: set[tuple[int, ...]]) -> torch.Tensor:
    """`wanted` distinct sequences none of which is in `taken`, drawn in rounds (a repeat is dropped,
    its first draw kept); the config guarantees at least twice as many exist, so few rounds are needed."""
    draw = _assoc_recall if data.task == "assoc_recall" else _copy
    kept: dict[tuple[int, ...], torch.Tensor] = {}
    while len(kept) < wanted:
        for row in draw(data, wanted - len(kept)):
            if (key := tuple(row.tolist())) not in taken:
                kept.setdefault(key, row)
    return torch.stack(list(kept.values())[:wanted])


def _assoc_recall(data: DataConfig, n: int) -> torch.Tensor:
    pairs, keys = sequence_shape(data).seq_len // 4, data.vocab // 2
    key = _distinct_keys(n, pairs, keys)
    value = torch.randint(keys, data.vocab, (n, pairs))
    order = torch.argsort(torch.rand(n, pairs), dim=1)  # the order of the queries
    stored = torch.stack([key, value], dim=2).reshape(n, 2 * pairs)
    queried = torch.stack([key.gather(1, order), value.gather(1, order)], dim=2).reshape(n, 2 * pairs)
    return torch.cat([stored, queried], dim=1)


def _distinct_keys(n: int, pairs: int, keys: int) -> torch.Tensor:
    """(n, pairs) keys from 0..keys-1, distinct within a row, uniform over ordered choices: Floyd's
    sampling of a subset, then a shuffle; O(n * pairs) memory, never n * keys (up to 32768 keys)."""
    chosen = torch.empty(n, 0, dtype=torch.long)
    for top in range(keys - pairs, keys):
        pick = torch.randint(0, top + 1, (n, 1))
        chosen = torch.cat([chosen, torch.where((chosen == pick).any(1, keepdim=True), top, pick)], dim=1)
    return chosen.gather(1, torch.argsort(torch.rand(n, pairs), dim=1))


def _copy(data: DataConfig, n: int) -> torch.Tensor:
    half = (sequence_shape(data).seq_len - 1) // 2
    tokens = torch.randint(1, data.vocab, (n, half))
    return torch.cat([tokens, torch.zeros(n, 1, dtype=torch.long), tokens], dim=1)


def _modular_add(data: DataConfig, wanted: int) -> torch.Tensor:
    p = data.vocab - 2
    pair = torch.randperm(p * p)[:wanted]
    a, b = pair // p, pair % p
    plus, equals = torch.full_like(a, p), torch.full_like(a, p + 1)
    return torch.stack([a, plus, b, equals, (a + b) % p], dim=1)


def make_text_task(data: DataConfig) -> Task:
    """The text task: its train split whole, and n_val fixed windows of its val split (VAL_SEED)."""
    train, val = _text_splits()
    length = sequence_shape(data).seq_len - 1
    held = torch.Generator().manual_seed(VAL_SEED)
    val_x, val_y = draw_windows(val[:-1], val[1:], length, data.n_val, held)
    return Task(train[:-1], train[1:], torch.arange(length), val_x, val_y)


def draw_windows(x: torch.Tensor, y: torch.Tensor, length: int, count: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` windows of `length` tokens at random starts, (count, length) inputs and targets: nanoGPT's
    get_batch, `ix = torch.randint(len(data) - block_size, (batch_size,))`, from `generator`."""
    return read_windows(x, y, window_starts(len(x), length, count, generator), length)


def window_starts(tokens: int, length: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` random starts of `length`-token windows in `tokens` tokens, (count,), from `generator`: the
    one draw `draw_windows` makes."""
    return torch.randint(tokens - length + 1, (count,), generator=generator)


def read_windows(x: torch.Tensor, y: torch.Tensor, starts: torch.Tensor,
                 length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows of `length` tokens at `starts` (any shape S): inputs and targets, (*S, length) each."""
    index = (starts[..., None] + torch.arange(length)).to(x.device)
    return x[index], y[index]


@functools.cache
def _text_splits() -> tuple[torch.Tensor, torch.Tensor]:
    """The shipped text's train and val splits as int64 token tensors (read once per process)."""
    from normexp.corpus import load

    corpus = load()
    return torch.from_numpy(corpus.train.astype("int64")), torch.from_numpy(corpus.val.astype("int64"))
