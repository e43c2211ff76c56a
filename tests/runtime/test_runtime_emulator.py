"""The generated forward kernel, run by the CPU emulator through the public API, against the
float64 reference: shapes that are not multiples of the tiles, GQA, both masks (including
rows that see no key), both dtypes, torch's SDPA layout, torch.compile.

Each problem below builds one kernel in the emulator (the slow part, cached on disk), so the
shapes of a problem share one build.
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import check_outputs, qkv

import flashtune

pytestmark = [pytest.mark.emulator, pytest.mark.usefixtures("dispatcher", "poisoned_outputs")]

# (dtype, causal, head_dim) -> shapes (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
PROBLEMS = {
    (torch.float16, True, 40): [(1, 70, 70, 2, 1), (2, 19, 85, 2, 2), (1, 90, 30, 1, 1)],
    (torch.bfloat16, False, 64): [(1, 65, 33, 4, 2), (2, 7, 129, 1, 1)],
}


@pytest.mark.parametrize("problem", list(PROBLEMS), ids=lambda p: f"{p[0]}-causal{p[1]}-d{p[2]}")
def test_emulated_kernel_matches_reference(problem: tuple[torch.dtype, bool, int]) -> None:
    dtype, causal, head_dim = problem
    for batch, seqlen_q, seqlen_k, heads_q, heads_kv in PROBLEMS[problem]:
        q, k, v = qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype=dtype)
        out, lse = flashtune.attention(q, k, v, causal=causal, return_lse=True,
                                       backend="emulator")
        check_outputs(out, lse, q, k, v, causal)


def test_sdpa_layout_and_compile_on_the_emulator() -> None:
    import torch._dynamo

    q, k, v = (t.transpose(1, 2).contiguous()
               for t in qkv(2, 50, 50, 4, 2, 64, dtype=torch.bfloat16))
    out = flashtune.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend="emulator")
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), enable_gqa=True)
    assert out.shape == q.shape and out.is_contiguous()
    error = (out.double() - ref).norm() / ref.norm()
    assert error <= 1e-2

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flashtune.scaled_dot_product_attention(q, k, v, enable_gqa=True,
                                                      backend="emulator") + 1

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(compiled, out + 1)
