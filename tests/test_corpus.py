"""The shipped text of `data.task: shakespeare_char` (normexp/corpus.py): what it is, its split and its
floors, each checked against a computation written here from the compressed file alone (plain Python:
gzip, hashlib, collections, math)."""

from __future__ import annotations

import collections
import gzip
import hashlib
import math

import pytest

from normexp import corpus


@pytest.fixture(scope="module")
def raw() -> str:
    return gzip.decompress(corpus.TEXT_FILE.read_bytes()).decode("ascii")


def test_the_text_is_the_documented_one(raw):
    assert len(raw) == corpus.N_CHARS == 5_057_198
    assert hashlib.sha256(raw.encode("ascii")).hexdigest() == corpus.SHA256
    assert len(set(raw)) == corpus.VOCAB_SIZE == 84 and max(map(ord, raw)) < 128
    assert corpus.text() == raw


def test_vocabulary_is_the_sorted_characters_and_the_split_contiguous_90_10(raw):
    loaded = corpus.load()
    assert loaded.vocabulary == "".join(sorted(set(raw)))
    cut = int(len(raw) * 0.9)
    assert (len(loaded.train), len(loaded.val)) == (cut, len(raw) - cut) == (4_551_478, 505_720)
    assert corpus.decode(loaded.train[:200]) == raw[:200]
    assert corpus.decode(loaded.val[-200:]) == raw[-200:]
    assert corpus.decode(loaded.val[:50]) == raw[cut:cut + 50]


def test_floors_are_the_documented_cross_entropies(raw):
    cut = int(len(raw) * 0.9)
    train, val = raw[:cut], raw[cut:]
    v = len(set(raw))
    counts = collections.Counter(train)
    unigram = -math.fsum(math.log(counts[c] / len(train)) for c in val) / len(val)
    pairs = collections.Counter(zip(train, train[1:]))
    starts = collections.Counter(train[:-1])
    bigram = -math.fsum(math.log((pairs[a, b] + 1) / (starts[a] + v)) for a, b in zip(val, val[1:])) / (len(val) - 1)
    floors = corpus.floors()
    assert floors.uniform == pytest.approx(math.log(84), abs=1e-12)
    assert floors.unigram == pytest.approx(unigram, abs=1e-9)
    assert floors.bigram == pytest.approx(bigram, abs=1e-9)
    assert floors.uniform > floors.unigram > floors.bigram
    assert round(floors.unigram, 2) == 3.33  # issue 47's measured unigram floor


def test_a_damaged_text_is_named_not_trained_on(tmp_path, monkeypatch):
    damaged = tmp_path / "shakespeare_char.txt.gz"
    damaged.write_bytes(gzip.compress(b"not Shakespeare"))
    monkeypatch.setattr(corpus, "TEXT_FILE", damaged)
    corpus.text.cache_clear()
    try:
        with pytest.raises(corpus.CorpusError, match="sha256"):
            corpus.text()
    finally:
        corpus.text.cache_clear()


@pytest.mark.process
def test_nothing_reads_the_text_but_a_run_of_its_task():
    from conftest import subprocess_output

    code = ("import normexp.corpus as c; from normexp.config import validate_run; "
            "from normexp.engines.reference import train_run; "
            "validate_run({'model': {'arch': 'transformer'}, 'data': {'task': 'shakespeare_char'}}); "
            "train_run(validate_run({'model': {'arch': 'transformer', 'depth': 1, 'width': 8, 'n_heads': 2}, "
            "'data': {'task': 'copy'}, 'train': {'steps': 1}})); "
            "train_run(validate_run({'model': {'depth': 2, 'width': 8}, 'train': {'steps': 1}})); "
            "print(c.text.cache_info().currsize, c.load.cache_info().currsize)")
    assert subprocess_output(code).split() == ["0", "0"]
