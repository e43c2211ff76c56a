"""The public API end to end on CPU, through the reference backend: argument plumbing and
layouts, output poisoning, memoisation of warm calls, gradients, the custom op and
torch.compile."""

from __future__ import annotations

import builtins
import io
from typing import Any

import pytest
import torch
from runtime_helpers import (
    TOL,
    ListSource,
    PyRefBackend,
    check_outputs,
    qkv,
    reference_attention,
    rel_fro,
)
from torch.utils._python_dispatch import TorchDispatchMode

import flashtune
from flashtune.api import ops
from flashtune.codegen.abi import ArgType
from flashtune.errors import InvalidInput
from flashtune.families.fwd.args import pack_args
from flashtune.runtime import plans
from flashtune.runtime.dispatch import Dispatcher, Tier
from flashtune.toolchain.cache import ArtifactCache


@pytest.fixture(autouse=True)
def _poison(poisoned_outputs: None) -> None:
    """Every output of these tests starts as NaN."""


CASES: list[tuple[int, int, int, int, int, int]] = [
    # batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim
    (2, 37, 53, 4, 2, 40),
    (1, 64, 64, 3, 3, 64),
    (2, 70, 20, 2, 1, 8),  # causal: rows 0..49 see no key
    (1, 5, 130, 8, 1, 128),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_attention_matches_reference(pyref: PyRefBackend,
                                     case: tuple[int, int, int, int, int, int],
                                     causal: bool, dtype: torch.dtype) -> None:
    q, k, v = qkv(*case, dtype=dtype)
    out, lse = flashtune.attention(q, k, v, causal=causal, return_lse=True, backend="pyref")
    check_outputs(out, lse, q, k, v, causal)
    assert out.is_contiguous()
    (kernel,) = pyref.kernels.values()
    assert kernel.source.problem.causal is causal
    assert kernel.source.problem.head_dim == case[-1]


def test_noncontiguous_layouts_and_scale(pyref: PyRefBackend) -> None:
    q, _, _ = qkv(2, 33, 1, 6, 2, 64)
    kv = torch.randn(2, 47, 2, 2, 64).half()  # packed (B, N, 2, H, D): k and v are views
    k, v = kv[:, :, 0], kv[:, :, 1]
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, N, D) memory
    out, lse = flashtune.attention(qt, k, v, softmax_scale=0.3, return_lse=True,
                                   backend="pyref")
    check_outputs(out, lse, q, k, v, causal=False, scale=0.3)
    assert out.stride() == qt.stride()  # like q


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_matches_torch(pyref: PyRefBackend, causal: bool) -> None:
    # torch's usual layout: contiguous (B, H, N, D)
    q, k, v = (t.transpose(1, 2).contiguous()
               for t in qkv(2, 45, 45, 4, 2, 32, dtype=torch.bfloat16))
    out = flashtune.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True,
                                                 backend="pyref")
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=True)
    assert out.shape == q.shape and out.is_contiguous()  # like query
    assert rel_fro(out, ref) <= TOL[torch.bfloat16]
    view = flashtune.scaled_dot_product_attention(q.transpose(1, 2).contiguous().transpose(1, 2),
                                                  k, v, is_causal=causal, enable_gqa=True,
                                                  backend="pyref")
    assert view.stride() == q.transpose(1, 2).contiguous().transpose(1, 2).stride()
    assert rel_fro(view, ref) <= TOL[torch.bfloat16]


def test_pack_args_equals_the_contract() -> None:
    """The generated packer against the kernel's parameter list written out by hand."""
    q, k, v = qkv(2, 19, 23, 4, 2, 16)
    kt = k.transpose(1, 2).contiguous().transpose(1, 2)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 19)
    p, i, L = ArgType.PTR, ArgType.I32, ArgType.I64
    expected = ((p, q.data_ptr()), (p, kt.data_ptr()), (p, v.data_ptr()), (p, out.data_ptr()),
                (p, lse.data_ptr()), (i, 19), (i, 23), (i, 4), (i, 2),
                *((L, s) for t in (q, kt, v, out) for s in t.stride()[:3]),
                (ArgType.F32, 0.25))
    assert pack_args(q, kt, v, out, lse, 0.25) == expected
    assert kt.stride()[:3] != k.stride()[:3]  # the strides are the tensors' own


def test_seqlen_bucket_matches_spec() -> None:
    from flashtune.codegen.spec import seq_bucket

    for n in [*range(1, 3000), 4095, 4096, 4097, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 10**8]:
        assert plans.seqlen_bucket(n) == seq_bucket(n), n


