"""The FP8 forward on mma.sync (sm_89 and later): e4m3 or e5m2 Q, K and V (one format) with
descale factors, a 16-bit O and the float32 LSE, as FlashAttention-3's FP8 forward takes
them (e5m2 beside it: the hardware has its mma too).

The forward's kernel with ``fp8`` on (``templates/fwd_fp8.cuh``): Q K^T on mma.sync m16n8k32
e4m3 or e5m2 (exact products, fp32 sums); V dequantised on chip (exactly: every e4m3 and
e5m2 value is an fp16 and a bf16 value) into the 16-bit V stage buffers, and P V in O's
16-bit type, P rounded to it as in the 16-bit forward; the descale factors (float32
``(batch, heads_kv)``) applied in fp32: ``q_descale * k_descale`` to the scores (so the LSE
is that of the dequantised inputs) and ``v_descale`` to O. The space, the static rules and
the defaults are the 16-bit forward's of the same head dim and O type (same tiles, same
shared memory: Q and K rows take half of the 16-bit rows), plus two rules: an arch with FP8
mma (sm_89 or later) and a head dim that is a multiple of 32 (one k32 step covers 32
values).

SASS (NVRTC 13): on sm_89 Q K^T is QMMA.16832.F32.E4M3.E4M3; sm_90's ptxas lowers the same
mma.sync to F2FP e4m3 unpacks and HMMA.16816 pairs, so there it saves bandwidth only.

Numerics: the output is the attention of the dequantised inputs ``q_descale * q`` etc. with
the 16-bit forward's roundings (P and O in the O type, fp32 accumulation), so the 16-bit
forward's tolerances of O's type apply against the float64 attention of those inputs, with
O's widened by P's rounding: one unit roundoff of O's type times P |V| (``O_BOUND``), which
the fixed tolerance covers only for V of unit scale (V here is up to 4x descale).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Protocol

from flashtune._lazy import lazy_module
from flashtune.codegen.abi import OPERAND_ALIASES, Element, EntryAbi, PackedArgs, tensor
from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.dtypes import FP8_INPUTS, Fp8Type
from flashtune.codegen.render import TemplateValue
from flashtune.codegen.spec import KernelConfig, Problem, Shape, ShapeLike
from flashtune.errors import InvalidConfig, InvalidInput
from flashtune.families.base import (
    Inputs,
    LaunchPlan,
    Tensors,
    Verdict,
    compare_outputs,
    generator,
    torch_dtype,
)
from flashtune.families.checks import o_and_lse_checks
from flashtune.families.fwd import ForwardFamily, variants
from flashtune.families.fwd.args import FWD_ABI, Grid, VariantLike, feature_values
from flashtune.families.registers import accumulator_registers

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

#: The descale factors' arguments, after the forward's: float32 (batch, heads_kv), contiguous.
DESCALES = ("q_descale", "k_descale", "v_descale")
#: The reference's per-element allowance for O beyond its fixed tolerance (``p_rounding``).
O_BOUND = "o_bound"
FWD8_ABI = FWD_ABI.extended("flash_fwd8", *(
    tensor(name, Element.FLOAT, const=True, wrap=i == 0) for i, name in enumerate(DESCALES)))
#: The template's types of the operands: FP8 bytes in, O's 16-bit Element out.
FP8_ALIASES: Mapping[Element, str] = {**OPERAND_ALIASES, Element.Q: "Fp8", Element.KV: "Fp8"}
#: The first arch with FP8 mma.sync (Ada, sm_89; Hopper's sm_90 has it too).
MIN_FP8_ARCH = (8, 9)
#: Descale factors of random inputs are drawn from [lo, hi): away from 1 so that a descale
#: applied twice, or to the wrong operand, shows.
RANDOM_DESCALE = (0.25, 4.0)


#: q_descale, k_descale, v_descale of one call.
Descales = tuple["torch.Tensor", ...]


class Fp8Packer(Protocol):
    """The FP8 forward's hot-path packer: ``FwdPacker``'s convention (it is one) with the
    call's descale factors, which it requires."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor, softmax_scale: float, variant: VariantLike | None = None,
                 descales: Descales | None = None) -> tuple[Grid, PackedArgs]: ...


