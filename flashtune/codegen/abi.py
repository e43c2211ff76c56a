"""The launch ABI of generated kernels: how each kernel parameter is passed.

A family's launch plan packs its arguments as (ArgType, value) pairs in the kernel's
parameter order; every backend converts them the same way (a 64-bit pointer, a 32-bit or
64-bit integer, a 32-bit float), except a tensor map (``TMAP``, a ``TensorMap``), which each
backend encodes its own way (``runtime.tma``).
"""

from __future__ import annotations

from enum import Enum

from flashtune.codegen.tensormap import TensorMap


class ArgType(str, Enum):
    PTR = "ptr"
    I32 = "i32"
    I64 = "i64"
    F32 = "f32"
    TMAP = "tmap"


#: The value of one packed argument.
ArgValue = int | float | TensorMap

#: A packed argument list: (type, value) in the kernel's parameter order.
PackedArgs = tuple[tuple[ArgType, ArgValue], ...]
