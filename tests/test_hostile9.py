"""Hostile review 9: the fast engine's per-process store of replayed starts (`starts.Starts`): what a batch
holds of a kept start, what the budget counts, and two threads keeping the same seed at once."""

from __future__ import annotations

import threading

import torch

from normexp.config import RunConfig, validate_run
from normexp.engines.fast import starts, step


def _sequence(seed: int, **data: object) -> RunConfig:
    return validate_run({"model": {"arch": "transformer", "depth": 2, "width": 8, "n_heads": 2},
                         "data": {"task": "modular_add", "vocab": 12, "n_samples": 48, "n_val": 24, **data},
                         "train": {"steps": 2}, "seed": seed})


def _storages(tensors: object) -> dict[int, int]:
    """Each storage the tensors use, once: its address and its bytes."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tensors if isinstance(t, torch.Tensor)}


def test_a_batch_shares_no_storage_with_a_kept_start(fresh_fast_engine):
    """stack_runs hands the batch copies of every kept tensor, the answer positions included (`.to("cpu")`
    of a CPU tensor is that tensor): a write into the batch (the compiled Adam step updates in place) can
    never reach the start that later runs of the same seed are given."""
    store = starts.reset()
    starts.seeded_start(_sequence(99))  # records the structure (its first run is built, not kept)
    batch = step.stack_runs([_sequence(0), _sequence(1)], "cpu")
    kept = [t for params, task, _ in store.by_seed.values() for t in (*params.values(), *vars(task).values())]
    held = [*batch.params.values(), batch.x, batch.y, batch.positions, batch.val_x, batch.val_y]
    assert sorted(store.by_seed) == [0, 1]
    assert not set(_storages(kept)) & set(_storages(held))


def test_the_budget_counts_the_storage_a_kept_start_holds_each_once(fresh_fast_engine):
    """A sequence task's inputs are views of its drawn sequences (x = train[:, :-1]; modular_add's two
    splits are views of one tensor): what a kept start holds alive is the storages, each counted once, and
    that is what the budget bounds."""
    store = starts.reset()
    starts.seeded_start(_sequence(99))  # records the structure (its first run is built, not kept)
    params, task = starts.seeded_start(_sequence(3))
    after = store.by_seed[3][2]
    held = sum(_storages((*params.values(), *vars(task).values(), after)).values())
    assert held > sum(t.nbytes for t in (*params.values(), *vars(task).values(), after) if t is not None)
    assert store.size == held


def test_two_threads_replaying_one_seed_at_once_keep_it_once(monkeypatch, fresh_fast_engine):
    """Two batches of one structure trained in two threads (the paired thread executor) miss the same
    seed together: the store keeps one start for it and counts its bytes once."""
    store = starts.reset()
    starts.seeded_start(_sequence(99))  # records the structure (its first run is built, not kept)
    replayed, together = starts.replay_start, threading.Barrier(2, timeout=30)

    def replayed_together(recording: starts.Recording, cfg: RunConfig) -> tuple:
        start = replayed(recording, cfg)
        together.wait()  # both have replayed seed 5, neither has kept it yet
        return start

    monkeypatch.setattr(starts, "replay_start", replayed_together)
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(starts.seeded_start(_sequence(5)))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    monkeypatch.setattr(starts, "replay_start", replayed)
    single = starts.reset()
    starts.seeded_start(_sequence(99))
    starts.seeded_start(_sequence(5))
    assert len(got) == 2 and list(store.by_seed) == [5]
    assert store.size == single.size
