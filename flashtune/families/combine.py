"""The combine family of split-KV decoding: merges the float32 partial O and LSE of the
splits into O (the input type) and the LSE, each split weighted by exp(LSE_s - LSE)
(templates/combine_splits.cuh).

It serves ``Problem(op="combine", ...)`` (causal is irrelevant and kept False), and with
``sinks=True`` joins each head's sink (float32 (heads_q,)) to every row's denominator where
the final O and LSE are written (decoding's sinks: a split's partial LSE leaves it out).
Verified on its own: random partial results with empty splits (LSE -inf), rows whose splits
are all empty (O = 0, LSE = +inf, or the sink) and split counts up to MAX_SPLITS, against a
float64 merge.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from flashtune._lazy import lazy_module
from flashtune.codegen.abi import Element, EntryAbi, PackedArgs, scalar, size, strides, tensor
from flashtune.codegen.params import Param, ParamSpace
from flashtune.codegen.render import TemplateValue
from flashtune.codegen.spec import KernelConfig, Problem, Shape, ShapeLike
from flashtune.families.base import (
    Inputs,
    LaunchPlan,
    Tensors,
    Tolerance,
    Verdict,
    compare_outputs,
    generator,
    torch_dtype,
)
from flashtune.families.checks import O_TOLERANCE
from flashtune.families.decode.splits import MAX_SPLITS
from flashtune.families.rows import RowFamily, row_kernel_params

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

#: block_m: rows per block (warps take every num_warps-th row); block_n and num_stages have
#: no meaning here and keep one value.
SPACE = ParamSpace((Param("block_m", (16, 32, 64, 128)), Param("block_n", (16,)),
                    Param("num_warps", (1, 2, 4)), Param("num_stages", (1,))))
#: The merge is float32 arithmetic in another order than float64: float32 resolution.
LSE_TOLERANCE = Tolerance(1e-5, 1e-6)
#: Split counts a generic verification draws from.
_VERIFY_SPLITS = (1, 3, 8, 33, MAX_SPLITS)


_F, _I = Element.FLOAT, Element.INT

#: The combine kernel's arguments (``combine_splits.cu.jinja``).
COMBINE_ABI = EntryAbi("combine_splits", (
    tensor("o_part", _F, const=True), tensor("lse_part", _F, const=True),
    tensor("o", Element.O, wrap=True), tensor("lse", _F),
    scalar("num_splits", _I, size("o_part", 0)), scalar("rows", _I),
    scalar("heads_q", _I, size("o_part", 2)),
    scalar("seqlen_q", _I, size("o_part", 3), wrap=True), *strides("o", wrap=False),
    tensor("sinks", _F, const=True, feature="sinks", wrap=True),
))
_pack = COMBINE_ABI.packer()
_pack_sinks = COMBINE_ABI.packer(("sinks",))


def pack_combine_args(o_part: torch.Tensor, lse_part: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor, sinks: torch.Tensor | None = None) -> PackedArgs:
    """The combine kernel's arguments: o_part (splits, batch, heads_q, seqlen_q, dim),
    lse_part (splits, batch, heads_q, seqlen_q), O (batch, seqlen_q, heads_q, dim) with any
    strides of a contiguous last dim, LSE contiguous (batch, heads_q, seqlen_q); ``sinks``
    contiguous float32 (heads_q,) for a kernel of a problem with sinks (else None)."""
    _, batch, heads_q, seqlen_q, _ = o_part.shape
    if sinks is None:
        return _pack(o_part, lse_part, o, lse, batch * heads_q * seqlen_q)
    return _pack_sinks(o_part, lse_part, o, lse, batch * heads_q * seqlen_q, sinks)


def combine_grid(rows: int, block_m: int) -> tuple[int, int, int]:
    """One block per block_m rows of (batch, head, query position)."""
    return (-(-rows // block_m), 1, 1)


def combine_reference(o_part: torch.Tensor, lse_part: torch.Tensor,
                      sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 O (batch, seqlen_q, heads_q, dim) and LSE (batch, heads_q, seqlen_q); with
    ``sinks`` (heads_q,) each head's sink is one more term of the LSE, with no value."""
    lse_s = lse_part.to(torch.float64)
    lse = torch.logsumexp(lse_s, dim=0)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(torch.float64)[None, :, None])
    empty = torch.isneginf(lse)
    weights = torch.exp(lse_s - lse.masked_fill(empty, 0.0)).masked_fill(empty, 0.0)
    o = torch.einsum("sbhq,sbhqd->bqhd", weights, o_part.to(torch.float64))
    return o, lse.masked_fill(empty, float("inf"))


