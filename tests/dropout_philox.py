"""An independent, plain-Python Philox 4x32-10 and the dropout mask the kernels promise
(templates/dropout.cuh), for the tests: written from the published algorithm (Salmon et al.,
SC'11) and checked against Random123's known-answer vectors, never from flashtune's code.
"""

from __future__ import annotations

import struct

import torch

_MASK = 0xFFFFFFFF

#: Random123's kat_vectors for philox4x32 with 10 rounds: (counter, key, output).
KNOWN_ANSWERS = (
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((_MASK, _MASK, _MASK, _MASK), (_MASK, _MASK),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
)


def philox(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, ...]:
    """Philox 4x32 with 10 rounds: multipliers D2511F53 and CD9E8D57, Weyl key increments
    9E3779B9 and BB67AE85 between rounds."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_ in range(10):
        if round_:
            k0, k1 = (k0 + 0x9E3779B9) & _MASK, (k1 + 0xBB67AE85) & _MASK
        prod0, prod1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((prod1 >> 32) ^ c1 ^ k0, prod1 & _MASK,
                          (prod0 >> 32) ^ c3 ^ k1, prod0 & _MASK)
    return c0, c1, c2, c3


def float32(p: float) -> float:
    """``p`` rounded to float32 (what the kernels are passed)."""
    return float(struct.unpack("f", struct.pack("f", p))[0])


def mask(seed: int, offset: int, p: float, batches: range, heads_q: int, seqlen_q: int,
         seqlen_k: int) -> torch.Tensor:
    """bool (len(batches), heads_q, seqlen_q, seqlen_k), True where element (b, h, i, j) is
    kept: x >= floor(p 2^32) for x = word 2 ((i / 8) mod 2) + j mod 2 of Philox keyed by
    the seed's two 32-bit halves at counter (j / 2, 8 (i / 16) + i mod 8, the 64-bit
    offset + b heads_q + h)."""
    threshold = int(float32(p) * 2.0**32)
    key = (seed & _MASK, seed >> 32)
    out = torch.zeros(len(batches), heads_q, seqlen_q, seqlen_k, dtype=torch.bool)
    for bi, b in enumerate(batches):
        for h in range(heads_q):
            stream = offset + b * heads_q + h
            for i in range(seqlen_q):
                pair = (i // 16) * 8 + i % 8
                for j in range(0, seqlen_k, 2):
                    words = philox((j // 2, pair, stream & _MASK, stream >> 32), key)
                    for e in range(min(2, seqlen_k - j)):
                        out[bi, h, i, j + e] = words[2 * ((i // 8) % 2) + e] >= threshold
    return out


def call_seed(torch_seed: int) -> int:
    """The dropout seed a flashtune call on CPU tensors takes right after
    torch.manual_seed(torch_seed) (api/dropout.py's documented draw: two 32-bit words, high
    first)."""
    torch.manual_seed(torch_seed)
    high, low = torch.randint(2**32, (2,), dtype=torch.int64).tolist()
    return int(high) << 32 | int(low)
