"""Precompiled kernels load without NVRTC; ``flashtune precompile`` and ``flashtune explain``.

The loading test runs the CUDA backend's real load path (shipped cache -> compiler) with
only the two GPU-bound steps replaced: the device query (a virtual sm_90) and the CuPy
module load (which records the cubin it was given).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.db.records import DeviceRecord, Keyed, TrialRecord, TrialStatus
from flashtune.db.store import TuningStore
from flashtune.errors import ToolchainNotFound
from flashtune.families import render
from flashtune.runtime import compiler, device
from flashtune.runtime.backends import cuda
from flashtune.runtime.cache import ArtifactCache
from flashtune.runtime.precompile import (
    NAMESPACE,
    artifact_name,
    default_kernels,
    load_shipped,
    precompile,
)
from flashtune.toolchain import cuda as toolchain

PROBLEM = Problem(head_dim=64, dtype=DType.FP16)
CONFIG = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
OTHER = KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)


def _no_nvrtc(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise ToolchainNotFound("NVRTC is not installed here (test)")

    monkeypatch.setattr(toolchain, "find_toolchain", missing)
    monkeypatch.setattr(compiler, "find_toolchain", missing)
    monkeypatch.setattr(compiler, "_run_nvrtc", missing)
    compiler.clear_memo()


def _fake_gpu(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bytes]]:
    loaded: list[tuple[str, bytes]] = []

    def load_cubin(self: cuda.CudaBackend, source: Any, cubin: bytes, index: int) -> Any:
        loaded.append((source.entry, cubin))
        return object()

    monkeypatch.setattr(device.DeviceInfo, "current",
                        classmethod(lambda cls, index=None: cls.virtual("sm_90")))
    monkeypatch.setattr(cuda.CudaBackend, "_load_cubin", load_cubin)
    return loaded


def test_precompiled_kernels_load_without_nvrtc(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    shipped = ArtifactCache(tmp_path / "ship")
    (item,) = precompile([(PROBLEM, CONFIG), (PROBLEM, CONFIG)], "sm_90", cache=shipped)
    assert item.path.is_file() and item.registers > 0
    source = render(PROBLEM, CONFIG)
    expected = compiler.compile_source(source, "sm_90").cubin
    assert not list((tmp_path / "ship").rglob("cubin"))  # only what is shipped

    monkeypatch.setenv("FLASHTUNE_CACHE_DIR", str(tmp_path / "ship"))
    _no_nvrtc(monkeypatch)
    loaded = _fake_gpu(monkeypatch)
    with pytest.raises(ToolchainNotFound):
        cuda.compile_cubin(source, "sm_90")
    cuda.CudaBackend()._load_on_current(source, 0)
    assert loaded == [(source.entry, expected)]
    # a kernel that was not precompiled needs the compiler, which is not there
    with pytest.raises(ToolchainNotFound):
        cuda.CudaBackend()._load_on_current(render(PROBLEM, OTHER), 0)


def test_damaged_or_foreign_artifacts_are_ignored(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    cache = ArtifactCache(tmp_path)
    source = render(PROBLEM, CONFIG)
    other = render(PROBLEM, OTHER)
    precompile([(PROBLEM, CONFIG)], "sm_90", cache=cache)
    assert load_shipped(source, "sm_90", cache) is not None
    assert load_shipped(source, "sm_80", cache) is None
    # the right file name holding another kernel's artifact (digest sidecar intact)
    data = cache.load_bytes(NAMESPACE, artifact_name(source, "sm_90"), ".zip")
    assert data is not None
    cache.put_bytes(NAMESPACE, artifact_name(other, "sm_90"), ".zip", data)
    assert load_shipped(other, "sm_90", cache) is None
    assert "describes another kernel" in caplog.text
    # flipped bytes: the digest check rejects it, and precompile writes it again
    path = cache.path_for(NAMESPACE, artifact_name(source, "sm_90"), ".zip")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert load_shipped(source, "sm_90", cache) is None
    precompile([(PROBLEM, CONFIG)], "sm_90", cache=cache)
    assert load_shipped(source, "sm_90", cache) is not None


def test_default_kernels_cover_every_compiled_problem() -> None:
    from flashtune.codegen.arch import get_arch
    from flashtune.codegen.spec import COMPILED_HEAD_DIMS
    from flashtune.families.fwd import space

    for arch in ("sm_80", "sm_86", "sm_90"):
        kernels = default_kernels(arch)
        assert len(kernels) == len(COMPILED_HEAD_DIMS) * 2 * 2
        assert {p.key() for p, _ in kernels} == {
            Problem(head_dim=d, dtype=t, causal=c).key()
            for d in COMPILED_HEAD_DIMS for t in DType for c in (False, True)}
        for problem, config in kernels:
            assert space.static_check(problem, config, get_arch(arch)) is None


# ------------------------------------------------------------------------------ CLI


def _db_with_result(path: Path) -> str:
    url = f"sqlite:///{path}"
    with TuningStore(url) as store:
        store.record_device(DeviceRecord("NVIDIA H200", 9, 0, 132, 141 << 30, "13.0",
                                         "13.0", "13.0", "14.0"))
        store.record_trial(TrialRecord(
            device="NVIDIA H200", problem=Keyed.of(PROBLEM), seqlen=2048,
            config=Keyed.of(OTHER), status=TrialStatus.OK,
            template_digest="0123456789abcdef", median_ms=0.2, min_ms=0.2, max_ms=0.2,
            count=5))
    return url


def test_cli_explain(tmp_path: Path) -> None:
    runner = CliRunner()
    db = _db_with_result(tmp_path / "t.db")
    base = ["explain", "--head-dim", "64", "--seqlen", "1500", "--db", db]
    result = runner.invoke(app, [*base, "--device", "NVIDIA H200"])
    assert result.exit_code == 0, result.output
    for text in ("fwd_d64_fp16_full_n2048", "NVIDIA H200 (sm_90)", "tier:     exact",
                 OTHER.key(), "precompiled cubin absent"):
        assert text in result.output, result.output
    result = runner.invoke(app, [*base, "--arch", "sm_90"])
    assert "tier:     same_arch" in result.output and "virtual-sm_90" in result.output
    result = runner.invoke(app, [*base, "--arch", "sm_80"])
    assert "tier:     default" in result.output
    result = runner.invoke(app, [*base, "--device", "Unknown GPU"])
    assert result.exit_code == 1 and "not in the tuning database" in result.output
    result = runner.invoke(app, [*base[:-1], str(tmp_path / "missing.db"), "--arch", "sm_90"])
    assert result.exit_code == 1 and "no database file" in result.output


def test_cli_precompile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    ship = tmp_path / "ship"
    db = _db_with_result(tmp_path / "t.db")
    args = ["precompile", "--arch", "sm_90", "--head-dim", "64", "--dtype", "fp16",
            "--no-causal", "--cache-dir", str(ship), "--db", db]
    result = runner.invoke(app, [*args, "--seqlen", "2000", "--seqlen", "100"])
    assert result.exit_code == 0, result.output
    # a virtual sm_90 gets the family's tuned config for every bucket
    assert OTHER.key() in result.output and f"FLASHTUNE_CACHE_DIR={ship}" in result.output
    monkeypatch.setenv("FLASHTUNE_CACHE_DIR", str(ship))
    assert load_shipped(render(PROBLEM, OTHER), "sm_90") is not None
    result = runner.invoke(app, ["precompile", "--arch", "sm_90"])
    assert result.exit_code == 1 and "nothing to compile" in result.output
    result = runner.invoke(app, ["explain", "--head-dim", "64", "--seqlen", "2048",
                                 "--arch", "sm_90", "--db", db])
    assert "precompiled cubin present" in result.output
