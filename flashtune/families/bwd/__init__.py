"""The FlashAttention-2 backward family: dK, dV and the float32 dQ accumulator.

Each block owns block_n keys of one kv head and steps over the query tiles (block_m rows,
of every query head of the group) that see them, recomputing P from the forward's LSE;
dK and dV stay in float32 registers, dQ is added to a float32 accumulator in global memory
(templates/flash_bwd.cuh). Two kernels surround it (families/bwd/rows.py): the preprocess
(D = rowsum(dO O), the accumulator zeroed) and the convert (the accumulator's slices summed
in a fixed order, scaled, rounded). ``bwd`` tunes the dQ mode too (float32 atomics or
per-block slices); ``bwddet`` serves ``deterministic=True`` and only has the slices.

Q/K head dims 512 and 576 (``spec.WIDE_HEAD_DIMS``, V's up to theirs) run in output column
chunks (the ``chunks`` knob of their space, ``space.WIDE_SPACE``): each block adds one
chunk of dK, dV and dQ's columns and recomputes S and dP over the full head dims; the grid's
y is the kv heads times the chunks.

Varlen: the forward's packed layout (``fwd.variants.random_varlen``: q, k, v, dO (1, total
rows, heads, dim), LSE and D (1, heads_q, total_q)); ``Shape`` then gives the number of
sequences and the longest query and key sequences, which size the main kernel's grid.

Declared score modifications (``codegen.score_mods``, traced ones included) are served
when each has its derivative (``ScoreMod.grad``): P is recomputed from the modified
scores, dS carries their slope, a block mask's column ranges skip query tiles, and the
optional ``dscore`` output receives the gradient by the modified score (the reduction of
captured tensors' gradients reads it).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

from flashtune._lazy import lazy_module
from flashtune.codegen.abi import EntryAbi
from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.dtypes import SAME_16BIT
from flashtune.codegen.features import mods_of
from flashtune.codegen.params import ParamSpace
from flashtune.codegen.render import TemplateValue
from flashtune.codegen.score_mods import ScoreMod
from flashtune.codegen.spec import WIDE_HEAD_DIMS, KernelConfig, Problem, Shape, ShapeLike
from flashtune.errors import FeatureNotSupported
from flashtune.families.base import (
    Inputs,
    KernelFamily,
    LaunchPlan,
    Tensors,
    Tolerance,
    Verdict,
    attention_matmul_flops,
    close_enough,
    element_params,
    generator,
    random_rows,
    sm_count,
)
from flashtune.families.bwd import args, defaults, space
from flashtune.families.bwd.reference import (
    BOUND_ULPS,
    backward_reference,
    softmax_stats,
    varlen_backward_reference,
    varlen_stats,
)
from flashtune.families.fwd import variants
from flashtune.families.fwd.args import feature_values

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


class BackwardFamily(KernelFamily):
    """The attention backward main kernel (``loss.backward()`` through flashtune.attention)."""

    op = "bwd"
    title = "attention backward (FlashAttention-2: dK, dV and the float32 dQ accumulator)"
    template = "flash_bwd.cu.jinja"
    dtypes = SAME_16BIT
    #: V's head dim may differ from Q/K's (templates: WithBwdHeadDimV).
    split_head_dims = True
    #: Q/K head dims 512 and 576 (spec.WIDE_HEAD_DIMS) with V's up to theirs, in output
    #: column chunks (templates: WithBwdColumnChunks; the ``chunks`` knob).
    max_head_dim = max(WIDE_HEAD_DIMS)
    features = frozenset({"window", "softcap", "alibi", "varlen", "dropout"})
    abi: ClassVar[EntryAbi | None] = args.MAIN_ABI
    score_mods = True
    #: True for the family whose every config is deterministic.
    deterministic = False

    def check_problem(self, problem: Problem) -> None:
        """The base checks, and FeatureNotSupported for a declared score modification
        without a derivative (its ``grad`` is empty)."""
        super().check_problem(problem)
        lacking = [name for name, mod in mods_of(problem.features) if not mod.grad]
        if lacking:
            raise FeatureNotSupported(
                f"the {self.op!r} kernel family needs the derivative of every score "
                f"modification; {lacking} declare none (ScoreMod.grad). A traced one has "
                "none when it uses an operation the backward cannot differentiate: trace it "
                "with codegen.trace and call score_slope() for the operation and line")

    def space(self, problem: Problem) -> ParamSpace:
        return space.space_of(problem, self.deterministic)

    def rules(self, problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
        return space.static_check(problem, config, arch, deterministic=self.deterministic)

    def default_config(self, problem: Problem, arch: ArchSpec) -> KernelConfig:
        return defaults.default_config(problem, arch, deterministic=self.deterministic)

    def default_reason(self, problem: Problem, arch: ArchSpec) -> str:
        return defaults.default_reason(problem, arch)

    def template_params(self, problem: Problem, config: KernelConfig
                        ) -> dict[str, TemplateValue]:
        return {
            "head_dim": problem.head_dim,
            **element_params(problem),
            "causal": problem.causal,
            "block_m": config.block_m,
            "block_n": config.block_n,
            "num_warps": config.num_warps,
            "num_stages": config.num_stages,
            "dq_split": space.dq_mode(config) == space.DQ_SPLIT,
            "smem_row_pad": space.SMEM_ROW_PAD,
            **variants.template_params(problem),
            **({"head_dim_v": problem.v_head_dim} if problem.split_head_dims else {}),
            **({"chunks": space.chunks(config)} if space.chunks(config) > 1 else {}),
        }

    def smem_bytes(self, problem: Problem, config: KernelConfig) -> int:
        return space.smem_bytes(problem, config)

    def random_inputs(self, problem: Problem, shape: Shape, device: torch.device | str,
                      seed: int | None = None) -> Inputs:
        """Random q, k, v, dO (packed, for varlen: ``variants.random_varlen``), the
        features' values (the forward's draws) and the forward's LSE and D of them."""
        gen = generator(device, seed)
        scale = problem.head_dim ** -0.5
        scalars, extra = variants.random_values(problem, shape, gen, device)
        if problem.varlen:
            tensors, scalars["max_seqlen_q"] = variants.random_varlen(problem, shape, gen,
                                                                      device)
            q = tensors["q"]
            tensors["do"] = random_rows(problem, dataclasses.replace(shape, batch=1),
                                        q.shape[1], shape.heads_q, gen, device,
                                        problem.v_head_dim)
        else:
            d, dv = problem.head_dim, problem.v_head_dim  # dO and V: V's head dim
            q, dout, k, v = (random_rows(problem, shape, n, h, gen, device, dim)
                             for n, h, dim in ((shape.seqlen_q, shape.heads_q, d),
                                               (shape.seqlen_q, shape.heads_q, dv),
                                               (shape.seqlen_k, shape.heads_kv, d),
                                               (shape.seqlen_k, shape.heads_kv, dv)))
            tensors = {"q": q, "k": k, "v": v, "do": dout}
        return with_stats(problem, Inputs({**tensors, **extra},
                                          {"softmax_scale": scale, **scalars}))

    def empty_outputs(self, problem: Problem, shape: Shape, inputs: Inputs, *,
                      poison: bool) -> dict[str, torch.Tensor]:
        """dK and dV (NaN when poisoned) and the dQ accumulator, zeroed as the kernel's
        contract requires, with as many slices as the split mode can use on this device
        (atomic configs add into slice 0 only); varlen: the packed layout's (one batch of
        the pack's rows)."""
        t = inputs.tensors
        slices = space.dq_slices(sm_count(t["q"].device), shape.batch, shape.heads_kv,
                                 shape.seqlen_k, min(space.BLOCK_N))
        dk, dv = torch.empty_like(t["k"]), torch.empty_like(t["v"])
        if poison:
            dk.fill_(float("nan"))
            dv.fill_(float("nan"))
        batch, rows = t["q"].shape[:2]
        accum = torch.zeros(slices, batch, shape.heads_q, rows, problem.head_dim,
                            dtype=torch.float32, device=t["q"].device)
        if not _mods(problem):
            return {"dk": dk, "dv": dv, "dq_accum": accum}
        # Zeroed as the contract requires: hidden elements are never written.
        dscore = torch.zeros(shape.batch, shape.heads_q, shape.seqlen_q, shape.seqlen_k,
                             dtype=torch.float32, device=t["q"].device)
        return {"dk": dk, "dv": dv, "dq_accum": accum, "dscore": dscore}

    def launch_plan(self, problem: Problem, config: KernelConfig, shape: Shape,
                    inputs: Inputs, outputs: Tensors) -> LaunchPlan:
        t = inputs.tensors
        values = {"q": t["q"], "k": t["k"], "v": t["v"], "dout": t["do"], "lse": t["lse"],
                  "dsum": t["dsum"], "dk": outputs["dk"], "dv": outputs["dv"],
                  "dq_accum": outputs["dq_accum"], **args.dscore_values(outputs.get("dscore")),
                  "softmax_scale": inputs.scalars["softmax_scale"],
                  **feature_values(problem, variants.VariantValues.of(inputs))}
        packed = args.MAIN_ABI.pack(values, problem.features)
        split = space.dq_mode(config) == space.DQ_SPLIT
        grid = args.main_grid(shape.seqlen_k, shape.heads_kv, shape.batch, config.block_n,
                              outputs["dq_accum"].shape[0] if split else None,
                              space.chunks(config))
        return LaunchPlan(grid, packed)

    def reference(self, problem: Problem, inputs: Inputs) -> dict[str, torch.Tensor]:
        t = inputs.tensors
        if problem.varlen:
            return varlen_backward_reference(t["q"], t["k"], t["v"], t["do"], t["lse"],
                                             t["dsum"], problem.causal,
                                             inputs.scalars["softmax_scale"],
                                             variants.VariantValues.of(inputs).only(problem))
        return backward_reference(t["q"], t["k"], t["v"], t["do"], t["lse"], t["dsum"],
                                  problem.causal, inputs.scalars["softmax_scale"],
                                  variants.VariantValues.of(inputs).only(problem),
                                  mods=_mods(problem))

    def compare(self, problem: Problem, shape: Shape, outputs: Tensors,
                reference: Tensors) -> Verdict:
        """dK, dV and the accumulator's sum over slices, each element within BOUND_ULPS
        unit roundoffs of the input type times the reference's sum of absolute terms, plus
        its subnormal floor; dK and dV, stored in the input type, also one unit roundoff of
        their value."""
        got = {"dk": outputs["dk"], "dv": outputs["dv"],
               "dq_accum": outputs["dq_accum"].to(torch.float64).sum(0)}
        if "dscore" in outputs:
            got["dscore"] = outputs["dscore"]
        u = problem.dtypes.o.element.unit_roundoff
        factor = BOUND_ULPS * u
        worst, main_rel, wrong = 0.0, 0.0, []
        for name, value in got.items():
            stored = Tolerance(1e-7, 0.0 if name in ("dq_accum", "dscore") else u)
            err, fro, msg = close_enough(name, value, reference[name], stored,
                                         factor * reference[f"{name}_bound"]
                                         + reference[f"{name}_floor"])
            worst = max(worst, err)
            main_rel = max(main_rel, fro)
            if msg:
                wrong.append(msg)
        if wrong:
            return Verdict(False, worst, main_rel,
                           f"wrong result on {shape.key()} ({problem.key()}): "
                           + "; ".join(wrong))
        return Verdict(True, worst, main_rel, "")

    def flops(self, problem: Problem, shape: ShapeLike) -> float:
        """2.5 x the forward's 4 B Nq Nk H D (five matmuls against two), halved when causal:
        the field's convention; with V's head dim Dv split from D, S, dQ and dK take D and
        dP and dV take Dv."""
        if not problem.split_head_dims:
            return attention_matmul_flops(problem, shape, 5)
        return attention_matmul_flops(problem, shape, 1) * (
            3 + 2 * problem.v_head_dim / problem.head_dim)

    def min_bytes(self, problem: Problem, shape: ShapeLike) -> float:
        """Q, dO, K, V read and dK, dV written once (the input type), LSE and D read and the
        float32 dQ accumulator written once."""
        e, d, dv = problem.dtype.itemsize, problem.head_dim, problem.v_head_dim
        q_rows = shape.batch * shape.heads_q * shape.seqlen_q
        kv_rows = shape.batch * shape.heads_kv * shape.seqlen_k
        return float(q_rows * (d + dv) * e + 2 * kv_rows * (d + dv) * e + 8 * q_rows
                     + 4 * q_rows * d)


