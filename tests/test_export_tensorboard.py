"""`normexp export --to tensorboard`, read back as TensorBoard reads it: its own event accumulator (scalars,
histograms, text, the HParams plugin's data), its own server over HTTP, and its dashboard's ordering of
charts; run folders named by the varying keys; a re-export in another process writes the same bytes."""

from __future__ import annotations

import csv
import functools
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, batched_sweep, run_folders
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import build_sweep, chance_classes, flatten, parse_yaml, trained_threshold
from normexp.export.tensorboard import EVENTS_FILE, MANIFEST, exported_folders
from normexp.folder import BLOCKS_FILE, METRICS_FILE
from normexp.folder.layout import read_json

pytest.importorskip("tensorboard")
runner = CliRunner()

SEEDED = """\
name: seeded
base:
  model: {depth: 3, width: 8}
  data: {n_samples: 16}
  optim: {name: sgd}
  train: {steps: 4, threads: 1, log_blocks: true}
grid:
  norm.placement: [pre, post]
  optim.lr: [0.1, 1.0e+8]
seeds: [0, 1]
"""
VARYING = ["norm.placement", "optim.lr", "seed"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return batched_sweep(tmp_path_factory, SEEDED)


@pytest.fixture(scope="module")
def exported(folder, tmp_path_factory) -> Path:
    tb = tmp_path_factory.mktemp("tb") / "out"
    result = runner.invoke(app, ["export", str(folder), str(tb), "--to", "tensorboard"])
    assert result.exit_code == 0, result.output
    return tb


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _flat(run: Path) -> dict:
    return flatten(build_sweep({"name": "x", "base": parse_yaml((run / "config.yaml").read_text())}).runs[0])


def _accumulator(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _expected_scalars(run: Path, block_scalars: bool) -> dict[str, list[tuple[int, float]]]:
    """Every scalar the export must hold for a run folder, by TensorBoard tag, read from its files alone."""
    rows = _rows(run / METRICS_FILE)
    group = {"loss": "loss", "val_loss": "loss", "z_loss": "loss"}
    series = {f"{group.get(c, 'metrics')}/{c}": [(int(r["step"]), float(r[c])) for r in rows]
              for c in rows[0] if c != "step"}
    if block_scalars:
        for r in _rows(run / BLOCKS_FILE):
            for c in r:
                if c not in ("step", "block"):
                    series.setdefault(f"per_block/{c}/{int(r['block']):02d}", []).append((int(r["step"]), float(r[c])))
    done = read_json(run / "done.json")
    cfg = build_sweep({"name": "x", "base": parse_yaml((run / "config.yaml").read_text())}).runs[0]
    trained = done["status"] == "completed" and done["final_loss"] < trained_threshold(chance_classes(cfg))
    final = {"final_loss": done["final_loss"], "min_loss": done["min_loss"], "final_acc": done["final_acc"],
             "diverged": float(done["diverged"]), "trained": float(trained)}
    return {**series, **{f"result/{k}": [(int(rows[-1]["step"]), float(v))] for k, v in final.items()}}


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize("block_scalars", [False, True])
def test_every_value_reads_back_and_blocks_are_histograms_over_blocks(folder, tmp_path, block_scalars):
    """Per step, each blocks.csv column is one histogram of its blocks' finite values (224 scalar charts a
    run at depth 32 before); `--block-scalars` adds the scalar per block."""
    import numpy as np
    from tensorboard.plugins.hparams import metadata
    from tensorboard.util import tensor_util

    tb = tmp_path / "tb"
    result = runner.invoke(app, ["export", str(folder), str(tb)] + ["--block-scalars"] * block_scalars)
    assert result.exit_code == 0, result.output
    runs = run_folders(folder)
    assert any(read_json(r / "done.json")["status"] == "diverged" for r in runs)  # lr 1e8: inf, nan
    folders = exported_folders(tb)
    assert sorted(folders) == [r.name for r in runs]
    for run in runs:
        acc = _accumulator(tb / folders[run.name])
        expected = _expected_scalars(run, block_scalars)
        assert sorted(acc.Tags()["scalars"]) == sorted(expected)
        for tag, points in expected.items():
            got = [(e.step, e.value) for e in acc.Scalars(tag)]
            assert [s for s, _ in got] == [s for s, _ in points], tag
            assert all(_same(g, float(np.float32(v))) for (_, g), (_, v) in zip(got, points)), tag  # float32
        blocks = _rows(run / BLOCKS_FILE)
        columns = [c for c in blocks[0] if c not in ("step", "block")
                   and any(math.isfinite(float(r[c])) for r in blocks)]  # norm_out_rms: nan but for some placements
        assert sorted(acc.Tags()["tensors"]) == sorted([metadata.SESSION_START_INFO_TAG, "run_id"]
                                                       + [f"per_block/{c}" for c in columns])
        assert tensor_util.make_ndarray(acc.Tensors("run_id")[0].tensor_proto).item().decode() == run.name
        for column in columns:
            by_step: dict[int, list[float]] = {}
            for r in blocks:
                by_step.setdefault(int(r["step"]), []).append(float(r[column]))
            finite = {s: [v for v in vs if math.isfinite(v)] for s, vs in by_step.items()}
            histograms = acc.Tensors(f"per_block/{column}")
            assert [h.step for h in histograms] == [s for s, vs in finite.items() if vs], column
            for h in histograms:
                buckets = tensor_util.make_ndarray(h.tensor_proto)  # [left edge, right edge, count] per bucket
                values = finite[h.step]
                assert buckets[:, 2].sum() == len(values)
                assert buckets[0, 0] == min(values) and buckets[-1, 1] == max(values), column


def test_hparams_declare_domains_mark_the_varying_keys_and_group_the_seeds(folder, exported):
    from tensorboard.plugins.hparams import api_pb2, metadata

    root = _accumulator(exported)
    experiment = metadata.parse_experiment_plugin_data(
        root.SummaryMetadata(metadata.EXPERIMENT_TAG).plugin_data.content)
    infos = {h.name: h for h in experiment.hparam_infos}
    assert sorted(infos) == sorted(flatten(build_sweep(parse_yaml(SEEDED)).runs[0]))
    assert [h.name for h in experiment.hparam_infos if h.differs] == VARYING
    assert not infos["data.task"].differs and not infos["model.depth"].differs
    assert list(infos["norm.placement"].domain_discrete) == ["post", "pre"]
    assert list(infos["optim.lr"].domain_discrete) == [0.1, 1e8]
    assert list(infos["seed"].domain_discrete) == [0, 1]
    assert infos["model.depth"].type == api_pb2.DATA_TYPE_FLOAT64 and list(infos["model.depth"].domain_discrete) == [3]
    assert infos["train.log_blocks"].type == api_pb2.DATA_TYPE_BOOL
    assert list(infos["train.log_blocks"].domain_discrete) == [True]
    assert [m.name.tag for m in experiment.metric_infos] == [f"result/{m}" for m in
                                                             ("final_loss", "min_loss", "final_acc", "diverged",
                                                              "trained")]
    folders = exported_folders(exported)
    groups = {}
    for run in run_folders(folder):
        start = metadata.parse_session_start_info_plugin_data(
            _accumulator(exported / folders[run.name]).SummaryMetadata(metadata.SESSION_START_INFO_TAG)
            .plugin_data.content)
        flat = _flat(run)
        shown = {k: json.loads(json.dumps(v.string_value if v.HasField("string_value") else v.bool_value
                                          if v.HasField("bool_value") else v.number_value))
                 for k, v in start.hparams.items()}
        assert shown == {k: "None" if v is None else json.dumps(list(v)) if isinstance(v, (list, tuple)) else v
                         for k, v in flat.items() if k != "seed"}  # null as None, a list as its JSON; the
        # seed is the one key a group's runs differ in, and TensorBoard shows a group's hparams as its first run's
        groups.setdefault(start.group_name, set()).add((flat["norm.placement"], flat["optim.lr"], flat["seed"]))
    assert len(groups) == 4 and all(len(members) == 2 for members in groups.values())  # one per config
    assert all(len({(p, lr) for p, lr, _ in members}) == 1 for members in groups.values())  # its seeds
    assert "post-lr0.1" in groups


def test_many_numbers_have_an_interval_and_non_finite_ones_no_domain():
    from tensorboard.plugins.hparams import metadata

    from normexp.export.tensorboard import _experiment_summary

    flats = [{"optim.lr": 10.0 ** -i, "model.depth": 2 + i % 3, "x": math.inf if i else 1.0} for i in range(13)]
    summary = _experiment_summary(flats, ["optim.lr", "model.depth", "x"], dict.fromkeys(flats[0], "number"))
    infos = {h.name: h for h in metadata.parse_experiment_plugin_data(
        summary.value[0].metadata.plugin_data.content).hparam_infos}
    assert infos["optim.lr"].HasField("domain_interval") and not infos["optim.lr"].domain_discrete
    assert (infos["optim.lr"].domain_interval.min_value, infos["optim.lr"].domain_interval.max_value) == (1e-12, 1.0)
    assert list(infos["model.depth"].domain_discrete) == [2, 3, 4]
    assert not infos["x"].HasField("domain_interval") and not infos["x"].domain_discrete and infos["x"].differs


# TensorBoard 2.21's Time Series dashboard orders its cards by `Qy` and groups them by the tag's part before
# the first "/" (`zD`, `GDe`), opening the first two groups: transcribed from tensorboard/webfiles.zip,
# index.js (functions Qy, PK, Bh, a3, zD, GDe; source: tensorboard/webapp/util/string.ts compareTagNames and
# webapp/metrics/views/main_view/common_selectors.ts).
def _tb_compare(a: str, b: str) -> int:
    digit, sep = (lambda c: "0" <= c <= "9"), (lambda c: c == "/" or "0" <= c <= "9")
    n = i = 0
    while True:
        if n == len(a):
            return 0 if i == len(b) else -1
        if i == len(b):
            return 1
        if digit(a[n]) and digit(b[i]):
            o, r = n, i
            n, i = _number_end(a, n + 1), _number_end(b, i + 1)
            s, t = _number(a[o:n]), _number(b[r:i])
            if s < t:
                return -1
            if s > t:
                return 1
        else:
            if sep(a[n]):
                if not sep(b[i]):
                    return -1
            else:
                if sep(b[i]):
                    return 1
                if a[n] < b[i]:
                    return -1
                if a[n] > b[i]:
                    return 1
            n, i = n + 1, i + 1


def _number_end(t: str, e: int) -> int:
    state, o = "natural", e
    while o < len(t):
        c = t[o]
        if state == "natural":
            if c == ".":
                state = "real"
            elif c in "eE":
                state = "sign"
            elif not "0" <= c <= "9":
                break
        elif state == "real":
            if c in "eE":
                state = "sign"
            elif not "0" <= c <= "9":
                break
        elif state == "sign":
            if not "0" <= c <= "9" and c not in "+-":
                break
            state = "exponent"
        elif not "0" <= c <= "9":
            break
        o += 1
    return o


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan  # JavaScript's Number(): NaN, which compares as neither less nor more


def test_loss_comes_first_in_the_dashboard_and_the_one_point_charts_after_the_curves(folder, exported):
    run = run_folders(folder)[0]
    tags = list(_accumulator(exported / exported_folders(exported)[run.name]).Tags()["scalars"])
    tags += [f"per_block/{c}" for c in _rows(run / BLOCKS_FILE)[0] if c not in ("step", "block")]
    cards = sorted(tags, key=functools.cmp_to_key(_tb_compare))
    groups = list(dict.fromkeys(t.split("/", 1)[0] for t in cards))
    assert cards[0] == "loss/loss"
    assert groups[:2] == ["loss", "metrics"]  # the two groups the dashboard opens
    assert groups.index("result") > groups.index("loss")
    assert _tb_compare("final/final_loss", "loss") < 0  # as it was: the one-point charts first


def test_runs_are_named_by_the_varying_keys_or_a_template_and_renamed_in_place(folder, tmp_path):
    tb = tmp_path / "tb"
    runs = run_folders(folder)
    result = runner.invoke(app, ["export", str(folder), str(tb), "--run-name", "{norm.placement}-{run_id}"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tb.iterdir() if p.is_dir()) == sorted(f"{_flat(r)['norm.placement']}-{r.name}"
                                                                       for r in runs)
    first = tb / f"{_flat(runs[0])['norm.placement']}-{runs[0].name}"
    (first / "notes.txt").write_text("the user's")
    result = runner.invoke(app, ["export", str(folder), str(tb)])
    assert result.exit_code == 0 and f"{runs[0].name} (now " in result.output, result.output
    named = {r.name: "{}-lr{:g}-s{}".format(*(_flat(r)[k] for k in VARYING)) for r in runs}
    assert "post-lr1e+08-s1" in named.values()
    assert exported_folders(tb) == named
    assert sorted(p.name for p in tb.iterdir() if p.is_dir()) == sorted([*named.values(), first.name])
    assert [p.name for p in first.iterdir()] == ["notes.txt"]  # normexp's file went, the user's stays
    assert json.loads((tb / MANIFEST).read_text())["runs"] == named


def test_an_export_by_run_id_is_replaced_and_a_users_folder_is_left_alone(folder, exported, tmp_path):
    """An export made before the names (`OUT/<run_id>/`) is moved, not doubled; a folder of the user's that
    bears a run's name keeps its files, and the run's name gets its run id's hash."""
    import shutil

    tb = tmp_path / "tb"
    shutil.copytree(exported, tb)
    for rid, name in exported_folders(tb).items():
        (tb / name).rename(tb / rid)
    (tb / MANIFEST).unlink()
    mine = tb / "pre-lr0.1-s0"
    mine.mkdir()
    (mine / "events.out.tfevents.1.mine").write_bytes(b"x")
    result = runner.invoke(app, ["export", str(folder), str(tb)])
    assert result.exit_code == 0, result.output
    folders = exported_folders(tb)
    assert sorted(p.name for p in tb.iterdir() if p.is_dir()) == sorted([*folders.values(), mine.name])
    assert [p.name for p in mine.iterdir()] == ["events.out.tfevents.1.mine"]
    taken = next(rid for rid, name in folders.items() if name.startswith("pre-lr0.1-s0"))
    assert folders[taken] == f"pre-lr0.1-s0-{taken.rsplit('-', 1)[-1][:6]}"


def test_block_scalars_are_refused_where_they_mean_nothing(folder, tmp_path):
    result = runner.invoke(app, ["export", str(folder), (tmp_path / "ml").as_uri(), "--to", "mlflow",
                                 "--block-scalars"])
    assert result.exit_code == 2 and "--block-scalars: only --to tensorboard" in result.output
    result = runner.invoke(app, ["export", str(folder), str(tmp_path / "tb"), "--run-name", "{depth}"])
    assert result.exit_code == 2 and "{model.depth}" in result.output, result.output


def _export_in_a_process(folder: Path, out: Path, hash_seed: str) -> dict[str, bytes]:
    done = subprocess.run([sys.executable, "-m", "normexp", "export", str(folder), str(out)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO),
                                                       "PYTHONHASHSEED": hash_seed})
    assert done.returncode == 0, done.stderr
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.process
def test_a_re_export_in_another_process_writes_the_same_bytes(folder, tmp_path):
    """A session's hparams are a protobuf map, serialised in the process's hash order: two exports differed."""
    first = _export_in_a_process(folder, tmp_path / "a", "1")
    second = _export_in_a_process(folder, tmp_path / "a", "2")
    again = _export_in_a_process(folder, tmp_path / "b", "3")
    assert len(first) == 2 + 8 and EVENTS_FILE in first
    assert second == first and again == first


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.mark.process  # TensorBoard's server starts and loads in ~4 s
def test_tensorboards_own_server_lists_the_varying_keys_and_the_seed_groups(exported, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "tensorboard.log", "w")
    server = subprocess.Popen([sys.executable, "-c", "from tensorboard.main import run_main; run_main()",
                               "--logdir", str(exported), "--host", "127.0.0.1", "--port", str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/data/plugin/hparams"
    try:
        deadline, experiment = time.monotonic() + 120, {}
        while not experiment.get("hparamInfos") or not experiment.get("metricInfos"):
            assert time.monotonic() < deadline and server.poll() is None, (tmp_path / "tensorboard.log").read_text()
            time.sleep(1)
            try:
                experiment = _post(f"{url}/experiment", {"experimentName": ""})
            except OSError:
                continue
        infos = experiment["hparamInfos"]
        assert [h["name"] for h in infos[:3]] == VARYING  # what the HParams table opens on
        assert all(h["differs"] for h in infos[:3]) and not any(h.get("differs") for h in infos[3:])
        assert {"data.task", "model.depth"} <= {h["name"] for h in infos}
        assert next(h for h in infos if h["name"] == "norm.placement")["domainDiscrete"] == ["post", "pre"]
        groups = _post(f"{url}/session_groups", {
            "experimentName": "", "startIndex": 0, "sliceSize": 100, "aggregationType": "AGGREGATION_AVG",
            "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
            "colParams": [{"metric": {"tag": "result/final_loss", "group": ""}, "order": "ORDER_ASC"}]})
        sessions = {g["name"]: sorted(s["name"] for s in g["sessions"]) for g in groups["sessionGroups"]}
        assert sessions["post-lr0.1"] == ["post-lr0.1-s0", "post-lr0.1-s1"] and len(sessions) == 4
        rows = {g["name"]: g["hparams"] for g in groups["sessionGroups"]}
        assert rows["post-lr0.1"]["norm.placement"] == "post" and rows["post-lr0.1"]["optim.lr"] == 0.1
        assert not any("seed" in hparams for hparams in rows.values())  # not one run's seed for the row
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_a_name_that_is_no_folder_name_is_made_one(folder, tmp_path):
    """A `/` made nested runs of one name, and a long template a name over the file system's 255 bytes."""
    tb = tmp_path / "tb"
    result = runner.invoke(app, ["export", str(folder), str(tb), "--run-name", "{norm.placement}/s{seed}-{run_id}"])
    assert result.exit_code == 0, result.output
    assert sorted(exported_folders(tb).values()) == sorted(f"{_flat(r)['norm.placement']}_s{_flat(r)['seed']}-{r.name}"
                                                          for r in run_folders(folder))
    result = runner.invoke(app, ["export", str(folder), str(tb), "--run-name", "{run_id}" * 12])
    assert result.exit_code == 0, result.output
    folders = exported_folders(tb)
    assert all(len(name.encode()) <= 200 and name.startswith(rid) for rid, name in folders.items())
    assert sorted(p.name for p in tb.iterdir() if p.is_dir()) == sorted(folders.values())


def test_a_run_alone_in_its_group_keeps_its_seed(folder, tmp_path):
    import shutil

    from tensorboard.plugins.hparams import metadata

    copy = tmp_path / "seeded"
    shutil.copytree(folder, copy)
    for run in run_folders(copy):
        if _flat(run)["seed"] == 1:
            shutil.rmtree(run)
    assert runner.invoke(app, ["export", str(copy), str(tmp_path / "tb")]).exit_code == 1  # 4 runs missing
    for rid, name in exported_folders(tmp_path / "tb").items():
        start = metadata.parse_session_start_info_plugin_data(_accumulator(tmp_path / "tb" / name).SummaryMetadata(
            metadata.SESSION_START_INFO_TAG).plugin_data.content)
        assert start.hparams["seed"].number_value == 0, rid
