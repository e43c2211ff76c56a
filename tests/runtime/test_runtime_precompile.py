"""Precompiled kernels load without NVRTC; ``flashtune precompile`` and ``flashtune explain``.

The loading test runs the CUDA backend's real load path (shipped cache -> compiler) with
only the two GPU-bound steps replaced: the device query (a virtual sm_90) and the CuPy
module load (which records the cubin it was given).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.db.records import DeviceRecord, Keyed, TrialRecord, TrialStatus
from flashtune.db.store import TuningStore
from flashtune.errors import CacheError, ToolchainNotFound
from flashtune.families import render
from flashtune.runtime import device
from flashtune.runtime.backends import cuda
from flashtune.runtime.precompile import (
    KERNELS_DIR,
    MANIFEST_NAME,
    artifact_name,
    default_kernels,
    load_shipped,
    precompile,
)
from flashtune.toolchain import compiler
from flashtune.toolchain import cuda as toolchain

PROBLEM = Problem(head_dim=64, dtype=DType.FP16)
CONFIG = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
OTHER = KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
HOPPER = Problem(head_dim=64, dtype=DType.FP16, op="fwd90aws")
HOPPER_TUNED = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


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


def _artifact(ship: Path, source: Any, arch: str = "sm_90") -> Path:
    return ship / KERNELS_DIR / f"{artifact_name(source, arch)}.zip"


def test_precompiled_kernels_load_without_nvrtc(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    ship = tmp_path / "ship"
    (item,) = precompile([(PROBLEM, CONFIG), (PROBLEM, CONFIG)], "sm_90", ship)
    assert item.path.is_file() and item.registers > 0
    source = render(PROBLEM, CONFIG)
    expected = compiler.compile_source(source, "sm_90").cubin
    assert sorted(p.name for p in ship.iterdir()) == [MANIFEST_NAME, KERNELS_DIR]
    # read-only for everyone, readable by everyone
    assert stat.S_IMODE(item.path.stat().st_mode) == 0o444
    assert stat.S_IMODE((ship / MANIFEST_NAME).stat().st_mode) == 0o444
    assert stat.S_IMODE(ship.stat().st_mode) == 0o755

    monkeypatch.setenv("FLASHTUNE_PRECOMPILED_DIR", str(ship))
    _no_nvrtc(monkeypatch)
    loaded = _fake_gpu(monkeypatch)
    with pytest.raises(ToolchainNotFound):
        cuda.compile_cubin(source, "sm_90")
    cuda.CudaBackend()._load_on_current(source, 0)
    assert loaded == [(source.entry, expected)]
    # a kernel that was not precompiled needs the compiler, which is not there
    with pytest.raises(ToolchainNotFound):
        cuda.CudaBackend()._load_on_current(render(PROBLEM, OTHER), 0)


def test_tampered_shipped_directory_is_refused(tmp_path: Path) -> None:
    """A shipped file that differs from the manifest is an error naming it, never a silent
    rebuild (regression: a tampered precompile directory was served as-is)."""
    ship = tmp_path / "ship"
    source, other = render(PROBLEM, CONFIG), render(PROBLEM, OTHER)
    precompile([(PROBLEM, CONFIG), (PROBLEM, OTHER)], "sm_90", ship)
    assert load_shipped(source, "sm_90", [ship]) is not None
    assert load_shipped(source, "sm_80", [ship]) is None  # not shipped for sm_80
    path = _artifact(ship, source)
    original = path.read_bytes()
    path.chmod(0o644)
    # flipped bytes
    raw = bytearray(original)
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CacheError, match="does not match the digest"):
        load_shipped(source, "sm_90", [ship])
    # another kernel's (valid) artifact copied over it
    path.write_bytes(_artifact(ship, other).read_bytes())
    with pytest.raises(CacheError, match="does not match the digest"):
        load_shipped(source, "sm_90", [ship])
    # listed but missing
    path.unlink()
    with pytest.raises(CacheError, match="listed in the manifest but missing"):
        load_shipped(source, "sm_90", [ship])
    # the build step writes it again
    precompile([(PROBLEM, CONFIG)], "sm_90", ship)
    assert load_shipped(source, "sm_90", [ship]) is not None
    assert load_shipped(other, "sm_90", [ship]) is not None  # kept from the first run


def test_shipped_directory_writable_by_others_is_refused(tmp_path: Path) -> None:
    ship = tmp_path / "ship"
    source = render(PROBLEM, CONFIG)
    precompile([(PROBLEM, CONFIG)], "sm_90", ship)
    for target in (ship, ship / KERNELS_DIR, ship / MANIFEST_NAME, _artifact(ship, source)):
        mode = stat.S_IMODE(target.stat().st_mode)
        target.chmod(mode | 0o002)
        with pytest.raises(CacheError, match="writable by other users"):
            load_shipped(source, "sm_90", [ship])
        target.chmod(mode)
    assert load_shipped(source, "sm_90", [ship]) is not None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory away")
def test_shipped_directory_owned_by_another_user_is_served(tmp_path: Path) -> None:
    """The documented use: an application ships the directory, installed by another user
    (regression: it was silently 'absent' and the rebuild failed on a .lock)."""
    ship = tmp_path / "ship"
    source = render(PROBLEM, CONFIG)
    precompile([(PROBLEM, CONFIG)], "sm_90", ship)
    for path in (ship, *ship.rglob("*")):
        os.chown(path, 65534, 65534)
    assert load_shipped(source, "sm_90", [ship]) is not None


def test_damaged_manifest_is_an_error(tmp_path: Path) -> None:
    ship = tmp_path / "ship"
    precompile([(PROBLEM, CONFIG)], "sm_90", ship)
    manifest = ship / MANIFEST_NAME
    manifest.chmod(0o644)
    manifest.write_text("{not json")
    with pytest.raises(CacheError, match="manifest .* is damaged"):
        load_shipped(render(PROBLEM, CONFIG), "sm_90", [ship])
    manifest.unlink()
    with pytest.raises(CacheError, match="has no flashtune-precompiled.json"):
        load_shipped(render(PROBLEM, CONFIG), "sm_90", [ship])


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
            template_digest=render(PROBLEM, OTHER).digest, median_ms=0.2, min_ms=0.2,
            max_ms=0.2, count=5))
        # what the sm_90a family (serving "fwd" on this cc 9.0 GPU) was tuned to
        store.record_trial(TrialRecord(
            device="NVIDIA H200", problem=Keyed.of(HOPPER), seqlen=2048,
            config=Keyed.of(HOPPER_TUNED), status=TrialStatus.OK,
            template_digest=render(HOPPER, HOPPER_TUNED).digest, median_ms=0.1, min_ms=0.1,
            max_ms=0.1, count=5))
    return url


def test_cli_explain(tmp_path: Path) -> None:
    runner = CliRunner()
    db = _db_with_result(tmp_path / "t.db")
    base = ["explain", "--head-dim", "64", "--seqlen", "1500", "--db", db]
    result = runner.invoke(app, [*base, "--device", "NVIDIA H200"],
                           env={"FLASHTUNE_ARCH_SPECIFIC": "0"})  # opted out: mma.sync
    assert result.exit_code == 0, result.output
    assert "fwd_d64_fp16_full_n2048" in result.output and OTHER.key() in result.output
    result = runner.invoke(app, [*base, "--device", "NVIDIA H200"])  # sm_90a by default
    assert result.exit_code == 0, result.output
    for text in ("fwd90aws_d64_fp16_full_n2048", "NVIDIA H200 (sm_90)", "tier:     exact",
                 HOPPER_TUNED.key(), "kernel:   flashtune_fwd90aws_d64_fp16_full_m64_n64_w4_s2",
                 "precompiled cubin absent",
                 "origin:   tuned into this database on host"):
        assert text in result.output, result.output
    result = runner.invoke(app, [*base, "--arch", "sm_90"])  # a virtual sm_90: mma.sync
    assert "tier:     same_arch" in result.output and "virtual-sm_90" in result.output
    assert "fwd_d64_fp16_full_n2048" in result.output and OTHER.key() in result.output
    result = runner.invoke(app, [*base, "--arch", "sm_80"])
    assert "tier:     default" in result.output
    result = runner.invoke(app, [*base, "--device", "Unknown GPU"])
    assert result.exit_code == 1 and "not in the tuning database" in result.output
    # it suggests a command that exists (regression: `flashtune db devices`)
    assert "`flashtune db list`" in result.output
    assert runner.invoke(app, ["db", "list", "--db", db]).exit_code == 0
    # a length that attention refuses is refused here too (regression: 10**12 ran)
    result = runner.invoke(app, ["explain", "--head-dim", "64", "--seqlen", str(10**12),
                                 "--db", db, "--arch", "sm_90"])
    assert result.exit_code == 1
    assert "exceed the limit 1073741312" in " ".join(result.output.split())
    result = runner.invoke(app, [*base[:-1], str(tmp_path / "missing.db"), "--arch", "sm_90"])
    assert result.exit_code == 1 and "no database file" in result.output


def test_cli_precompile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    ship = tmp_path / "ship"
    db = _db_with_result(tmp_path / "t.db")
    args = ["precompile", "--arch", "sm_90", "--head-dim", "64", "--dtype", "fp16",
            "--no-causal", "--out", str(ship), "--db", db]
    result = runner.invoke(app, [*args, "--seqlen", "2000", "--seqlen", "100"])
    assert result.exit_code == 0, result.output
    # a virtual sm_90 gets the family's tuned config for every bucket
    assert OTHER.key() in result.output
    assert f"FLASHTUNE_PRECOMPILED_DIR={ship}" in result.output
    monkeypatch.setenv("FLASHTUNE_PRECOMPILED_DIR", str(ship))
    assert load_shipped(render(PROBLEM, OTHER), "sm_90") is not None
    # an output directory that cannot exist is a message, not a traceback
    bad = runner.invoke(app, [*args[:-4], "--out", "/proc/flashtune-x", "--db", db])
    assert bad.exit_code == 1
    said = " ".join(bad.output.split())
    assert "cannot write the precompiled directory" in said
    # the fix names the option that chose the directory, not the cache's knob
    assert "give --out" in said and "FLASHTUNE_CACHE_DIR" not in said
    assert bad.exception is None or isinstance(bad.exception, SystemExit)
    huge = runner.invoke(app, [*args, "--seqlen", str(1 << 40)])
    assert huge.exit_code == 1 and "exceed the limit" in " ".join(huge.output.split())
    result = runner.invoke(app, ["precompile", "--arch", "sm_90"])
    assert result.exit_code == 1 and "nothing to compile" in result.output
    result = runner.invoke(app, ["explain", "--head-dim", "64", "--seqlen", "2048",
                                 "--arch", "sm_90", "--db", db])
    assert "precompiled cubin present" in result.output


def test_backward_problems_for_precompiling() -> None:
    """--backward adds the backward's four families; its row kernels have no mask."""
    from flashtune.commands.runtime import _problems

    fwd = _problems([64], [DType.BF16], True)
    assert [p.key() for p in fwd] == ["fwd_d64_bf16_causal"]
    both = {p.key() for p in _problems([64], [DType.BF16], True, backward=True)}
    assert both == {"fwd_d64_bf16_causal", "bwd_d64_bf16_causal", "bwddet_d64_bf16_causal",
                    "bwdpre_d64_bf16_full", "bwdsum_d64_bf16_full"}
    full = {p.key() for p in _problems([64], [DType.BF16], None, backward=True)}
    assert len(full) == 2 * 3 + 2


