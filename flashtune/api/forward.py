"""Running the forward family's kernel on validated tensors: plan, outputs, arguments,
launch.

The plan (``runtime.plans``: the dispatcher's decision, the loaded kernel and the family's
hot-path packer, memoised per backend, device, dtype, head dim, causal, features and
sequence bucket) makes a warm call one lookup, two output allocations, one pack (the
serving family's ``FwdPacker``) and the launch: no compile, no database, no file access.

``forward`` is the implementation of the ``flashtune::attention_fwd`` op; it expects inputs
that passed ``validate.check_attention_inputs``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashtune import settings
from flashtune.api.variants import Variant
from flashtune.codegen.spec import MAX_HEAD_DIM, ProblemBucket
from flashtune.errors import FlashtuneError, InvalidInput
from flashtune.families.fwd.args import FwdPacker
from flashtune.runtime import plans
from flashtune.runtime.backends import BackendEntry
from flashtune.runtime.dispatch import Decision
from flashtune.runtime.plans import Plan


def _longest(q: torch.Tensor, k: torch.Tensor, longest: tuple[int, int] | None) -> int:
    seqlen_q, seqlen_k = longest if longest is not None else (q.shape[1], k.shape[1])
    return seqlen_q if seqlen_q > seqlen_k else seqlen_k


def problem_bucket(q: torch.Tensor, k: torch.Tensor, causal: bool, op: str = "fwd",
                   features: tuple[str, ...] = (), longest: tuple[int, int] | None = None
                   ) -> ProblemBucket:
    """The tuning bucket of a call of kernel family ``op`` on these tensors, with the
    Problem feature switches ``features`` on (FeatureNotSupported if the family has not got
    one of them). ``longest``: the longest query and key sequences when they are not
    q's and k's second dims (varlen)."""
    return plans.problem_bucket(q, causal, op, features, _longest(q, k, longest))


def decide(q: torch.Tensor, k: torch.Tensor, causal: bool, backend: str | None,
           arch: str | None = None, op: str = "fwd", features: tuple[str, ...] = (),
           longest: tuple[int, int] | None = None) -> tuple[Decision, BackendEntry]:
    """The dispatcher's decision for these tensors (no kernel is loaded or compiled), for
    kernel family ``op`` (the forward unless named) with the feature switches ``features``.

    ``arch`` overrides the device with a virtual GPU of that arch.
    """
    return plans.decide(q, causal, backend, op, features, _longest(q, k, longest), arch)


def plan_for(q: torch.Tensor, k: torch.Tensor, causal: bool, backend: str, op: str = "fwd",
             features: tuple[str, ...] = (), longest: tuple[int, int] | None = None) -> Plan:
    """The memoised plan of this call of kernel family ``op`` with the Problem feature
    switches ``features`` (``plans.plan_for``); ``longest`` as in ``problem_bucket``."""
    return plans.plan_for(q, causal, backend, op, features, _longest(q, k, longest))


def _misaligned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> InvalidInput:
    bad = [name for name, t in (("q", q), ("k", k), ("v", v)) if t.data_ptr() % 16]
    return InvalidInput(f"{', '.join(bad)} start(s) at an address that is not 16-byte aligned "
                        "(a view with an odd storage offset); the kernel loads 16-byte chunks. "
                        "Pass a copy made with .clone() or .contiguous()")


def _no_packer(plan: Plan) -> FlashtuneError:
    op = plan.decision.problem.op
    return FlashtuneError(f"the {op!r} kernel family serves the forward but supplies no "
                          "hot-path packer; its hot_packer must return a "
                          "families.fwd.args.FwdPacker (ForwardFamily's does)")


def empty_outputs(q: torch.Tensor, head_dim_v: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised O (like q, same strides when q is dense; (B, Nq, Hq, head_dim_v)
    contiguous where V's head dim differs) and LSE (B, Hq, Nq) float32."""
    batch, seqlen_q, heads_q, _ = q.shape
    # Sizes as separate ints: torch parses them several times faster than a tuple.
    return (torch.empty_like(q) if head_dim_v is None
            else q.new_empty(batch, seqlen_q, heads_q, head_dim_v),
            torch.empty(batch, heads_q, seqlen_q, dtype=torch.float32, device=q.device))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            softmax_scale: float, backend: str, variant: Variant | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """O (like q, with v's head dim) and the float32 LSE (B, Hq, Nq) of validated inputs,
    launched on the current stream. ``backend`` "" means the FLASHTUNE_BACKEND setting.
    ``variant``: the call's validated features (``api.variants.resolve``; its ``causal`` is
    ignored in favour of ``causal``), None for none. V's head dim may differ from Q/K's
    (the problem's ``head_dim_v``; families that do not take it refuse it)."""
    name = backend or settings.BACKEND.get()
    features = variant.features if variant is not None else ()
    varlen = variant.varlen if variant is not None else None
    if varlen is None:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    else:
        seqlen_q, seqlen_k = varlen.max_seqlen_q, varlen.max_seqlen_k
    head_dim_v = v.shape[3]
    if head_dim_v > MAX_HEAD_DIM:
        return _in_column_chunks(q, k, v, causal, softmax_scale, backend, variant)
    split = None if head_dim_v == q.shape[3] else head_dim_v
    plan = plans.plan_for(q, causal, name, "fwd", features,
                          seqlen_q if seqlen_q > seqlen_k else seqlen_k,
                          operands=plans.AS_Q if split is None
                          else plans.Operands(head_dim_v=split))
    out, lse = empty_outputs(q, split)
    pack: FwdPacker | None = plan.pack
    if pack is None:
        raise _no_packer(plan)
    grid, args = pack(q, k, v, out, lse, softmax_scale, variant)
    if (args[0][1] | args[1][1] | args[2][1]) & 15:  # type: ignore[operator]  # pointers
        raise _misaligned(q, k, v)
    plan.kernel.launch(grid, args, stream=plan.stream())
    return out, lse


def _in_column_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      softmax_scale: float, backend: str, variant: Variant | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward`` of a V wider than MAX_HEAD_DIM (beside Q/K of one of spec.WIDE_HEAD_DIMS),
    by ``in_column_chunks``. Dropout draws the same mask in every chunk (from positions
    only)."""
    return in_column_chunks(v.shape[3], lambda start, end: forward(
        q, k, v[..., start:end], causal, softmax_scale, backend, variant))


def in_column_chunks(width: int, attend: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """O and LSE of an attention whose V is ``width`` columns wide, more than MAX_HEAD_DIM:
    O's columns are P V's, so each chunk [start, end) of at most MAX_HEAD_DIM columns is a
    call ``attend(start, end)`` of its own (Q K^T and P recomputed: a thread's registers hold
    no wider O), the chunks' O concatenated; every chunk's LSE is the same (P's), the first
    is returned."""
    outs = []
    lse: torch.Tensor | None = None
    for start in range(0, width, MAX_HEAD_DIM):
        out, chunk_lse = attend(start, min(start + MAX_HEAD_DIM, width))
        outs.append(out)
        lse = chunk_lse if lse is None else lse
    assert lse is not None
    return torch.cat(outs, dim=-1), lse
