"""NVRTC compilation without a GPU: binaries, resources, PTX/SASS, failures, memo and cache."""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace
from pathlib import Path

import pytest

from flashtune.codegen.spec import DType, KernelConfig, KernelSource, Problem
from flashtune.errors import CompileError, InvalidConfig, ToolchainNotFound
from flashtune.families import render
from flashtune.toolchain import compiler
from flashtune.toolchain.cache import ArtifactCache
from flashtune.toolchain.compiler import compile_source
from flashtune.toolchain.cuda import Toolchain, find_toolchain
from flashtune.toolchain.disasm import disassemble

PROBLEM = Problem(head_dim=64, dtype=DType.BF16, causal=True)
CONFIG = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


def handmade(code: str, entry: str, *, threads: int = 128, smem: int = 0,
             options: tuple[str, ...] = ("-std=c++17",)) -> KernelSource:
    """A KernelSource for a hand-written kernel (digest over code and options)."""
    digest = hashlib.sha256((code + "\0".join(options)).encode()).hexdigest()
    return KernelSource(problem=PROBLEM, config=CONFIG, code=code, entry=entry, headers={},
                        options=options, digest=digest, smem_bytes=smem, threads=threads)


@pytest.fixture(scope="module")
def source() -> KernelSource:
    return render(PROBLEM, CONFIG)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_forward_kernel_compiles_with_resources(source: KernelSource, arch: str,
                                                cache: ArtifactCache) -> None:
    kernel = compile_source(source, arch, cache=cache, ptx=True)
    assert kernel.arch == arch and kernel.entry == source.entry
    assert kernel.cubin[:4] == b"\x7fELF"
    assert kernel.ptx is not None
    assert re.search(rf"^\.target\s+{arch}\b", kernel.ptx, re.MULTILINE)
    assert f".entry {source.entry}(" in kernel.ptx
    res = kernel.resources
    assert 0 < res.registers <= 255
    assert res.dynamic_smem == source.smem_bytes
    assert res.max_threads == source.threads == CONFIG.threads
    assert f"Used {res.registers} registers" in kernel.log
    assert f"--gpu-architecture={arch}" in kernel.options


def test_sass_has_tensor_core_mma(source: KernelSource, cache: ArtifactCache,
                                  toolchain: Toolchain) -> None:
    if toolchain.nvdisasm is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    kernel = compile_source(source, "sm_80", cache=cache)
    sass = disassemble(kernel.cubin)
    assert source.entry in sass
    assert "HMMA.16816" in sass  # mma.sync m16n8k16 lowers to HMMA.16816
    assert "LDSM" in sass  # ldmatrix


def test_static_smem_and_stack_are_read_back(cache: ArtifactCache) -> None:
    words = 300
    code = (
        "extern \"C\" __global__ void __launch_bounds__(64) probe(float* out, int n) {\n"
        f"  __shared__ float tile[{words}];\n"
        "  volatile float local[40];\n"
        "  for (int i = 0; i < 40; ++i) local[i] = out[i * n];\n"
        f"  tile[threadIdx.x] = local[n % 40];\n"
        "  __syncthreads();\n"
        f"  out[threadIdx.x] = tile[{words} - 1 - threadIdx.x];\n"
        "}\n"
    )
    kernel = compile_source(handmade(code, "probe", threads=64, smem=512), "sm_86", cache=cache)
    res = kernel.resources
    assert res.static_smem == 4 * words
    assert res.dynamic_smem == 512
    assert res.smem_bytes == 4 * words + 512
    assert res.stack_frame >= 4 * 40  # the volatile array lives in local memory
    assert res.max_threads == 64
    assert res.barriers >= 1


def test_spills_are_read_back(cache: ArtifactCache) -> None:
    # 64 live accumulators under a 32-register cap cannot avoid spilling.
    code = (
        "extern \"C\" __global__ void pressure(const float* in, float* out, int n) {\n"
        "  float acc[64];\n"
        "#pragma unroll\n"
        "  for (int j = 0; j < 64; ++j) acc[j] = in[j * n + threadIdx.x];\n"
        "  for (int i = 1; i < n; ++i) {\n"
        "#pragma unroll\n"
        "    for (int j = 0; j < 64; ++j) acc[j] = acc[j] * in[i + j] + acc[(j + 7) % 64];\n"
        "  }\n"
        "#pragma unroll\n"
        "  for (int j = 0; j < 64; ++j) out[j * n + threadIdx.x] = acc[j];\n"
        "}\n"
    )
    capped = handmade(code, "pressure", options=("-std=c++17", "--maxrregcount=32"))
    free = handmade(code, "pressure")
    tight = compile_source(capped, "sm_80", cache=cache).resources
    roomy = compile_source(free, "sm_80", cache=cache).resources
    assert tight.registers <= 32 < roomy.registers
    assert tight.spill_stores > 0 and tight.spill_loads > 0
    assert roomy.spill_bytes == 0


