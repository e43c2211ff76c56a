"""Attention dropout of one API call: the probability checked, the generator's seed and
offset taken from torch's default generator, and the kept mask for testing.

As in flash-attn, each call draws from torch's default generator of the tensors' device, so
``torch.manual_seed(s)`` makes a run reproducible and two calls draw different masks. On a
CUDA device (a Philox generator) the call takes the generator's seed and current offset and
advances the offset past the batch * heads_q streams it draws from (rounded up to a multiple
of 4, as torch's Philox offsets are). The CPU generator (the emulator's tensors) has no
offset: the call draws a 64-bit seed from it instead (``torch.randint(2**32, (2,))``, the
high word first), with offset 0. The mask itself is
defined in ``templates/dropout.cuh`` (and drawn on the host by ``families.fwd.dropout``).
"""

from __future__ import annotations

import math
import numbers

import torch

from flashtune.errors import InvalidInput
from flashtune.families.fwd.args import DropoutArgs
from flashtune.families.fwd.dropout import kept_tensor


def check_dropout_p(dropout_p: object) -> float:
    """``dropout_p`` as a float in [0, 1); InvalidInput otherwise."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise InvalidInput(f"dropout_p={dropout_p!r} must be a float in [0, 1): the "
                           "probability of dropping each attention probability (0.0: none)")
    p = float(dropout_p)
    if not (math.isfinite(p) and 0.0 <= p < 1.0):
        raise InvalidInput(f"dropout_p={dropout_p!r} is not in [0, 1); expected e.g. 0.1, or "
                           "0.0 for no dropout (1.0 would drop every element)")
    return p


def draw(device: torch.device, streams: int, p: float) -> DropoutArgs:
    """The seed and offset of one call on ``device`` that draws ``streams`` (batch *
    heads_q) streams of the mask, from torch's default generator of that device (advanced,
    see the module doc), and ``p``."""
    if device.type == "cuda":
        gen = torch.cuda.default_generators[device.index if device.index is not None
                                            else torch.cuda.current_device()]
        offset = int(gen.get_offset())
        gen.set_offset(offset + -(-streams // 4) * 4)
        return DropoutArgs(int(gen.initial_seed()) % 2**64, offset, p)
    words = torch.randint(2**32, (2,), dtype=torch.int64).tolist()
    return DropoutArgs(words[0] << 32 | words[1], 0, p)


def mask_of(dropout: DropoutArgs, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int,
            device: torch.device) -> torch.Tensor:
    """bool (batch, heads_q, seqlen_q, seqlen_k): the elements a call with ``dropout`` kept
    (drawn on the host with the kernels' definition; the kernels never store it)."""
    return kept_tensor(dropout.seed, dropout.offset, dropout.p, heads_q, seqlen_q, seqlen_k,
                       range(batch), device)