def test_warm_call_touches_neither_store_nor_disk(pyref: PyRefBackend,
                                                   source: ListSource) -> None:
    q, k, v = qkv(1, 100, 100, 2, 2, 32)
    flashtune.attention(q, k, v, backend="pyref")
    assert (source.reads, len(pyref.loads)) == (1, 1)

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a warm call touched the disk, the compiler or the database")

    with pytest.MonkeyPatch.context() as mp:
        for name in ("lookup", "load_bytes", "get_or_build", "put_bytes"):
            mp.setattr(ArtifactCache, name, forbidden)
        mp.setattr(plans, "render", forbidden)
        mp.setattr(builtins, "open", forbidden)
        mp.setattr(io, "open", forbidden)
        for seqlen in (100, 120, 65):  # one bucket (128)
            q, k, v = qkv(1, seqlen, seqlen, 2, 2, 32)
            out, lse = flashtune.attention(q, k, v, return_lse=True, backend="pyref")
            check_outputs(out, lse, q, k, v, causal=False)
    assert (source.reads, len(pyref.loads)) == (1, 1)
    q, k, v = qkv(1, 300, 300, 2, 2, 32)  # a new bucket: a new plan, no new database read
    flashtune.attention(q, k, v, backend="pyref")
    assert (source.reads, len(pyref.loads)) == (1, 2)


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_op_is_visible_to_dispatch_modes(pyref: PyRefBackend) -> None:
    q, k, v = qkv(1, 40, 40, 2, 2, 16)
    direct = flashtune.attention(q, k, v, backend="pyref")
    with OpLog() as log:
        through_op = flashtune.attention(q, k, v, backend="pyref")
    assert "flashtune.attention_fwd.default" in log.ops
    assert isinstance(direct, torch.Tensor) and isinstance(through_op, torch.Tensor)
    assert torch.equal(direct, through_op)


def test_opcheck(pyref: PyRefBackend) -> None:
    """Schema, fake implementation (shapes, strides) and autograd registration agree with
    the real op, for contiguous and SDPA-style transposed queries."""
    q, k, v = qkv(2, 24, 40, 4, 2, 32)
    torch.library.opcheck(ops.attention_fwd, (q, k, v, True, 0.2, "pyref"))
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    torch.library.opcheck(ops.attention_fwd, (qt, k, v, False, 0.2, "pyref"))


def test_inputs_requiring_grad_go_through_the_op_with_autograd(pyref: PyRefBackend) -> None:
    """A call that needs a gradient takes the custom op (whose autograd formula runs the
    backward kernels), never the direct call that would leave the output without one."""
    q, k, v = qkv(1, 16, 16, 2, 2, 16)
    q.requires_grad_(True)
    out = flashtune.attention(q, k, v, backend="pyref")
    assert out.requires_grad and out.grad_fn is not None
    with torch.no_grad():
        assert not flashtune.attention(q, k, v, backend="pyref").requires_grad
    with torch.inference_mode():
        flashtune.attention(q, k, v, backend="pyref")
    with pytest.raises(InvalidInput, match="deterministic"):
        flashtune.attention(q, k, v, backend="pyref", deterministic="yes")  # type: ignore[call-overload]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = flashtune.attention(q, k, v, causal=True, backend="pyref")
    assert isinstance(out, torch.Tensor)
    return out * 2


def test_compile_traces_without_graph_breaks(pyref: PyRefBackend) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    q, k, v = qkv(2, 33, 33, 4, 2, 32)
    explanation = torch._dynamo.explain(_attend)(q, k, v)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    graph_text = "\n".join(str(g.graph) for g in explanation.graphs)
    assert "flashtune.attention_fwd" in graph_text
    compiled = torch.compile(_attend, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    ref, _ = reference_attention(q, k, v, causal=True, scale=32 ** -0.5)
    assert rel_fro(out / 2, ref) <= TOL[torch.float16]


def test_compile_on_meta_tensors() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    q, k, v = (t.to("meta") for t in qkv(2, 33, 17, 4, 2, 64, dtype=torch.bfloat16))
    out = torch.compile(_attend, fullgraph=True, backend="eager")(q, k, v)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == q.dtype
    out, lse = flashtune.attention(q, k, v, return_lse=True)  # eager meta: shapes only
    assert lse.shape == (2, 4, 33) and lse.dtype == torch.float32


def test_explain(pyref: PyRefBackend) -> None:
    q, k, v = qkv(1, 1000, 1000, 2, 2, 128, dtype=torch.bfloat16)
    decision = flashtune.explain(q, k, v, causal=True, backend="pyref")
    assert decision.tier is Tier.DEFAULT
    assert decision.bucket.key() == "fwd_d128_bf16_causal_n1024"
    assert decision.device == "virtual-sm_90"
    assert not pyref.loads  # nothing was compiled or loaded
    meta = flashtune.explain(q.to("meta"), k.to("meta"), v.to("meta"), arch="sm_80")
    assert (meta.arch, meta.device) == ("sm_80", "virtual-sm_80")


def test_tuned_config_reaches_the_kernel(dispatcher: Dispatcher, source: ListSource,
                                         pyref: PyRefBackend) -> None:
    from runtime_helpers import best_entry

    source.entries.append(best_entry("other-gpu", "sm_90", "fwd_d32_fp16_full", 256,
                                     "m128_n32_w8_s3"))
    q, k, v = qkv(1, 200, 200, 2, 2, 32)
    out, lse = flashtune.attention(q, k, v, return_lse=True, backend="pyref")
    (kernel,) = pyref.kernels.values()
    assert kernel.source.config.key() == "m128_n32_w8_s3"
    assert kernel.launches[0][0] == (2, 2, 1)  # ceil(200 / 128) query blocks
    check_outputs(out, lse, q, k, v, causal=False)