def test_compile_error_carries_log_and_saved_source(source: KernelSource,
                                                    cache: ArtifactCache) -> None:
    broken_code = source.code + "\nstatic_assert(kBlockM == -1, \"flashtune test: broken\");\n"
    broken = replace(source, code=broken_code,
                     digest=hashlib.sha256(broken_code.encode()).hexdigest())
    with pytest.raises(CompileError) as info:
        compile_source(broken, "sm_90", cache=cache)
    err = info.value
    assert "flashtune test: broken" in err.log
    assert err.source_path is not None and err.source_path.is_file()
    assert err.source_path.read_text() == broken_code
    assert err.source_path.is_relative_to(cache.root / "failed")
    for name, text in source.headers.items():  # saved alongside: compiles by hand with -I
        assert (err.source_path.parent / name).read_text() == text
    assert "--gpu-architecture=sm_90" in (err.source_path.parent / "nvrtc.log").read_text()
    assert str(err.source_path) in str(err) and "flashtune test: broken" in str(err)
    assert not list((cache.root / "cubin").rglob("*.zip"))  # failures are not cached


def test_failure_is_retried_not_cached(source: KernelSource, cache: ArtifactCache,
                                       nvrtc_calls: list[str]) -> None:
    code = source.code + "\n#error flashtune test failure\n"
    broken = replace(source, code=code, digest=hashlib.sha256(code.encode()).hexdigest())
    for _ in range(2):
        with pytest.raises(CompileError, match="flashtune test failure"):
            compile_source(broken, "sm_80", cache=cache)
    assert len(nvrtc_calls) == 2


def test_memo_then_disk_then_compile(source: KernelSource, cache: ArtifactCache,
                                     nvrtc_calls: list[str]) -> None:
    first = compile_source(source, "sm_80", cache=cache)
    assert nvrtc_calls == [source.entry]
    again = compile_source(source, "sm_80", cache=cache)
    assert again is first  # in-process memo
    compiler.clear_memo()
    from_disk = compile_source(source, "sm_80", cache=cache)
    assert nvrtc_calls == [source.entry]
    assert from_disk == first
    with_ptx = compile_source(source, "sm_80", cache=cache, ptx=True)
    assert nvrtc_calls == [source.entry]
    assert with_ptx.ptx and with_ptx.cubin == first.cubin
    other_cache = ArtifactCache(cache.base.parent / "other")
    compiler.clear_memo()
    rebuilt = compile_source(source, "sm_80", cache=other_cache)
    assert nvrtc_calls == [source.entry, source.entry]
    assert rebuilt.resources == first.resources
    assert rebuilt.compile_key == first.compile_key


def test_archs_give_different_binaries(source: KernelSource, cache: ArtifactCache) -> None:
    a = compile_source(source, "sm_80", cache=cache)
    b = compile_source(source, "sm_90", cache=cache)
    assert a.compile_key != b.compile_key
    assert a.cubin != b.cubin


def test_arch_spellings_are_canonical(source: KernelSource, cache: ArtifactCache) -> None:
    assert compile_source(source, "90", cache=cache).arch == "sm_90"
    assert compile_source(source, "sm90", cache=cache).compile_key == \
        compile_source(source, "sm_90", cache=cache).compile_key


def test_unknown_arch_lists_the_supported_ones(source: KernelSource,
                                               cache: ArtifactCache) -> None:
    with pytest.raises(InvalidConfig, match=r"expected one of \['sm_80', 'sm_86', 'sm_87', "):
        compile_source(source, "sm_75", cache=cache)


def test_arch_this_nvrtc_cannot_target(source: KernelSource, cache: ArtifactCache,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from flashtune.toolchain import nvrtc

    lib = nvrtc.load(find_toolchain().nvrtc_path)
    monkeypatch.setitem(lib.__dict__, "supported_archs", (75, 80, 86))
    with pytest.raises(ToolchainNotFound, match=r"cannot compile for sm_90.*flashtune\[cu13\]"):
        compile_source(source, "sm_90", cache=cache)
    assert compile_source(source, "sm_80", cache=cache).arch == "sm_80"


def test_unreadable_artifact_is_rebuilt(source: KernelSource, cache: ArtifactCache,
                                        nvrtc_calls: list[str]) -> None:
    first = compile_source(source, "sm_86", cache=cache)
    (path,) = (cache.root / "cubin").rglob("*.zip")
    # Garbage whose sidecar digest matches: passes the cache's check, fails to parse.
    garbage = b"not a zip archive"
    path.write_bytes(garbage)
    Path(str(path) + ".sha256").write_text(hashlib.sha256(garbage).hexdigest())
    compiler.clear_memo()
    again = compile_source(source, "sm_86", cache=cache)
    assert len(nvrtc_calls) == 2
    assert again.cubin == first.cubin
    assert path.read_bytes()[:2] == b"PK"
