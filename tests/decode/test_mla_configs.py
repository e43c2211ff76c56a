"""Every config of the MLA space that passes sm_90's static rules (the split knob left to
the heuristic) computes MLA decoding within the float64 tolerances in the emulator: paged
(3-row pages), causal speculative rows, 32 heads, 3 splits, an empty cache among uneven
lengths. Two configs drawn with the seed by default, all of them under sweep."""

from __future__ import annotations

import os
import random

import pytest
from mla_cases import MlaCase, run_case

from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig
from flashtune.families.mla import MLA
from flashtune.families.mla.space import config_splits

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
CASE = MlaCase(DType.FP16, 3, 2, 32, 3)
CONFIGS = tuple(c for c in MLA.search_space(CASE.problem)
                if config_splits(c) == 0 and MLA.rules(CASE.problem, c, get_arch("sm_90")) is None)


def check_config(config: KernelConfig, case: MlaCase = CASE) -> None:
    inputs, outputs, _, _ = run_case(case, f"{SEED}-{case.key}-{config.key()}", config)
    verdict = MLA.compare(case.problem, case.shape, outputs, MLA.reference(case.problem,
                                                                            inputs))
    assert verdict.ok, f"{config.key()}: {verdict.message}"


def test_the_space_has_configs_of_every_knob() -> None:
    assert len(CONFIGS) >= 40
    for knob, values in (("block_m", {16, 32, 64}), ("block_n", {16, 32, 64}),
                         ("num_stages", {1, 2, 3})):
        assert {c.to_dict()[knob] for c in CONFIGS} == values


@pytest.mark.emulator
@pytest.mark.parametrize("config", random.Random(SEED).sample(CONFIGS, 2),
                         ids=lambda c: c.key())
def test_sampled_configs_match_float64(config: KernelConfig) -> None:
    check_config(config)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.key())
def test_every_config_matches_float64(config: KernelConfig) -> None:
    check_config(config)
