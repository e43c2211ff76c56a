"""Encoding tensor maps (``codegen.tensormap.TensorMap``) for the backend that launches them.

* ``encode_emulator``: the emulator's 128-byte record (``ftemu_tensor_map`` in the emulator's
  abi.h), which its TMA model decodes; the layout is flashtune's own and documented there.
* ``encode_driver``: the driver's opaque ``CUtensorMap`` from ``cuTensorMapEncodeTiled``,
  called through ctypes on ``libcuda.so.1`` (so only where a CUDA driver is installed), with
  the enum values of cuda.h (tiled mode: interleave NONE, element strides 1, L2 promotion
  128B).

Both return 128 bytes; the backends place them in a 64-byte-aligned parameter.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
from functools import cache

from flashtune.codegen.tensormap import MAX_RANK, TensorMap
from flashtune.errors import DeviceError

TENSOR_MAP_BYTES = 128
#: First word of an emulator tensor map ("tnsormap" little-endian; FTEMU_TMAP_MAGIC).
EMULATOR_MAGIC = 0x70616D726F736E74
#: ftemu_tensor_map: magic, address, dims[5], strides[4] (u64); box[5] (u32); rank,
#: element bytes, swizzle, OOB fill, element strides[5], data type (u8); 10 reserved bytes.
_EMULATOR_LAYOUT = struct.Struct("<QQ5Q4Q5I4B5BB10x")
assert _EMULATOR_LAYOUT.size == TENSOR_MAP_BYTES

#: cuda.h: CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B.
_INTERLEAVE_NONE = 0
_L2_PROMOTION_128B = 2


def _padded(values: tuple[int, ...], n: int) -> list[int]:
    return list(values) + [0] * (n - len(values))


def encode_emulator(tmap: TensorMap) -> bytes:
    """The emulator's 128-byte record of ``tmap``."""
    return _EMULATOR_LAYOUT.pack(
        EMULATOR_MAGIC, tmap.address, *_padded(tmap.dims, MAX_RANK),
        *_padded(tmap.strides, MAX_RANK - 1), *_padded(tmap.box, MAX_RANK), tmap.rank,
        tmap.dtype.itemsize, int(tmap.swizzle), int(tmap.oob_fill),
        *_padded((1,) * tmap.rank, MAX_RANK), int(tmap.dtype))


@cache
def _encode_tiled() -> Callable[..., int]:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
    except (OSError, AttributeError) as exc:
        raise DeviceError(f"cannot encode a TMA tensor map: the CUDA driver library "
                          f"(libcuda.so.1, with cuTensorMapEncodeTiled: CUDA 12+) is not "
                          f"available ({exc})") from None
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p, ctypes.POINTER(u64),
                   ctypes.POINTER(u64), ctypes.POINTER(u32), ctypes.POINTER(u32), ctypes.c_int,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int]
    encode: Callable[..., int] = fn
    return encode


def aligned_buffer(data: bytes, align: int = 64) -> ctypes.Array[ctypes.c_uint64]:
    """``data`` (128 bytes) in a ctypes array of 16 uint64 at an ``align``-byte boundary (it
    keeps its backing storage alive)."""
    raw = ctypes.create_string_buffer(len(data) + align)
    start = -ctypes.addressof(raw) % align
    out = (ctypes.c_uint64 * (len(data) // 8)).from_buffer(raw, start)
    ctypes.memmove(ctypes.addressof(out), data, len(data))
    return out


def encode_driver(tmap: TensorMap) -> bytes:
    """The driver's ``CUtensorMap`` of ``tmap`` (needs the CUDA driver; DeviceError when the
    driver is missing or refuses the map, with its error code)."""
    fn = _encode_tiled()
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    rank = tmap.rank
    out = aligned_buffer(bytes(TENSOR_MAP_BYTES))
    dims = (u64 * rank)(*tmap.dims)
    strides = (u64 * max(1, rank - 1))(*tmap.strides)
    box = (u32 * rank)(*tmap.box)
    element_strides = (u32 * rank)(*([1] * rank))
    status = fn(ctypes.addressof(out), int(tmap.dtype), rank, tmap.address, dims, strides, box,
                element_strides, _INTERLEAVE_NONE, int(tmap.swizzle), _L2_PROMOTION_128B,
                int(tmap.oob_fill))
    if status != 0:
        raise DeviceError(f"cuTensorMapEncodeTiled refused the tensor map {tmap} (CUresult "
                          f"{status})")
    return bytes(out)
