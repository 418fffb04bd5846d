"""The data section of a run (`data.*`): which task, its sizes, and the rules that fit its keys together.

- `random_labels`, the FFN toy's task, uses `n_samples` only.
- The synthetic sequence tasks (`SEQUENCE_TASKS`) draw `n_samples` training and `n_val` held-out
  sequences of `seq_len` tokens over `vocab` tokens; `sequence_shape` gives their layout (where the
  answers are), `sequence_problem` the first key they cannot work with.
- The text task (`TEXT_TASKS`: `shakespeare_char`, normexp/corpus.py) trains on the shipped text: its
  vocabulary is the text's 84 characters (`data.vocab` is set to it), each step reads `batch_size` random
  windows of `seq_len` characters (the context length, nanoGPT's block_size; unset: 64) of the train
  split, and `n_val` fixed windows of the val split are its held-out set. `batch_size` unset is 32;
  `n_samples` does not apply. A sweep's base leaves vocab and batch_size to each run (`keep_inert`), so
  a grid over data.task resolves them per task.

Errors are blamed on one key (`cross_key_error`); nothing here reads the text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, ValidationInfo, model_validator

from normexp.config.fields import _Section, cross_key_error, keeps_inert

TaskName = Literal["random_labels", "assoc_recall", "copy", "modular_add", "shakespeare_char"]
SEQUENCE_TASKS = ("assoc_recall", "copy", "modular_add")  # synthetic, the Transformer's; random_labels is the FFN's
TEXT_TASKS = ("shakespeare_char",)  # the Transformer's real text (normexp/corpus.py)
TRANSFORMER_TASKS = SEQUENCE_TASKS + TEXT_TASKS
MODULAR_ADD_MAX_VOCAB = 2050  # p = 2048: randperm(p^2) is 32 MiB (Power et al. use p = 97)
DEFAULT_SEQ_LEN = {"assoc_recall": 16, "copy": 17, "modular_add": 5, "shakespeare_char": 64}
TEXT_BATCH_SIZE = 32  # data.batch_size of a text task left unset: windows per step
VOCAB_SIZE = 84  # shakespeare_char's vocabulary: its text's distinct characters (normexp/corpus.py checks them)


class DataConfig(_Section):
    task: TaskName = "random_labels"
    n_samples: int = Field(64, ge=1, le=10_000_000)  # sequence tasks: the training split's size
    vocab: int = Field(16, ge=2, le=65_536)  # sequence tasks: token count (modular_add: p + 2 tokens)
    seq_len: int | None = Field(None, ge=2, le=4096)  # sequence tasks: tokens per sequence; None: the task's
    n_val: int = Field(128, ge=1, le=10_000_000)  # sequence tasks: the held-out split's size
    batch_size: int | None = Field(None, ge=1, le=10_000_000)  # sequence tasks: minibatch; None: full batch

    @model_validator(mode="after")
    def _task_shape(self, info: ValidationInfo) -> DataConfig:
        if self.task == "random_labels":
            for key in ("vocab", "seq_len", "n_val", "batch_size"):
                if getattr(self, key) != DataConfig.model_fields[key].default:
                    raise cross_key_error(f"data.{key}", "applies to the sequence tasks "
                                          f"({', '.join(TRANSFORMER_TASKS)}), not to random_labels")
            return self
        problem = text_problem(self) if self.task in TEXT_TASKS else sequence_problem(self)
        if problem is not None:
            raise cross_key_error(*problem)
        if self.seq_len == DEFAULT_SEQ_LEN[self.task]:
            # the task's own length written out is the same run as leaving it unset: one config, one run id
            object.__setattr__(self, "seq_len", None)
        if self.task in TEXT_TASKS and not keeps_inert(info):
            object.__setattr__(self, "vocab", VOCAB_SIZE)  # the text's characters, whatever the base said
            if self.batch_size is None:
                object.__setattr__(self, "batch_size", TEXT_BATCH_SIZE)
        return self


@dataclass(frozen=True)
class SequenceShape:
    """The layout of a sequence task (normexp/data.py draws it): every sequence has `seq_len` tokens;
    the model reads the first seq_len - 1 and is scored where its next token is an answer, at input
    `positions`; `capacity` is how many distinct sequences the task has. A text task's sequence is a
    window of data.seq_len + 1 characters: the model reads data.seq_len and is scored at every one."""

    seq_len: int
    positions: tuple[int, ...]
    capacity: int


def sequence_shape(data: DataConfig) -> SequenceShape:
    """assoc_recall: k1 v1 .. kP vP q1 a1 .. qP aP (P = seq_len / 4 distinct keys from the lower half of
    the vocabulary, values from the upper half, the queries a permutation of the keys); copy: s1 .. sn 0
    s1 .. sn (n = (seq_len - 1) / 2 tokens from 1..vocab-1, 0 the separator); modular_add: a + b = c
    with p = vocab - 2 (tokens p and p + 1 are '+' and '='); shakespeare_char: seq_len characters of
    context, each followed by the character to predict."""
    length = data.seq_len if data.seq_len is not None else DEFAULT_SEQ_LEN[data.task]
    if data.task in TEXT_TASKS:
        return SequenceShape(length + 1, tuple(range(length)), 0)  # capacity: windows, not a count of sequences
    if data.task == "assoc_recall":
        pairs, keys = length // 4, data.vocab // 2
        positions = tuple(2 * pairs + 2 * j for j in range(pairs))
        capacity = math.perm(keys, pairs) * (data.vocab - keys) ** pairs * math.factorial(pairs) if keys >= pairs else 0
        return SequenceShape(length, positions, capacity)
    if data.task == "copy":
        n = (length - 1) // 2
        return SequenceShape(length, tuple(range(n, 2 * n)), (data.vocab - 1) ** n)
    return SequenceShape(length, (3,), max(data.vocab - 2, 0) ** 2)


def text_problem(data: DataConfig) -> tuple[str, str] | None:
    """(key, why) for the first data key a text task cannot work with, else None."""
    if data.n_samples != DataConfig.model_fields["n_samples"].default:
        return "data.n_samples", (f"applies to the synthetic tasks ({', '.join(SEQUENCE_TASKS)}): {data.task} "
                                  "trains on its text's train split (data.batch_size windows a step)")
    if data.vocab not in (DataConfig.model_fields["vocab"].default, VOCAB_SIZE):
        return "data.vocab", (f"{data.task}'s vocabulary is its text's {VOCAB_SIZE} characters: leave it unset, "
                              f"got {data.vocab}")
    return None


def sequence_problem(data: DataConfig) -> tuple[str, str] | None:
    """(key, why) for the first data key a synthetic sequence task cannot work with, else None."""
    shape, given = sequence_shape(data), data.seq_len
    if data.task == "assoc_recall" and given is not None and (given % 4 or given < 8):
        return "data.seq_len", f"assoc_recall needs a multiple of 4, at least 8 (2 pairs, 2 queries), got {given}"
    if data.task == "copy" and given is not None and (given % 2 == 0 or given < 5):
        return "data.seq_len", f"copy needs an odd length, at least 5 (2 tokens, separator, 2 copies), got {given}"
    if data.task == "modular_add" and given is not None and given != 5:
        return "data.seq_len", f"modular_add sequences are 'a + b = c', 5 tokens: leave it unset, got {given}"
    if data.task == "modular_add" and data.vocab > MODULAR_ADD_MAX_VOCAB:
        return "data.vocab", (f"modular_add shuffles all p^2 sums (p = vocab - 2): at most {MODULAR_ADD_MAX_VOCAB} "
                              f"tokens ({(MODULAR_ADD_MAX_VOCAB - 2) ** 2} sums), got {data.vocab}")
    smallest = {"assoc_recall": max(2 * (shape.seq_len // 4), 4), "copy": 3, "modular_add": 4}[data.task]
    if data.vocab < smallest:
        return "data.vocab", f"{data.task} at seq_len {shape.seq_len} needs >= {smallest} tokens, got {data.vocab}"
    wanted = data.n_samples + data.n_val
    # modular_add splits its p^2 sums exactly; the others draw at random, so keep them far from full
    if shape.capacity < (wanted if data.task == "modular_add" else 2 * wanted):
        return "data.vocab", (f"{data.task} has {shape.capacity} distinct sequences at vocab {data.vocab}, too few "
                              f"for n_samples + n_val = {wanted} distinct ones: raise vocab or lower the counts")
    if data.batch_size is not None and data.batch_size > data.n_samples:
        return "data.batch_size", f"must be <= data.n_samples {data.n_samples}, got {data.batch_size}"
    return None
