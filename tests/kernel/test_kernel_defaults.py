"""The default config table: complete, legal on every arch for every problem, documented."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from flashtune.codegen.arch import ARCHS, ArchClass, ArchSpec, arch_class, get_arch
from flashtune.codegen.spec import COMPILED_HEAD_DIMS, MAX_HEAD_DIM, DType, Problem
from flashtune.errors import InvalidConfig
from flashtune.families.fwd import FORWARD, defaults, space

#: Every head dim a Problem accepts (multiples of 8 up to 256), both dtypes and masks.
ALL_PROBLEMS = [Problem(hd, dt, causal=c) for hd, dt, c in
                itertools.product(range(8, MAX_HEAD_DIM + 1, 8), DType, (False, True))]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_default_passes_static_check_for_every_problem(arch: str) -> None:
    spec = get_arch(arch)
    for problem in ALL_PROBLEMS:
        config = defaults.default_config(problem, spec)
        why = space.static_check(problem, config, spec)
        assert why is None, f"default {config.key()} for {problem.key()} on {arch}: {why}"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_table_entry_itself_fits_every_known_arch(arch: str) -> None:
    """The fallback is for archs added later; the table must fit every arch it names."""
    spec = get_arch(arch)
    for problem in ALL_PROBLEMS:
        entry = defaults.default_entry(problem, spec)
        assert defaults.default_config(problem, spec) == entry.config
        assert entry.head_dim == problem.padded_head_dim
        assert entry.causal == problem.causal


def test_table_is_complete_and_unique() -> None:
    keys = [e.key for e in defaults.DEFAULT_TABLE]
    assert len(keys) == len(set(keys)), "duplicate default entries"
    expected = set(itertools.product(ArchClass, COMPILED_HEAD_DIMS, (False, True)))
    assert set(keys) == expected


def test_every_class_has_an_arch_and_each_arch_the_class_of_its_shared_memory() -> None:
    classes = {spec.default_class for spec in ARCHS.values()}
    assert classes == set(ArchClass)
    for name, spec in ARCHS.items():
        # the classes stand for shared memory per block: 227 KB, 163 KB, 99 KB
        smem = spec.max_smem_per_block // 1024
        expected = {227: ArchClass.SM90, 163: ArchClass.SM80,
                    99: ArchClass.SM86}[smem]
        assert arch_class(spec) is expected, name


def test_entries_are_in_the_search_space_with_reasons() -> None:
    for entry in defaults.DEFAULT_TABLE:
        problem = Problem(entry.head_dim, DType.FP16, causal=entry.causal)
        assert entry.config in FORWARD.search_space(problem), entry
        assert len(entry.reason) > 20, entry
        row = entry.to_dict()
        assert row["config"] == entry.config.key()
        assert row["archs"], entry
        assert set(row) == {"arch_class", "archs", "head_dim", "causal", "config", "reason"}


def test_padded_head_dims_share_the_compiled_entry() -> None:
    spec = get_arch("sm_80")
    assert (defaults.default_entry(Problem(72, DType.FP16), spec)
            == defaults.default_entry(Problem(96, DType.FP16), spec))
    assert (defaults.default_config(Problem(40, DType.BF16, causal=True), "sm_90")
            == defaults.default_config(Problem(64, DType.BF16, causal=True), "sm_90"))


def _shrunk(name: str, smem: int) -> ArchSpec:
    base = get_arch("sm_86")
    return dataclasses.replace(base, name=name, max_smem_per_block=smem, smem_per_sm=smem)


def test_unknown_small_arch_gets_the_fallback() -> None:
    # 80 KB per block: the sm86 entry for d256 (99 KB) does not fit, the fallback does.
    spec = _shrunk("sm_77", 80 * 1024)
    problem = Problem(256, DType.FP16)
    assert space.static_check(problem, defaults.default_entry(problem, spec).config, spec)
    config = defaults.default_config(problem, spec)
    assert config == defaults.FALLBACK
    assert space.static_check(problem, config, spec) is None


def test_arch_with_too_little_smem_is_an_error() -> None:
    spec = _shrunk("sm_77", 16 * 1024)
    with pytest.raises(InvalidConfig, match="no default config fits"):
        defaults.default_config(Problem(256, DType.FP16), spec)


def test_arch_by_name_or_spec_agree() -> None:
    for name in ARCHS:
        for problem in ALL_PROBLEMS[::7]:
            assert (defaults.default_config(problem, name)
                    == defaults.default_config(problem, get_arch(name)))
