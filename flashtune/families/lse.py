"""The row-wise LSE family: LSE[b, h, i] = log(sum_j exp(scale * q_i . k_j)), no output O.

A small second family (scalar FP32 dot products, templates/row_lse.cuh) that exercises every
part of the family interface: its own template, space, static rules, launch plan, float64
reference, counts and default. It serves ``Problem(op="lse", ...)``; causal masks are
bottom-right aligned as in the forward, and a row that sees no key gets +inf.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from flashtune._lazy import lazy_module
from flashtune.codegen.abi import Element, EntryAbi, scalar, size, strides, tensor
from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.dtypes import SAME_16BIT
from flashtune.codegen.params import Param, ParamSpace
from flashtune.codegen.render import TemplateValue
from flashtune.codegen.spec import KernelConfig, Problem, Shape, ShapeLike
from flashtune.families.base import (
    Inputs,
    KernelFamily,
    LaunchPlan,
    Tensors,
    Tolerance,
    Verdict,
    attention_matmul_flops,
    compare_outputs,
    element_params,
    generator,
    torch_dtype,
)
from flashtune.families.checks import causal_visible
from flashtune.families.launch_args import grid

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

SPACE = ParamSpace((Param("block_m", (16, 32, 64)), Param("block_n", (32, 64, 128)),
                    Param("num_warps", (1, 2, 4)), Param("num_stages", (1,))))
#: FP32 dot products in a different order than float64: a float32-resolution error.
TOLERANCE = Tolerance(1e-3, 1e-5)
_DEFAULT = KernelConfig(block_m=32, block_n=64, num_warps=2, num_stages=1)
_I = Element.INT

#: The kernel's arguments (``row_lse.cu.jinja``).
LSE_ABI = EntryAbi("row_lse", (
    tensor("q", Element.Q, const=True), tensor("k", Element.KV, const=True),
    tensor("lse", Element.FLOAT),
    scalar("seqlen_q", _I, size("q", 1), wrap=True), scalar("seqlen_k", _I, size("k", 1)),
    scalar("heads_q", _I, size("q", 2)), scalar("heads_kv", _I, size("k", 2)),
    *strides("q"), *strides("k"),
    scalar("softmax_scale", Element.FLOAT, wrap=True),
))


class RowLseFamily(KernelFamily):
    """Row-wise log-sum-exp of scaled attention scores."""

    op = "lse"
    title = "row-wise LSE of scale * Q K^T (no output O; scalar FP32)"
    template = "row_lse.cu.jinja"
    dtypes = SAME_16BIT
    abi: ClassVar[EntryAbi | None] = LSE_ABI

    def space(self, problem: Problem) -> ParamSpace:
        return SPACE

    def rules(self, problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
        if config.num_stages != 1:
            return f"num_stages={config.num_stages}: this kernel stages one K tile at a time"
        smem = self.smem_bytes(problem, config)
        if smem > arch.max_smem_per_block:
            return (f"shared memory {smem} B exceeds the {arch.name} per-block limit "
                    f"{arch.max_smem_per_block} B")
        return None

    def default_config(self, problem: Problem, arch: ArchSpec) -> KernelConfig:
        return self.fitting(problem, _DEFAULT, arch)

    def default_reason(self, problem: Problem, arch: ArchSpec) -> str:
        return "one mid-sized tile for every arch (at most 48 KB of shared memory at d256)"

    def template_params(self, problem: Problem, config: KernelConfig
                        ) -> dict[str, TemplateValue]:
        return {"head_dim": problem.head_dim, **element_params(problem),
                "causal": problem.causal, "block_m": config.block_m,
                "block_n": config.block_n, "num_warps": config.num_warps}

    def smem_bytes(self, problem: Problem, config: KernelConfig) -> int:
        """Q rows and one K tile, staged as float32."""
        return 4 * problem.head_dim * (config.block_m + config.block_n)

    def random_inputs(self, problem: Problem, shape: Shape, device: torch.device | str,
                      seed: int | None = None) -> Inputs:
        gen = generator(device, seed)
        dt = torch_dtype(problem.dtype)
        q = torch.randn(shape.batch, shape.seqlen_q, shape.heads_q, problem.head_dim,
                        generator=gen, device=device).to(dt)
        k = torch.randn(shape.batch, shape.seqlen_k, shape.heads_kv, problem.head_dim,
                        generator=gen, device=device).to(dt)
        return Inputs({"q": q, "k": k}, {"softmax_scale": problem.head_dim ** -0.5})

    def empty_outputs(self, problem: Problem, shape: Shape, inputs: Inputs, *,
                      poison: bool) -> dict[str, torch.Tensor]:
        lse = torch.empty(shape.batch, shape.heads_q, shape.seqlen_q, dtype=torch.float32,
                          device=inputs.tensors["q"].device)
        return {"lse": lse.fill_(float("nan")) if poison else lse}

    def launch_plan(self, problem: Problem, config: KernelConfig, shape: Shape,
                    inputs: Inputs, outputs: Tensors) -> LaunchPlan:
        assert self.abi is not None
        args = self.abi.pack({**inputs.tensors, **inputs.scalars, **outputs},
                             problem.features)
        return LaunchPlan(grid(shape.seqlen_q, shape.heads_q, shape.batch, config.block_m),
                          args)

    def reference(self, problem: Problem, inputs: Inputs) -> dict[str, torch.Tensor]:
        q, k = (inputs.tensors[n].to(torch.float64) for n in ("q", "k"))
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * inputs.scalars["softmax_scale"]
        if problem.causal:
            visible = causal_visible(q.shape[1], k.shape[1], q.device)
            scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        return {"lse": lse.masked_fill(torch.isneginf(lse), float("inf"))}

    def compare(self, problem: Problem, shape: Shape, outputs: Tensors,
                reference: Tensors) -> Verdict:
        return compare_outputs(problem, shape, outputs, reference, [("LSE", "lse", TOLERANCE)])

    def flops(self, problem: Problem, shape: ShapeLike) -> float:
        """2 B Nq Nk H D (one matmul), halved when causal."""
        return attention_matmul_flops(problem, shape, 1)

    def min_bytes(self, problem: Problem, shape: ShapeLike) -> float:
        e, d = problem.dtype.itemsize, problem.head_dim
        q_rows = shape.batch * shape.heads_q * shape.seqlen_q
        return float(q_rows * d * e + shape.batch * shape.heads_kv * shape.seqlen_k * d * e
                     + 4 * q_rows)


LSE = RowLseFamily()
