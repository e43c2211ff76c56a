"""Attention dropout on the host: the kept-element mask the kernels draw, and the values
verification draws.

The mask is defined in ``templates/dropout.cuh`` (Philox 4x32-10 keyed by the seed, its
counter made of the element's key pair, row pair and the stream offset + batch * heads_q +
head); ``kept_mask`` computes the same definition with NumPy for the float64 references and
for ``flashtune.attention(..., return_dropout_mask=True)``. The kernels never store a mask,
so this is the only way to see one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashtune._lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    np = lazy_module("numpy", globals())
    torch = lazy_module("torch", globals())

#: Dropout probabilities verification draws from (flash-attn's tests use 0.17).
DROPOUT_PS = (0.1, 0.17, 0.5)

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_LOW = 0xFFFFFFFF


def philox4x32_10(counter: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
                  key: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Philox 4x32-10 (Random123's constants) of broadcastable uint32 counter words and a
    (key0, key1) key; the four output words as uint32 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    m0, m1, low, shift = (np.uint64(x) for x in (_M0, _M1, _LOW, 32))
    k0, k1 = key[0] & _LOW, key[1] & _LOW
    for round_ in range(10):
        if round_:
            k0, k1 = (k0 + _W0) & _LOW, (k1 + _W1) & _LOW
        p0, p1 = m0 * c0, m1 * c2
        c0, c1, c2, c3 = (((p1 >> shift) ^ c1 ^ np.uint64(k0)) & low, p1 & low,
                          ((p0 >> shift) ^ c3 ^ np.uint64(k1)) & low, p0 & low)
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def threshold(p: float) -> int:
    """The kernels' keep threshold floor(p 2^32) of ``p`` as a float32 (what they are
    passed): a 32-bit draw x is kept iff x >= it."""
    return int(float(np.float32(p)) * 2.0 ** 32)


def kept_mask(seed: int, offset: int, p: float, heads_q: int, seqlen_q: int, seqlen_k: int,
              batches: range) -> np.ndarray:
    """bool (len(batches), heads_q, seqlen_q, seqlen_k): True where the kernels keep the
    element (batch b of ``batches``, query head, row, key) of a call with ``seed``,
    ``offset`` and dropout probability ``p``."""
    b = np.array(list(batches), dtype=np.uint64)[:, None, None, None]
    h = np.arange(heads_q, dtype=np.uint64)[None, :, None, None]
    i = np.arange(seqlen_q, dtype=np.uint64)[None, None, :, None]
    j = np.arange(seqlen_k, dtype=np.uint64)[None, None, None, :]
    stream = (np.uint64(offset) + b * np.uint64(heads_q) + h) & np.uint64(2**64 - 1)
    pair = (i >> np.uint64(4)) * np.uint64(8) + (i & np.uint64(7))
    words = philox4x32_10((j >> np.uint64(1), pair, stream & np.uint64(_LOW),
                           stream >> np.uint64(32)), (seed & _LOW, seed >> 32))
    which = ((i >> np.uint64(3)) & np.uint64(1)) * np.uint64(2) + (j & np.uint64(1))
    shape = np.broadcast_shapes(*(w.shape for w in words), which.shape)
    stacked = np.stack([np.broadcast_to(w, shape) for w in words])
    drawn = np.take_along_axis(stacked, np.broadcast_to(which, shape)[None].astype(np.int64),
                               axis=0)[0]
    return np.asarray(drawn >= np.uint32(min(threshold(p), 2**32 - 1)))


def kept_tensor(seed: int, offset: int, p: float, heads_q: int, seqlen_q: int, seqlen_k: int,
                batches: range, device: torch.device | str = "cpu") -> torch.Tensor:
    """``kept_mask`` as a torch bool tensor on ``device``."""
    mask = kept_mask(seed, offset, p, heads_q, seqlen_q, seqlen_k, batches)
    return torch.from_numpy(np.ascontiguousarray(mask)).to(device)
