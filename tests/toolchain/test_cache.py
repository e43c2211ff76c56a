"""ArtifactCache: digest-checked artifacts, corruption recovery, one build across processes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.families import render
from flashtune.toolchain import compiler
from flashtune.toolchain.cache import ArtifactCache, bound_digest
from flashtune.toolchain.compiler import compile_source


def _counting_build(counter: list[bytes], data: bytes):  # type: ignore[no-untyped-def]
    def build(tmp: Path) -> None:
        counter.append(data)
        tmp.write_bytes(data)
    return build


def test_put_lookup_load(cache: ArtifactCache) -> None:
    data = os.urandom(4096)
    path = cache.put_bytes("ns", "abcdef", ".bin", data)
    assert path == cache.path_for("ns", "abcdef", ".bin")
    assert path.parent.name == "ab"
    assert cache.lookup("ns", "abcdef", ".bin") == path
    assert cache.load_bytes("ns", "abcdef", ".bin") == data
    # The sidecar binds the bytes to their namespace and name, not just to their content.
    assert Path(str(path) + ".sha256").read_text() == bound_digest("ns", "abcdef.bin", data)
    assert bound_digest("ns", "abcdef.bin", data) != hashlib.sha256(data).hexdigest()
    assert cache.load_bytes("ns", "missing", ".bin") is None
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete-sidecar", "empty-sidecar"])
def test_damaged_artifact_is_rebuilt(cache: ArtifactCache, damage: str) -> None:
    data = os.urandom(10000)
    builds: list[bytes] = []
    path = cache.get_or_build("ns", "k1", ".bin", _counting_build(builds, data))
    side = Path(str(path) + ".sha256")
    if damage == "truncate":
        path.write_bytes(data[:5000])
    elif damage == "flip":
        path.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    elif damage == "delete-sidecar":
        side.unlink()
    else:
        side.write_text("")
    assert cache.lookup("ns", "k1", ".bin") is None
    assert cache.load_bytes("ns", "k1", ".bin") is None
    again = cache.get_or_build("ns", "k1", ".bin", _counting_build(builds, data))
    assert len(builds) == 2
    assert again.read_bytes() == data
    assert cache.load_bytes("ns", "k1", ".bin") == data


def test_failed_build_publishes_nothing(cache: ArtifactCache) -> None:
    def build(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError, match="build failed"):
        cache.get_or_build("ns", "k2", ".bin", build)
    path = cache.path_for("ns", "k2", ".bin")
    assert not path.exists()
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_rebuild_publishes_a_new_inode(cache: ArtifactCache) -> None:
    path = cache.put_bytes("ns", "k3", "", b"first")
    with path.open("rb") as reader:  # a process that has the old artifact open
        path.write_bytes(b"corrupt")
        old_inode = os.fstat(reader.fileno()).st_ino
        cache.get_or_build("ns", "k3", "", _counting_build([], b"first"))
        assert os.stat(path).st_ino != old_inode  # not rewritten in place
        assert reader.read() == b"corrupt"  # the reader keeps what it opened
    assert cache.load_bytes("ns", "k3", "") == b"first"


def test_discard_forces_a_rebuild(cache: ArtifactCache) -> None:
    builds: list[bytes] = []
    cache.get_or_build("ns", "k4", "", _counting_build(builds, b"x"))
    cache.discard("ns", "k4", "")
    assert cache.lookup("ns", "k4", "") is None
    cache.get_or_build("ns", "k4", "", _counting_build(builds, b"x"))
    assert len(builds) == 2
    cache.discard("other", "never-written", "")  # no error


def test_put_files_is_atomic_and_immutable(cache: ArtifactCache) -> None:
    folder = cache.put_files("dirs", "d1", {"a.cu": b"A", "b.log": b"B"})
    assert sorted(p.name for p in folder.iterdir()) == ["a.cu", "b.log"]
    same = cache.put_files("dirs", "d1", {"a.cu": b"changed"})
    assert same == folder and (folder / "a.cu").read_bytes() == b"A"
    with pytest.raises(ValueError, match="must match"):
        cache.put_files("dirs", "d2", {"../escape": b""})
    assert not [p for p in folder.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("name", ["../x", "a/b", "", "x" * 201, "a b"])
def test_unsafe_names_are_rejected(cache: ArtifactCache, name: str) -> None:
    with pytest.raises(ValueError, match="must match"):
        cache.path_for("ns", name)


_RACE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    start, counter, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    cache_base = Path(sys.argv[4])
    from flashtune.toolchain.cache import ArtifactCache, bound_digest
    from flashtune.toolchain import compiler
    cache = ArtifactCache(cache_base)
    def note():
        with counter.open("a") as f:
            f.write(f"{os.getpid()}\\n")
    if mode == "generic":
        def build(tmp):
            note()
            time.sleep(0.5)
            tmp.write_bytes(b"payload")
        work = lambda: cache.get_or_build("race", "same-key", ".bin", build).read_bytes()
    else:
        from flashtune.families import render
        from flashtune.codegen.spec import KernelConfig, Problem
        real = compiler._run_nvrtc
        def counting(lib, source, options):
            note()
            return real(lib, source, options)
        compiler._run_nvrtc = counting
        src = render(Problem.from_key("fwd_d64_fp16_causal"),
                     KernelConfig.from_key("m64_n64_w4_s2"))
        work = lambda: compiler.compile_source(src, "sm_89", cache=cache).cubin
    while not start.exists():
        time.sleep(0.005)
    import hashlib
    print(hashlib.sha256(work()).hexdigest())
""")


