"""A placement and a norm kind from a user's own package (docs/extending.md): validated, labelled, given
run ids of their own, and trained on every engine. The package is written here, outside normexp, and
reached through sys.path (and PYTHONPATH for the command line), as a user's would be."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from normexp.config import ConfigError, build_sweep, validate_run
from normexp.engines.batched import plan_batches, train_batch
from normexp.engines.common import seeded_init
from normexp.engines.fast import train_fast
from normexp.engines.reference import train_run
from normexp.folder import is_run_id, run_id

PACKAGE = '''
import torch
from torch import nn


class CenterNorm(nn.Module):
    """(x - mean x) / (mean |x - mean x| + eps), times a gain: a toy norm kind."""

    stackable = True

    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        c = x - x.mean(-1, keepdim=True)
        return self.weight * c / (c.abs().mean(-1, keepdim=True) + self.eps)


class Halfway:
    """x + Norm(x + F(x)) / 2: a toy placement."""

    stackable = True

    @staticmethod
    def build(block, norm):
        block.norm = norm()

    @staticmethod
    def forward(block, x):
        return x + block.norm(x + block.branch(x)) / 2


class Unstacked(Halfway):
    stackable = False


class Drawing(Halfway):
    @staticmethod
    def build(block, norm):
        block.norm = norm()
        torch.rand(1)


class NoForward:
    pass


class DrawingNorm(CenterNorm):
    def __init__(self, d, eps):
        super().__init__(d, eps)
        torch.rand(1)


from torch.nn import LayerNorm  # noqa: E402 - a module: a norm kind, not a placement
'''
OWN, KIND = "usernorms:Halfway", "usernorms:CenterNorm"


@pytest.fixture
def package(tmp_path, monkeypatch):
    (tmp_path / "usernorms.py").write_text(textwrap.dedent(PACKAGE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def configs(arch: str = "ffn", placement: str = OWN, kind: str = KIND, seeds: int = 3) -> list:
    data = {"task": "copy", "n_samples": 16, "n_val": 8} if arch == "transformer" else {"n_samples": 16}
    return [validate_run({"model": {"arch": arch, "depth": 3, "width": 8, **({"n_heads": 2} if arch == "transformer"
                                                                           else {})},
                          "norm": {"placement": placement, "kind": kind}, "data": data,
                          "optim": {"lr": [0.01, 0.003, 0.02][s % 3]}, "train": {"steps": 6}, "seed": s})
            for s in range(seeds)]


def test_the_placement_is_its_authors_one_line_at_init(package):
    """An independent transcription of the user's formula, x + CenterNorm(x + fc2(relu(fc1 x))) / 2 per
    block, then the article's final norm (of the run's kind) and head, equals normexp's model."""
    cfg = configs()[0]
    model, task = seeded_init(cfg)
    x = task.x
    for block in model.blocks:
        fc1, fc2 = block.branch.fc1, block.branch.fc2
        u = x + torch.relu(x @ fc1.weight.T + fc1.bias) @ fc2.weight.T + fc2.bias
        c = u - u.mean(-1, keepdim=True)
        x = x + (block.norm.weight * c / (c.abs().mean(-1, keepdim=True) + cfg.norm.eps)) / 2
    c = x - x.mean(-1, keepdim=True)
    x = model.final_norm.weight * c / (c.abs().mean(-1, keepdim=True) + cfg.norm.eps)
    expected = x @ model.head.weight.T + model.head.bias
    torch.testing.assert_close(model(task.x), expected, rtol=1e-5, atol=1e-6)


def test_it_trains_on_every_engine(package):
    """Reference; batched, bit for bit (it says it stacks); fast, within 2e-4 of the reference."""
    runs = configs()
    reference = [train_run(cfg) for cfg in runs]
    batches, alone = plan_batches(runs)
    assert [len(b) for b in batches] == [3] and not alone
    assert [repr(r.metrics) for r in train_batch(runs)] == [repr(r.metrics) for r in reference]
    for got, want in zip(train_fast(runs, compile=False), reference):
        assert got.status == want.status == "completed"
        assert got.metrics["loss"] == pytest.approx(want.metrics["loss"], rel=2e-4, abs=2e-4)


def test_it_trains_in_the_transformer_on_every_engine(package):
    runs = configs("transformer", kind="layernorm", seeds=2)
    reference = [train_run(cfg) for cfg in runs]
    assert all(r.status == "completed" for r in reference)
    assert plan_batches(runs) == ([], runs)  # the batched engine gives Transformer runs to the reference
    for got, want in zip(train_fast(runs, compile=False), reference):
        assert got.metrics["loss"] == pytest.approx(want.metrics["loss"], rel=2e-4, abs=2e-4)


