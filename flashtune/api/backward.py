"""Running the backward kernels on the forward's tensors: preprocess, main kernel, convert.

``backward`` is the implementation of the ``flashtune::attention_bwd`` op. Three launches
on the current stream:

1. ``bwdpre``: D = rowsum(dO * O) in float32 and the float32 dQ accumulator zeroed (with
   V's head dim other than Q/K's, where O and dO have V's and the accumulator Q's: D by a
   torch float32 sum and a zeroed accumulator instead);
2. ``bwd`` (or ``bwddet`` when deterministic): dK, dV and the accumulator;
3. ``bwdsum``: dQ = softmax_scale * (the accumulator's slices summed in slice order).

Q/K head dims above MAX_HEAD_DIM (512, 576: the main kernel in output column chunks, its
grid's y the kv heads times the chunks) have no row kernels: D and the convert's sum (in
slice order) run in torch.

Each kernel comes from its own family's dispatcher decision (tuned or default), its plan
memoised with every other op's (``runtime.plans``). The
only buffers besides the gradients are D (B, Hq, Nq) and the accumulator: one float32 copy
of dQ in the atomic mode, ``dq_slices`` copies in the deterministic mode (a constant factor:
about one slice per SM over the batch and kv heads), so memory stays linear in the sequence
length. A gradient of the LSE output (``return_lse=True``) enters as D - dLSE: the
derivative of LSE with respect to the scores is P, so dS = P (dP - D + dLSE).

Varlen (packed sequences, ``attention_varlen``): the tensors come in the forward's packed
layout with a batch dim of 1 (q (1, total_q, Hq, D), the LSE (1, Hq, total_q)); D and the
accumulator follow it, the preprocess and the convert run over the pack's rows as one
sequence, and the main kernel's grid and dQ slices count the sequences and the longest key
sequence (the kernel reads each sequence's rows from the cumulative lengths).

Attention sinks need no kernel of their own: the forward's LSE includes the sink, so the
kernels' P = exp(S - LSE) is already the probability with the sink in the denominator, and
dS = P (dP - D) holds as is. The sink's gradient is d sink_h = -sum over (batch, rows of head
h) of exp(sink_h - LSE) (D - dLSE), a reduction of the preprocess's D in a fixed order (a
torch sum, not atomics), so it is the same bits in every run and for every block order of
the main kernel.
"""

from __future__ import annotations

import functools

import torch

