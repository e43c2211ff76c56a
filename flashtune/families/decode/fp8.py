"""Split-KV decoding over an e4m3 KV cache (``Problem(op="decode8", ...)``, element types
``bf16-e4m3-bf16`` or ``fp16-e4m3-fp16``: q, the cache, O), with FlashAttention-3's descale
factors ``k_descale``, ``v_descale`` (float32 ``(batch, heads_kv)``, as its
``flash_attn_with_kvcache``): the cache's key j of (batch b, KV head h) is
``k_descale[b, h] * k_cache[..]``.

The decode kernel with ``fp8_cache`` on (``templates/decode_fp8.cuh``): cache rows are
dequantised exactly into the 16-bit shared tiles (every e4m3 value is an fp16 and a bf16
value), so Q K^T and P V are the 16-bit kernel's; the K descale joins the softmax scale and
the V descale multiplies O in fp32. New rows ``k``, ``v`` (q's 16-bit type) are quantised in
the kernel as ``e4m3(x / descale)`` (round to nearest even, saturating at +-448: torch's
``(x.float() / descale).clamp(-448, 448).to(torch.float8_e4m3fn)``), appended, and attended
to as appended. The space, rules, defaults and shared memory are the 16-bit decode kernel's of
q's type (the tiles are the same); the cvt instructions of the conversions need sm_89.

The combine is the 16-bit ``combine`` family's (float32 partials in, O in q's type).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

from flashtune._lazy import lazy_module
from flashtune.codegen.abi import OPERAND_ALIASES, Element, EntryAbi
from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.dtypes import DType, Dtypes, Fp8Type
from flashtune.codegen.render import TemplateValue
from flashtune.codegen.spec import KernelConfig, Problem, Shape, ShapeLike
from flashtune.errors import InvalidConfig
from flashtune.families.base import Inputs, Tensors, Verdict, generator
from flashtune.families.decode import O_BOUND, DecodeCase, DecodeFamily
from flashtune.families.decode.args import CACHE_DESCALES, DECODE8_ABI
from flashtune.families.decode.reference import expected_caches
from flashtune.families.fwd8 import MIN_FP8_ARCH, RANDOM_DESCALE

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

#: q and O of one 16-bit type beside an e4m3 K/V cache.
E4M3_CACHE: frozenset[Dtypes] = frozenset(Dtypes(d, Fp8Type.E4M3, d) for d in DType)
#: The largest finite e4m3 value: what a new row's x / descale saturates to.
E4M3_MAX = 448.0
_CACHES = ("k_cache", "v_cache")


def twin(problem: Problem) -> Problem:
    """The 16-bit decode problem of q's type with the same head dim, mask and features: its
    space, rules, defaults, shared memory and template parameters are this family's."""
    return replace(problem, op="decode", kv_dtype=problem.dtypes.o)


