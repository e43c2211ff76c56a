"""The artifact cache's security model and broken layouts (issue: caches that cannot be
hijacked). Every test here failed on the code before the model was enforced."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import stat
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hardening_helpers import is_root

from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.errors import CacheError, CompileError
from flashtune.families import render
from flashtune.runtime.backends.emulator import build, build_module, i32, ptr
from flashtune.toolchain import cache as cache_module
from flashtune.toolchain import compiler
from flashtune.toolchain.cache import ArtifactCache, bound_digest

DATA = b"artifact bytes"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _plain_sidecar(path: Path) -> None:
    """What a careless user (or an attacker who knows only the old scheme) writes."""
    Path(str(path) + ".sha256").write_text(hashlib.sha256(path.read_bytes()).hexdigest())


# ------------------------------------------------------------------ private directories


def test_cache_directories_are_created_private(cache: ArtifactCache) -> None:
    path = cache.put_bytes("ns", "k1", ".bin", DATA)
    for directory in (cache.base, cache.root, path.parent.parent, path.parent):
        assert _mode(directory) == 0o700, directory


@pytest.mark.parametrize("level", ["base", "root", "namespace", "shard"])
@pytest.mark.parametrize("bits", [0o020, 0o002])
def test_directory_writable_by_others_is_refused(cache: ArtifactCache, level: str,
                                                 bits: int) -> None:
    path = cache.put_bytes("ns", "k1", ".bin", DATA)
    directory = {"base": cache.base, "root": cache.root, "namespace": path.parent.parent,
                 "shard": path.parent}[level]
    directory.chmod(0o700 | bits)
    cache_module.forget_trusted_directories()
    for action in (lambda: cache.load_bytes("ns", "k1", ".bin"),
                   lambda: cache.put_bytes("ns", "k1-other", ".bin", DATA)):
        with pytest.raises(CacheError) as info:
            action()
        text = str(info.value)
        assert str(directory) in text and "writable by other users" in text
        assert oct(0o700 | bits) in text and f"chmod 700 {directory}" in text


def test_artifact_writable_by_others_is_refused(cache: ArtifactCache) -> None:
    path = cache.put_bytes("ns", "k1", ".bin", DATA)
    path.chmod(0o666)
    with pytest.raises(CacheError, match="writable by other users"):
        cache.load_bytes("ns", "k1", ".bin")


@pytest.mark.skipif(not is_root(), reason="needs root to give files away")
def test_cache_or_artifact_owned_by_someone_else_is_refused(cache: ArtifactCache) -> None:
    path = cache.put_bytes("ns", "k1", ".bin", DATA)
    os.chown(path, 65534, 65534)
    with pytest.raises(CacheError, match=r"owned by .*uid 65534.*not by you"):
        cache.load_bytes("ns", "k1", ".bin")
    os.chown(path, 0, 0)
    os.chown(cache.base, 65534, 65534)
    cache_module.forget_trusted_directories()
    with pytest.raises(CacheError, match="FLASHTUNE_CACHE_DIR at a directory you own"):
        cache.load_bytes("ns", "k1", ".bin")


@pytest.mark.parametrize("sticky", [False, True])
def test_parent_writable_by_everyone_needs_the_sticky_bit(tmp_path: Path, sticky: bool) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777 if sticky else 0o777)
    cache_module.forget_trusted_directories()
    cache = ArtifactCache(shared / "cache")
    if sticky:  # like /tmp: others cannot replace what is yours
        cache.put_bytes("ns", "k", "", DATA)
        assert cache.load_bytes("ns", "k") == DATA
        return
    with pytest.raises(CacheError, match=f"parent directory {shared} is writable by every "
                                         "user without the sticky bit"):
        cache.put_bytes("ns", "k", "", DATA)


# ------------------------------------------------------------------ broken layouts


def test_cache_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "cache").write_text("not a directory")
    with pytest.raises(CacheError, match="is a file, not a directory"):
        ArtifactCache(tmp_path / "cache").put_bytes("ns", "k", "", DATA)


@pytest.mark.parametrize("what", ["artifact", "sidecar", "lock"])
def test_entry_that_is_a_directory(cache: ArtifactCache, what: str) -> None:
    path = cache.path_for("ns", "k1", ".bin")
    path.parent.mkdir(parents=True, mode=0o700)
    for d in (cache.base, cache.root, path.parent.parent):
        d.chmod(0o700)
    suffix = {"artifact": "", "sidecar": ".sha256", "lock": ".lock"}[what]
    Path(str(path) + suffix).mkdir()
    with pytest.raises(CacheError, match="directory"):
        cache.put_bytes("ns", "k1", ".bin", DATA)


def _no_write(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)  # what cache_module calls


def test_read_only_cache_serves_what_it_has_and_explains_what_it_lacks(
        cache: ArtifactCache, monkeypatch: pytest.MonkeyPatch) -> None:
    path = cache.put_bytes("ns", "have", ".bin", DATA)
    if is_root():  # root writes anywhere: simulate the read-only file system
        _no_write(monkeypatch, errno.EROFS)
    else:
        path.parent.chmod(0o500)
    try:
        assert cache.load_bytes("ns", "have", ".bin") == DATA
        with pytest.raises(CacheError, match="the cache is not writable") as info:
            cache.put_bytes("ns", "missing", ".bin", DATA)
        assert "FLASHTUNE_PRECOMPILED_DIR" in str(info.value)
    finally:
        path.parent.chmod(0o700)


def test_full_disk_is_explained(cache: ArtifactCache, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(tmp: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))

    with pytest.raises(CacheError, match="disk .* is full"):
        cache.get_or_build("ns", "k1", ".bin", full)
    _no_write(monkeypatch, errno.ENOSPC)
    with pytest.raises(CacheError, match="disk .* is full"):
        cache.put_bytes("ns", "k2", ".bin", DATA)


def test_emulator_build_on_a_full_disk_blames_the_disk(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a full disk was reported as 'host compiler failed ... fix the source'."""
    fake = tmp_path / "fake-g++"
    # Answers the toolchain's questions; every build runs out of space.
    fake.write_text("#!/bin/sh\ncase \" $* \" in *' -o '*) ;; *) echo 'fake 12.2'; exit 0;; esac\n"
                    "echo '/tmp/ccX.o: No space left on device' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("FLASHTUNE_CXX", str(fake))
    with pytest.raises(CacheError, match="disk .* is full") as info:
        build_module('extern "C" __global__ void k(int* o) { o[0] = 1; }', ["k"],
                     cache=ArtifactCache(tmp_path / "cache"))
    assert not isinstance(info.value, CompileError)


# ------------------------------------------------------------------ artifacts bound to keys


def test_sidecar_binds_bytes_to_their_key(cache: ArtifactCache) -> None:
    one = cache.put_bytes("ns", "key-one", ".bin", b"one")
    two = cache.put_bytes("ns", "key-two", ".bin", b"two")
    # another key's artifact, copied with its (valid) sidecar
    one.write_bytes(two.read_bytes())
    Path(str(one) + ".sha256").write_text(Path(str(two) + ".sha256").read_text())
    assert cache.load_bytes("ns", "key-one", ".bin") is None
    # a rewritten plain-sha256 sidecar does not verify either
    _plain_sidecar(one)
    assert cache.load_bytes("ns", "key-one", ".bin") is None
    assert cache.put_bytes("ns", "key-one", ".bin", b"one").read_bytes() == b"one"


def test_tampered_cubin_with_rewritten_sidecar_is_rebuilt(
        cache: ArtifactCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a replaced cubin with a rewritten sidecar was served as-is."""
    calls: list[str] = []
    real = compiler._run_nvrtc

    def counting(lib: Any, source: Any, options: Any) -> Any:
        calls.append(source.entry)
        return real(lib, source, options)

    monkeypatch.setattr(compiler, "_run_nvrtc", counting)
    compiler.clear_memo()
    source = render(Problem(64, DType.FP16), KernelConfig(64, 32, 4, 1))
    first = compiler.compile_source(source, "sm_80", cache=cache)
    (path,) = (cache.root / "cubin").rglob("*.zip")
    with zipfile.ZipFile(path) as zf:
        parts = {name: zf.read(name) for name in zf.namelist()}
    parts["kernel.cubin"] = b"\x7fELF" + b"\xcc" * 64  # meta (and its key) left intact
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in parts.items():
            zf.writestr(name, data)
    path.write_bytes(buf.getvalue())
    _plain_sidecar(path)
    compiler.clear_memo()
    again = compiler.compile_source(source, "sm_80", cache=cache)
    assert again.cubin == first.cubin and len(calls) == 2


# ------------------------------------------------------------------ emulator libraries

_KERNEL = 'extern "C" __global__ void {name}(int* out, int add) {{ out[0] = {value} + add; }}'


@pytest.mark.emulator
@pytest.mark.parametrize("sidecar", ["plain", "bound"])
def test_foreign_emulator_library_is_discarded_and_rebuilt(sidecar: str) -> None:
    """Regression: another kernel's valid library under a key (sidecar fixed) was loaded,
    running its constructors, and failed with a raw AttributeError on every run."""
    tag = f"{sidecar}_{os.getpid()}"
    mine = _KERNEL.format(name=f"mine_{tag}", value=11)
    theirs = _KERNEL.format(name=f"theirs_{tag}", value=22)
    store = ArtifactCache()
    options = build.BuildOptions()
    lib_mine = build.kernel_library(mine, [f"mine_{tag}"], options, store)  # built, not loaded
    lib_theirs = build.kernel_library(theirs, [f"theirs_{tag}"], options, store)
    lib_mine.path.write_bytes(lib_theirs.path.read_bytes())
    if sidecar == "plain":
        _plain_sidecar(lib_mine.path)
    else:  # someone who knows the sidecar scheme: the embedded build key still differs
        Path(str(lib_mine.path) + ".sha256").write_text(
            bound_digest(build.NAMESPACE, lib_mine.path.name, lib_mine.path.read_bytes()))
    module = build_module(mine, [f"mine_{tag}"], cache=store)
    assert module.built.build_seconds > 0  # rebuilt
    out = np.zeros(1, dtype=np.int32)
    module[f"mine_{tag}"].launch(1, 1, [ptr(out), i32(1)])
    assert out[0] == 12
    assert build.key_marker(lib_mine.key) in lib_mine.path.read_bytes()
