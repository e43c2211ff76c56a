"""A changed ABI declaration end to end in the emulator: a family whose row-wise LSE kernel
takes one more scalar renders it into its signature, packs it, and its built library's
parameters match the declaration (checked at load); the kernel still matches float64."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch

from flashtune import families
from flashtune.codegen.abi import ArgType, Element, EntryAbi, scalar
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.errors import EmulatorError
from flashtune.families.base import Inputs
from flashtune.families.lse import LSE_ABI, RowLseFamily
from flashtune.runtime.backends.emulator import EmulatorBackend
from flashtune.runtime.backends.emulator.backend import check_signature
from flashtune.runtime.launch import prepare, verify

pytestmark = pytest.mark.emulator

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
#: The row-wise LSE's arguments with a float32 scalar appended (the kernel ignores it).
BIASED_ABI = LSE_ABI.extended("row_lse_bias", scalar("bias", Element.FLOAT))


class BiasedLseFamily(RowLseFamily):
    """The row-wise LSE with one more (unused) kernel argument, declared once."""

    op = "lsebias"
    abi: ClassVar[EntryAbi | None] = BIASED_ABI

    def random_inputs(self, problem: Problem, shape: Shape, device: torch.device | str,
                      seed: int | None = None) -> Inputs:
        inputs = super().random_inputs(problem, shape, device, seed)
        return Inputs(inputs.tensors, {**inputs.scalars, "bias": 0.75})


@pytest.fixture
def biased() -> Iterator[BiasedLseFamily]:
    family = BiasedLseFamily()
    families.register(family)
    yield family
    families.unregister(family.op)


def test_the_added_argument_reaches_source_packer_and_library(biased: BiasedLseFamily
                                                              ) -> None:
    problem = Problem(64, DType.BF16, causal=True, op=biased.op)
    source = families.render(problem, KernelConfig(32, 64, 2, 1))
    assert "float softmax_scale, float bias) {" in source.code
    kernel = EmulatorBackend().load(source)  # its parameters checked against BIASED_ABI
    assert kernel.kernel.signature == BIASED_ABI.emulator_signature() == (
        LSE_ABI.emulator_signature() + "f")
    shape = Shape(batch=2, seqlen_q=37, seqlen_k=53, heads_q=4, heads_kv=2)
    launch = prepare(kernel, shape, "cpu", seed=SEED, poison=True)
    assert launch.plan.args[-1] == (ArgType.F32, 0.75)
    verdict = verify(kernel, shape, "cpu", seed=SEED)
    assert verdict.ok, verdict.message

    # The declaration without the argument no longer matches the built library.
    class Stale(BiasedLseFamily):
        abi = LSE_ABI

    families.register(Stale(), replace=True)
    with pytest.raises(EmulatorError, match=r"its family's ABI declares"):
        check_signature(source, kernel.kernel)
