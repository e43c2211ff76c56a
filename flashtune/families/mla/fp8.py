"""FlashMLA's FP8 latent cache format: the row layout, quantisation of a 16-bit latent into
it, and the dequantisation the MLA kernel performs on chip (``templates/mla_fp8.cuh``).

Per token one row of ``ROW_BYTES`` = 656 bytes:

* bytes [0, 512): the latent's first 512 dims (also V) as e4m3 (``torch.float8_e4m3fn``);
* bytes [512, 528): 4 float32 scales, scale g for dims [128 g, 128 g + 128);
* bytes [528, 656): the 64 RoPE dims as bf16, not quantised.

A cache is such rows in a tensor of ``torch.float8_e4m3fn`` (FlashMLA's) or ``torch.uint8``
whose last dim is 656: (num_pages, page_size, 1, 656) paged or (batch, max_len, 1, 656).

Dequantisation (the kernel's order): dim d is ``e4m3(byte d)`` (exact in float32) times
``scale[d // 128]`` in float32 (round to nearest even), rounded to bf16 (round to nearest
even); the RoPE values are taken as they are. With a power-of-two scale (what
``quantize_latent`` writes) both roundings are exact, so the kernel sees exactly
``e4m3 x scale``; another scale is rounded twice, as stated.

Quantisation (``quantize_latent``, FlashMLA's UE8M0-style scales): per 128-dim group,
``scale`` is the smallest power of two with ``amax <= 448 x scale`` (1 for an all-zero
group), and each value is ``x / scale`` (exact) rounded to the nearest e4m3 (ties to even).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashtune._lazy import lazy_module
from flashtune.errors import InvalidInput

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

#: Dims quantised to e4m3 (the latent's first 512, also V).
NOPE = 512
#: Dims per float32 scale.
GROUP = 128
#: Scales per row.
SCALES = NOPE // GROUP
#: RoPE dims stored as bf16.
ROPE = 64
#: Byte offsets of the scales and the RoPE part, and the row's bytes.
SCALE_OFFSET = NOPE
ROPE_OFFSET = SCALE_OFFSET + 4 * SCALES
ROW_BYTES = ROPE_OFFSET + 2 * ROPE
#: The largest finite e4m3 value.
E4M3_MAX = 448.0


def is_fp8_cache(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds FP8 rows: a float8_e4m3fn or uint8 tensor (the layout is
    checked by the API)."""
    return cache.dtype in (torch.float8_e4m3fn, torch.uint8)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    if cache.dtype not in (torch.float8_e4m3fn, torch.uint8) or cache.shape[-1] != ROW_BYTES:
        raise InvalidInput(f"an FP8 latent cache is a torch.float8_e4m3fn or torch.uint8 tensor "
                           f"whose last dim is {ROW_BYTES} bytes, got {cache.dtype} "
                           f"{tuple(cache.shape)}")
    return cache.contiguous().view(torch.uint8)


def dequantize_latent(cache: torch.Tensor) -> torch.Tensor:
    """The bf16 latent (..., 576) of FP8 rows (..., 656), in the kernel's order (module
    docstring)."""
    raw = _bytes(cache)
    values = raw[..., :NOPE].view(torch.float8_e4m3fn).to(torch.float32)
    scales = raw[..., SCALE_OFFSET:ROPE_OFFSET].contiguous().view(torch.float32)
    nope = values * scales.repeat_interleave(GROUP, dim=-1)  # float32 products, RN
    rope = raw[..., ROPE_OFFSET:].contiguous().view(torch.bfloat16)
    return torch.cat((nope.to(torch.bfloat16), rope), dim=-1)


def power_of_two_scales(amax: torch.Tensor) -> torch.Tensor:
    """Per group, the smallest power of two ``s`` with ``amax <= 448 s`` (float32); 1 where
    amax is 0."""
    mantissa, exponent = torch.frexp(amax.to(torch.float64) / E4M3_MAX)
    # ratio = mantissa x 2^exponent with mantissa in [0.5, 1): a power of two iff 0.5.
    power = torch.where(mantissa == 0.5, exponent - 1, exponent)
    scale = torch.ldexp(torch.ones_like(mantissa), power)
    return torch.where(amax > 0, scale, torch.ones_like(scale)).to(torch.float32)


def quantize_latent(latent: torch.Tensor) -> torch.Tensor:
    """FP8 rows (..., 656) as ``torch.float8_e4m3fn`` (FlashMLA's cache dtype) of a bf16
    latent (..., 576) (module docstring). InvalidInput for another width or dtype, or a
    non-finite value."""
    if not isinstance(latent, torch.Tensor) or latent.dtype != torch.bfloat16:
        raise InvalidInput(f"latent must be a torch.bfloat16 tensor (the format stores its "
                           f"RoPE dims as bf16), got {getattr(latent, 'dtype', type(latent))}")
    if latent.dim() < 1 or latent.shape[-1] != NOPE + ROPE:
        raise InvalidInput(f"latent has shape {tuple(latent.shape)}; expected its last dim "
                           f"{NOPE + ROPE} ({NOPE} quantised dims + {ROPE} RoPE dims)")
    if not bool(torch.isfinite(latent).all()):
        raise InvalidInput("latent holds a non-finite value; e4m3 with a float32 scale "
                           "stores finite values only")
    x = latent.to(torch.float32)
    groups = x[..., :NOPE].reshape(*x.shape[:-1], SCALES, GROUP)
    scales = power_of_two_scales(groups.abs().amax(dim=-1))
    # x / scale is exact (a power of two) and at most 448: the cast rounds to nearest even.
    codes = (groups / scales[..., None]).flatten(-2).to(torch.float8_e4m3fn)
    rope = latent[..., NOPE:].contiguous()
    row = torch.cat((codes.view(torch.uint8), scales.contiguous().view(torch.uint8),
                     rope.view(torch.uint8)), dim=-1)
    return row.view(torch.float8_e4m3fn)
