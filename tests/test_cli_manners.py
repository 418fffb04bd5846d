"""The command line's manners (issue 49): --version, -h, shell completion, hints for the names and
argument shapes other tools taught their users."""

from __future__ import annotations

import json
import re

import pytest
from conftest import SMALL_SWEEP
from typer.testing import CliRunner

import normexp
from normexp.cli import app

runner = CliRunner()


def normexp_cli(*args: str, **kwargs):
    return runner.invoke(app, [str(a) for a in args], **kwargs)


def test_version_prints_normexps_version():
    for flag in ("--version", "-V"):
        result = normexp_cli(flag)
        assert result.exit_code == 0 and result.stdout.strip() == f"normexp {normexp.__version__}"


def test_h_is_help_on_every_command():
    for args in ([], ["sweep"], ["report"], ["plot"], ["verify"], ["norms", "props"], ["studies"]):
        short, long = normexp_cli(*args, "-h"), normexp_cli(*args, "--help")
        assert short.exit_code == 0 and short.stdout == long.stdout and "Usage:" in short.stdout


def test_show_completion_prints_a_bash_script():
    result = runner.invoke(app, ["--show-completion", "bash"], prog_name="normexp")
    assert result.exit_code == 0 and "_NORMEXP_COMPLETE" in result.stdout and "complete " in result.stdout


# (the name typed, where, the hint): the names other tools use, as --set keys, grid keys and nested keys
ALIASED = [
    ("--set", "learning_rate", "optim.lr"), ("--set", "lr", "optim.lr"),
    ("--set", "warmup", "schedule.warmup_steps"), ("--set", "norm.type", "norm.kind"),
    ("--set", "norm.position", "norm.placement"), ("--set", "batch_size", "data.batch_size"),
    ("--set", "optim.learning_rate", "optim.lr"), ("grid", "lr", "optim.lr"),
    ("base", "optim: {learning_rate: 0.1}", "base.optim.learning_rate: unknown key (did you mean 'lr'?)"),
    ("base", "norm: {type: rmsnorm}", "base.norm.type: unknown key (did you mean 'kind'?)"),
    ("base", "norm: {position: pre}", "base.norm.position: unknown key (did you mean 'placement'?)"),
    ("base", "learning_rate: 0.1", "base.learning_rate: unknown key (did you mean 'optim.lr'?)"),
    ("base", "train: {seed: 3}", "base.train.seed: unknown key (did you mean 'seeds'?)"),
]


@pytest.mark.parametrize(("where", "name", "hint"), ALIASED)
def test_did_you_mean_knows_the_names_ml_users_type(where, name, hint, tmp_path):
    path = tmp_path / "s.yaml"
    if where == "--set":
        path.write_text("name: t\n")
        result, expected = normexp_cli("validate", path, "--set", f"{name}=0.1"), \
            f"--set {name}: unknown key (did you mean '{hint}'?)"
    elif where == "grid":
        path.write_text(f"name: t\ngrid: {{{name}: [0.1]}}\n")
        result, expected = normexp_cli("validate", path), f"grid.{name}: unknown key (did you mean '{hint}'?)"
    else:
        path.write_text(f"name: t\nbase: {{{name}}}\n")
        result, expected = normexp_cli("validate", path), hint
    assert result.exit_code == 2 and expected in result.output, result.output