class CombineFamily(RowFamily):
    """Merge of split-KV partial results (a row kernel: no key tiles, no mask)."""

    op = "combine"
    title = "merge of split-KV partial O and LSE, weighted by LSE"
    template = "combine_splits.cu.jinja"
    row_space = SPACE
    row_default_reason = "64 rows per block on 4 warps: one row per warp at a time, any arch"
    abi: ClassVar[EntryAbi | None] = COMBINE_ABI
    features = frozenset({"sinks"})

    def template_params(self, problem: Problem, config: KernelConfig
                        ) -> dict[str, TemplateValue]:
        params = row_kernel_params(problem, config)
        if problem.sinks:
            params["sinks"] = True
        return params

    def random_inputs(self, problem: Problem, shape: Shape, device: torch.device | str,
                      seed: int | None = None, num_splits: int | None = None) -> Inputs:
        """Partial results of ``num_splits`` splits (drawn when None): a third of the
        splits empty at random, the second half of the splits empty for the last query
        position, and the first (batch, head) with every split empty."""
        gen = generator(device, seed)
        if num_splits is None:
            pick = torch.randint(len(_VERIFY_SPLITS), (1,), generator=gen, device=gen.device)
            num_splits = _VERIFY_SPLITS[int(pick)]
        size = (num_splits, shape.batch, shape.heads_q, shape.seqlen_q)
        lse = torch.randn(*size, generator=gen, device=device) * 3
        empty = torch.rand(*size, generator=gen, device=device) < 1 / 3
        empty[num_splits // 2:, :, :, -1] = True
        empty[:, 0, 0] = True
        o_part = torch.randn(*size, problem.head_dim, generator=gen, device=device)
        o_part = o_part.masked_fill(empty[..., None], 0.0)
        tensors = {"o_part": o_part, "lse_part": lse.masked_fill(empty, float("-inf"))}
        if problem.sinks:  # around the partial LSEs' spread, so that both terms matter
            tensors["sinks"] = torch.randn(shape.heads_q, generator=gen, device=device) * 3
        return Inputs(tensors, {})

    def empty_outputs(self, problem: Problem, shape: Shape, inputs: Inputs, *,
                      poison: bool) -> dict[str, torch.Tensor]:
        _, batch, heads_q, seqlen_q, dim = inputs.tensors["o_part"].shape
        device = inputs.tensors["o_part"].device
        o = torch.empty(batch, seqlen_q, heads_q, dim, dtype=torch_dtype(problem.dtype),
                        device=device)
        lse = torch.empty(batch, heads_q, seqlen_q, dtype=torch.float32, device=device)
        if poison:
            o.fill_(float("nan"))
            lse.fill_(float("nan"))
        return {"o": o, "lse": lse}

    def launch_plan(self, problem: Problem, config: KernelConfig, shape: Shape,
                    inputs: Inputs, outputs: Tensors) -> LaunchPlan:
        o_part, lse_part = inputs.tensors["o_part"], inputs.tensors["lse_part"]
        args = pack_combine_args(o_part, lse_part, outputs["o"], outputs["lse"],
                                 inputs.tensors.get("sinks") if problem.sinks else None)
        return LaunchPlan(combine_grid(lse_part[0].numel(), config.block_m), args)

    def reference(self, problem: Problem, inputs: Inputs) -> dict[str, torch.Tensor]:
        o, lse = combine_reference(inputs.tensors["o_part"], inputs.tensors["lse_part"],
                                   inputs.tensors.get("sinks") if problem.sinks else None)
        return {"o": o, "lse": lse}

    def compare(self, problem: Problem, shape: Shape, outputs: Tensors,
                reference: Tensors) -> Verdict:
        return compare_outputs(problem, shape, outputs, reference,
                               [("O", "o", O_TOLERANCE[problem.dtypes.o]),
                                ("LSE", "lse", LSE_TOLERANCE)])

    def flops(self, problem: Problem, shape: ShapeLike) -> float:
        """Two FLOPs per partial element (a multiply-add), one split assumed."""
        return 2.0 * shape.batch * shape.heads_q * shape.seqlen_q * problem.head_dim

    def min_bytes(self, problem: Problem, shape: ShapeLike) -> float:
        """One split's partial O and LSE read, O and LSE written."""
        rows = shape.batch * shape.heads_q * shape.seqlen_q
        d = problem.head_dim
        return float(rows * (4 * d + 4) + rows * (problem.dtype.itemsize * d + 4))


COMBINE = CombineFamily()