from flashtune import settings
from flashtune.api.variants import Variant, kernel_features
from flashtune.codegen.abi import PackedArgs
from flashtune.codegen.spec import MAX_HEAD_DIM
from flashtune.families.base import sm_count
from flashtune.families.bwd import args, space
from flashtune.families.bwd8 import BWD8_ABI
from flashtune.families.fwd.args import feature_values
from flashtune.families.fwd8 import DESCALES
from flashtune.runtime.plans import Operands, Plan, plan_for


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` if the kernels can read it in place (last dim contiguous, other strides
    multiples of 8 elements, 16-byte aligned base), else a contiguous copy. Gradients that
    autograd hands over may be expanded (stride 0) or transposed views."""
    st = t.stride()
    if st[3] == 1 and not (st[0] % 8 or st[1] % 8 or st[2] % 8 or t.data_ptr() % 16):
        return t
    return t.contiguous()


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int | None:
    return sm_count(device)


def _launch(plan: Plan, grid: tuple[int, int, int], packed: PackedArgs) -> None:
    plan.kernel.launch(grid, packed, stream=plan.stream())


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, grad_lse: torch.Tensor | None,
             causal: bool, softmax_scale: float, deterministic: bool, backend: str,
             variant: Variant | None = None, dscore: torch.Tensor | None = None,
             descales: tuple[torch.Tensor, ...] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dQ, dK, dV (like q, k, v) of the forward that produced ``out`` and ``lse`` from
    validated q, k, v, given dO (and optionally the gradient of the LSE), with the
    forward's features ``variant`` (None: none), and the float32 gradient of its sinks
    (None without sinks). ``backend`` "" means the FLASHTUNE_BACKEND setting. With varlen,
    every tensor is in the packed layout of the module doc. With traced modifications
    (``variant.traced``), ``dscore`` (zeroed float32 (B, Hq, Nq, Nk), varlen: (sequences, Hq,
    longest Nq, longest Nk) with each sequence's positions at its top left; or None) receives the
    gradient by the modified scores (``api.flex_grad``). FP8 q, k, v (``descales``: their
    q, k, v descale factors, float32 (batch or sequences, heads_kv)) run the FP8 backward
    (``bwd8``); dO and O, and so dQ, dK and dV, are then in O's 16-bit type."""
    name = backend or settings.BACKEND.get()
    dout, out = _kernel_ready(dout), _kernel_ready(out)
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    # The main kernel's blocks: per (sequence, kv head), over the longest key sequence.
    sequences, keys, longest = batch, seqlen_k, max(seqlen_q, seqlen_k)
    varlen = variant.varlen if variant is not None else None
    if varlen is not None:
        sequences, keys = varlen.batch, varlen.max_seqlen_k or seqlen_k
        longest = max(varlen.max_seqlen_q, keys)
    op = ("bwd8" if descales is not None else "bwd") + ("det" if deterministic else "")
    features = kernel_features(op, variant.features) if variant is not None else ()
    grad_type = None if descales is None else out.dtype  # FP8 inputs: O's type
    head_dim_v = v.shape[3]
    split_v = None if head_dim_v == head_dim else head_dim_v  # V's own head dim
    main = plan_for(q, causal, name, op, features, longest,
                    operands=Operands(o_dtype=grad_type, head_dim_v=split_v))
    # The row kernels read O and dO and write dQ: O's type (q's, but for FP8 inputs). With
    # V's head dim split from Q/K's, O and dO have V's and dQ has Q's: the preprocess
    # (one head dim for both) gives way to D in torch (below), and the convert runs at q's.
    # A Q/K head dim above MAX_HEAD_DIM (the row kernels' limit) takes both in torch.
    wide = head_dim > MAX_HEAD_DIM
    pre = (plan_for(out, False, name, "bwdpre", (), longest)
           if split_v is None and not wide else None)
    convert = (None if wide else
               plan_for(out if split_v is None else q, False, name, "bwdsum", (), longest))
    config = main.source.config
    split = space.dq_mode(config) == space.DQ_SPLIT
    slices = (space.dq_slices(_sm_count(q.device), sequences, heads_kv, keys, config.block_n)
              if split else 1)

    if pre is not None:
        dsum = torch.empty(batch, heads_q, seqlen_q, dtype=torch.float32, device=q.device)
        accum = torch.empty(slices, batch, heads_q, seqlen_q, head_dim, dtype=torch.float32,
                            device=q.device)
        row_grid = args.row_grid(seqlen_q, heads_q, batch, pre.block_m)
        _launch(pre, row_grid, args.pre_args(out, dout, dsum, accum))
    else:  # D = rowsum(dO * O) over V's head dim (float32 products of 16-bit values)
        dsum = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
        accum = torch.zeros(slices, batch, heads_q, seqlen_q, head_dim, dtype=torch.float32,
                            device=q.device)
    if grad_lse is not None:
        dsum.sub_(grad_lse)

    dk, dv = (torch.empty(t.shape, dtype=out.dtype, device=t.device) for t in (k, v))
    grid = args.main_grid(keys, heads_kv, sequences, config.block_n, slices if split else None,
                          space.chunks(config))
    if descales is None and not features:  # the plain kernel's straight-line packer
        packed = args.main_args(q, k, v, dout, lse, dsum, dk, dv, accum, softmax_scale)
    else:
        values = {"q": q, "k": k, "v": v, "dout": dout, "lse": lse, "dsum": dsum, "dk": dk,
                  "dv": dv, "dq_accum": accum, "softmax_scale": softmax_scale,
                  **feature_values(main.source.problem, variant)}
        if descales is not None:
            packed = BWD8_ABI.pack({**values, **dict(zip(DESCALES, descales, strict=True))},
                                   features)
        else:
            packed = args.MAIN_ABI.pack(
                {**values, **(args.dscore_values(dscore) if variant is not None
                              and variant.traced else {})}, features)
    _launch(main, grid, packed)

    if convert is None:
        dq = _sum_slices(accum, softmax_scale, out.dtype)
    else:
        dq = torch.empty(q.shape, dtype=out.dtype, device=q.device)
        _launch(convert, args.row_grid(seqlen_q, heads_q, batch, convert.block_m),
                args.sum_args(accum, dq, softmax_scale))
    dsinks = None
    if variant is not None and variant.sinks is not None:
        dsinks = sink_grad(variant.sinks, lse, dsum)
    return dq, dk, dv, dsinks


def _sum_slices(accum: torch.Tensor, softmax_scale: float, dtype: torch.dtype
                ) -> torch.Tensor:
    """dQ (B, Nq, Hq, D) of ``dtype`` from the float32 accumulator (slices, B, Hq, Nq, D):
    the convert kernel's definition in torch (its slices added in slice order, so the same
    bits in every run, then scaled and rounded), for head dims above its MAX_HEAD_DIM."""
    total = accum[0].clone()
    for piece in accum[1:]:
        total += piece
    return (total * softmax_scale).to(dtype).transpose(1, 2)


def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, dsum: torch.Tensor) -> torch.Tensor:
    """The gradient of the sinks (Hq,): -sum over batch and rows of exp(sink - LSE) D, from
    the LSE (B, Hq, Nq) and D - dLSE (B, Hq, Nq), summed in a fixed order."""
    weight = torch.exp(sinks.detach().to(torch.float32)[None, :, None] - lse)
    return -(weight * dsum).sum(dim=(0, 2))
