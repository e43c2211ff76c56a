"""The MLA decoding family: absorbed multi-head latent attention (DeepSeek V2/V3, FlashMLA's
convention) over a (paged) latent cache, split-KV, written as float32 partial O and LSE per
split for the ``combine`` family (templates/mla_decode.cuh).

It serves ``Problem(op="mla", head_dim=64, ...)``: ``head_dim`` is the RoPE part of the
latent (64 for DeepSeek), whose first 512 values (the compressed KV, kv_lora_rank) are also
V: per token one latent row of 512 + head_dim values shared by every query head; queries are
(batch, seqlen_q, heads_q, 576), outputs 512 wide. A call's sizes beyond its Shape (page
size, per-sequence cache lengths, split count) are a decode ``DecodeCase`` without appended
rows; ``Shape.heads_kv`` is 1 and ``Shape.seqlen_k`` the cache capacity per sequence.

The latent cache is 16-bit like q (``mla_d64_bf16``), or FlashMLA's FP8 rows (``fp8``: 512
e4m3 values, 4 float32 scales, 64 bf16 RoPE values per token) beside bf16 queries and
outputs, the problem ``Problem(64, "bf16", kv_dtype="e4m3", op="mla")`` (key
``mla_d64_bf16-e4m3-bf16``), dequantised on chip into the bf16 tile the kernel reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

from flashtune._lazy import lazy_module
from flashtune.codegen.abi import OPERAND_ALIASES, Element, EntryAbi
from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.dtypes import SAME_16BIT, DType, Dtypes, Fp8Type
from flashtune.codegen.params import ParamSpace, Point, Value
from flashtune.codegen.render import TemplateValue
from flashtune.codegen.spec import KernelConfig, Problem, Shape, ShapeLike
from flashtune.errors import InvalidProblem
from flashtune.families.base import (
    Inputs,
    KernelFamily,
    LaunchPlan,
    Tensors,
    Verdict,
    compare_outputs,
    generator,
)
from flashtune.families.checks import o_and_lse_checks
from flashtune.families.decode import device_sms, nominal_splits
from flashtune.families.decode.inputs import DecodeCase, draw_case
from flashtune.families.decode.status import STATUS_WORDS, describe
from flashtune.families.mla import fp8, space
from flashtune.families.mla.args import MLA_ABI, mla_grid, pack_mla_args
from flashtune.families.mla.inputs import make_inputs, mla_reference

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

#: DeepSeek's RoPE part of the latent: the one head_dim the family serves.
ROPE_DIM = 64
#: Page sizes a generic verification draws from (None: an unpaged cache).
VERIFY_PAGE_SIZES: tuple[int | None, ...] = (None, 1, 3, 16, 64)
#: What a tuning bucket is timed on by default: (batch, query heads), one query row each
#: (DeepSeek's 16 heads per GPU under tensor parallelism, and all 128).
TUNING_BATCH_HEADS = ((1, 16), (16, 16), (64, 16), (16, 128))
#: Cached rows (sequences x length) a timed shape holds at most.
TUNING_TOKENS = 1 << 20
#: The cache length a tuning candidate is verified on (at most).
VERIFY_CACHE = 300
#: bf16 queries and outputs over FlashMLA's FP8 latent cache (its RoPE part is bf16).
FP8_CACHE = Dtypes(DType.BF16, Fp8Type.E4M3, DType.BF16)
#: The template's alias of the cache's element type (Element, or bytes of FP8 rows).
MLA_ALIASES: Mapping[Element, str] = {**OPERAND_ALIASES, Element.KV: "CacheElement"}


class MlaFamily(KernelFamily):
    """Split-KV absorbed-MLA decoding over a (paged) latent cache."""

    op = "mla"
    title = "MLA decoding: query heads x 576 against one shared latent cache (partial O, LSE)"
    template = "mla_decode.cu.jinja"
    dtypes = SAME_16BIT | {FP8_CACHE}
    abi: ClassVar[EntryAbi | None] = MLA_ABI
    abi_aliases: ClassVar[Mapping[Element, str]] = MLA_ALIASES
    default_head_dim: ClassVar[int] = ROPE_DIM

    def check_problem(self, problem: Problem) -> None:
        """Also: head_dim is the RoPE width, ROPE_DIM."""
        super().check_problem(problem)
        if problem.head_dim != ROPE_DIM:
            raise InvalidProblem(
                f"the 'mla' family takes head_dim={ROPE_DIM} (the RoPE part of a "
                f"{space.NOPE_DIM + ROPE_DIM}-wide latent), got head_dim={problem.head_dim}; "
                f"use Problem({ROPE_DIM}, dtype, op='mla') (on the command line: --op mla "
                f"--head-dim {ROPE_DIM})")

    def space(self, problem: Problem) -> ParamSpace:
        return space.SPACE

    def config(self, point: Point) -> KernelConfig:
        """The config of a point; splits 0 (the heuristic) is the config without the knob."""
        values = dict(point)
        if values.get(space.SPLITS) == 0:
            del values[space.SPLITS]
        return KernelConfig.from_dict(values)

    def point(self, config: KernelConfig) -> dict[str, Value]:
        return {**config.to_dict(), space.COL_WARPS: space.col_warps(config),
                space.SPLITS: space.config_splits(config)}

    def bind(self, problem: Problem, config: KernelConfig, inputs: Inputs) -> Inputs:
        """A config with a split count launches that many splits; without one the inputs'
        own (the heuristic's, when they were drawn) stay."""
        splits = space.config_splits(config)
        if splits <= 0 or splits == inputs.scalars["num_splits"]:
            return inputs
        return Inputs(inputs.tensors, {**inputs.scalars, "num_splits": splits})

    def tuning_shapes(self, problem: Problem, seqlen: int,
                      batch_heads: Sequence[tuple[int, int]], shape_class: str = ""
                      ) -> tuple[list[Shape], Shape]:
        """Caches of ``seqlen`` and 3/4 of it at each (batch, heads_q) pair (default
        TUNING_BATCH_HEADS; batches cut to TUNING_TOKENS cached rows), one query row;
        verified on two sequences of 16 heads x 2 query rows over a small cache."""
        shapes: list[Shape] = []
        for batch, heads in batch_heads or TUNING_BATCH_HEADS:
            for length in (seqlen, max(1, seqlen * 3 // 4)):
                shape = Shape(max(1, min(batch, TUNING_TOKENS // length)), heads, 1, 1, length)
                if shape not in shapes:
                    shapes.append(shape)
        return shapes, Shape(2, 16, 1, 2, min(seqlen, VERIFY_CACHE))

    def rules(self, problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
        return space.static_check(problem, config, arch)

    def default_config(self, problem: Problem, arch: ArchSpec) -> KernelConfig:
        return space.default_entry(problem, arch)[0]

    def default_reason(self, problem: Problem, arch: ArchSpec) -> str:
        return space.default_entry(problem, arch)[1]

    def threads(self, problem: Problem, config: KernelConfig) -> int:
        return space.threads(config)

    def compute_warps(self, problem: Problem, config: KernelConfig) -> int:
        return space.threads(config) // 32

    def template_params(self, problem: Problem, config: KernelConfig
                        ) -> dict[str, TemplateValue]:
        q = problem.dtypes.q
        return {"rope_dim": problem.head_dim, "element": q.element.cpp,
                "element_ptx": q.element.ptx, "fp8_cache": space.fp8_cache(problem),
                "causal": problem.causal, "block_m": config.block_m,
                "block_n": config.block_n, "row_warps": config.num_warps,
                "col_warps": space.col_warps(config), "num_stages": config.num_stages}

    def smem_bytes(self, problem: Problem, config: KernelConfig) -> int:
        return space.smem_bytes(problem, config)

    def random_inputs(self, problem: Problem, shape: Shape, device: torch.device | str,
                      seed: int | None = None, case: DecodeCase | None = None) -> Inputs:
        """Inputs of ``case``; without one, a case drawn from the same seed: a page size of
        VERIFY_PAGE_SIZES, per-sequence lengths (the first at the full capacity) and the
        heuristic split count for ``device``."""
        gen = generator(device, seed)
        if case is None:
            case = draw_case(shape, gen, page_sizes=VERIFY_PAGE_SIZES, append=False,
                             num_splits=nominal_splits(shape, device_sms(device)))
        return make_inputs(problem, shape, case, device, gen)

    def empty_outputs(self, problem: Problem, shape: Shape, inputs: Inputs, *,
                      poison: bool) -> dict[str, torch.Tensor]:
        """Partial O and LSE (NaN when poisoned) and a zeroed status."""
        q = inputs.tensors["q"]
        batch, seqlen_q, heads_q, _ = q.shape
        splits = int(inputs.scalars["num_splits"])
        o_part = torch.empty(splits, batch, heads_q, seqlen_q, space.NOPE_DIM,
                             dtype=torch.float32, device=q.device)
        lse_part = torch.empty(splits, batch, heads_q, seqlen_q, dtype=torch.float32,
                               device=q.device)
        if poison:
            o_part.fill_(float("nan"))
            lse_part.fill_(float("nan"))
        status = torch.zeros(STATUS_WORDS, dtype=torch.int32, device=q.device)
        return {"o_part": o_part, "lse_part": lse_part, "status": status}

    def launch_plan(self, problem: Problem, config: KernelConfig, shape: Shape,
                    inputs: Inputs, outputs: Tensors) -> LaunchPlan:
        t = inputs.tensors
        splits = int(inputs.scalars["num_splits"])
        args = pack_mla_args(t["q"], t["kv_cache"], t.get("block_table"), t["cache_seqlens"],
                             outputs["o_part"], outputs["lse_part"], outputs["status"],
                             num_splits=splits, softmax_scale=inputs.scalars["softmax_scale"],
                             trap_on_error=False)
        batch, seqlen_q, heads_q, _ = t["q"].shape
        return LaunchPlan(mla_grid(batch, heads_q, seqlen_q, config.block_m, splits), args)

    def reference(self, problem: Problem, inputs: Inputs) -> dict[str, torch.Tensor]:
        return mla_reference(inputs, problem.causal)

    def compare(self, problem: Problem, shape: Shape, outputs: Tensors,
                reference: Tensors) -> Verdict:
        status = [int(w) for w in outputs["status"].tolist()]
        if any(status):
            message = describe(status, seqlen_new=0, capacity=shape.seqlen_k, num_pages=None)
            return Verdict(False, float("inf"), float("inf"),
                           f"the kernel refused its inputs on {shape.key()}: {message}")
        return compare_outputs(problem, shape, outputs, reference,
                               o_and_lse_checks(problem.dtypes.o, "o_part", "lse_part",
                                                "partial "))

    def flops(self, problem: Problem, shape: ShapeLike) -> float:
        """2 B Nq Nk Hq (576 + 512) over the full cache capacity (S and P V)."""
        return (2.0 * shape.batch * shape.seqlen_q * shape.seqlen_k * shape.heads_q
                * (space.latent_dim(problem) + space.NOPE_DIM))

    def min_bytes(self, problem: Problem, shape: ShapeLike) -> float:
        """The latent cache read once per sequence (its 16-bit rows, or 656-byte FP8 rows),
        Q read, O (Q's type) and the float32 LSE written, at the full capacity."""
        e, width = problem.dtype.itemsize, space.latent_dim(problem)
        row = fp8.ROW_BYTES if space.fp8_cache(problem) else width * e
        q_rows = shape.batch * shape.heads_q * shape.seqlen_q
        return float(shape.batch * shape.seqlen_k * row + q_rows * width * e
                     + q_rows * (space.NOPE_DIM * e + 4))


MLA = MlaFamily()

__all__ = ["MLA", "ROPE_DIM", "MlaFamily"]
