"""The FlashAttention-2 forward family: O and the LSE of softmax(scale * Q K^T) V.

Each block owns block_m query rows of one (batch, head); K/V tiles of block_n rows stream
through shared memory in a cp.async pipeline of num_stages buffers; S = Q K^T and O += P V
on mma.sync m16n8k16; the online softmax stays in registers (templates/flash_fwd.cuh).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from flashtune._lazy import lazy_module
from flashtune.codegen.abi import EntryAbi
from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.dtypes import SAME_16BIT
from flashtune.codegen.features import mods_of
from flashtune.codegen.params import ParamSpace, Point, Value
from flashtune.codegen.render import TemplateValue
from flashtune.codegen.spec import WIDE_HEAD_DIMS, KernelConfig, Problem, Shape, ShapeLike
from flashtune.families.base import (
    Inputs,
    KernelFamily,
    LaunchPlan,
    Tensors,
    Verdict,
    attention_matmul_flops,
    compare_outputs,
    element_params,
    generator,
    random_rows,
    sm_count,
)
from flashtune.families.checks import o_and_lse_checks
from flashtune.families.fwd import args, defaults, knobs, space, variants
from flashtune.families.fwd.reference import attention_reference, varlen_reference
from flashtune.families.launch_args import persistent_grid

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


class ForwardFamily(KernelFamily):
    """The attention forward pass (``flashtune.attention``)."""

    op = "fwd"
    title = "attention forward (FlashAttention-2: O and LSE)"
    template = "flash_fwd.cu.jinja"
    dtypes = SAME_16BIT
    features = frozenset({"window", "softcap", "alibi", "varlen", "sinks", "dropout"})
    score_mods = True
    #: V's head dim may differ from Q/K's (templates: WithHeadDimV), and Q/K's may be one of
    #: spec.WIDE_HEAD_DIMS beside V's of at most 256 (Gemma 4's 512, DeepSeek's 576).
    split_head_dims = True
    max_head_dim = max(WIDE_HEAD_DIMS)
    abi: ClassVar[EntryAbi | None] = args.FWD_ABI

    def space(self, problem: Problem) -> ParamSpace:
        return space.SPACE

    def config(self, point: Point) -> KernelConfig:
        """The config of a point; knobs at their defaults are left out of it, so a default
        kernel's config (and key) carries no knob."""
        return KernelConfig.from_dict(knobs.without_defaults(point))

    def search_space(self, problem: Problem) -> list[KernelConfig]:
        """The forward space's configs from a cache (10^5 of them, the same for every
        problem); a subclass that declares another space enumerates its own."""
        if self.space(problem) is not space.SPACE:
            return super().search_space(problem)
        return list(space.legal_configs())

    def point(self, config: KernelConfig) -> dict[str, Value]:
        return {**config.to_dict(), **knobs.knob_values(config)}

    def rules(self, problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
        return space.static_check(problem, config, arch)

    def default_config(self, problem: Problem, arch: ArchSpec) -> KernelConfig:
        return defaults.default_config(problem, arch)

    def default_reason(self, problem: Problem, arch: ArchSpec) -> str:
        return defaults.default_reason(problem, arch)

    def template_params(self, problem: Problem, config: KernelConfig
                        ) -> dict[str, TemplateValue]:
        return {
            "head_dim": problem.head_dim,
            "head_dim_padded": problem.padded_head_dim,
            **element_params(problem),
            "causal": problem.causal,
            "block_m": config.block_m,
            "block_n": config.block_n,
            "num_warps": config.num_warps,
            "num_stages": config.num_stages,
            "smem_row_pad": space.SMEM_ROW_PAD,
            **knobs.knob_values(config),
            **variants.template_params(problem),
            **({"head_dim_v": problem.v_head_dim,
                "head_dim_v_padded": problem.padded_v_head_dim}
               if problem.split_head_dims else {}),
        }

    def smem_bytes(self, problem: Problem, config: KernelConfig) -> int:
        return space.smem_bytes(problem, config)

    def random_inputs(self, problem: Problem, shape: Shape, device: torch.device | str,
                      seed: int | None = None) -> Inputs:
        """Random q, k, v (packed, for varlen: ``variants.random_varlen``) and the values of
        the problem's features."""
        gen = generator(device, seed)
        scalars, extra = variants.random_values(problem, shape, gen, device)
        if problem.varlen:
            tensors, scalars["max_seqlen_q"] = variants.random_varlen(problem, shape, gen, device)
        else:
            tensors = {name: random_rows(problem, shape, n, heads, gen, device, dim)
                       for name, n, heads, dim in (
                           ("q", shape.seqlen_q, shape.heads_q, problem.head_dim),
                           ("k", shape.seqlen_k, shape.heads_kv, problem.head_dim),
                           ("v", shape.seqlen_k, shape.heads_kv, problem.v_head_dim))}
        return Inputs(tensors | extra, {"softmax_scale": problem.head_dim ** -0.5} | scalars)

    def empty_outputs(self, problem: Problem, shape: Shape, inputs: Inputs, *,
                      poison: bool) -> dict[str, torch.Tensor]:
        q = inputs.tensors["q"]
        o = q.new_empty(*q.shape[:-1], problem.v_head_dim)  # O has V's head dim
        rows = (1, shape.heads_q, q.shape[1]) if problem.varlen else (
            shape.batch, shape.heads_q, shape.seqlen_q)
        lse = torch.empty(rows, dtype=torch.float32, device=q.device)
        if poison:
            o.fill_(float("nan"))
            lse.fill_(float("nan"))
        return {"o": o, "lse": lse}

    def extra_values(self, config: KernelConfig) -> args.ExtraValues | None:
        """Inputs of the ABI's arguments beyond the forward's, made from q, k and v (None:
        none)."""
        return None

    def hot_packer(self, problem: Problem, config: KernelConfig) -> args.FwdPacker:
        """The forward op's packer of this family's kernel (``args.forward_packer``)."""
        assert self.abi is not None
        return args.forward_packer(self.abi, problem, config.block_m,
                                   self.extra_values(config))

    def launch_plan(self, problem: Problem, config: KernelConfig, shape: Shape,
                    inputs: Inputs, outputs: Tensors) -> LaunchPlan:
        """The hot path's packer on the inputs; a persistent kernel's grid is sized by the
        device's SMs."""
        t = inputs.tensors
        grid, packed = self.hot_packer(problem, config)(
            t["q"], t["k"], t["v"], outputs["o"], outputs["lse"],
            inputs.scalars["softmax_scale"], variants.VariantValues.of(inputs))
        return LaunchPlan(self.sized_grid(config, grid, t["q"].device), packed)

    @staticmethod
    def sized_grid(config: KernelConfig, grid: args.Grid, device: torch.device
                   ) -> args.Grid:
        """The launch grid of ``config``: ``grid`` (one block per query tile), or for a
        persistent kernel the device's SMs times its resident blocks (fewer in x)."""
        if knobs.knob(config, knobs.PERSISTENT):
            blocks_per_sm = max(args.PERSISTENT_BLOCKS_PER_SM,
                                int(knobs.knob(config, knobs.MINBLOCKS)))
            return persistent_grid(grid, sm_count(device), blocks_per_sm)
        return grid

    def reference(self, problem: Problem, inputs: Inputs) -> dict[str, torch.Tensor]:
        t = inputs.tensors
        values = variants.VariantValues.of(inputs).only(problem)
        mods = [mod for _, mod in mods_of(problem.features)]
        if values.varlen is not None:
            o, lse = varlen_reference(t["q"][0], t["k"][0], t["v"][0],
                                      values.varlen.cu_seqlens_q, values.varlen.cu_seqlens_k,
                                      problem.causal, inputs.scalars["softmax_scale"],
                                      window=values.window, softcap=values.softcap or None,
                                      alibi_slopes=values.alibi_slopes, mods=mods,
                                      mod_values=values.mods, sinks=values.sinks,
                                      dropout=values.dropout)
            return {"o": o[None], "lse": lse[None]}
        o, lse = attention_reference(t["q"], t["k"], t["v"], problem.causal,
                                     inputs.scalars["softmax_scale"], window=values.window,
                                     softcap=values.softcap or None,
                                     alibi_slopes=values.alibi_slopes, mods=mods,
                                     mod_values=values.mods, sinks=values.sinks,
                                     dropout=values.dropout)
        return {"o": o, "lse": lse}

    def compare(self, problem: Problem, shape: Shape, outputs: Tensors,
                reference: Tensors) -> Verdict:
        return compare_outputs(problem, shape, outputs, reference,
                               o_and_lse_checks(problem.dtypes.o))

    def flops(self, problem: Problem, shape: ShapeLike) -> float:
        """2 B Nq Nk H (D + Dv) (Q K^T over Q/K's head dim D, P V over V's Dv; 4 B Nq Nk H D
        when they are equal), halved when causal: the field's convention."""
        if not problem.split_head_dims:
            return attention_matmul_flops(problem, shape, 2)
        return attention_matmul_flops(problem, shape, 1) * (
            1 + problem.v_head_dim / problem.head_dim)

    def min_bytes(self, problem: Problem, shape: ShapeLike) -> float:
        """Q, K, V read once, O written once (the input type) and the float32 LSE (Q and
        K rows of Q/K's head dim, V and O rows of V's)."""
        e, d, dv = problem.dtype.itemsize, problem.head_dim, problem.v_head_dim
        q_rows = shape.batch * shape.heads_q * shape.seqlen_q
        kv_rows = shape.batch * shape.heads_kv * shape.seqlen_k
        return float(q_rows * (d + dv) * e + kv_rows * (d + dv) * e + 4 * q_rows)


FORWARD = ForwardFamily()
