"""The shipped text of the real-text task (`data.task: shakespeare_char`): Shakespeare's plays by character.

    text()      the 5,057,198 characters (normexp/texts/shakespeare_char.txt.gz, checked against SHA256)
    load()      its vocabulary and its train / val split as token ids (numpy uint8)
    floors()    the reference losses of the split: uniform, unigram, bigram (nats per character)

- The text is package data (normexp/texts/README.md: source, file list, licence): nothing is downloaded,
  and nothing here reads it until a function is called (a run of another task never does). Each function
  reads it once per process.
- Tokens are characters. The vocabulary is the text's distinct characters, sorted (token i is
  `vocabulary[i]`), as nanoGPT's data/shakespeare_char/prepare.py makes it: 84 characters, all ASCII.
- The split is contiguous, as prepare.py's: the first int(0.9 n) characters train, the rest validate.
- The floors (what a model that ignores the context, or all but the last character, reaches on the val
  split) are cross-entropies of the val split under counts of the train split, in nats per character:
  uniform ln V; unigram -mean log p(c) with p the train split's character frequencies, unsmoothed
  (every character of the val split occurs in the train split); bigram -mean log p(b | a) over the val
  split's consecutive pairs (a, b), with add-one smoothing over the V characters, p(b | a) =
  (n(a, b) + 1) / (n(a) + V), n counting the train split's consecutive pairs (40 of the val split's
  505,719 pairs never occur in the train split, so the unsmoothed bigram loss would be infinite).

No torch here: reports and figures draw the floors as reference lines without loading it.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from normexp.config.data import VOCAB_SIZE  # a shakespeare_char run's data.vocab: the text's distinct characters

if TYPE_CHECKING:
    import numpy as np

TEXT_FILE = Path(__file__).resolve().parent / "texts" / "shakespeare_char.txt.gz"
SHA256 = "da68ca4e8201d41a12c1d5e82d967bda85105f1dabe823d5735138bccabdd387"  # of the uncompressed text
N_CHARS = 5_057_198
TRAIN_FRACTION = 0.9  # the train split: the first int(0.9 * N_CHARS) characters (nanoGPT's prepare.py)


class CorpusError(RuntimeError):
    """The shipped text is missing or not the one normexp was released with (a damaged install)."""


@functools.cache
def text() -> str:
    """The whole text, checked against SHA256."""
    try:
        raw = gzip.decompress(TEXT_FILE.read_bytes())
    except (OSError, EOFError) as exc:
        raise CorpusError(f"{TEXT_FILE}: cannot be read ({exc}); reinstall normexp") from None
    if hashlib.sha256(raw).hexdigest() != SHA256:
        raise CorpusError(f"{TEXT_FILE}: not the shipped text (its sha256 differs from {SHA256}); reinstall normexp")
    return raw.decode("ascii")


@dataclass(frozen=True)
class Corpus:
    """The text as tokens: `vocabulary[i]` is token i's character; `train` and `val` the split's ids."""

    vocabulary: str
    train: np.ndarray  # (int(0.9 n),) uint8
    val: np.ndarray  # (n - int(0.9 n),) uint8


@functools.cache
def load() -> Corpus:
    """The vocabulary (sorted distinct characters) and the contiguous 90/10 split, as token ids."""
    import numpy as np

    raw = np.frombuffer(text().encode("ascii"), dtype=np.uint8)
    present = np.unique(raw)
    if len(present) != VOCAB_SIZE:  # the config sizes the model by it
        raise CorpusError(f"{TEXT_FILE}: {len(present)} distinct characters, the config's vocabulary has {VOCAB_SIZE}")
    lookup = np.zeros(256, dtype=np.uint8)
    lookup[present] = np.arange(len(present), dtype=np.uint8)
    ids = lookup[raw]
    cut = int(len(ids) * TRAIN_FRACTION)
    return Corpus(bytes(present.tolist()).decode("ascii"), ids[:cut], ids[cut:])


def decode(ids: np.ndarray | list[int]) -> str:
    """Token ids back to their characters."""
    vocabulary = load().vocabulary
    return "".join(vocabulary[int(i)] for i in ids)


@dataclass(frozen=True)
class Floors:
    """Reference losses of the val split, in nats per character (see the module docstring)."""

    uniform: float  # ln V: a model that knows the vocabulary only
    unigram: float  # the train split's character frequencies, whatever the context
    bigram: float  # the train split's next-character frequencies given the last character (add-one)


@functools.cache
def floors() -> Floors:
    """The uniform, unigram and bigram floors of the split, computed from the text."""
    import numpy as np

    corpus = load()
    v = len(corpus.vocabulary)
    train, val = corpus.train.astype(np.int64), corpus.val.astype(np.int64)
    unigram = np.bincount(train, minlength=v) / len(train)
    pairs = np.bincount(train[:-1] * v + train[1:], minlength=v * v).reshape(v, v).astype(np.float64)
    bigram = (pairs + 1) / (pairs.sum(axis=1, keepdims=True) + v)
    return Floors(uniform=math.log(v),
                  unigram=float(-np.log(unigram[val]).mean()),
                  bigram=float(-np.log(bigram[val[:-1], val[1:]]).mean()))