#: The accumulator registers (O and S fragments) from which the FP8 kernel spills: measured
#: with NVRTC 13 on sm_90 (m128 n128 w4 at head dim 64, m64 n64 w2 at 128: 132 and 36
#: spill stores where the 16-bit kernel has at most 4).
MAX_ACCUMULATORS = 192
#: Defaults where the 16-bit forward's holds too many accumulators, in order.
FALLBACKS = (KernelConfig(64, 64, 4, 2), KernelConfig(64, 32, 4, 2), KernelConfig(64, 32, 4, 1))


def twin(problem: Problem) -> Problem:
    """The 16-bit forward problem of the same head dim and mask whose type is O's: its
    space, rules, defaults and template parameters are this family's."""
    return Problem(problem.head_dim, problem.dtypes.o, causal=problem.causal,
                   features=problem.features)


class Fp8ForwardFamily(ForwardFamily):
    """The attention forward with FP8 inputs (``flashtune.attention`` on float8_e4m3fn or
    float8_e5m2; Q, K and V of one format)."""

    op = "fwd8"
    title = "FP8 attention forward (e4m3 or e5m2 Q, K, V with descale factors; mma.sync)"
    dtypes = FP8_INPUTS
    #: The 16-bit forward's features whose hooks take the dequantised scores' scale
    #: (flash_fwd.cuh's qk_scale), varlen (descales per sequence) and sinks; dropout is
    #: not compiled with FP8.
    features = frozenset({"window", "softcap", "alibi", "varlen", "sinks"})
    score_mods = False
    abi: ClassVar[EntryAbi | None] = FWD8_ABI
    abi_aliases: ClassVar[Mapping[Element, str]] = FP8_ALIASES

    @staticmethod
    def refusal(problem: Problem, arch: ArchSpec) -> str | None:
        """Why no config of this family runs ``problem`` on ``arch``: an arch without FP8
        mma, or a head dim off the k32 step; None when some may."""
        if arch.compute_capability < MIN_FP8_ARCH:
            return (f"{arch.name} has no FP8 tensor cores (mma.sync e4m3/e5m2 needs sm_89 or "
                    f"later); compile for sm_89 or sm_90, or use bf16/fp16 inputs on "
                    f"{arch.name}")
        if problem.head_dim % 32:
            return (f"head_dim={problem.head_dim}: the FP8 forward takes head dims that are "
                    "multiples of 32 (one mma k step); pad q, k and v with zeros to "
                    f"{-(-problem.head_dim // 32) * 32}")
        return None

    def rules(self, problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
        why = self.refusal(problem, arch)
        if why is None and accumulator_registers(problem, config) >= MAX_ACCUMULATORS:
            why = (f"accumulators of {accumulator_registers(problem, config)} registers per "
                   f"thread: at {MAX_ACCUMULATORS} or more the FP8 kernel spills (the V "
                   "dequantisation and the FP8 fragments need more than the 16-bit kernel's "
                   "margin); use fewer rows per warp or a narrower key tile")
        return why or super().rules(twin(problem), config, arch)

    def default_config(self, problem: Problem, arch: ArchSpec) -> KernelConfig:
        """The 16-bit forward's default of the same head dim and O type where this family's
        rules pass it, else the first of ``FALLBACKS`` that they pass."""
        why = self.refusal(problem, arch)
        if why is not None:
            raise InvalidConfig(f"no config runs {problem.key()} on {arch.name}: {why}")
        for config in (super().default_config(twin(problem), arch), *FALLBACKS):
            if self.static_check(problem, config, arch) is None:
                return config
        raise InvalidConfig(f"no default config fits {problem.key()} on {arch.name}: the "
                            f"16-bit default and {[c.key() for c in FALLBACKS]} are ruled "
                            "out; tune this problem")

    def default_reason(self, problem: Problem, arch: ArchSpec) -> str:
        config = self.default_config(problem, arch)
        if config == super().default_config(twin(problem), arch):
            return ("the 16-bit forward's default of the same head dim: "
                    + super().default_reason(twin(problem), arch))
        return (f"{config.key()}: the first fallback under {MAX_ACCUMULATORS} accumulator "
                "registers (the 16-bit forward's default holds more)")

    def template_params(self, problem: Problem, config: KernelConfig
                        ) -> dict[str, TemplateValue]:
        return {**super().template_params(twin(problem), config), **fp8_params(problem)}

    def smem_bytes(self, problem: Problem, config: KernelConfig) -> int:
        return super().smem_bytes(twin(problem), config)

    def random_inputs(self, problem: Problem, shape: Shape, device: torch.device | str,
                      seed: int | None = None) -> Inputs:
        """The forward's random normal q, k, v rounded to the FP8 format, and descale factors
        drawn from ``RANDOM_DESCALE`` per (batch, KV head)."""
        inputs = super().random_inputs(problem, shape, device, seed)
        return Inputs({**inputs.tensors, **random_descales(shape, device, seed)},
                      inputs.scalars)

    def empty_outputs(self, problem: Problem, shape: Shape, inputs: Inputs, *,
                      poison: bool) -> dict[str, torch.Tensor]:
        out = super().empty_outputs(problem, shape, inputs, poison=poison)
        o = torch.empty(out["o"].shape, dtype=torch_dtype(problem.dtypes.o),
                        device=out["o"].device)
        if poison:
            o.fill_(float("nan"))
        return {**out, "o": o}

    def hot_packer(self, problem: Problem, config: KernelConfig) -> Fp8Packer:
        """The forward's calling convention plus the descale factors (required)."""
        pack = FWD8_ABI.packer(problem.features)
        names = FWD8_ABI.inputs(problem.features)
        block_m = config.block_m

        def fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                lse: torch.Tensor, softmax_scale: float, variant: VariantLike | None = None,
                descales: Descales | None = None) -> tuple[Grid, PackedArgs]:
            if descales is None:
                raise InvalidInput("the FP8 forward needs q_descale, k_descale and v_descale "
                                   "(float32 (batch, heads_kv))")
            values: dict[str, object] = {
                "q": q, "k": k, "v": v, "o": o, "lse": lse, "softmax_scale": softmax_scale,
                **feature_values(problem, variant), **dict(zip(DESCALES, descales, strict=True))}
            batch, seqlen_q, heads_q, _ = q.shape
            varlen = variant.varlen if variant is not None and problem.varlen else None
            if varlen is not None:
                batch, seqlen_q = varlen.batch, varlen.max_seqlen_q
            return ((-(-seqlen_q // block_m), heads_q, batch),
                    pack(*(values[n] for n in names)))
        return fp8

    def launch_plan(self, problem: Problem, config: KernelConfig, shape: Shape,
                    inputs: Inputs, outputs: Tensors) -> LaunchPlan:
        t = inputs.tensors
        grid, packed = self.hot_packer(problem, config)(
            t["q"], t["k"], t["v"], outputs["o"], outputs["lse"],
            inputs.scalars["softmax_scale"], variants.VariantValues.of(inputs),
            descales=tuple(t[n] for n in DESCALES))
        return LaunchPlan(self.sized_grid(config, grid, t["q"].device), packed)

    def reference(self, problem: Problem, inputs: Inputs) -> dict[str, torch.Tensor]:
        """The 16-bit forward's float64 reference (with the problem's features) of the
        dequantised inputs (``dequantised``), and ``O_BOUND``: what P's rounding may add to
        O's error beyond the 16-bit tolerance (``p_rounding``). V is up to 4x descale here,
        where the tolerance assumes V of unit scale."""
        values = dequantised(inputs.tensors)
        ref = super().reference(problem, Inputs(values, inputs.scalars))
        # P |V|: the attention of |V| (the same softmax weights, every feature included).
        weighted = super().reference(problem, Inputs({**values, "v": values["v"].abs()},
                                                     inputs.scalars))["o"]
        return {**ref, O_BOUND: self.p_rounding(problem, values, weighted)}

    def p_rounding(self, problem: Problem, values: Tensors,
                   weighted: torch.Tensor) -> torch.Tensor:
        """The error O may carry from P's rounding, per element, given the dequantised
        inputs ``values`` and ``weighted`` = P |V|: the kernel rounds P to O's type before
        P V (as the 16-bit forward does), one unit roundoff of each product."""
        return problem.dtypes.o.element.unit_roundoff * weighted

    def compare(self, problem: Problem, shape: Shape, outputs: Tensors,
                reference: Tensors) -> Verdict:
        """The 16-bit forward's comparison, O's tolerance widened by ``O_BOUND``."""
        return compare_outputs(problem, shape, outputs, reference,
                               o_and_lse_checks(problem.dtypes.o), bounds={"o": reference[O_BOUND]})

    def min_bytes(self, problem: Problem, shape: ShapeLike) -> float:
        """Q, K, V read once (1 byte a value), O written once (2 bytes) and the LSE."""
        d = problem.head_dim
        q_rows = shape.batch * shape.heads_q * shape.seqlen_q
        kv_rows = shape.batch * shape.heads_kv * shape.seqlen_k
        o_bytes = problem.dtypes.o.itemsize
        return float(q_rows * d * (1 + o_bytes) + 2 * kv_rows * d + 4 * q_rows)


def fp8_params(problem: Problem) -> dict[str, TemplateValue]:
    """The template switches of FP8 inputs: ``fp8``, and ``fp8_format`` for e5m2."""
    params: dict[str, TemplateValue] = {"fp8": True}
    if problem.dtypes.q == Fp8Type.E5M2:
        params["fp8_format"] = "e5m2"
    return params


def dequantised(t: Tensors) -> dict[str, torch.Tensor]:
    """``t`` with q, k and v in float64, each FP8 value times its (batch, KV head)'s descale
    factor (a query head takes its KV head's; varlen: sequence i's factors scale the packed
    rows ``cu_seqlens[i]:cu_seqlens[i + 1]``)."""
    heads_q, heads_kv = t["q"].shape[2], t["k"].shape[2]
    group = heads_q // heads_kv

    def rows(name: str, cu: str) -> torch.Tensor:
        scale = t[f"{name}_descale"].to(torch.float64)
        if name == "q":
            scale = scale.repeat_interleave(group, dim=1)
        if cu not in t:
            return scale[:, None, :, None]
        lengths = (t[cu][1:] - t[cu][:-1]).to(torch.int64)
        return scale.repeat_interleave(lengths, dim=0)[None, :, :, None]

    q = t["q"].to(torch.float64) * rows("q", "cu_seqlens_q")
    k, v = (t[name].to(torch.float64) * rows(name, "cu_seqlens_k") for name in ("k", "v"))
    return {**t, "q": q, "k": k, "v": v}


def random_descales(shape: Shape, device: torch.device | str, seed: int | None
                    ) -> dict[str, torch.Tensor]:
    """Descale factors drawn from ``RANDOM_DESCALE`` per (batch or sequence, KV head)."""
    gen = generator(device, None if seed is None else seed + 1)
    lo, hi = RANDOM_DESCALE
    return {name: lo + (hi - lo) * torch.rand(shape.batch, shape.heads_kv, generator=gen,
                                              device=device)
            for name in DESCALES}


FORWARD_FP8 = Fp8ForwardFamily()