def test_a_placement_that_does_not_say_it_stacks_trains_on_the_reference(package):
    runs = configs(placement="usernorms:Unstacked")
    assert plan_batches(runs) == ([], runs)


def test_run_ids_name_it_and_hash_the_whole_reference(package):
    cfg = configs()[0]
    rid = run_id(cfg)
    assert rid.startswith("ext_halfway-ext_centernorm-s0-") and is_run_id(rid)
    assert run_id(configs(placement="usernorms:Unstacked")[0]) != rid  # another reference, another id


@pytest.mark.parametrize("ref,says", [
    ("usernorms:Nope", "usernorms has no attribute Nope"),
    ("nosuchpackage:Halfway", "cannot import nosuchpackage"),
    ("usernorms:NoForward", "usernorms:NoForward: a placement needs forward(block, x)"),
    ("usernorms:LayerNorm", "usernorms:LayerNorm: is a torch.nn.Module, which makes a norm kind"),
    ("exits:X", "cannot import exits: SystemExit: 3"),
])
def test_a_bad_reference_is_a_config_error_naming_the_key(package, ref, says):
    (package / "exits.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ConfigError) as error:
        build_sweep({"name": "x", "base": {"norm": {"placement": ref}}})
    assert f"base.norm.placement: {says}" in str(error.value)


def test_a_placement_or_kind_that_draws_random_numbers_is_refused(package):
    with pytest.raises(ValueError, match="usernorms:Drawing: a placement's build.. drew random numbers"):
        seeded_init(configs(placement="usernorms:Drawing")[0])
    with pytest.raises(ValueError, match="usernorms:DrawingNorm: a norm kind drew random numbers"):
        seeded_init(configs(kind="usernorms:DrawingNorm")[0])


@pytest.mark.process
def test_a_sweep_of_it_from_the_command_line(package, tmp_path):
    """From outside: PYTHONPATH names the user's package; sweep, report and verify work as for any run."""
    (tmp_path / "own.yaml").write_text(
        f"name: own\nbase: {{model: {{depth: 2, width: 4}}, train: {{steps: 3}}}}\n"
        f"grid: {{norm.placement: [pre, '{OWN}'], norm.kind: [layernorm, '{KIND}']}}\nseeds: [0, 1]\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package), os.environ.get("PYTHONPATH", "")])}

    def normexp(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "normexp", *args], capture_output=True, text=True, env=env)

    out = tmp_path / "out"
    swept = normexp("sweep", str(tmp_path / "own.yaml"), "--out", str(out), "--engine", "batched", "-q")
    assert swept.returncode == 0, swept.stderr
    shown = normexp("report", str(out), "--format", "markdown")
    assert shown.returncode == 0 and f"{OWN}-{KIND}" in shown.stdout and "Pre-LN" in shown.stdout
    assert normexp("verify", str(out)).returncode == 0
    assert len(list(out.glob("ext_halfway-ext_centernorm-s*"))) == 2
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")  # the package gone: its runs are read as written
    for command in (("report", str(out), "--format", "csv"), ("verify", str(out)), ("plot", str(out))):
        read = normexp(*command)
        assert read.returncode == 0 and "Traceback" not in read.stderr, (command, read.stderr)
    code = (f"import sys; from normexp.results import load_metrics; load_metrics({str(out)!r}); "
            "print('torch' in sys.modules or 'usernorms' in sys.modules)")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert loaded.stdout.strip() == "False", loaded.stderr


def test_a_module_its_forward_never_uses_is_named_on_the_exact_engines(package):
    (package / "unused.py").write_text(textwrap.dedent('''
        import torch
        from torch import nn

        class Unused:
            @staticmethod
            def build(block, norm):
                block.norm = norm()
                block.spare = nn.Parameter(torch.zeros(3))

            @staticmethod
            def forward(block, x):
                return x + block.branch(block.norm(x))
    '''))
    with pytest.raises(ValueError, match=r"shape \(3,\)\) received no gradient"):
        train_run(configs(placement="unused:Unused")[0])


def test_a_reference_is_looked_up_once_per_process_until_reset(package):
    """`load_plugin` imports a reference's module once; `registry.reset` forgets what it looked up, as a
    fresh process starts, and the next lookup finds the module as sys.modules then holds it."""
    from normexp import registry

    first = registry.load_plugin(OWN)
    module = sys.modules["usernorms"]
    del sys.modules["usernorms"]
    try:
        assert registry.load_plugin(OWN) is first
        registry.reset()
        again = registry.load_plugin(OWN)
        assert again is not first and again is sys.modules["usernorms"].Halfway
    finally:
        sys.modules["usernorms"] = module
        registry.reset()
