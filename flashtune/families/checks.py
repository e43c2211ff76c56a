"""What the attention families' verifications share: the causal mask of their float64
references and the tolerances of an attention output O and its LSE.

The forward, the backward, decoding, the split combine and the row-wise LSE all compare an
output against a reference written from the definition; these are the parts that are the
same for all of them, so that a family checks O and LSE exactly as the forward does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashtune._lazy import lazy_module
from flashtune.codegen.spec import DType
from flashtune.families.base import Tolerance

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

#: O is rounded to the output type and P to the input type before P @ V: a few ulps.
O_TOLERANCE = {DType.FP16: Tolerance(4e-3, 4e-3), DType.BF16: Tolerance(2.5e-2, 2.5e-2)}
#: LSE is float32: an absolute error plus a float32-resolution share for large scores.
LSE_TOLERANCE = Tolerance(1e-3, 2e-6)


def o_and_lse_checks(dtype: DType, o: str = "o", lse: str = "lse", label: str = ""
                     ) -> list[tuple[str, str, Tolerance]]:
    """``compare_outputs`` checks of an attention output O and its LSE (by output name;
    ``label`` prefixes their names in messages)."""
    return [(f"{label}O", o, O_TOLERANCE[dtype]), (f"{label}LSE", lse, LSE_TOLERANCE)]


def causal_visible(seqlen_q: int, seqlen_k: int, device: torch.device | str = "cpu"
                   ) -> torch.Tensor:
    """(Nq, Nk) bool: query row i sees key j iff j <= i + Nk - Nq (the causal mask aligned
    to the bottom-right corner, as every kernel of flashtune applies it)."""
    rows = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    return torch.arange(seqlen_k, device=device)[None, :] <= rows
