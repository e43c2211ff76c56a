"""Tensor maps: the description of a TMA-loadable tensor that a kernel receives as a
``const __grid_constant__ CUtensorMap`` parameter (``templates/tma.cuh``).

A ``TensorMap`` holds the arguments of the driver's ``cuTensorMapEncodeTiled`` (tiled mode,
no interleave, element strides 1) and checks them by the driver's documented rules, so a bad
map fails here with the rule it breaks instead of as CUDA_ERROR_INVALID_VALUE. Launch plans
carry it as an ``ArgType.TMAP`` argument; each backend encodes it (``runtime.tma``): the CUDA
backend through the driver, the emulator into its own documented 128-byte record.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from flashtune.errors import InvalidInput

MAX_RANK = 5
MAX_BOX = 256


class TmaDType(IntEnum):
    """CUtensorMapDataType values (cuda.h) of the types flashtune loads."""

    UINT8 = 0
    UINT16 = 1
    UINT32 = 2
    INT32 = 3
    FLOAT16 = 6
    FLOAT32 = 7
    BFLOAT16 = 9

    @property
    def itemsize(self) -> int:
        return {0: 1, 1: 2, 2: 4, 3: 4, 6: 2, 7: 4, 9: 2}[int(self)]


class TmaSwizzle(IntEnum):
    """CUtensorMapSwizzle values (cuda.h); the span is the bytes of one swizzled row."""

    NONE = 0
    B32 = 1
    B64 = 2
    B128 = 3

    @property
    def span(self) -> int:
        return (0, 32, 64, 128)[int(self)]


class TmaOobFill(IntEnum):
    """CUtensorMapFloatOOBfill values (cuda.h): zeros, or NaN (floating-point types only)."""

    ZERO = 0
    NAN_REQUEST_ZERO_FMA = 1


@dataclass(frozen=True)
class TensorMap:
    """A tiled tensor map.

    address: global address of element (0, .., 0), 16-byte aligned.
    dims: elements per dim, innermost first (1..5 dims, each 1..2^32).
    strides: bytes between consecutive indices of dims 1.. (rank - 1 entries; the innermost
        dim is contiguous), multiples of 16 below 2^40.
    box: elements per dim of one load (1..256 each); the inner box dim times the element
        size is a multiple of 16 bytes and, with a swizzle, at most its span.
    """

    dtype: TmaDType
    address: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: TmaSwizzle = TmaSwizzle.NONE
    oob_fill: TmaOobFill = TmaOobFill.ZERO

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", TmaDType(self.dtype))
        object.__setattr__(self, "swizzle", TmaSwizzle(self.swizzle))
        object.__setattr__(self, "oob_fill", TmaOobFill(self.oob_fill))
        for name in ("dims", "strides", "box"):
            object.__setattr__(self, name, tuple(int(x) for x in getattr(self, name)))
        rank = len(self.dims)
        if not 1 <= rank <= MAX_RANK:
            raise InvalidInput(f"tensor map: {rank} dims; expected 1..{MAX_RANK}")
        if len(self.strides) != rank - 1 or len(self.box) != rank:
            raise InvalidInput(f"tensor map: {rank} dims need {rank - 1} strides and {rank} box "
                               f"dims; got {len(self.strides)} and {len(self.box)}")
        if self.address <= 0 or self.address % 16:
            raise InvalidInput(f"tensor map: global address {self.address:#x} must be non-null "
                               "and 16-byte aligned")
        for i, (dim, box) in enumerate(zip(self.dims, self.box, strict=True)):
            if not 1 <= dim <= 1 << 32:
                raise InvalidInput(f"tensor map: dim {i} is {dim}; expected 1..2^32")
            if not 1 <= box <= MAX_BOX:
                raise InvalidInput(f"tensor map: box dim {i} is {box}; expected 1..{MAX_BOX} "
                                   "(split larger tiles into several boxes)")
        for i, stride in enumerate(self.strides, start=1):
            if stride <= 0 or stride % 16 or stride >= 1 << 40:
                raise InvalidInput(f"tensor map: the stride of dim {i} is {stride} bytes; "
                                   "expected a positive multiple of 16 below 2^40")
        inner = self.box[0] * self.dtype.itemsize
        if inner % 16:
            raise InvalidInput(f"tensor map: the inner box dim is {inner} bytes ({self.box[0]} "
                               f"x {self.dtype.itemsize}); it must be a multiple of 16 bytes")
        if self.swizzle is not TmaSwizzle.NONE and inner > self.swizzle.span:
            raise InvalidInput(f"tensor map: the inner box dim is {inner} bytes, more than the "
                               f"{self.swizzle.span}-byte span of {self.swizzle.name} swizzle")
        if self.oob_fill is TmaOobFill.NAN_REQUEST_ZERO_FMA and self.dtype not in (
                TmaDType.FLOAT16, TmaDType.FLOAT32, TmaDType.BFLOAT16):
            raise InvalidInput(f"tensor map: NaN out-of-bounds fill needs a floating-point "
                               f"type, not {self.dtype.name}")

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def box_bytes(self) -> int:
        """Bytes one load delivers (and completes as transactions), out-of-bounds included."""
        n = self.dtype.itemsize
        for b in self.box:
            n *= b
        return n
