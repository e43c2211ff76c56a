"""sm_90a, the arch-specific Hopper target: its own arch name, compile key, NVRTC option and
shipped artifact, served by the dispatcher on compute capability 9.0 devices only (no GPU:
devices are described by their arch, families by a test family)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import pytest

from flashtune import families
from flashtune.codegen.arch import ArchClass, compile_target, device_arch, get_arch
from flashtune.codegen.spec import DType, KernelConfig, KernelSource, Problem, ProblemBucket
from flashtune.db.records import BestEntry
from flashtune.errors import CompileError, InvalidConfig, InvalidProblem
from flashtune.families.fwd import ForwardFamily
from flashtune.families.hopper.ws import HOPPER_WS_FORWARD
from flashtune.runtime.device import DeviceInfo
from flashtune.runtime.dispatch import Dispatcher, Tier
from flashtune.runtime.precompile import artifact_name, load_shipped, precompile
from flashtune.toolchain import compiler
from flashtune.toolchain.cache import ArtifactCache
from flashtune.toolchain.compiler import compile_key, compile_source
from flashtune.toolchain.cuda import find_toolchain

PROBLEM = Problem(head_dim=64, dtype=DType.FP16, causal=True)
CONFIG = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


class HopperStandIn(ForwardFamily):
    """The forward's kernel declared as an sm_90a family that serves "fwd" calls, except at
    head dim 32 (a problem it does not accept)."""

    op = "fwdtest"
    title = "test: an sm_90a family serving the forward"
    target_arch: ClassVar[str | None] = "sm_90a"
    serves: ClassVar[str | None] = "fwd"

    def check_problem(self, problem: Problem) -> None:
        super().check_problem(problem)
        if problem.head_dim == 32:
            raise InvalidProblem("head_dim 32 is not served by this test family")


@pytest.fixture
def no_hopper() -> Iterator[None]:
    """The registry without the built-in sm_90a families (restored afterwards)."""
    builtins = [f for f in families.all_families() if f.target_arch is not None]
    for family in builtins:
        families.unregister(family.op)
    yield
    for family in builtins:
        families.register(family)


@pytest.fixture
def hopper(no_hopper: None) -> Iterator[HopperStandIn]:
    family = HopperStandIn()
    families.register(family)
    yield family
    families.unregister(family.op)


@dataclass(frozen=True)
class Dev:
    """A GPU as the dispatcher sees it (whether it runs sm_90a kernels: the knob)."""

    name: str
    arch: str


@pytest.fixture(autouse=True)
def arch_specific_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUs here run the arch-specific families (the default, FLASHTUNE_ARCH_SPECIFIC unset)."""
    monkeypatch.delenv("FLASHTUNE_ARCH_SPECIFIC", raising=False)


class _NoTuned:
    def all_best(self) -> list[BestEntry]:
        return []


def _decide(problem: Problem, arch: str) -> Problem:
    bucket = ProblemBucket(problem, 1024)
    decision = Dispatcher(_NoTuned).decide(bucket, Dev("GPU", arch))
    assert decision.tier is Tier.DEFAULT and decision.bucket.seqlen == 1024
    return decision.problem


# ------------------------------------------------------------------ names


@pytest.mark.parametrize("name", ["sm_90a", "sm90a", "90a", "9.0a", "compute_90a", " SM_90A "])
def test_sm90a_is_an_arch_of_its_own(name: str) -> None:
    spec = get_arch(name)
    assert spec.name == "sm_90a" and spec.arch_specific
    assert spec.compute_capability == (9, 0)
    generic = get_arch(name.replace("a", "").replace("A", "").replace("compute_", "sm_"))
    assert generic.name == "sm_90" and not generic.arch_specific
    assert spec.default_class is generic.default_class is ArchClass.SM90


def test_only_sm90_has_an_arch_specific_target() -> None:
    for name in ("sm_80a", "sm_86a", "sm_100a", "sm_90aa"):
        with pytest.raises(InvalidConfig, match="only arch-specific target is sm_90a"):
            get_arch(name)


def test_sm90a_code_runs_on_compute_capability_9_0_only() -> None:
    target = get_arch("sm_90a")
    assert [a for a in ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_120")
            if target.runs_on(get_arch(a))] == ["sm_90", "sm_90a"]
    # a generic target runs on its own arch only (flashtune compiles per device arch)
    assert get_arch("sm_90").runs_on(get_arch("sm_90"))
    assert not get_arch("sm_90").runs_on(get_arch("sm_100"))


