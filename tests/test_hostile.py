"""Hostile input and command-line misuse: every error is a few lines naming the key or option, exit
2, in bounded time and memory, with nothing written; YAML follows 1.2 rules and standard merge keys."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import MAX_ERROR_LINES, MAX_YAML_NODES, ConfigError, build_sweep, parse_yaml
from normexp.engines import reference
from normexp.results import load_metrics
from normexp.tables import number

runner = CliRunner()
TINY = "name: t\nbase: {model: {depth: 2, width: 8}, train: {steps: 3}}\n"


def alias_bomb(levels: int, fan: int = 10) -> str:
    """Each level lists the previous one `fan` times: fan**levels values from a few hundred bytes."""
    lines = [f"a0: &a0 [{', '.join(['1'] * fan)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * fan)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nname: bomb\nbase: {{model: {{depth: *a{levels - 1}}}}}\n"


@pytest.mark.parametrize("levels", [4, 6, 9])
def test_alias_expansion_is_bounded(levels):
    text = alias_bomb(levels)
    assert len(text) < 600
    start = time.perf_counter()
    if 10**levels <= MAX_YAML_NODES // 2:
        assert isinstance(parse_yaml(text)["base"]["model"]["depth"], list)
        return
    with pytest.raises(ConfigError, match="expands to more than") as caught:
        parse_yaml(text, "bomb.yaml")
    assert time.perf_counter() - start < 2
    assert len(str(caught.value)) < 200 and str(caught.value).startswith("bomb.yaml: line ")


def test_alias_bomb_through_validate_is_a_short_error(write_yaml):
    result = runner.invoke(app, ["validate", str(write_yaml(alias_bomb(8)))])
    assert result.exit_code == 2 and "expands to more than" in result.output
    assert len(result.output) < 400 and "Traceback" not in result.output


def test_an_alias_inside_itself_is_refused():
    with pytest.raises(ConfigError, match="refers to the node that contains it"):
        parse_yaml("a: &a [1, *a]\n")


def test_an_error_never_echoes_more_than_a_short_value(write_yaml):
    values = ", ".join(str(i) for i in range(5000))
    result = runner.invoke(app, ["validate", str(write_yaml(f"name: t\nbase: {{model: {{depth: [{values}]}}}}\n"))])
    assert result.exit_code == 2 and "base.model.depth: must be an integer, got [0, 1, 2" in result.output
    assert len(result.output) < 200


def test_many_errors_are_cut_to_a_few_lines(write_yaml):
    keys = "\n".join(f"  key{i}: 1" for i in range(40))
    result = runner.invoke(app, ["validate", str(write_yaml(f"name: t\nbase:\n{keys}\n"))])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == MAX_ERROR_LINES and lines[-1].endswith("more errors")


@given(st.dictionaries(st.sampled_from("abcdef"), st.integers(-5, 5), min_size=1),
       st.dictionaries(st.sampled_from("abcdefgh"), st.integers(-5, 5)))
def test_a_merge_key_then_overrides_reads_as_the_merged_mapping_updated(merged, written):
    text = f"defaults: &d {yaml.safe_dump(merged, default_flow_style=True).strip()}\nthis:\n  <<: *d\n"
    text += "".join(f"  {k}: {v}\n" for k, v in written.items())
    assert parse_yaml(text)["this"] == {**merged, **written}


def test_merge_sources_earlier_wins_and_a_real_duplicate_is_refused():
    assert parse_yaml("a: &a {x: 1}\nb: &b {x: 2, y: 2}\nc:\n  <<: [*a, *b]\n")["c"] == {"x": 1, "y": 2}
    with pytest.raises(ConfigError, match="x: duplicate key"):
        parse_yaml("a: &a {y: 1}\nc:\n  <<: *a\n  x: 1\n  x: 2\n")


def test_a_merge_key_works_in_a_sweep_file(write_yaml):
    text = "name: m\nbase:\n  model:\n    <<: &m {depth: 4, width: 16}\n    width: 8\n"
    result = runner.invoke(app, ["validate", str(write_yaml(text))])
    assert result.exit_code == 0, result.output


@given(st.integers(0, 10**6), st.integers(1, 3))
def test_yaml_12_integers_with_leading_zeros_are_decimal(value, zeros):
    assert parse_yaml("0" * zeros + str(value)) == value


@pytest.mark.parametrize(("text", "value"), [
    ("010", 10), ("0o10", 8), ("0x10", 16), ("-010", -10), ("1_000", 1000), ("1e-3", 0.001), ("true", True),
    ("False", False), ("yes", "yes"), ("off", "off"), ("1:30", "1:30"), ("0b11", "0b11"), ("~", None),
])
def test_yaml_12_scalars(text, value):
    assert parse_yaml(text) == value


def test_depth_010_is_ten(write_yaml):
    assert build_sweep(parse_yaml("name: t\nbase: {model: {depth: 010}}\n")).base.model.depth == 10


def test_a_section_check_blames_the_grid_key_it_came_from():
    data = parse_yaml("name: t\nbase: {schedule: {kind: constant}}\ngrid: {schedule.warmup_steps: [0, 5]}\n")
    with pytest.raises(ConfigError) as caught:
        build_sweep(data)
    assert str(caught.value).startswith("grid.schedule.warmup_steps: warmup_steps has no effect")


@pytest.mark.parametrize(("data", "path"), [
    ({"name": "t", "base": {"model": {1: 2}}}, "base.model.1"),  # a mapping built in Python: YAML refuses it
    ({"name": "t", "base": {1: {"depth": 2}}}, "base.1"),
    ("name: t\nseeds: [0, x]\n", "seeds.1"),
    ("name: t\nreport: {steps: [1, -1]}\n", "report.steps.1"),
])
def test_key_paths_are_well_formed(data, path):
    with pytest.raises(ConfigError) as caught:
        build_sweep(parse_yaml(data) if isinstance(data, str) else data)
    first = str(caught.value).splitlines()[0]
    key = first.split(": ")[0]
    assert key == path and ".." not in key and not key.endswith(".")


@pytest.mark.parametrize(("text", "message"), [
    ("name: t\ngrid: {1: 2, null: 3, true: 4}\n", "grid: keys must be strings (got 1, null, true; line 2)"),
    ("name: t\nbase: {model: {1: 2}}\n", "base.model: keys must be strings (got 1; line 2)"),
    ("name: t\nbase:\n  model:\n    depth: 2\n    0: 1\n    false: 2\n",
     "base.model: keys must be strings (got 0, false; line 5)"),
    ("1: x\nname: t\n", "sweep.yaml: keys must be strings (got 1; line 1)"),
    ("name: t\ntags: [{2.5: a}]\n", "tags.0: keys must be strings (got 2.5; line 2)"),
    ("name: t\nbase: {? [1, 2] : 3}\n", "base: keys must be strings (got a list; line 2)"),
    ("d: &d {1: 2}\nname: t\nbase: {model: {<<: *d}}\n", "d: keys must be strings (got 1; line 1)"),
    ("name: t\nbase: {model: {<<: {7: 2}}}\n", "base.model: keys must be strings (got 7; line 2)"),
])
def test_keys_that_are_not_strings_are_named_as_such(write_yaml, text, message):
    """YAML reads `1`, `null`, `true` as an int, None, a bool; 1 and true are one Python key, which
    must not read as a duplicate: the error says the keys are not strings, and where they are."""
    result = runner.invoke(app, ["validate", str(write_yaml(text))])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "duplicate" not in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize(("text", "message"), [
    ("name: t\ngrid: {optim.lr: [0.1], optim.lr: [0.2]}\n", "optim.lr: duplicate key (line 2)"),
    ("name: t\nbase: {model: {'1': 2, \"1\": 3}}\n", "1: duplicate key (line 2)"),
    ("name: t\nbase: {}\nbase: {}\n", "base: duplicate key (line 3)"),
])
def test_string_keys_written_twice_are_still_duplicates(write_yaml, text, message):
    result = runner.invoke(app, ["validate", str(write_yaml(text))])
    assert result.exit_code == 2 and message in result.output and "strings" not in result.output, result.output


def test_max_runs_is_not_offered_where_there_is_no_such_option(write_yaml):
    config = write_yaml("name: t\ngrid: {optim.lr: [" + ", ".join(f"0.{i + 1}" for i in range(400)) + "]}\n"
                        "seeds: [" + ", ".join(str(s) for s in range(300)) + "]\n")
    for command in ("validate", "gradnorm"):
        result = runner.invoke(app, [command, str(config)])
        assert result.exit_code == 2 and "120000" in result.output and "--max-runs" not in result.output


# ----------------------------------------------------------------------------- command-line misuse


@pytest.mark.parametrize("address", ["foo", "LOCAL", "local:abc", "local:", "local:1.5", "local:99999",
                                     "tcp://127.0.0.1:notaport", "tcp://:8786", "http://127.0.0.1:8786",
                                     "tcp://127.0.0.1:70000"])
def test_malformed_cluster_addresses_are_refused(write_yaml, tmp_path, address):
    out = tmp_path / "out"
    result = runner.invoke(app, ["sweep", str(write_yaml(TINY)), "--out", str(out), "--cluster", address])
    assert result.exit_code == 2 and "expected local, local:N" in result.output, result.output
    assert "Traceback" not in result.output and not out.exists()


@pytest.mark.parametrize("address", ["local:0", "local:-1"])
def test_a_cluster_of_no_workers_is_refused_at_once(write_yaml, tmp_path, address):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "normexp", "sweep", str(write_yaml(TINY)), "--out", str(out),
                           "--cluster", address], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "N must be a whole number from 1" in proc.stderr, proc.stderr
    assert not out.exists()  # the folder's lock was never taken


def test_empty_out_is_refused(write_yaml, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_yaml(TINY)
    for command in (["sweep"], ["gradnorm"]):
        result = runner.invoke(app, [*command, str(config), "--out", ""])
        assert result.exit_code == 2 and "--out: empty" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]


def test_a_dangling_symlink_as_out_is_named(write_yaml, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    result = runner.invoke(app, ["sweep", str(write_yaml(TINY)), "--out", str(link)])
    assert result.exit_code == 2 and "does not exist" in result.output and "File exists" not in result.output


def test_a_symlink_loop_is_called_a_loop(write_yaml, tmp_path):
    """ELOOP: a link that leads back to itself is no missing file; as CONFIG, as --out or on their way."""
    config = write_yaml(TINY)
    loop, dangling = tmp_path / "loop", tmp_path / "dangling"
    loop.symlink_to(loop)
    dangling.symlink_to(tmp_path / "gone")
    for args in (["validate", str(loop)], ["sweep", str(loop / "x.yaml")], ["sweep", str(config), "--out", str(loop)],
                 ["gradnorm", str(config), "--out", str(loop)], ["sweep", str(config), "--out", str(loop / "out")]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "a symbolic link loop (too many levels of symbolic links)" in result.output
        assert "does not exist" not in result.output and "Errno" not in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
    result = runner.invoke(app, ["validate", str(dangling)])  # a dangling link keeps its message
    assert result.exit_code == 2 and result.output == f"error: {dangling}: no such file\n", result.output
    result = runner.invoke(app, ["validate", str(tmp_path)])  # a folder: the reason, without errno's repr
    assert result.exit_code == 2 and result.output == f"error: {tmp_path}: cannot read: Is a directory\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "loop", "sweep.yaml"]


@pytest.mark.parametrize("command", ["sweep", "gradnorm"])
def test_a_file_as_out_is_refused(write_yaml, tmp_path, command):
    file = tmp_path / "file"
    file.write_text("keep me")
    result = runner.invoke(app, [command, str(write_yaml(TINY)), "--out", str(file)])
    assert result.exit_code == 2 and "is a file, not a folder" in result.output
    assert "Traceback" not in result.output and file.read_text() == "keep me"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    folder = tmp_path_factory.mktemp("finished")
    config = folder / "t.yaml"
    config.write_text(TINY + "grid: {norm.placement: [post, pre]}\nseeds: [0, 1]\n")
    assert runner.invoke(app, ["sweep", str(config), "--out", str(folder / "out"), "-q"]).exit_code == 0
    return config, folder / "out"


def test_pivot_on_one_key_twice_is_refused(finished):
    result = runner.invoke(app, ["report", str(finished[1]), "--pivot", "norm.placement,norm.placement"])
    assert result.exit_code == 2 and "must differ" in result.output


def test_report_of_a_step_never_recorded_says_so(finished):
    result = runner.invoke(app, ["report", str(finished[1]), "--steps", "1,99"])
    assert result.exit_code == 2 and "--steps 99: not recorded" in result.output and "0 to 3" in result.output
    assert runner.invoke(app, ["report", str(finished[1]), "--steps", "1,3"]).exit_code == 0


def test_a_second_sweep_of_another_config_into_one_folder_is_refused(finished, write_yaml, tmp_path):
    config, out = finished
    other = write_yaml(TINY.replace("name: t", "name: other") + "seeds: [5]\n", "other.yaml")
    before = (out / "summary.csv").read_text(), (out / "sweep.yaml").read_text()
    result = runner.invoke(app, ["sweep", str(other), "--out", str(out)])
    assert result.exit_code == 2 and "holds sweep 't', not 'other'" in result.output and "--force" in result.output
    assert ((out / "summary.csv").read_text(), (out / "sweep.yaml").read_text()) == before
    assert runner.invoke(app, ["sweep", str(config), "--out", str(out), "-q"]).exit_code == 0  # resuming is fine
    extended = write_yaml(TINY + "grid: {norm.placement: [post, pre]}\nseeds: [0, 1, 2]\n", "more.yaml")
    assert runner.invoke(app, ["sweep", str(extended), "--out", str(out), "-q"]).exit_code == 0  # so is adding


def test_quiet_still_prints_failed_runs(write_yaml, tmp_path, monkeypatch):
    real = reference.train_run

    def train_run(cfg, **kwargs):
        if cfg.seed == 1:
            raise RuntimeError("boom")
        return real(cfg, **kwargs)

    monkeypatch.setattr(reference, "train_run", train_run)
    config = write_yaml(TINY + "seeds: [0, 1]\n")
    result = runner.invoke(app, ["sweep", str(config), "--out", str(tmp_path / "out"), "-q", "--engine", "reference"])
    assert result.exit_code == 1
    assert "failed: RuntimeError: boom" in result.output and "1 run failed" in result.output
    assert "completed" not in result.output  # quiet otherwise


def test_one_run_is_not_1_runs(write_yaml):
    result = runner.invoke(app, ["validate", str(write_yaml(TINY))])
    assert result.exit_code == 0 and "· 1 run\n" in result.output


@pytest.mark.parametrize("depths", ["1", "4", "1,2"])
def test_gradnorm_with_one_depth_or_depth_1(write_yaml, tmp_path, depths):
    config = write_yaml("name: g\nbase: {model: {width: 8}}\ngrid: {norm.placement: [post, pre]}\nseeds: [0, 1]\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", np.exceptions.RankWarning)
        result = runner.invoke(app, ["gradnorm", str(config), "--set", f"model.depth={depths}",
                                     "--out", str(tmp_path / "g")])
    assert result.exit_code == 0, result.output
    assert "+nan" not in result.output
    if "," not in depths:
        assert "needs two depths or more" in result.output


@given(st.floats(-1e300, 1e300))
def test_a_table_number_stays_short_and_keeps_its_value(value):
    text = number(value)
    assert len(text) <= 12
    assert math.isclose(float(text), value, rel_tol=1e-4, abs_tol=1e-4)


def test_a_diverging_loss_is_shown_whole(write_yaml, tmp_path):
    config = write_yaml("name: d\nbase: {model: {depth: 2, width: 8}, norm: {placement: none}, "
                        "optim: {name: sgd}, train: {steps: 8, stop_on_nonfinite: false}}\n"
                        "grid: {optim.lr: [10.0, 10.5, 11.0, 11.5, 12.0]}\nreport: {steps: [0, 5, 8]}\n")
    out = tmp_path / "out"
    result = runner.invoke(app, ["sweep", str(config), "--out", str(out), "--engine", "reference"])
    assert result.exit_code == 0
    assert max(abs(v) for v in load_metrics(out)["loss"] if math.isfinite(v)) >= 1e6, "no large loss to show"
    assert "…" not in result.output


def test_a_run_folders_config_reruns_that_run_alone(finished, tmp_path):
    _, out = finished
    run = sorted(p for p in out.iterdir() if (p / "done.json").exists())[1]
    again = tmp_path / "again"
    result = runner.invoke(app, ["sweep", str(run / "config.yaml"), "--out", str(again), "-q"])
    assert result.exit_code == 0, result.output
    assert [p.name for p in again.glob("*/done.json")] == ["done.json"]
    assert (again / run.name / "metrics.csv").read_text() == (run / "metrics.csv").read_text()


def test_max_runs_must_be_at_least_one(write_yaml, tmp_path):
    result = runner.invoke(app, ["sweep", str(write_yaml(TINY)), "--out", str(tmp_path / "o"), "--max-runs", "0"])
    assert result.exit_code == 2 and "--max-runs" in result.output and not (tmp_path / "o").exists()


def test_max_runs_counts_distinct_runs(write_yaml, tmp_path):
    """Repeated grid values, and values of a key that a run does not use, make one run each."""
    config = write_yaml(TINY + "grid: {optim.lr: [0.01, 0.01, 0.010], norm.placement: [pre, post, mixln],"
                               " norm.mixln_fraction: [0.25, 0.5]}\n")
    result = runner.invoke(app, ["sweep", str(config), "--dry-run", "--max-runs", "4"])
    assert result.exit_code == 0 and "4 runs" in result.output, result.output
    result = runner.invoke(app, ["sweep", str(config), "--dry-run", "--max-runs", "3"])
    assert result.exit_code == 2 and "more than --max-runs 3 distinct runs (18 combinations)" in result.output


@pytest.mark.parametrize(("text", "options", "key"), [
    ("seeds: [0, 18446744073709551615]\n", [], "seeds.1"),
    ("grid: {optim.lr: [0.1]}\n", ["--set", "seeds=1,9223372036854775808"], "seeds.1"),
    ("base: {seed: 9223372036854775808}\n", [], "base.seed"),
])
def test_a_seed_too_large_names_where_it_came_from(write_yaml, text, options, key):
    result = runner.invoke(app, ["validate", str(write_yaml("name: t\n" + text)), *options])
    assert result.exit_code == 2 and result.output.startswith(f"error: {key}: must be <="), result.output


@pytest.mark.parametrize(("option", "shown"), [
    (["--cluster", "local:-1"], "--cluster local:-1: N must be"),  # ":-1:" is an emoji code to Rich
    (["--cluster", "[bold]x[/bold]"], "--cluster [bold]x[/bold]: expected"),  # markup to Rich
    (["--engine", ":smile:"], "--engine: must be one of auto, reference, batched, fast, got ':smile:'"),
])
def test_errors_print_user_text_literally(write_yaml, tmp_path, option, shown):
    result = runner.invoke(app, ["sweep", str(write_yaml(TINY)), "--out", str(tmp_path / "o"), *option])
    assert result.exit_code == 2 and shown in result.output, result.output


def test_a_path_in_brackets_prints_literally(tmp_path):
    folder = tmp_path / "[bold]runs"
    folder.mkdir()
    result = runner.invoke(app, ["report", str(folder)])
    assert result.exit_code == 2 and "[bold]runs" in result.output, result.output


@pytest.mark.parametrize(("args", "named"), [
    (["report", "{out}", "--steps", ""], "--steps"),
    (["report", "{out}", "--steps", "1,"], "--steps"),
    (["report", "{out}", "--by", ""], "--by"),
    (["report", "{out}", "--by", " , "], "--by"),
    (["report", ""], "RUN_DIR"),
    (["plot", " "], "RUN_DIR"),
    (["verify", ""], "DIR"),
])
def test_empty_options_are_refused_by_name(finished, args, named):
    result = runner.invoke(app, [arg.format(out=finished[1]) for arg in args])
    assert result.exit_code == 2 and named in result.output and "Traceback" not in result.output, result.output


def _studies(out, monkeypatch, capsys) -> tuple[int, str]:
    """`normexp studies --quick --out OUT` (python -m normexp.studies: the same command), in this process on
    one core: exit code and stderr."""
    from normexp import stopping
    from normexp.studies import run

    monkeypatch.setattr(run, "usable_cores", lambda: 1)  # no worker pool: it fails before training
    previous = {signum: signal.getsignal(signum) for signum in stopping.STOP_SIGNALS}
    try:
        with pytest.raises(SystemExit) as caught:
            app(["studies", "--quick", "--out", str(out)], prog_name="normexp")
    finally:
        stopping.on_stop_signals(previous)
    return caught.value.code, capsys.readouterr().err


def test_the_studies_exit_2_on_an_output_folder_they_cannot_use(tmp_path, monkeypatch, capsys):
    """As `normexp sweep`: an --out that is a file or a symbolic link loop, a study folder that holds
    another sweep or one that another sweep is writing is one `error:` line and exit 2 (bad usage), not 1
    (a run failed)."""
    from normexp.folder import SweepLock

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    other = tmp_path / "other"
    (other / "depth").mkdir(parents=True)
    (other / "depth" / "sweep.yaml").write_text("name: not-depth\nbase: {}\ngrid: {}\nseeds: [0]\n")
    busy, late, loop, dangling = tmp_path / "busy", tmp_path / "late", tmp_path / "loop", tmp_path / "dangling"
    loop.symlink_to(loop)
    dangling.symlink_to(tmp_path / "nowhere")
    with SweepLock(busy / "warmup"), SweepLock(late / "blocks"):  # the first study's folder, and the last's
        for out, said in ((a_file, "is a file, not a folder"), (other, "holds sweep 'not-depth'"),
                          (busy, "another sweep is writing here"), (late, "another sweep is writing here"),
                          (loop, "a symbolic link loop"), (dangling, "which does not exist"), ("", "--out: empty")):
            code, stderr = _studies(out, monkeypatch, capsys)
            assert code == 2 and stderr.startswith("error: ") and said in stderr, (code, stderr)
            assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr
    assert a_file.read_text() == "" and not (other / "warmup").exists()
    assert sorted(p.name for p in (busy / "warmup").iterdir()) == [".lock"]
    assert sorted(p.name for p in late.iterdir()) == ["blocks"]  # refused before the first study trained


@pytest.mark.parametrize("command", [["report"], ["report", "--lr-sensitivity"],
                                     ["report", "--pivot", "optim.lr,seed"], ["plot"]])
def test_a_folder_name_too_long_to_read_is_one_error_line(tmp_path, command):
    too_long = str(tmp_path / ("x" * 300))
    result = runner.invoke(app, [command[0], too_long, *command[1:]])
    assert result.exit_code == 2 and "cannot read: File name too long" in result.output, result.output
    assert "Traceback" not in result.output and "cannot write" not in result.output