def test_seed_is_sent_to_the_seeds_list(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: t\n")
    result = normexp_cli("validate", path, "--set", "seed=1")
    assert result.exit_code == 2 and "'seeds' list (or --set seeds=0,1,2)" in result.output


@pytest.mark.parametrize("command", ["sweep", "validate"])
def test_hydra_style_argument_is_answered_with_set(command, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: t\n")
    result = normexp_cli(command, path, "--set", "train.steps=2", "optim.lr=0.1", "+model.depth=3")
    assert result.exit_code == 2
    assert "did you mean `--set optim.lr=0.1 --set model.depth=3`?" in result.output
    plain = normexp_cli(command, path, "extra")
    assert plain.exit_code == 2 and "--set" not in plain.output


@pytest.mark.parametrize(("text", "hint"), [
    ("name: t\nmodel: {depth: 3}\n", "model: unknown key (did you mean 'base.model'?"),
    ("name: t\noptim: {lr: 0.1}\n", "optim: unknown key (did you mean 'base.optim'?"),
    ("name: t\ngrid: {optim.lr: 0.1}\n", "grid.optim.lr: must be a list of the axis's values, e.g. [0.1], got 0.1"),
    ("name: t\nseeds: 3\n", "seeds: must be a list of seeds, e.g. [3], got 3"),
])
def test_yaml_shape_mistakes_get_a_hint(text, hint, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    result = normexp_cli("validate", path)
    assert result.exit_code == 2 and hint in result.output, result.output


def test_shipped_configs_are_named_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, shipped in (("warmup", "configs/warmup.yaml"), ("depth.yaml", "configs/studies/depth.yaml")):
        result = normexp_cli("validate", name)
        assert result.exit_code == 0, result.output
        assert "using the config shipped with normexp" in result.output and shipped in result.output
    (tmp_path / "warmup").write_text("name: mine\n")  # a file of that name here is the one meant
    result = normexp_cli("validate", "warmup")
    assert result.exit_code == 0 and "sweep 'mine'" in result.output and "shipped" not in result.output
    assert normexp_cli("validate", "nosuch").exit_code == 2


def test_a_comparison_figure_goes_to_the_current_folder_not_into_an_input(write_yaml, tmp_path, monkeypatch):
    config = write_yaml(SMALL_SWEEP.replace("seeds: [0, 1]", "seeds: [0]"))
    folders = [tmp_path / "a", tmp_path / "b"]
    for folder in folders:
        assert normexp_cli("sweep", config, "--out", folder, "-q").exit_code == 0
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    result = normexp_cli("plot", *folders, "--dpi", "30")
    assert result.exit_code == 0, result.output
    assert "wrote compare-loss.png" in result.output and (here / "compare-loss.png").is_file()
    assert not [path for folder in folders for path in folder.glob("compare-*")]
    named = normexp_cli("plot", *folders, "-o", tmp_path / "mine.png", "--dpi", "30")
    assert named.exit_code == 0 and (tmp_path / "mine.png").is_file()


@pytest.mark.process
def test_the_readmes_interrupted_sweep_exits_as_it_shows(write_yaml, tmp_path):
    """The README's stop-and-resume example, its `timeout` prefix as printed (a shorter wait): `echo $?`
    prints what the README shows."""
    import re
    import shutil
    import subprocess
    import sys

    from conftest import REPO

    if shutil.which("timeout") is None:
        pytest.skip("needs coreutils' timeout")
    readme = (REPO / "README.md").read_text()
    example = re.search(r"\$ (timeout [^\n]*?) normexp sweep .*?\$ echo \$\?\n(\d+)\n", readme, re.S)
    assert example, "the README's stop-and-resume example"
    prefix, shown = example.group(1).split(), int(example.group(2))
    prefix[-1] = "4"  # seconds: too few to finish
    config = write_yaml(SMALL_SWEEP.replace("steps: 5", "steps: 100000"))
    done = subprocess.run([*prefix, sys.executable, "-m", "normexp", "sweep", str(config), "--out",
                           str(tmp_path / "out"), "--engine", "reference"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == shown == 130, done.stderr


def test_verify_suggests_what_mends_the_folder(write_yaml, tmp_path):
    """An interrupted sweep's folder (runs missing): verify says to rerun the sweep, not --fix (which has
    nothing to do there); the command it names mends it. A corrupt run: --fix, then the rerun."""
    import shlex
    import shutil

    out = tmp_path / "out"
    assert normexp_cli("sweep", write_yaml(SMALL_SWEEP), "--out", out, "-q").exit_code == 0
    runs = sorted(p for p in out.iterdir() if (p / "done.json").exists())
    for run in runs[:3]:  # as a sweep stopped by Ctrl-C leaves it: runs never started
        shutil.rmtree(run)
    result = normexp_cli("verify", out)
    last = result.output.strip().splitlines()[-1]
    assert result.exit_code == 1 and "--fix" not in last and "problems found: rerun the sweep (" in last, last
    command = shlex.split(last.split("(", 1)[1].rstrip(")"))
    assert command[:2] == ["normexp", "sweep"]
    assert normexp_cli(*command[1:], "-q").exit_code == 0
    assert normexp_cli("verify", out).exit_code == 0
    (runs[0] / "metrics.csv").write_text("step,loss\n0,1.0\n")  # corrupt: --fix removes it, the rerun redoes it
    last = normexp_cli("verify", out).output.strip().splitlines()[-1]
    assert f"normexp verify {out} --fix, then rerun the sweep (" in last, last


def test_report_calls_the_runs_of_a_sweep_still_writing_pending(write_yaml, tmp_path):
    import shutil

    from normexp.folder import SweepLock

    out = tmp_path / "out"
    assert normexp_cli("sweep", write_yaml(SMALL_SWEEP), "--out", out, "-q").exit_code == 0
    shutil.rmtree(sorted(p for p in out.iterdir() if (p / "done.json").exists())[0])  # not yet written
    with SweepLock(out):  # as the sweep writing it holds it
        result = normexp_cli("report", out)
    assert result.exit_code == 1
    assert "pending, the sweep is still writing" in result.output and "(pending)" in result.output
    assert "normexp verify" not in result.output and "missing, failed or corrupt" not in result.output
    result = normexp_cli("report", out)  # the sweep gone: a run missing, and verify to say more
    assert result.exit_code == 1 and "missing, failed or corrupt" in result.output and "normexp verify" in result.output


def test_engine_fast_says_which_engine_trains_what_it_does_not_serve(write_yaml, tmp_path):
    config = write_yaml(SMALL_SWEEP.replace("train: {steps: 5}", "train: {steps: 5, log_blocks: true}"))
    dry = normexp_cli("sweep", config, "--engine", "fast", "--dry-run", "--out", tmp_path / "dry")
    line = "--engine fast: 8 of 8 runs set train.log_blocks, which the fast engine does not serve: they train on " \
           "the exact engines instead"
    assert dry.exit_code == 0 and line in dry.output, dry.output
    fast, reference = re.search(r"estimated ~(\S+ \S+) on --engine fast, ~(\S+ \S+) on --engine reference",
                                dry.output).groups()
    assert fast == reference  # the exact engines' time, not the fast engine's
    ran = normexp_cli("sweep", config, "--engine", "fast", "--out", tmp_path / "out")
    assert ran.exit_code == 0 and line in ran.output
    assert "fast" not in {json.loads(p.read_text())["engine"] for p in (tmp_path / "out").glob("*/done.json")}
    plain = normexp_cli("sweep", write_yaml(SMALL_SWEEP), "--engine", "fast", "--dry-run", "--out", tmp_path / "p")
    assert plain.exit_code == 0 and "does not serve" not in plain.output
