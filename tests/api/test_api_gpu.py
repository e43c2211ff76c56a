# mypy: disable-error-code="no-untyped-call"
"""The cuda backend on a GPU: numerics against torch, launch on the current (non-default)
stream, CUDA graph capture and replay, torch.compile. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import TOL, check_outputs, qkv, rel_fro

import flashtune

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("dispatcher", "poisoned_outputs")]


def _cuda(batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_kv: int,
          head_dim: int, dtype: torch.dtype = torch.bfloat16
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype=dtype,
               device="cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 257, 257, 8, 2, 128), (1, 100, 1000, 4, 4, 64),
                                   (3, 333, 77, 6, 3, 96), (1, 64, 64, 2, 1, 256)])
def test_matches_float64_reference(shape: tuple[int, int, int, int, int, int], causal: bool,
                                   dtype: torch.dtype) -> None:
    q, k, v = _cuda(*shape, dtype=dtype)
    out, lse = flashtune.attention(q, k, v, causal=causal, return_lse=True)
    assert out.device == q.device and lse.device == q.device
    check_outputs(out, lse, q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_matches_torch_sdpa(causal: bool) -> None:
    q, k, v = (t.transpose(1, 2).contiguous() for t in _cuda(4, 1024, 1024, 16, 4, 128))
    out = flashtune.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=True)
    assert out.shape == q.shape and out.is_contiguous()
    assert rel_fro(out, ref) <= TOL[torch.bfloat16]


def test_launches_on_the_current_stream() -> None:
    """Inputs written on a busy side stream must be seen: a launch anywhere but the current
    stream would race with the delayed write and read zeros."""
    q_new, k, v = _cuda(2, 512, 512, 8, 8, 64)
    q = torch.zeros_like(q_new)
    flashtune.attention(q, k, v)  # compile and load outside the timed region
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # keep the side stream busy for a while
        q.copy_(q_new)
        out, lse = flashtune.attention(q, k, v, return_lse=True)
        done = torch.cuda.Event()
        done.record(side)
    assert not done.query()  # the work is queued behind the sleep: nothing synchronised
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    check_outputs(out, lse, q_new, k, v, causal=False)


def test_cuda_graph_capture_and_replay() -> None:
    q, k, v = _cuda(2, 300, 300, 8, 2, 128, dtype=torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, load) outside the capture
        flashtune.attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flashtune.attention(q, k, v, causal=True, return_lse=True)
    for _ in range(2):  # fresh inputs, copied into the captured buffers, then replayed
        q2, k2, v2 = _cuda(2, 300, 300, 8, 2, 128, dtype=torch.float16)
        q.copy_(q2)
        k.copy_(k2)
        v.copy_(v2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_outputs(out, lse, q2, k2, v2, causal=True)


def test_torch_compile_inductor() -> None:
    q, k, v = _cuda(2, 200, 200, 4, 4, 64)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = flashtune.attention(q * 0.5, k, v)
        assert isinstance(out, torch.Tensor)
        return out.float().relu()

    compiled = torch.compile(fn, fullgraph=True)
    assert torch.equal(compiled(q, k, v), fn(q, k, v))


def test_explain_names_this_gpu() -> None:
    q, k, v = _cuda(1, 128, 128, 2, 2, 64)
    decision = flashtune.explain(q, k, v)
    assert decision.device == torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    assert decision.arch == f"sm_{major}{minor}"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cc90_serves_the_sm90a_forward_unless_it_opts_out(head_dim: int,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """On a compute capability 9.0 GPU the public forward runs the sm_90a (wgmma) family (its
    kernel passes the first-use check) and matches float64; with FLASHTUNE_ARCH_SPECIFIC=0,
    the mma.sync forward."""
    from flashtune.runtime import first_use, plans

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90a forward serves compute capability 9.0 only")
    q, k, v = _cuda(2, 1000, 1000, 8, 2, head_dim)
    for opted_out, op in ((False, "fwd90aws"), (True, "fwd")):
        if opted_out:
            monkeypatch.setenv("FLASHTUNE_ARCH_SPECIFIC", "0")
        else:
            monkeypatch.delenv("FLASHTUNE_ARCH_SPECIFIC", raising=False)
        plans.clear_caches()
        for causal in (False, True):
            assert flashtune.explain(q, k, v, causal=causal).problem.op == op
            out, lse = flashtune.attention(q, k, v, causal=causal, return_lse=True)
            check_outputs(out, lse, q, k, v, causal)
        assert first_use.refused(torch.cuda.get_device_name()) is None