def quantise_e4m3(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """``x / descale`` (float32 division) as e4m3, saturating at +-E4M3_MAX: what the kernel
    appends for a new row ``x``. ``descale`` broadcasts against ``x``."""
    return (x.to(torch.float32) / descale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _per_head(descale: torch.Tensor) -> torch.Tensor:
    """A (batch, heads_kv) factor broadcast over a (batch, rows, heads_kv, dim) tensor."""
    return descale[:, None, :, None]


def dequantised(inputs: Inputs) -> Inputs:
    """``inputs`` as the 16-bit reference reads them, in float64: the caches as drawn (their
    e4m3 values, exactly; the reference multiplies a sequence's rows by its own descale
    factors, ``reference.sequence_keys``) and the new rows as the kernel quantises them
    (``quantise_e4m3``), dequantised."""
    t = dict(inputs.tensors)
    out = dict(t)
    for name in ("k", "v"):
        out[f"{name}_cache_before"] = t[f"{name}_cache_before"].to(torch.float64)
        if f"{name}_new" in t:
            scale = _per_head(t[f"{name}_descale"])
            out[f"{name}_new"] = (quantise_e4m3(t[f"{name}_new"], scale).to(torch.float64)
                                  * scale.to(torch.float64))
    return Inputs(out, inputs.scalars)


def expected_e4m3_caches(inputs: Inputs) -> dict[str, torch.Tensor]:
    """The caches after the call: as drawn, with the quantised new rows appended."""
    t = dict(inputs.tensors)
    quantised = {f"{n}_new": quantise_e4m3(t[f"{n}_new"], _per_head(t[f"{n}_descale"]))
                 for n in ("k", "v") if f"{n}_new" in t}
    return expected_caches(Inputs({**t, **quantised}, inputs.scalars))


class Fp8CacheDecodeFamily(DecodeFamily):
    """Split-KV partial attention over an e4m3 (paged) KV cache with descale factors."""

    op = "decode8"
    title = ("split-KV decoding over an e4m3 KV cache (descale factors per (batch, KV head); "
             "new rows quantised in the kernel)")
    dtypes = E4M3_CACHE
    abi: ClassVar[EntryAbi | None] = DECODE8_ABI
    abi_aliases: ClassVar[Mapping[Element, str]] = {**OPERAND_ALIASES, Element.KV: "Cache"}

    @staticmethod
    def refusal(arch: ArchSpec) -> str | None:
        """Why no config runs on ``arch`` (no e4m3 conversions before sm_89), or None."""
        if arch.compute_capability < MIN_FP8_ARCH:
            return (f"{arch.name} has no e4m3 conversions (cvt e4m3x2 needs sm_89 or later); "
                    f"compile for sm_89 or sm_90, or keep a bf16/fp16 cache on {arch.name}")
        return None

    def rules(self, problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
        return self.refusal(arch) or super().rules(twin(problem), config, arch)

    def default_config(self, problem: Problem, arch: ArchSpec) -> KernelConfig:
        why = self.refusal(arch)
        if why is not None:
            raise InvalidConfig(f"no config runs {problem.key()} on {arch.name}: {why}")
        return super().default_config(twin(problem), arch)

    def default_reason(self, problem: Problem, arch: ArchSpec) -> str:
        return ("the 16-bit decode kernel's default (the same tiles): "
                + super().default_reason(twin(problem), arch))

    def template_params(self, problem: Problem, config: KernelConfig
                        ) -> dict[str, TemplateValue]:
        return {**super().template_params(twin(problem), config), "fp8_cache": True}

    def smem_bytes(self, problem: Problem, config: KernelConfig) -> int:
        return super().smem_bytes(twin(problem), config)

    def random_inputs(self, problem: Problem, shape: Shape, device: torch.device | str,
                      seed: int | None = None, case: DecodeCase | None = None) -> Inputs:
        """The 16-bit decode kernel's inputs (q's type) with the caches rounded to e4m3
        (unused rows stay NaN) and descale factors drawn from ``RANDOM_DESCALE`` per
        (batch, KV head); the new rows stay 16-bit."""
        inputs = super().random_inputs(twin(problem), shape, device, seed, case)
        t = dict(inputs.tensors)
        for name in _CACHES:
            t[name] = t[name].to(torch.float32).to(torch.float8_e4m3fn)
            t[f"{name}_before"] = t[name].clone()
        gen = generator(device, None if seed is None else seed + 1)
        lo, hi = RANDOM_DESCALE
        for name in CACHE_DESCALES:
            t[name] = lo + (hi - lo) * torch.rand(shape.batch, shape.heads_kv, generator=gen,
                                                  device=device)
        return Inputs(t, inputs.scalars)

    def cache_descales(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs.tensors["k_descale"], inputs.tensors["v_descale"]

    def reference(self, problem: Problem, inputs: Inputs) -> dict[str, torch.Tensor]:
        """The 16-bit kernel's float64 reference of the dequantised caches and quantised new
        rows (``dequantised``), the e4m3 caches with those rows appended, and partial O's
        rounding bound (``O_BOUND``): P's rounding to q's type times P |V|.

        Why the bound: V is ``descale * e4m3`` (up to 448 * 4, far from the unit scale the
        16-bit tolerance assumes), and the kernel rounds P to q's type before P V, so each
        product carries a relative error of up to one unit roundoff; where V's values cancel,
        that error is large beside |O|. P |V| is the partial attention of |V| (the same
        softmax weights per split)."""
        values = dequantised(inputs)
        ref = super().reference(problem, values)
        t = dict(values.tensors)
        for name in ("v_cache_before", "v_new"):
            if name in t:
                t[name] = t[name].abs()
        weighted = super().reference(problem, Inputs(t, values.scalars))["o_part"]
        unit = problem.dtypes.q.element.unit_roundoff
        return {**ref, **expected_e4m3_caches(inputs), O_BOUND: unit * weighted}

    def compare(self, problem: Problem, shape: Shape, outputs: Tensors,
                reference: Tensors) -> Verdict:
        """The 16-bit kernel's comparison, the caches bit for bit (as bytes)."""
        def as_bytes(t: Tensors) -> dict[str, torch.Tensor]:
            return {**t, **{n: t[n].view(torch.uint8) for n in _CACHES}}
        return super().compare(problem, shape, as_bytes(outputs), as_bytes(reference))

    def min_bytes(self, problem: Problem, shape: ShapeLike) -> float:
        """The 16-bit kernel's bytes with each K and V value one byte (Q and O stay 16-bit),
        plus the two float32 descale factors of each (batch, KV head)."""
        e = problem.dtypes.o.itemsize
        full = super().min_bytes(problem, shape)
        q_rows = shape.batch * shape.heads_q * shape.seqlen_q
        kv_bytes = full - q_rows * problem.head_dim * e - q_rows * (e * problem.head_dim + 4)
        return full - kv_bytes * (e - 1) / e + 8.0 * shape.batch * shape.heads_kv


DECODE_FP8 = Fp8CacheDecodeFamily()

__all__ = ["DECODE_FP8", "E4M3_CACHE", "Fp8CacheDecodeFamily", "dequantised",
           "expected_e4m3_caches", "quantise_e4m3"]
