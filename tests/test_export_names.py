"""Run names (normexp/export/names.py): a template of config keys, or by default the sweep's varying keys."""

import pytest

from normexp.config import ConfigError, flatten, load_sweep
from normexp.export.names import run_names, value_text, varying_keys
from normexp.folder import run_id


def _runs(path, sets=()):
    cfgs = list(load_sweep(path, list(sets)).runs)
    return cfgs, [run_id(c) for c in cfgs]


def test_the_default_names_the_grid_axes_and_tells_every_run_apart():
    cfgs, ids = _runs("normexp/configs/studies/lr_warmup.yaml")
    names = run_names(cfgs, ids)
    assert len(set(names.values())) == len(cfgs)
    cfg = cfgs[0]
    expected = (f"{cfg.norm.placement}-lr{cfg.optim.lr:g}-wu{cfg.schedule.warmup_steps}-s{cfg.seed}")
    assert names[ids[0]] == expected


def test_a_key_that_follows_another_is_left_out_of_the_default():
    cfgs, _ = _runs("normexp/configs/studies/instabilities.yaml", ["seeds=0", "optim.lr=0.001"])
    keys = varying_keys([flatten(c) for c in cfgs])
    assert "model.width" in keys and "model.n_heads" not in keys  # heads are listed with the width
    assert "model.qk_norm" in keys and "model.qk_norm_eps" not in keys


def test_a_template_renders_each_field_and_alike_names_get_the_hash():
    cfgs, ids = _runs("normexp/configs/studies/lr_warmup.yaml")
    names = run_names(cfgs, ids, "{norm.placement}-lr{optim.lr}")  # seeds are not in it: names collide
    assert len(set(names.values())) == len(cfgs)
    rid = ids[0]
    assert names[rid] == f"{cfgs[0].norm.placement}-lr{cfgs[0].optim.lr:g}-{rid.rsplit('-', 1)[-1][:6]}"
    one = run_names(cfgs[:1], ids[:1], "{run_id}/{seed}/{model.depth}")
    assert one == {rid: f"{rid}/{cfgs[0].seed}/{cfgs[0].model.depth}"}


@pytest.mark.parametrize("template, says", [("{depth}", "{model.depth}"), ("", "empty"), ("{optim.lr", "unbalanced")])
def test_a_bad_template_names_the_option_and_the_field(template, says):
    cfgs, ids = _runs("normexp/configs/warmup.yaml")
    with pytest.raises(ConfigError, match="--run-name") as caught:
        run_names(cfgs, ids, template)
    assert says in str(caught.value)


def test_values_read_as_a_user_writes_them():
    assert [value_text(v) for v in (1e-05, 0.001, 3, True, None, [0.9, 0.95])] == \
        ["1e-05", "0.001", "3", "true", "None", "[0.9,0.95]"]
