"""Loading a step package that cannot be read (aot.load_package): it raises, for load_or_compile to
compile it again, and prints nothing of torch's own."""

import logging
from pathlib import Path

import pytest

from normexp.engines import aot


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 truncated", b"\x00" * 64])
def test_an_unreadable_package_raises_without_torchs_regenerate_line(tmp_path, content):
    package = tmp_path / "step.pt2"
    package.write_bytes(content)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("torch._inductor.package.package")
    handler = Keep(level=logging.DEBUG)
    logger.addHandler(handler)
    try:
        with pytest.raises(Exception):  # noqa: B017 - whatever torch raises on it
            aot.load_package(package)
    finally:
        logger.removeHandler(handler)
    assert not [m for m in seen if "regenerate" in m]


def test_compiling_a_package_shows_no_treespec_deprecation(monkeypatch, tmp_path):
    """torch warns of its own treespec deprecation while AOTInductor copies the exported program (seen
    on stderr of every cold compile, torch 2.13); nothing a user can act on, so none is shown."""
    import warnings

    import torch
    import torch._inductor

    def compile_and_package(exported, package_path, inductor_configs=None):
        assert inductor_configs == aot.INDUCTOR_CONFIGS  # the wrapper at -O0
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, stacklevel=1)
        Path(package_path).write_bytes(b"package")

    monkeypatch.setattr(torch.export, "export", lambda graph, inputs: graph)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_and_package)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aot.compile_package(None, (), tmp_path / "step.pt2")
    assert [str(w.message) for w in caught] == []
    assert (tmp_path / "step.pt2").read_bytes() == b"package" and list(tmp_path.iterdir()) == [tmp_path / "step.pt2"]
