"""The loader never raises anything but ConfigError, whatever YAML or mutation it is fed."""

from __future__ import annotations

import yaml
from conftest import REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from normexp.config import ConfigError, build_sweep, parse_yaml, read_mapping, run_keys

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12))
documents = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=12)
VALID = read_mapping(REPO / "configs" / "warmup.yaml")
KEYS = ["name", "base", "grid", "seeds", "report",
        *(f"base.{k}" for k in run_keys()), *(f"grid.{k}" for k in run_keys())]


def load(data) -> None:
    try:
        if not isinstance(data, dict):
            raise ConfigError("not a mapping")
        build_sweep(data, max_runs=1000)
    except ConfigError as exc:
        assert str(exc)  # every error says something


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=200))
def test_random_text_as_yaml(text):
    try:
        load(parse_yaml(text))
    except ConfigError:
        pass


@settings(max_examples=300, deadline=None)
@given(doc=documents)
def test_random_documents(doc):
    load(doc)
    try:
        load(parse_yaml(yaml.safe_dump(doc)))
    except ConfigError:
        pass


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(KEYS), value=documents)
def test_mutations_of_a_valid_sweep(key, value):
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in VALID.items()}
    section, _, rest = key.partition(".")
    if not rest:
        data[section] = value
    else:
        target = data.setdefault(section, {})
        if section == "grid":
            target[rest] = value
        else:
            sub, _, leaf = rest.partition(".")
            if leaf:
                target[sub] = {**(target.get(sub) or {}), leaf: value}
            else:
                target[sub] = value
    load(data)
