"""The rule that chooses the default forward configs (perf.model.default_rule): its candidates and
occupancy floor without compiling, and the rule run on one entry with NVRTC (a shortlist of
four, so that the test stays short; the whole table: ``docs/default_configs.py --check``).
The run on one entry compiles about 40 s of a core, so its two tests are ``slow``."""

from __future__ import annotations

import pytest

from flashtune.codegen.arch import ArchClass, get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.families.defaults import archs_of
from flashtune.families.fwd import space
from flashtune.perf.model import default_rule
from flashtune.perf.model.occupancy import occupancy
from flashtune.perf.sass.loops import MAX_LOCAL_ACCESSES


def test_workload_is_the_4k_point_at_hidden_size_2048() -> None:
    assert default_rule.rule_shape(128).key() == "b4_hq16_hkv16_q4096_k4096"
    assert default_rule.rule_shape(64).heads_q == 32
    assert default_rule.rule_shape(96).heads_q == 21
    assert default_rule.class_gpu(ArchClass.SM90).name == "H100"


@pytest.mark.parametrize(("cls", "head_dim"), [(ArchClass.SM90, 128), (ArchClass.SM80, 160)])
def test_candidates_pass_the_static_check_and_two_blocks_on_every_arch(
        cls: ArchClass, head_dim: int) -> None:
    configs, floor = default_rule.candidates(cls, head_dim, causal=True)
    assert floor == default_rule.Floor(2, 8)
    assert configs and all(not c.extras for c in configs)
    problem = Problem(head_dim, DType.BF16, causal=True)
    for config in configs:
        for arch in archs_of(cls):
            assert space.static_check(problem, config, get_arch(arch)) is None
            occ = occupancy(arch, threads=config.threads, registers=1,
                            smem_bytes=space.smem_bytes(problem, config))
            assert occ.blocks_per_sm >= 2 and occ.warps_per_sm >= 8, (config, arch)
    # a tile over the floor is left out: 128 x 128 with 3 K/V buffers needs 224 KB at d128
    assert KernelConfig(128, 128, 4, 3) not in configs


def test_the_floor_drops_to_one_block_only_where_no_tile_keeps_two() -> None:
    configs, floor = default_rule.candidates(ArchClass.SM86, 256, causal=False)
    assert floor == default_rule.Floor(1, 8)
    assert all(c.num_warps >= 8 for c in configs)


def test_floor_shortfall_names_the_limit() -> None:
    occ = occupancy("sm_90", threads=128, registers=255, smem_bytes=120 * 1024)
    why = default_rule.Floor(2, 8).shortfall(occ)
    assert why == "1 block/SM on sm_90, shared memory the limit (the floor: 2 blocks, 8 warps)"
    assert default_rule.Floor(1, 4).shortfall(occ) is None


ENTRY = [(ArchClass.SM90, 128, False, KernelConfig(128, 32, 4, 2))]


def derive_one_entry(**rule: float) -> default_rule.Choice:
    """sm90 d128 (not causal) chosen by the rule with a shortlist of 4, from the table's old
    default 128 x 32, with the rule's constants in ``rule`` changed. Each test below derives
    it; one xdist worker runs both, so the second finds the first's kernels and listings in
    the cache (two workers at once would both spawn compile pools and run nvdisasm)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(default_rule, "SHORTLIST", 4)
        for name, value in rule.items():
            mp.setattr(default_rule, name, value)
        return default_rule.derive(ENTRY)[0]


@pytest.mark.slow
@pytest.mark.xdist_group("default_rule_one_entry")
@pytest.mark.usefixtures("compile_cubin")  # skips without NVRTC or nvdisasm
def test_rule_takes_the_best_prediction_that_passes_every_build() -> None:
    choice = derive_one_entry()
    chosen = choice.chosen
    assert chosen is choice.best and not chosen.problems
    # every arch of the class in both dtypes was compiled and checked
    assert {(b.arch, b.dtype) for b in chosen.builds} == {
        (a, d) for a in archs_of(ArchClass.SM90) for d in DType}
    assert chosen.blocks_per_sm >= 2 and chosen.local_accesses <= MAX_LOCAL_ACCESSES
    for other in choice.passed_over:
        assert other.predicted_ms < chosen.predicted_ms and other.problems
    assert choice.incumbent is not None and choice.incumbent.config == KernelConfig(128, 32, 4, 2)
    assert chosen.predicted_ms <= choice.incumbent.predicted_ms
    assert choice.reason().startswith("best predicted of ")
    assert f"{chosen.registers} regs, {chosen.blocks_per_sm} blocks/SM" in choice.reason()
    assert choice.change().startswith("previous default m128_n32_w4_s2: ")


@pytest.mark.slow
@pytest.mark.xdist_group("default_rule_one_entry")
@pytest.mark.usefixtures("compile_cubin")
def test_a_current_default_within_the_margin_stays() -> None:
    kept = derive_one_entry(KEEP_MARGIN=1.0)
    assert kept.config == KernelConfig(128, 32, 4, 2)
    assert kept.best.config != kept.config  # kept by the margin, not as the best
    assert kept.reason().startswith(f"kept: {kept.best.config.key()}, the best predicted")
    assert kept.change() == ""
