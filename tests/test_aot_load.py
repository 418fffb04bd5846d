"""Loading a step package that cannot be read (aot.load_package): it raises, for load_or_compile to
compile it again, and prints nothing of torch's own."""

import logging
from pathlib import Path

import pytest

from normexp.engines.fast import aot


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
    """torch may warn of its own treespec deprecation inside AOTInductor (seen on stderr of every cold
    compile through torch.export, torch 2.13); nothing a user can act on, so none is shown."""
    import warnings

    import torch._inductor
    import torch._inductor.package
    from torch.fx.experimental.proxy_tensor import make_fx

    def compile_graph(graph, inputs, options=None):
        assert options == {**aot.inductor_options(), "aot_inductor.package": True}  # the wrapper at -O0
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, stacklevel=1)
        return ["files"]

    def package(path, files):
        assert files == ["files"]
        Path(path).write_bytes(b"package")

    monkeypatch.setattr(torch._inductor, "aot_compile", compile_graph)
    monkeypatch.setattr(torch._inductor.package, "package_aoti", package)
    x = torch.ones(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aot.compile_package(make_fx(lambda x: (x + 1,))(x), (x,), tmp_path / "step.pt2")
    assert [str(w.message) for w in caught] == []
    assert (tmp_path / "step.pt2").read_bytes() == b"package" and list(tmp_path.iterdir()) == [tmp_path / "step.pt2"]


def test_a_package_compiled_as_traced_updates_its_inputs_in_place_and_is_called_flat(tmp_path):
    """compile_package hands make_fx's graph to AOTInductor as traced (no torch.export): the package writes
    what the graph copies into its inputs back into them, returns its flat tuple, and carries the flat call
    specification that load_package's direct call needs (a call with the wrong count is refused by it)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(p: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = (p * x).sum()
        p.copy_(p - 0.5 * x)
        return total, x * 3

    p, x = torch.arange(4.0), torch.tensor([1.0, -2.0, 0.5, 4.0])
    aot.compile_package(make_fx(step)(p.clone(), x), (p, x), tmp_path / "step.pt2")
    loaded = aot.load_package(tmp_path / "step.pt2")
    mine = p.clone()
    total, tripled = loaded(mine, x)
    assert torch.equal(mine, p - 0.5 * x) and torch.equal(total, (p * x).sum()) and torch.equal(tripled, x * 3)
    with pytest.raises(TypeError, match="takes 2 tensors, got 1"):
        loaded(mine)


def test_the_vector_isa_is_taken_from_the_cpu_s_flags_only_with_a_gcc_that_builds_them_all(monkeypatch):
    """inductor's test builds of each candidate ISA (~7.5 s of gcc in a cold process) are skipped where its
    compiler is GCC 12 or later; with an older GCC, or clang, inductor probes as it does."""
    from torch._inductor import cpp_builder

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: "g++")
    monkeypatch.setattr(cpp_builder, "_is_gcc_version_less_than", lambda compiler, major: major > 12)
    assert aot.inductor_options() == {**aot.INDUCTOR_CONFIGS, "cpp.vec_isa_ok": True}
    assert aot.inductor_options()["aot_inductor.compile_wrapper_opt_level"] == "O0"
    monkeypatch.setattr(cpp_builder, "_is_gcc_version_less_than", lambda compiler, major: major > 11)
    assert aot.inductor_options() == aot.INDUCTOR_CONFIGS
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: "clang++")
    assert aot.inductor_options() == aot.INDUCTOR_CONFIGS


def test_a_loaded_package_leaves_no_extracted_library_behind(tmp_path, monkeypatch):
    """torch's loader extracts a package's library into /tmp/aotinductor_XXXXXX and removes it only when freed,
    which a sweep's killed worker never is: load_package removes the folder once the library is mapped, and only
    that one (a folder of that pattern loaded before stays)."""
    import ctypes
    import shutil
    import subprocess
    import sys

    import torch

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not sys.platform.startswith("linux"):
        pytest.skip("needs Linux's /proc/self/maps and a C compiler")
    source = tmp_path / "lib.c"
    source.write_text("int normexp_test_answer(void) { return 42; }\n")

    def extracted_library(name: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        library = folder / "model.so"
        subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
        return library

    older = extracted_library("aotinductor_Older1")
    ctypes.CDLL(str(older))  # mapped before: another runner's, alive

    class Loader:
        def __init__(self, *args):
            self.library = ctypes.CDLL(str(extracted_library("aotinductor_AbC123")))

    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", Loader)
    monkeypatch.setattr(aot, "_digest", lambda package: "digest")
    monkeypatch.setattr(aot, "_flat_call", lambda runner, digest: runner)
    runner = aot.load_package(tmp_path / "step.pt2")
    assert runner.library.normexp_test_answer() == 42  # still callable: the mapping outlives the file
    assert not (tmp_path / "aotinductor_AbC123").exists() and older.exists()


@pytest.mark.parametrize("script", ["exit 1", "echo unknown", "echo 11.4.0"])
def test_a_gcc_whose_version_is_unread_or_old_keeps_inductor_s_probes(monkeypatch, tmp_path, script):
    """torch's `_is_gcc_version_less_than` answers "not less" where it cannot run the compiler or read its
    version: such a GCC must not count as one that builds every ISA (nor, of course, a GCC 11)."""
    from torch._inductor import cpp_builder

    compiler = tmp_path / "bin" / "g++"
    compiler.parent.mkdir()
    compiler.write_text(f"#!/bin/sh\n{script}\n")
    compiler.chmod(0o755)
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: str(compiler))
    assert aot.inductor_options() == aot.INDUCTOR_CONFIGS
    compiler.write_text("#!/bin/sh\necho 12.2.0\n")  # a GCC 12, under another path (torch caches by path)
    trusted = tmp_path / "bin" / "x86_64-linux-gnu-g++"
    compiler.rename(trusted)
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: str(trusted))
    assert aot.inductor_options()["cpp.vec_isa_ok"] is True


def test_a_library_extracted_under_a_folder_with_spaces_is_removed_too(tmp_path, monkeypatch):
    """TMPDIR="/tmp/my runs": /proc/self/maps writes the path with its spaces; the folder torch's loader made
    there is removed like any other, and a folder of that pattern outside the path's last space is not taken
    for it."""
    import ctypes
    import shutil
    import subprocess
    import sys

    import torch

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not sys.platform.startswith("linux"):
        pytest.skip("needs Linux's /proc/self/maps and a C compiler")
    source = tmp_path / "lib.c"
    source.write_text("int normexp_test_answer(void) { return 42; }\n")
    folder = tmp_path / "my runs" / "aotinductor_Sp4ce1"
    folder.mkdir(parents=True)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(folder / "model.so"), str(source)], check=True)

    class Loader:
        def __init__(self, *args):
            self.library = ctypes.CDLL(str(folder / "model.so"))

    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", Loader)
    monkeypatch.setattr(aot, "_digest", lambda package: "digest")
    monkeypatch.setattr(aot, "_flat_call", lambda runner, digest: runner)
    runner = aot.load_package(tmp_path / "step.pt2")
    assert runner.library.normexp_test_answer() == 42 and not folder.exists()
    maps = "7f00-7f01 r-xp 00000000 08:01 42 /tmp/x /tmp/aotinductor_Other1/model.so\n"
    assert aot._extracted(maps) == {"/tmp/x /tmp/aotinductor_Other1"}


class _Builder:
    """A stand-in for inductor's CppBuilder: builds (records, writes) its target."""

    def __init__(self, target: Path, built: list, header: bool = True) -> None:
        self.target, self.built = target, built
        self._precompiling = header

    def get_target_file_path(self) -> str:
        return str(self.target)

    def build(self) -> None:
        self.built.append(self.target.name)
        self.target.write_text("built")


@pytest.fixture
def header_locks(tmp_path, monkeypatch):
    """Inductor's header lock folder in tmp_path; CppBuilder.build recording non-header builds."""
    from torch._inductor import codecache
    from torch._inductor.cpp_builder import CppBuilder

    locks = tmp_path / "locks"
    locks.mkdir()
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", str(locks))
    monkeypatch.setattr(CppBuilder, "build", lambda self: self.built.append(self.target.name))
    return codecache, CppBuilder, locks


def _held_elsewhere(lock: Path, built: list, after_s: float):
    """A header's lock another process holds: taken now, let go `after_s` after the returned timer starts
    (recording "released" in `built`), unbuilt."""
    import threading

    from torch.utils._filelock import FileLock

    holder = FileLock(str(lock), thread_local=False)  # released by the timer's thread
    holder.acquire()
    return threading.Timer(after_s, lambda: (built.append("released"), holder.release()))


def test_a_header_another_process_builds_is_left_until_a_build_reads_it(header_locks, tmp_path):
    """Two processes building inductor's two precompiled headers: the one whose lock is held elsewhere is not
    waited for (the other header is built meanwhile); the first non-header build waits for it, and builds it
    where the holder left it unbuilt. Without `_headers_in_parallel` the second header waits for the first's
    lock (it was built after the holder let go)."""
    codecache, builder_type, locks = header_locks
    built: list[str] = []
    released = _held_elsewhere(locks / "wrapper.lock", built, 1.0)
    released.start()
    try:
        with aot._headers_in_parallel():
            codecache._worker_compile_cpp(str(locks / "wrapper.lock"), [_Builder(tmp_path / "wrapper.gch", built)])
            codecache._worker_compile_cpp(str(locks / "kernel.lock"), [_Builder(tmp_path / "kernel.gch", built)])
            assert built == ["kernel.gch"]  # built while the other process held the wrapper header's lock
            builder_type.build(_Builder(tmp_path / "wrapper.o", built, header=False))
    finally:
        released.join()
    # the holder let go without building its header: this process built it, before the build that reads it
    assert built == ["kernel.gch", "released", "wrapper.gch", "wrapper.o"]


def test_headers_and_other_locks_pass_through_where_nobody_else_holds_them(header_locks, tmp_path):
    codecache, _, locks = header_locks
    built: list[str] = []
    (tmp_path / "done.gch").write_text("built earlier")
    with aot._headers_in_parallel():
        codecache._worker_compile_cpp(str(locks / "a.lock"), [_Builder(tmp_path / "a.gch", built)])
        codecache._worker_compile_cpp(str(locks / "done.lock"), [_Builder(tmp_path / "done.gch", built)])
        codecache._worker_compile_cpp(str(tmp_path / "other.lock"), [_Builder(tmp_path / "k.so", built, False)])
    assert built == ["a.gch", "k.so"]
    assert codecache._worker_compile_cpp.__name__ == "_worker_compile_cpp"  # unpatched after the compile


@pytest.mark.parametrize("fails", ["before_any_build", "building_the_left_header"])
def test_a_header_left_for_later_is_not_trusted_after_the_compile_raises(header_locks, tmp_path, monkeypatch,
                                                                          fails):
    """Inductor keeps each precompiled header's path for the process (`_precompile_header` is functools.cache'd),
    so a later compile includes it without taking its lock. A header left for later that no build waited for
    (the compile raised first, or building it raised) must not stay so: the next compile in the process (after a
    failed compile a batch trains uncompiled, the next batch compiles again) would read a .gch the other process
    may still be writing (gcc 12: "while reading precompiled header", a failed compile)."""
    import functools

    from torch.utils._filelock import FileLock

    codecache, builder_type, locks = header_locks
    built: list[str] = []
    runs: list[str] = []
    header = tmp_path / "wrapper.gch"

    class _Failing(_Builder):
        def build(self) -> None:
            raise RuntimeError("gcc failed")

    @functools.cache
    def precompile_header(name: str) -> str:  # inductor's, without the preprocessing and the hashes
        kind = _Failing if fails == "building_the_left_header" and not runs else _Builder
        runs.append(name)
        codecache._worker_compile_cpp(str(locks / f"{name}.lock"), [kind(header, built)])
        return str(header)

    monkeypatch.setattr(codecache, "_precompile_header", precompile_header)
    holder = FileLock(str(locks / "wrapper.lock"), thread_local=False)
    with pytest.raises(RuntimeError):
        with aot._headers_in_parallel():
            holder.acquire()  # another process compiles the wrapper's header
            codecache._precompile_header("wrapper")
            holder.release()  # it died without building it
            if fails == "before_any_build":
                raise RuntimeError("the kernels' header failed")
            builder_type.build(_Builder(tmp_path / "wrapper.o", built, header=False))
    assert runs == ["wrapper"] and not header.exists()
    codecache._precompile_header("wrapper")  # the next compile: the header is looked for again, under its lock
    assert runs == ["wrapper", "wrapper"] and header.exists()


def test_another_threads_compile_waits_for_a_header_as_inductor_does(header_locks, tmp_path):
    """The helpers are patched for the whole process while one thread compiles a package: a compile in another
    thread (a torch.compile, or a second package) meanwhile is inductor's own, unchanged. Left for later in the
    first thread's list, its header could be read unbuilt once the first compile's patch was undone (or waited
    for by a build of the first thread's); and a second package waited for the whole first compile."""
    import threading

    codecache, builder_type, locks = header_locks
    built: list[str] = []
    released = _held_elsewhere(locks / "wrapper.lock", built, 0.5)
    seen: list[list[str]] = []

    def other_thread() -> None:
        codecache._worker_compile_cpp(str(locks / "wrapper.lock"), [_Builder(tmp_path / "wrapper.gch", built)])
        seen.append(list(built))  # inductor's: returns once the header is there
        with aot._headers_in_parallel():  # a second package's compile does not wait for the first one's
            seen.append(list(built))

    with aot._headers_in_parallel():
        released.start()
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(timeout=10)
        builder_type.build(_Builder(tmp_path / "main.o", built, header=False))
    released.join()
    assert seen == [["released", "wrapper.gch"], ["released", "wrapper.gch"]]
    assert built == ["released", "wrapper.gch", "main.o"]


def test_a_build_in_another_thread_waits_for_a_header_the_compiling_thread_left(header_locks, tmp_path):
    """Inductor looks for a kernel's headers in the compiling thread and may build the kernel in its pool's."""
    import threading

    codecache, builder_type, locks = header_locks
    built: list[str] = []
    released = _held_elsewhere(locks / "kernel.lock", built, 0.5)
    with aot._headers_in_parallel():
        codecache._worker_compile_cpp(str(locks / "kernel.lock"), [_Builder(tmp_path / "kernel.gch", built)])
        released.start()
        pool = threading.Thread(target=builder_type.build, args=(_Builder(tmp_path / "kernel.so", built, False),))
        pool.start()
        pool.join(timeout=10)
    released.join()
    assert built == ["released", "kernel.gch", "kernel.so"]


def test_a_header_builder_passed_alone_as_older_torch_passes_it_is_built(header_locks, tmp_path):
    """torch releases whose `_worker_compile_cpp` takes one builder, not a sequence of them, still compile."""
    codecache, _, locks = header_locks
    built: list[str] = []
    with aot._headers_in_parallel():
        codecache._worker_compile_cpp(str(locks / "one.lock"), _Builder(tmp_path / "one.gch", built))
    assert built == ["one.gch"]
