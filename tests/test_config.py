"""Config loading: defaults, grid expansion, --set, and a clear error naming the key for bad input."""

from __future__ import annotations

import json
import re
from typing import get_origin

import pytest
from conftest import REPO, SMALL_SWEEP
from pydantic import BaseModel
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import (
    MAX_ERROR_LINES,
    ConfigError,
    RunConfig,
    build_sweep,
    load_sweep,
    parse_set,
    parse_yaml,
    run_keys,
    validate_run,
)

runner = CliRunner()


def test_article_sweep_expands_to_the_four_runs():
    sweep = load_sweep(REPO / "configs" / "warmup.yaml")
    assert sweep.name == "warmup"
    assert [(r.norm.placement, r.norm.kind) for r in sweep.runs] == [
        ("post", "layernorm"), ("post", "rmsnorm"), ("pre", "layernorm"), ("pre", "rmsnorm")]
    run = sweep.runs[0]
    assert (run.model.depth, run.model.width, run.optim.name, run.optim.lr, run.train.steps, run.seed) == (
        32, 32, "adam", 0.01, 30, 0)
    assert run.schedule.kind == "constant" and run.schedule.warmup_steps == 0
    assert sweep.report.steps == [0, 1, 2, 3, 5, 10, 20, 30]


def test_every_field_has_a_default():
    cfg = RunConfig()
    assert cfg.model.depth == 32 and cfg.norm.eps == 1e-5 and cfg.data.n_samples == 64


def test_run_keys_are_dotted_paths():
    keys = run_keys()
    assert {"norm.placement", "optim.lr", "schedule.warmup_steps", "train.threads", "seed"} <= set(keys)


def test_grid_product_then_seeds(write_yaml):
    sweep = load_sweep(write_yaml(SMALL_SWEEP))
    assert len(sweep.runs) == 8
    assert [(r.norm.placement, r.norm.kind, r.seed) for r in sweep.runs[:3]] == [
        ("post", "layernorm", 0), ("post", "layernorm", 1), ("post", "rmsnorm", 0)]
    assert sweep.varying_keys == ["norm.placement", "norm.kind", "seed"]


def test_set_adds_and_replaces_axes(write_yaml):
    path = write_yaml(SMALL_SWEEP)
    sweep = load_sweep(path, ["optim.lr=0.1,1e-3", "norm.kind=rmsnorm", "seeds=5"])
    assert [r.optim.lr for r in sweep.runs] == [0.1, 0.001, 0.1, 0.001]
    assert {r.norm.kind for r in sweep.runs} == {"rmsnorm"}
    assert {r.seed for r in sweep.runs} == {5}


def test_set_keeps_list_values_together():
    assert parse_set("optim.betas=[0.9,0.99],[0.8,0.9]") == ("optim.betas", [[0.9, 0.99], [0.8, 0.9]])


def test_yaml12_floats():
    assert parse_yaml("lr: 1e-3") == {"lr": 0.001}


def test_resolved_sweep_round_trips(write_yaml):
    sweep = load_sweep(write_yaml(SMALL_SWEEP), ["optim.lr=0.1,0.2"])
    again = build_sweep(parse_yaml(sweep.to_yaml()))
    assert again.runs == sweep.runs


def test_duplicate_runs_are_kept_once(write_yaml):
    sweep = load_sweep(write_yaml(SMALL_SWEEP), ["optim.lr=0.1,0.1"])
    assert len(sweep.runs) == 8


def test_base_seed_is_used_without_seeds(write_yaml):
    sweep = load_sweep(write_yaml("name: x\nbase: {seed: 7, train: {steps: 1}}\n"))
    assert [r.seed for r in sweep.runs] == [7]


GOOD = "name: t\nbase:\n  optim: {lr: 0.01}\n"