def test_fp8_problems_for_precompiling(tmp_path: Path) -> None:
    """--fp8 adds the FP8 forward with each input format beside --dtype as O's type; it
    compiles for sm_89 and is refused on sm_80 naming the arch."""
    from flashtune.commands.runtime import _problems

    got = {p.key() for p in _problems([64], [DType.BF16], True, fp8=True)}
    assert got == {"fwd_d64_bf16_causal", "fwd8_d64_e4m3-e4m3-bf16_causal",
                   "fwd8_d64_e5m2-e5m2-bf16_causal"}
    runner = CliRunner()
    args = ["precompile", "--head-dim", "64", "--dtype", "bf16", "--causal", "--fp8",
            "--all-defaults"]
    result = runner.invoke(app, [*args, "--arch", "sm_89", "--out", str(tmp_path / "s")])
    assert result.exit_code == 0, result.output
    manifest = (tmp_path / "s" / "flashtune-precompiled.json").read_text()
    for key in ("fwd_d64_bf16_causal", "fwd8_d64_e4m3_e4m3_bf16_causal",
                "fwd8_d64_e5m2_e5m2_bf16_causal"):
        assert f"flashtune_{key}_" in manifest, manifest[:500]
    refused = runner.invoke(app, [*args, "--arch", "sm_80", "--out", str(tmp_path / "t")])
    assert refused.exit_code == 1 and "sm_80 has no FP8 tensor cores" in " ".join(
        refused.output.split()), refused.output