def test_compile_target_of_a_source() -> None:
    assert compile_target(None, "sm_90").name == "sm_90"
    assert compile_target(None, "sm_90a").name == "sm_90a"
    assert compile_target("sm_90a", "sm_90").name == "sm_90a"
    assert compile_target("sm_90a", "9.0a").name == "sm_90a"
    for arch in ("sm_80", "sm_100", "sm_120"):
        with pytest.raises(InvalidConfig, match=r"built for sm_90a, which runs only on "
                                                r"compute capability 9\.0 devices"):
            compile_target("sm_90a", arch)


def test_virtual_sm90a_device() -> None:
    device = DeviceInfo.virtual("sm_90a")
    assert device.arch == "sm_90a" and device.compute_capability == (9, 0)
    assert device.key() == "virtual-sm_90a" != DeviceInfo.virtual("sm_90").key()


# ------------------------------------------------------------------ dispatch


def test_dispatcher_picks_the_sm90a_family_on_compute_capability_9_0(
        hopper: HopperStandIn) -> None:
    for arch in ("sm_90", "sm_90a"):
        chosen = _decide(PROBLEM, arch)
        assert chosen == replace(PROBLEM, op=hopper.op), arch
        assert families.render(chosen, CONFIG).target == "sm_90a"
    for arch in ("sm_80", "sm_86", "sm_89", "sm_100", "sm_120"):
        assert _decide(PROBLEM, arch) == PROBLEM, arch


def test_dispatcher_keeps_the_mma_sync_family_where_no_sm90a_one_applies(
        hopper: HopperStandIn) -> None:
    small = Problem(head_dim=32, dtype=DType.BF16)
    assert _decide(small, "sm_90") == small  # the sm_90a family does not accept it
    lse = Problem(head_dim=64, dtype=DType.FP16, op="lse")
    assert _decide(lse, "sm_90") == lse  # it serves "fwd" only


def test_without_an_sm90a_family_cc90_gets_the_forward(no_hopper: None) -> None:
    assert all(f.target_arch is None for f in families.all_families())
    assert _decide(PROBLEM, "sm_90") == PROBLEM
    assert families.render(PROBLEM, CONFIG).target is None


def test_the_builtin_sm90a_forward_serves_cc90_gpus_only() -> None:
    served = replace(PROBLEM, op=HOPPER_WS_FORWARD.op)
    for arch in ("sm_90", "sm_90a"):
        assert _decide(PROBLEM, arch) == served, arch
    for arch in ("sm_80", "sm_89", "sm_100"):
        assert _decide(PROBLEM, arch) == PROBLEM, arch
    odd = Problem(head_dim=96, dtype=DType.BF16)  # not a whole number of 128-byte panels
    assert _decide(odd, "sm_90") == odd


