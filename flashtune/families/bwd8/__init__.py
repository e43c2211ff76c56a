"""The FP8 backward on mma.sync (sm_89 and later): dK, dV and the float32 dQ accumulator
from e4m3 or e5m2 Q, K and V (one format) with descale factors, and a 16-bit dO, as the FP8
forward (``families/fwd8``) takes its inputs; dK and dV in dO's 16-bit type.

The backward's kernel with ``fp8`` on (``templates/bwd_traits.cuh`` WithFp8Inputs): Q, K
and V rows are dequantised exactly (every e4m3 and e5m2 value is an fp16 and a bf16 value)
as they are loaded into the 16-bit shared tiles, and every product runs on them as in the
16-bit backward; the descale factors (float32 ``(batch, heads_kv)``; varlen: per sequence)
are applied in fp32: ``q_descale * k_descale`` to S (so P is that of the dequantised
inputs), ``v_descale`` to dP, ``q_descale`` to dK and ``k_descale`` to dQ. P and dS stay in
the 16-bit type: rounding either to FP8 (for an FP8 product) multiplies dV's, or dQ's and
dK's, error several times (``benchmarks/fp8_backward_error.py``, measured in float64: FP8
inputs with 16-bit P and dS stay within the 16-bit backward's error class). So the
gradients are those of the dequantised inputs with the 16-bit backward's roundings, and its
tolerances of dO's type apply against float64 autograd of those inputs; what FP8 saves is
the bytes of Q, K and V (half of the 16-bit kernel's).

The space, the static rules and the defaults are the 16-bit backward's of the same head dim
and dO type (same shared memory: the tiles are 16-bit), plus the FP8 forward's two rules (an
arch with FP8 mma, a head dim that is a multiple of 32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

from flashtune._lazy import lazy_module
from flashtune.codegen.abi import WITH_SCORE_MODS, Element, EntryAbi, tensor
from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.dtypes import FP8_INPUTS
from flashtune.codegen.render import TemplateValue
from flashtune.codegen.spec import KernelConfig, Problem, Shape, ShapeLike
from flashtune.errors import InvalidConfig
from flashtune.families.base import Inputs, LaunchPlan, Tensors, torch_dtype
from flashtune.families.bwd import BackwardFamily, args, space, with_stats
from flashtune.families.fwd import variants
from flashtune.families.fwd.args import feature_values
from flashtune.families.fwd8 import (
    DESCALES,
    FP8_ALIASES,
    Fp8ForwardFamily,
    dequantised,
    fp8_params,
    random_descales,
)

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

#: The main kernel's arguments with FP8 q, k, v: dK and dV take dO's 16-bit type, and the
#: descale factors (float32 (batch, heads_kv), contiguous) come last.
BWD8_ABI = EntryAbi("flash_bwd8", tuple(
    dataclasses.replace(a, element=Element.O) if a.name in ("dk", "dv") else a
    for a in args.MAIN_ABI.args if a.feature not in ("dropout", WITH_SCORE_MODS)) + tuple(
    tensor(name, Element.FLOAT, const=True, wrap=i == 0) for i, name in enumerate(DESCALES)))


def twin(problem: Problem) -> Problem:
    """The 16-bit backward problem of the same head dim, mask and features whose type is
    dO's: its space, rules, defaults and template parameters are this family's."""
    return Problem(problem.head_dim, problem.dtypes.o, causal=problem.causal, op="bwd",
                   features=problem.features)


class Fp8BackwardFamily(BackwardFamily):
    """The attention backward of FP8 inputs (dK, dV and the dQ accumulator)."""

    op = "bwd8"
    title = "FP8 attention backward (e4m3 or e5m2 Q, K, V with descale factors; mma.sync)"
    dtypes = FP8_INPUTS
    features = frozenset({"window", "softcap", "alibi", "varlen"})
    score_mods = False
    abi: ClassVar[EntryAbi | None] = BWD8_ABI
    abi_aliases: ClassVar[Mapping[Element, str]] = FP8_ALIASES

    def rules(self, problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
        why = Fp8ForwardFamily.refusal(problem, arch)
        return why or super().rules(twin(problem), config, arch)

    def default_config(self, problem: Problem, arch: ArchSpec) -> KernelConfig:
        why = Fp8ForwardFamily.refusal(problem, arch)
        if why is not None:
            raise InvalidConfig(f"no config runs {problem.key()} on {arch.name}: {why}")
        return super().default_config(twin(problem), arch)

    def default_reason(self, problem: Problem, arch: ArchSpec) -> str:
        return ("the 16-bit backward's default of the same head dim: "
                + super().default_reason(twin(problem), arch))

    def template_params(self, problem: Problem, config: KernelConfig
                        ) -> dict[str, TemplateValue]:
        return {**super().template_params(twin(problem), config), **fp8_params(problem)}

    def smem_bytes(self, problem: Problem, config: KernelConfig) -> int:
        return super().smem_bytes(twin(problem), config)

    def random_inputs(self, problem: Problem, shape: Shape, device: torch.device | str,
                      seed: int | None = None) -> Inputs:
        """The 16-bit backward's random inputs with q, k, v rounded to the FP8 format,
        descale factors drawn per (batch or sequence, KV head) (``fwd8.random_descales``),
        and the LSE and D of the dequantised inputs."""
        base = super().random_inputs(twin(problem), shape, device, seed)
        fp8 = torch_dtype(problem.dtypes.q)
        t = {**base.tensors, **{n: base.tensors[n].to(fp8) for n in ("q", "k", "v")},
             **random_descales(shape, device, seed)}
        stats = with_stats(twin(problem), Inputs(dequantised(t), base.scalars)).tensors
        return Inputs({**t, "lse": stats["lse"], "dsum": stats["dsum"]}, base.scalars)

    def empty_outputs(self, problem: Problem, shape: Shape, inputs: Inputs, *,
                      poison: bool) -> dict[str, torch.Tensor]:
        """The 16-bit backward's outputs with dK and dV in dO's type."""
        out = super().empty_outputs(problem, shape, inputs, poison=poison)
        grads = {n: torch.empty(out[n].shape, dtype=torch_dtype(problem.dtypes.o),
                                device=out[n].device) for n in ("dk", "dv")}
        if poison:
            for g in grads.values():
                g.fill_(float("nan"))
        return {**out, **grads}

    def launch_plan(self, problem: Problem, config: KernelConfig, shape: Shape,
                    inputs: Inputs, outputs: Tensors) -> LaunchPlan:
        t = inputs.tensors
        values = {"q": t["q"], "k": t["k"], "v": t["v"], "dout": t["do"], "lse": t["lse"],
                  "dsum": t["dsum"], "dk": outputs["dk"], "dv": outputs["dv"],
                  "dq_accum": outputs["dq_accum"],
                  "softmax_scale": inputs.scalars["softmax_scale"],
                  **feature_values(problem, variants.VariantValues.of(inputs)),
                  **{n: t[n] for n in DESCALES}}
        packed = BWD8_ABI.pack(values, problem.features)
        split = space.dq_mode(config) == space.DQ_SPLIT
        grid = args.main_grid(shape.seqlen_k, shape.heads_kv, shape.batch, config.block_n,
                              outputs["dq_accum"].shape[0] if split else None)
        return LaunchPlan(grid, packed)

    def reference(self, problem: Problem, inputs: Inputs) -> dict[str, torch.Tensor]:
        """The 16-bit backward's float64 reference of the dequantised inputs."""
        return super().reference(twin(problem),
                                 Inputs(dequantised(inputs.tensors), inputs.scalars))

    def min_bytes(self, problem: Problem, shape: ShapeLike) -> float:
        """Q, K, V read once (1 byte a value), dO read and dK, dV written once (dO's type),
        LSE and D read and the float32 dQ accumulator written once."""
        e, d = problem.dtypes.o.itemsize, problem.head_dim
        q_rows = shape.batch * shape.heads_q * shape.seqlen_q
        kv_rows = shape.batch * shape.heads_kv * shape.seqlen_k
        return float(q_rows * d * (1 + e) + kv_rows * d * (2 + 2 * e) + 8 * q_rows
                     + 4 * q_rows * d)


class DeterministicFp8BackwardFamily(Fp8BackwardFamily):
    """The FP8 backward of ``deterministic=True``: dQ in per-block slices only."""

    op = "bwd8det"
    title = "FP8 attention backward, deterministic (dQ slices summed in a fixed order)"
    deterministic = True


BACKWARD_FP8 = Fp8BackwardFamily()
BACKWARD_FP8_DETERMINISTIC = DeterministicFp8BackwardFamily()

__all__ = ["BACKWARD_FP8", "BACKWARD_FP8_DETERMINISTIC", "BWD8_ABI", "Fp8BackwardFamily"]
