"""Loading a step package that cannot be read (aot.load_package): it raises, for load_or_compile to
compile it again, and prints nothing of torch's own."""

import logging

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