@pytest.mark.parametrize("mode", ["generic", "compile"])
def test_concurrent_processes_build_once(tmp_path: Path, mode: str) -> None:
    start, counter = tmp_path / "go", tmp_path / "builds.txt"
    counter.touch()
    procs = [
        subprocess.Popen([sys.executable, "-c", _RACE, str(start), str(counter), mode,
                          str(tmp_path / "cache")], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    time.sleep(1.5)  # let every process import flashtune and wait at the start line
    start.touch()
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outputs)) == 1 and len(outputs[0]) == 64
    assert len(counter.read_text().split()) == 1


def test_truncated_kernel_artifact_is_recompiled(cache: ArtifactCache,
                                                 nvrtc_calls: list[str]) -> None:
    src = render(Problem(64, DType.FP16), KernelConfig(64, 32, 4, 1))
    first = compile_source(src, "sm_80", cache=cache)
    (path,) = (cache.root / "cubin").rglob("*.zip")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    compiler.clear_memo()
    again = compile_source(src, "sm_80", cache=cache)
    assert nvrtc_calls == [src.entry, src.entry]
    assert again == first
    compiler.clear_memo()
    compile_source(src, "sm_80", cache=cache)
    assert len(nvrtc_calls) == 2


def test_first_compile_on_a_fresh_account_creates_the_private_cache(tmp_path: Path) -> None:
    """A HOME with no ~/.cache (fresh accounts, containers, CI runners): the first compile
    creates the user's cache directory and flashtune's below it, each private (0700)."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLASHTUNE_CACHE_DIR", "XDG_CACHE_HOME")}
    env["HOME"] = str(home)
    script = textwrap.dedent("""
        from flashtune.codegen.spec import DType, KernelConfig, Problem
        from flashtune.families import render
        from flashtune.toolchain.compiler import compile_source
        src = render(Problem(64, DType.FP16), KernelConfig(64, 64, 4, 2))
        print(len(compile_source(src, "sm_80").cubin))
    """)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 0
    for made in (home / ".cache", home / ".cache" / "flashtune"):
        assert made.is_dir(), f"{made} was not created"
        assert made.stat().st_mode & 0o777 == 0o700, oct(made.stat().st_mode)
    assert list((home / ".cache" / "flashtune").rglob("*.zip")), "no cubin in the new cache"
