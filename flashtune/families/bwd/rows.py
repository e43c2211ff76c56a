"""The two row-wise kernels around the backward main kernel (templates/bwd_rows.cuh).

``bwdpre`` (preprocess): D = rowsum(dO * O) in float32 from the 16-bit O and dO, and every
slice of the float32 dQ accumulator zeroed. ``bwdsum`` (convert): dQ = softmax_scale times
the sum of the accumulator's slices, added in slice order (so the deterministic mode is
bitwise reproducible), rounded to the input type.

Both are memory-bound row kernels (families/rows.py: no key tile, no mask), one block per
block_m query rows of one (batch, head). The number of accumulator slices a verification
launch uses is the scalar input ``dq_slices``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from flashtune._lazy import lazy_module
from flashtune.codegen.abi import EntryAbi
from flashtune.codegen.params import Param, ParamSpace
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape, ShapeLike
from flashtune.families.base import (
    Inputs,
    LaunchPlan,
    Tensors,
    Tolerance,
    Verdict,
    compare_outputs,
    generator,
    random_rows,
    torch_dtype,
)
from flashtune.families.bwd import args
from flashtune.families.rows import RowFamily

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

SPACE = ParamSpace((Param("block_m", (32, 64, 128)), Param("block_n", (16,)),
                    Param("num_warps", (1, 2, 4, 8)), Param("num_stages", (1,))))
#: Accumulator slices of a verification launch: more than one, so that summing (and
#: zeroing) every slice is what gets checked.
VERIFY_SLICES = 3

#: D: float32 sums of exact products, against float64.
DSUM_TOLERANCE = Tolerance(1e-4, 1e-5)
#: dQ: one rounding to the input type after a float32 sum.
DQ_TOLERANCE = {DType.FP16: Tolerance(1e-6, 1e-3), DType.BF16: Tolerance(1e-6, 8e-3)}


def _grid(config: KernelConfig, shape: Shape) -> tuple[int, int, int]:
    """One block per block_m query rows of one (batch, head)."""
    return args.row_grid(shape.seqlen_q, shape.heads_q, shape.batch, config.block_m)


class PreprocessFamily(RowFamily):
    """D = rowsum(dO * O) and the zeroed dQ accumulator."""

    op = "bwdpre"
    title = "attention backward preprocess (D = rowsum(dO * O), dQ accumulator zeroed)"
    template = "bwd_pre.cu.jinja"
    row_space = SPACE
    abi: ClassVar[EntryAbi | None] = args.PRE_ABI

    def random_inputs(self, problem: Problem, shape: Shape, device: torch.device | str,
                      seed: int | None = None) -> Inputs:
        gen = generator(device, seed)
        o, dout = (random_rows(problem, shape, shape.seqlen_q, shape.heads_q, gen, device)
                   for _ in range(2))
        return Inputs({"o": o, "do": dout},
                      {"dq_slices": float(VERIFY_SLICES)})

    def empty_outputs(self, problem: Problem, shape: Shape, inputs: Inputs, *,
                      poison: bool) -> dict[str, torch.Tensor]:
        device = inputs.tensors["o"].device
        slices = int(inputs.scalars["dq_slices"])
        dsum = torch.empty(shape.batch, shape.heads_q, shape.seqlen_q, dtype=torch.float32,
                           device=device)
        accum = torch.empty(slices, shape.batch, shape.heads_q, shape.seqlen_q,
                            problem.head_dim, dtype=torch.float32, device=device)
        if poison:
            dsum.fill_(float("nan"))
            accum.fill_(float("nan"))
        return {"dsum": dsum, "dq_accum": accum}

    def launch_plan(self, problem: Problem, config: KernelConfig, shape: Shape,
                    inputs: Inputs, outputs: Tensors) -> LaunchPlan:
        t = inputs.tensors
        return LaunchPlan(_grid(config, shape),
                          args.pre_args(t["o"], t["do"], outputs["dsum"], outputs["dq_accum"]))

    def reference(self, problem: Problem, inputs: Inputs) -> dict[str, torch.Tensor]:
        o, dout = (inputs.tensors[n].to(torch.float64) for n in ("o", "do"))
        batch, seqlen_q, heads_q, dim = o.shape
        slices = int(inputs.scalars["dq_slices"])
        return {"dsum": (o * dout).sum(-1).transpose(1, 2),
                "dq_accum": torch.zeros(slices, batch, heads_q, seqlen_q, dim,
                                        dtype=torch.float64, device=o.device)}

    def compare(self, problem: Problem, shape: Shape, outputs: Tensors,
                reference: Tensors) -> Verdict:
        return compare_outputs(problem, shape, outputs, reference, [
            ("D", "dsum", DSUM_TOLERANCE), ("dQ accumulator", "dq_accum", Tolerance(0.0, 0.0))])

    def flops(self, problem: Problem, shape: ShapeLike) -> float:
        return 2.0 * shape.batch * shape.seqlen_q * shape.heads_q * problem.head_dim

    def min_bytes(self, problem: Problem, shape: ShapeLike) -> float:
        """O and dO read, D written; the accumulator zeroed (one slice at least)."""
        rows = shape.batch * shape.heads_q * shape.seqlen_q
        return float(rows * (2 * problem.dtype.itemsize * problem.head_dim + 4
                             + 4 * problem.head_dim))


class ConvertFamily(RowFamily):
    """dQ = softmax_scale * (sum of the accumulator's slices, in slice order)."""

    op = "bwdsum"
    title = "attention backward dQ convert (slices summed in a fixed order, scaled, rounded)"
    template = "bwd_sum.cu.jinja"
    row_space = SPACE
    abi: ClassVar[EntryAbi | None] = args.SUM_ABI

    def random_inputs(self, problem: Problem, shape: Shape, device: torch.device | str,
                      seed: int | None = None) -> Inputs:
        gen = generator(device, seed)
        accum = torch.randn(VERIFY_SLICES, shape.batch, shape.heads_q, shape.seqlen_q,
                            problem.head_dim, generator=gen, device=device)
        return Inputs({"dq_accum": accum}, {"softmax_scale": problem.head_dim ** -0.5})

    def empty_outputs(self, problem: Problem, shape: Shape, inputs: Inputs, *,
                      poison: bool) -> dict[str, torch.Tensor]:
        accum = inputs.tensors["dq_accum"]
        dq = torch.empty(shape.batch, shape.seqlen_q, shape.heads_q, problem.head_dim,
                         dtype=torch_dtype(problem.dtype), device=accum.device)
        return {"dq": dq.fill_(float("nan")) if poison else dq}

    def launch_plan(self, problem: Problem, config: KernelConfig, shape: Shape,
                    inputs: Inputs, outputs: Tensors) -> LaunchPlan:
        return LaunchPlan(_grid(config, shape),
                          args.sum_args(inputs.tensors["dq_accum"], outputs["dq"],
                                        inputs.scalars["softmax_scale"]))

    def reference(self, problem: Problem, inputs: Inputs) -> dict[str, torch.Tensor]:
        accum = inputs.tensors["dq_accum"].to(torch.float64)
        return {"dq": (accum.sum(0) * inputs.scalars["softmax_scale"]).transpose(1, 2)}

    def compare(self, problem: Problem, shape: Shape, outputs: Tensors,
                reference: Tensors) -> Verdict:
        return compare_outputs(problem, shape, outputs, reference,
                               [("dQ", "dq", DQ_TOLERANCE[problem.dtypes.o])])

    def flops(self, problem: Problem, shape: ShapeLike) -> float:
        """One multiply (the scale) and one add of the first slice per element; each further
        slice adds one more."""
        return 2.0 * shape.batch * shape.seqlen_q * shape.heads_q * problem.head_dim

    def min_bytes(self, problem: Problem, shape: ShapeLike) -> float:
        """One accumulator slice read and dQ written."""
        rows = shape.batch * shape.heads_q * shape.seqlen_q
        return float(rows * problem.head_dim * (4 + problem.dtype.itemsize))


PREPROCESS = PreprocessFamily()
CONVERT = ConvertFamily()