def test_gpus_keep_the_mma_sync_forward_when_they_opt_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With FLASHTUNE_ARCH_SPECIFIC=0 a cc 9.0 GPU keeps the mma.sync forward."""
    monkeypatch.setenv("FLASHTUNE_ARCH_SPECIFIC", "0")
    for arch in ("sm_90", "sm_90a", "sm_80"):
        assert _decide(PROBLEM, arch) == PROBLEM, arch


def test_virtual_devices_run_sm90a_families_only_when_named_sm90a() -> None:
    """A virtual sm_90 (the emulator's default device, --arch sm_90 listings and
    precompiles) keeps the mma.sync forward; a virtual sm_90a runs the sm_90a family."""
    bucket = ProblemBucket(PROBLEM, 1024)
    generic = Dispatcher(_NoTuned).decide(bucket, DeviceInfo.virtual("sm_90"))
    assert generic.problem == PROBLEM
    specific = Dispatcher(_NoTuned).decide(bucket, DeviceInfo.virtual("sm_90a"))
    assert specific.problem == replace(PROBLEM, op=HOPPER_WS_FORWARD.op)


def test_sm90a_family_configs_are_ruled_out_elsewhere(hopper: HopperStandIn) -> None:
    variant = replace(PROBLEM, op=hopper.op)
    assert hopper.static_check(variant, CONFIG, get_arch("sm_90")) is None
    assert hopper.static_check(variant, CONFIG, get_arch("sm_90a")) is None
    why = hopper.static_check(variant, CONFIG, get_arch("sm_100"))
    assert why is not None and "built for sm_90a" in why and "sm_100" in why
    assert hopper.candidates(variant, get_arch("sm_80")) == []


# ------------------------------------------------------------------ compile and cache


def test_sm90a_source_is_compiled_for_sm90a(hopper: HopperStandIn,
                                            cache: ArtifactCache) -> None:
    source = families.render(replace(PROBLEM, op=hopper.op), CONFIG)
    generic = families.render(PROBLEM, CONFIG)
    assert source.target == "sm_90a" and "// target: sm_90a only" in source.code
    assert source.digest != generic.digest
    # what a cc 9.0 device asks for (its arch, sm_90) is built for sm_90a
    kernel = compile_source(source, "sm_90", cache=cache, ptx=True)
    assert kernel.arch == "sm_90a"
    assert "--gpu-architecture=sm_90a" in kernel.options
    assert kernel.ptx is not None and re.search(r"^\.target\s+sm_90a\b", kernel.ptx,
                                                re.MULTILINE)
    assert compile_key(source, "sm_90") == compile_key(source, "sm_90a")
    with pytest.raises(InvalidConfig, match="built for sm_90a"):
        compile_source(source, "sm_80", cache=cache)


def test_compile_key_and_options_tell_sm90_from_sm90a() -> None:
    source = families.render(PROBLEM, CONFIG)
    assert compile_key(source, "sm_90") != compile_key(source, "sm_90a")
    tc = find_toolchain()
    assert "--gpu-architecture=sm_90a" in compiler.nvrtc_options(source, "sm_90a", tc)
    assert "--gpu-architecture=sm_90" in compiler.nvrtc_options(source, "sm_90", tc)
    key = compile_key(source, "sm_90a")
    assert compiler.artifact_name(source, "sm_90a", key) != compiler.artifact_name(
        source, "sm_90", compile_key(source, "sm_90"))


_WGMMA_FENCE = """
extern "C" __global__ void fence_only(int* out) {
    asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory");
    out[threadIdx.x] = 1;
}
"""


def _handmade(target: str | None) -> KernelSource:
    digest = hashlib.sha256(_WGMMA_FENCE.encode()).hexdigest()
    return KernelSource(problem=PROBLEM, config=CONFIG, code=_WGMMA_FENCE, entry="fence_only",
                        headers={}, options=("-std=c++17",), digest=digest, smem_bytes=0,
                        threads=128, target=target)


def test_nvrtc_accepts_wgmma_for_sm90a_only(cache: ArtifactCache) -> None:
    """The reason sm_90a exists: wgmma needs the arch-specific target."""
    assert compile_source(_handmade("sm_90a"), "sm_90", cache=cache).arch == "sm_90a"
    with pytest.raises(CompileError, match="sm_90"):
        compile_source(_handmade(None), "sm_90", cache=cache)


def test_precompiled_cache_tells_sm90_from_sm90a(hopper: HopperStandIn,
                                                 tmp_path: Path) -> None:
    ship = tmp_path / "ship"
    variant = replace(PROBLEM, op=hopper.op)
    (item,) = precompile([(variant, CONFIG)], "sm_90", ship, workers=1)
    source = families.render(variant, CONFIG)
    assert item.arch == "sm_90a" and "_sm_90a_" in item.path.name
    assert artifact_name(source, "sm_90") == artifact_name(source, "sm_90a")
    # a cc 9.0 device (arch sm_90) finds it; the cubin is the sm_90a build
    shipped = load_shipped(source, "sm_90", [ship])
    assert shipped == compile_source(source, "sm_90a").cubin
    # the generic forward has one shipped name per arch
    generic = families.render(PROBLEM, CONFIG)
    assert artifact_name(generic, "sm_90") != artifact_name(generic, "sm_90a")
    assert load_shipped(generic, "sm_90", [ship]) is None


def test_precompile_for_sm90a_ships_portable_kernels_as_a_cc90_device_loads_them(
        hopper: HopperStandIn, tmp_path: Path) -> None:
    # `precompile --arch sm_90a` plans what a cc 9.0 GPU runs: the arch-specific kernels and
    # the portable ones beside them (other head dims, the backward); the portable ones must
    # carry the name a cc 9.0 device (arch sm_90) looks for, not one for sm_90a.
    ship = tmp_path / "ship"
    variant = replace(PROBLEM, op=hopper.op)
    done = precompile([(variant, CONFIG), (PROBLEM, CONFIG)], "sm_90a", ship, workers=1)
    assert sorted(item.arch for item in done) == ["sm_90", "sm_90a"]
    for problem in (variant, PROBLEM):
        source = families.render(problem, CONFIG)
        assert load_shipped(source, "sm_90", [ship]) == compile_source(
            source, compile_target(source.target, "sm_90").name).cubin
    assert device_arch(get_arch("sm_90a")) == get_arch("sm_90")
    assert device_arch(get_arch("sm_80")) == get_arch("sm_80")


def test_the_arch_knob_names_exactly_the_arch_table() -> None:
    """knobs sit below codegen and keep their own list of archs: held equal here."""
    from flashtune import settings
    from flashtune.codegen.arch import ARCHS

    assert tuple(ARCHS) == settings.ARCH_NAMES
    assert [get_arch(name).name for name in settings.ARCH_NAMES] == list(ARCHS)
    compute = [spec.compute_capability for spec in ARCHS.values()]
    assert compute == sorted(compute), "the table is in compute-capability order"