BAD_FILES = {
    "unknown top-level key": ("name: t\nbse: {}\n", "bse: unknown key (did you mean 'base'?)"),
    "tags not a list": ("name: t\ntags: 5\n", "tags: must be a list, got 5"),
    "notes not text": ("name: t\nnotes: [1]\n", "notes: must be a string, got [1]"),
    "unknown section key": ("name: t\nbase: {optim: {lrr: 0.1}}\n", "base.optim.lrr: unknown key (did you mean 'lr'?)"),
    "unknown section": ("name: t\nbase: {optimizer: {}}\n", "base.optimizer: unknown key (did you mean 'optim'?)"),
    "wrong type": ("name: t\nbase: {model: {depth: deep}}\n", "base.model.depth: must be an integer"),
    "string number": ("name: t\nbase: {model: {depth: '32'}}\n", "base.model.depth: must be an integer"),
    "bool as int": ("name: t\nbase: {model: {depth: true}}\n", "base.model.depth: must be an integer"),
    "lr zero": ("name: t\nbase: {optim: {lr: 0}}\n", "base.optim.lr: must be > 0"),
    "lr negative": ("name: t\nbase: {optim: {lr: -0.1}}\n", "base.optim.lr: must be > 0"),
    "lr inf": ("name: t\nbase: {optim: {lr: .inf}}\n", "base.optim.lr: must be a finite number"),
    "lr nan": ("name: t\nbase: {optim: {lr: .nan}}\n", "base.optim.lr: must be a finite number"),
    "depth zero": ("name: t\nbase: {model: {depth: 0}}\n", "base.model.depth: must be >= 1"),
    "width zero": ("name: t\nbase: {model: {width: 0}}\n", "base.model.width: must be >= 1"),
    "steps negative": ("name: t\nbase: {train: {steps: -1}}\n", "base.train.steps: must be >= 0"),
    "warmup negative": ("name: t\nbase: {schedule: {kind: cosine, warmup_steps: -5}}\n",
                        "base.schedule.warmup_steps: must be >= 0"),
    "unknown placement": ("name: t\nbase: {norm: {placement: psot}}\n",
                          "base.norm.placement: must be one of"),
    "unknown kind": ("name: t\nbase: {norm: {kind: rmsnrom}}\n", "(did you mean 'rmsnorm'?)"),
    "unknown optimizer": ("name: t\nbase: {optim: {name: adamx}}\n", "base.optim.name: must be one of"),
    "unknown schedule": ("name: t\nbase: {schedule: {kind: step}}\n", "base.schedule.kind: must be one of"),
    "warmup with constant": ("name: t\nbase: {schedule: {warmup_steps: 10}}\n",
                             "base.schedule: warmup_steps has no effect with kind 'constant'"),
    "grid value out of range": ("name: t\ngrid: {optim.lr: [0.1, -1]}\n", "grid.optim.lr: must be > 0"),
    "grid unknown key": ("name: t\ngrid: {optim.lrr: [0.1]}\n",
                         "grid.optim.lrr: unknown key (did you mean 'optim.lr'?)"),
    "grid not a list": ("name: t\ngrid: {optim.lr: 0.1}\n", "grid.optim.lr: must be a list"),
    "grid empty list": ("name: t\ngrid: {optim.lr: []}\n", "grid.optim.lr: the list is empty"),
    "seeds empty": ("name: t\nseeds: []\n", "seeds: the list is empty"),
    "seed negative": ("name: t\nseeds: [-1]\n", "seeds.0: must be >= 0"),
    "duplicate key": ("name: t\nbase: {}\nbase: {}\n", "base: duplicate key (line 3)"),
    "nested duplicate key": ("name: t\nbase:\n  optim: {lr: 0.1, lr: 0.2}\n", "lr: duplicate key"),
    "malformed": ("name: t\nbase: {optim: [}\n", "malformed YAML"),
    "unsafe tag": ("name: !!python/object/apply:os.system ['true']\n", "unsafe YAML"),
    "empty file": ("", "the file is empty"),
    "comments only": ("# nothing\n", "the file is empty"),
    "not a mapping": ("- a\n- b\n", "must be a mapping"),
    "scalar document": ("42\n", "must be a mapping"),
    "missing name": ("base: {}\n", "name: required key is missing"),
    "name escapes folder": ("name: ../../etc\n", "name: must be letters, digits"),
    "name absolute": ("name: /tmp/x\n", "name: must be letters, digits"),
    "base not a mapping": ("name: t\nbase: [1, 2]\n", "base: must be a mapping"),
    "betas wrong length": ("name: t\nbase: {optim: {betas: [0.9]}}\n", "base.optim.betas"),
    "betas out of range": ("name: t\nbase: {optim: {betas: [0.9, 1.5]}}\n", "base.optim.betas.1: must be < 1"),
    "report column unknown": ("name: t\nreport: {columns: [norm.plcement]}\n", "report.columns: unknown key"),
    "seed as grid key": ("name: t\ngrid: {seed: [1, 2]}\n", "grid.seed: seeds are set with the 'seeds' list"),
    "grid key lookalike": ("name: t\ngrid: {seed_list: [1]}\n", "grid.seed_list: unknown key"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_file_names_the_key(write_yaml, case):
    text, expected = BAD_FILES[case]
    with pytest.raises(ConfigError) as info:
        load_sweep(write_yaml(text))
    assert expected in str(info.value)


BAD_SETS = {
    "no equals": ("optim.lr", "--set optim.lr: expected KEY=VALUE"),
    "no values": ("optim.lr=", "--set optim.lr: no values given"),
    "unknown key": ("optim.lrr=0.1", "--set optim.lrr: unknown key (did you mean 'optim.lr'?)"),
    "bad value": ("optim.lr=0,0.1", "grid.optim.lr: must be > 0"),
    "bad type": ("model.depth=two", "grid.model.depth: must be an integer"),
    "bad placement": ("norm.placement=middle", "grid.norm.placement: must be one of"),
    "malformed list": ("optim.betas=[0.9", "--set optim.betas: malformed YAML"),
}


@pytest.mark.parametrize("case", list(BAD_SETS))
def test_bad_set_names_the_key(write_yaml, case):
    option, expected = BAD_SETS[case]
    with pytest.raises(ConfigError) as info:
        load_sweep(write_yaml(GOOD), [option])
    assert expected in str(info.value)


def test_max_runs_guards_absurd_grids(write_yaml):
    with pytest.raises(ConfigError, match="expands to 1000000 runs, more than the limit of"):
        load_sweep(write_yaml(GOOD), ["seeds=" + ",".join(map(str, range(1000))),
                                      "optim.lr=" + ",".join(str(0.001 * (i + 1)) for i in range(1000))])


def test_each_seed_of_a_grid_point_is_the_run_a_fresh_validation_gives(write_yaml):
    """Seeds are set on one validated run per grid point: each must be the run its own mapping
    validates to (equal, same hash, same dump), whatever the optimizer's seed-independent defaults."""
    sweep = load_sweep(write_yaml(GOOD), ["seeds=0,1,7", "optim.name=adam,adamw", "optim.lr=0.01,0.1"])
    assert len(sweep.runs) == 12 and sorted({run.seed for run in sweep.runs}) == [0, 1, 7]
    for run in sweep.runs:
        fresh = RunConfig.model_validate(run.model_dump(mode="json"))
        assert fresh == run and hash(fresh) == hash(run)
        assert fresh.model_dump(mode="json") == run.model_dump(mode="json")


def _sections() -> dict[str, type[BaseModel]]:
    return {name: field.annotation for name, field in RunConfig.model_fields.items()
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)}


# Every run key whose value is a fixed-length list (a tuple in the schema), with its default: read from the
# models, so that a tuple key added later is checked too.
TUPLE_KEYS = {f"{section}.{leaf}": field.default for section, model in _sections().items()
              for leaf, field in model.model_fields.items() if get_origin(field.annotation) is tuple}


def test_the_schema_has_tuple_keys():
    assert "optim.betas" in TUPLE_KEYS


@pytest.mark.parametrize("key", list(TUPLE_KEYS))
@pytest.mark.parametrize("shape", ["short", "long", "empty", "scalar"])
def test_a_list_of_the_wrong_length_says_what_it_must_be(key, shape):
    """`betas: [0.9]` is a list of the wrong length, not a missing key: in the base, the grid and --set."""
    default = list(TUPLE_KEYS[key])
    bad = {"short": default[:-1], "long": [*default, default[-1]], "empty": [], "scalar": default[0]}[shape]
    section, leaf = key.split(".")
    attempts = {"base": lambda: build_sweep({"name": "t", "base": {section: {leaf: bad}}}),
                "grid": lambda: build_sweep({"name": "t", "grid": {key: [default, bad]}}),
                "--set": lambda: build_sweep({"name": "t"}, [f"{key}={json.dumps(bad)}"])}
    for where, attempt in attempts.items():
        with pytest.raises(ConfigError) as caught:
            attempt()
        path = "base" if where == "base" else "grid"
        expected = rf"{path}\.{re.escape(key)}: must be a list of \w+ numbers, e\.g\. .*, got {re.escape(repr(bad))}"
        assert re.fullmatch(expected, str(caught.value)), (where, str(caught.value))


def test_set_betas_of_one_number_names_the_key_and_its_shape(write_yaml):
    result = CliRunner().invoke(app, ["validate", str(write_yaml(GOOD)), "--set", "optim.betas=[0.9]"])
    assert result.exit_code == 2, result.output
    assert result.output == "error: grid.optim.betas: must be a list of two numbers, e.g. [0.9, 0.999], got [0.9]\n"


def _refuses_zero(key: str) -> bool:
    section, _, leaf = key.partition(".")
    try:
        validate_run({section: {leaf: 0.0}})
    except ConfigError as exc:
        return f"{key}: must be > 0" in str(exc)
    return False


# Every float key the schema requires > 0 (found by trying 0.0): each is a float32 number in training (an eps,
# a learning rate, an init scale), so a value that float32 rounds to 0 is 0 there. Not prms_fraction: it
# counts features in Python, max(1, int(d * p)), and a tiny fraction is simply 1 feature.
POSITIVE_FLOAT32_KEYS = [key for key in run_keys() if _refuses_zero(key) and key != "norm.prms_fraction"]


def test_the_positive_keys_include_both_eps():
    assert {"norm.eps", "optim.eps", "optim.lr"} <= set(POSITIVE_FLOAT32_KEYS)


@pytest.mark.parametrize("key", POSITIVE_FLOAT32_KEYS)
@pytest.mark.parametrize("value", [1e-50, 7e-46, 1e-300])
def test_a_positive_value_that_is_0_in_float32_is_refused(key, value):
    section, _, leaf = key.partition(".")
    with pytest.raises(ConfigError) as caught:
        validate_run({section: {leaf: value}}, "base")
    assert str(caught.value).startswith(f"base.{key}: is 0 in float32"), str(caught.value)
    with pytest.raises(ConfigError) as caught:
        build_sweep({"name": "t"}, [f"{key}={value!r}"])
    assert str(caught.value).startswith(f"grid.{key}: is 0 in float32"), str(caught.value)


@pytest.mark.parametrize("key", ["norm.eps", "optim.eps"])
def test_the_smallest_positive_float32_is_not_0(key):
    section, _, leaf = key.partition(".")
    assert getattr(getattr(validate_run({section: {leaf: 1.5e-45}}), section), leaf) == 1.5e-45


def test_eps_1e_50_exits_2(write_yaml):
    result = CliRunner().invoke(app, ["validate", str(write_yaml("name: t\nbase: {optim: {eps: 1e-50}}\n"))])
    assert result.exit_code == 2 and result.output.startswith("error: base.optim.eps: is 0 in float32"), result.output


def test_set_of_a_list_key_without_brackets_says_to_bracket_it():
    """`--set optim.betas=0.9,0.99` is two grid values, 0.9 and 0.99, neither a pair: say how to write one."""
    with pytest.raises(ConfigError, match=r"optim.betas is a list, written in brackets .*optim.betas=\[0.9,0.99\]"):
        parse_set("optim.betas=0.9,0.99")
    assert parse_set("optim.betas=[0.9,0.99],[0.8,0.9]") == ("optim.betas", [[0.9, 0.99], [0.8, 0.9]])


# ----------------------------------------------------------------------------- short errors that name the key


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


def test_max_runs_is_not_offered_where_there_is_no_such_option(write_yaml):
    config = write_yaml("name: t\ngrid: {optim.lr: [" + ", ".join(f"0.{i + 1}" for i in range(400)) + "]}\n"
                        "seeds: [" + ", ".join(str(s) for s in range(300)) + "]\n")
    for command in ("validate", "gradnorm"):
        result = runner.invoke(app, [command, str(config)])
        assert result.exit_code == 2 and "120000" in result.output and "--max-runs" not in result.output


@pytest.mark.parametrize(("text", "options", "key"), [
    ("seeds: [0, 18446744073709551615]\n", [], "seeds.1"),
    ("grid: {optim.lr: [0.1]}\n", ["--set", "seeds=1,9223372036854775808"], "seeds.1"),
    ("base: {seed: 9223372036854775808}\n", [], "base.seed"),
])
def test_a_seed_too_large_names_where_it_came_from(write_yaml, text, options, key):
    result = runner.invoke(app, ["validate", str(write_yaml("name: t\n" + text)), *options])
    assert result.exit_code == 2 and result.output.startswith(f"error: {key}: must be <="), result.output