def with_stats(problem: Problem, inputs: Inputs) -> Inputs:
    """``inputs`` with the forward's LSE and D of its q, k, v and dO (``lse``, ``dsum``),
    with the features' values."""
    values = variants.VariantValues.of(inputs).only(problem)
    t = inputs.tensors
    scale = inputs.scalars["softmax_scale"]
    if problem.varlen:
        lse, dsum = varlen_stats(t["q"], t["k"], t["v"], t["do"], problem.causal, scale,
                                 values=values)
    else:
        lse, dsum = softmax_stats(t["q"], t["k"], t["v"], t["do"], problem.causal, scale,
                                  values=values, mods=_mods(problem))
    return Inputs({**inputs.tensors, "lse": lse, "dsum": dsum}, inputs.scalars)


def _mods(problem: Problem) -> list[ScoreMod]:
    """The problem's declared score modifications, in key order."""
    return [mod for _, mod in mods_of(problem.features)]


class DeterministicBackwardFamily(BackwardFamily):
    """The backward main kernel of ``deterministic=True``: dQ in per-block slices only."""

    op = "bwddet"
    title = "attention backward, deterministic (dQ slices summed in a fixed order)"
    deterministic = True
    split_head_dims = True
    max_head_dim = max(WIDE_HEAD_DIMS)


BACKWARD = BackwardFamily()
BACKWARD_DETERMINISTIC = DeterministicBackwardFamily()
