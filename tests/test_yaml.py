"""The sweep file's YAML: aliases expand within a bound (an alias bomb is one short error), standard merge
keys, YAML 1.2 scalars (`010` is ten, `yes` a string), keys that are not strings named as such, and a key
written twice refused."""

from __future__ import annotations

import time

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from normexp.cli import app
from normexp.config import MAX_YAML_NODES, ConfigError, build_sweep, parse_yaml

runner = CliRunner()


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
