"""Routing PyTorch's flash-attention operators to flashtune (an explicit opt-in).

torch (2.9 and later) keeps a registry of flash-attention implementations
(``torch.nn.attention.register_flash_attention_impl``): a registered implementation replaces
the CUDA kernels of the aten flash-attention operators once the user activates it, and
``restore_flash_attention_impl()`` puts torch's own kernels back. ``register_sdpa()`` adds
flashtune to that registry and activates nothing::

    flashtune.register_sdpa()
    torch.nn.attention.activate_flash_attention_impl("flashtune")
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

From then on, every call torch sends to its flash backend runs flashtune's kernels:
``scaled_dot_product_attention`` when torch picks the flash backend (fp16/bf16 CUDA inputs;
force it with ``torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)``) with its
backward, and ``torch.nn.attention.varlen.varlen_attn`` (packed sequences, sliding windows)
with its backward, as in ``flashtune.attention_varlen``. SDPA's ``is_causal`` keeps torch's
meaning for L != S (the mask aligned to the top-left corner, served by ``api.sdpa_causal``
forward and backward; ``_flash_attention_forward``'s ``is_causal`` is flash-attn's
bottom-right one, as torch's own kernel has it). Calls flashtune does not serve (dropout, a
debug mask, a paged KV cache) raise an error that says so: restore torch's kernels for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flashtune.api import backward as _bwd
from flashtune.api.limits import check_softmax_scale
from flashtune.api.ops import attention
from flashtune.api.sdpa_causal import top_left_backward, top_left_forward
from flashtune.api.variants import Variant, refuse_unsupported, resolve
from flashtune.api.varlen_ops import attention_varlen
from flashtune.errors import FeatureNotSupported, InvalidInput
from flashtune.families.fwd.args import VarlenArgs

#: The name flashtune registers under (``activate_flash_attention_impl(IMPL_NAME)``).
IMPL_NAME = "flashtune"


@dataclass
class Routing:
    """The activated registration: the operator library that holds flashtune's kernels.
    ``remove()`` (called by torch's ``restore_flash_attention_impl``) unregisters them."""

    library: torch.library.Library | None

    def remove(self) -> None:
        library, self.library = self.library, None
        if library is not None:
            library._destroy()  # type: ignore[no-untyped-call]


def register_sdpa(name: str = IMPL_NAME) -> str:
    """Add flashtune to torch's flash-attention registry under ``name`` and return it.

    Nothing is routed until ``torch.nn.attention.activate_flash_attention_impl(name)``;
    ``torch.nn.attention.restore_flash_attention_impl()`` undoes the activation.
    FeatureNotSupported when the installed torch has no such registry (then use
    ``flashtune.scaled_dot_product_attention``, a drop-in called by name).
    """
    registry = getattr(torch.nn.attention, "register_flash_attention_impl", None)
    if registry is None:
        raise FeatureNotSupported(
            f"torch {torch.__version__} has no flash-attention registry "
            "(torch.nn.attention.register_flash_attention_impl, torch 2.9 or later), so "
            "flashtune cannot take over its SDPA calls; upgrade torch, or call "
            "flashtune.scaled_dot_product_attention in place of "
            "torch.nn.functional.scaled_dot_product_attention")
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"name={name!r} must be a non-empty string, e.g. {IMPL_NAME!r}")
    registry(name, register_fn=route_flash_operators)
    return name


def route_flash_operators(dispatch_key: str = "CUDA", backend: str = "cuda") -> Routing:
    """Register flashtune's kernels for torch's flash-attention operators on
    ``dispatch_key``, run on ``backend`` (the CPU key with the emulator serves tests)."""
    library = torch.library.Library("aten", "IMPL", dispatch_key)  # type: ignore[no-untyped-call]
    kernels = _Kernels(backend)
    for op, kernel in (
            ("_scaled_dot_product_flash_attention", kernels.sdpa_forward),
            ("_scaled_dot_product_flash_attention_backward", kernels.sdpa_backward),
            ("_flash_attention_forward", kernels.flash_forward),
            ("_flash_attention_forward_no_dropout_inplace", kernels.flash_forward_into),
            ("_flash_attention_backward", kernels.flash_backward)):
        library.impl(op, kernel, dispatch_key)  # type: ignore[no-untyped-call]
    return Routing(library)


def _refused(what: str) -> FeatureNotSupported:
    return FeatureNotSupported(
        f"flashtune's kernels serve torch's flash-attention calls (activated with "
        f"torch.nn.attention.activate_flash_attention_impl) but not {what}; run this call "
        "with torch's own kernels: torch.nn.attention.restore_flash_attention_impl()")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _seqlens(query: torch.Tensor, key: torch.Tensor) -> tuple[int, int]:
    return query.shape[-2], key.shape[-2]


def _window(left: int | None, right: int | None) -> tuple[int, int]:
    """flash-attn's window from the operators' optional sizes (None: unbounded)."""
    return (-1 if left is None else int(left), -1 if right is None else int(right))


def _no_rng(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dropout state and debug mask torch's flash operators return, for dropout 0."""
    return (torch.zeros(2, dtype=torch.uint64, device=query.device),
            torch.zeros((), dtype=torch.uint64, device=query.device),
            query.new_empty(0))


@dataclass(frozen=True)
class _Kernels:
    """The five operator kernels, running flashtune on ``backend``."""

    backend: str

    def _check_forward(self, dropout_p: float, return_debug_mask: bool) -> None:
        if dropout_p != 0.0:
            raise _refused(f"dropout_p={dropout_p} (torch's operators carry their own "
                           "generator state; flashtune's dropout is flashtune.attention's "
                           "and flashtune.scaled_dot_product_attention's dropout_p)")
        if return_debug_mask:
            raise _refused("return_debug_mask=True")

    def sdpa_forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     dropout_p: float = 0.0, is_causal: bool = False,
                     return_debug_mask: bool = False, *, scale: float | None = None
                     ) -> tuple[Any, ...]:
        """aten::_scaled_dot_product_flash_attention on (B, H, N, D) tensors."""
        self._check_forward(dropout_p, return_debug_mask)
        seqlen_q, seqlen_k = _seqlens(query, key)
        q, k, v = (_last_dim_contiguous(t).transpose(1, 2) for t in (query, key, value))

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            return attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True,
                             backend=self.backend)

        if is_causal and seqlen_q != seqlen_k:  # SDPA's top-left mask (api.sdpa_causal)
            out, lse = top_left_forward(attend, q, k, v)
        else:
            out, lse = attend(q, k, v, is_causal)
        rng_state, unused, debug_mask = _no_rng(query)
        empty = query.new_empty(0, dtype=torch.int32)
        return (out.transpose(1, 2), lse, empty, empty, seqlen_q, seqlen_k, rng_state, unused,
                debug_mask)

    def sdpa_backward(self, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor,
                      cum_seq_q: torch.Tensor | None, cum_seq_k: torch.Tensor | None,
                      max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                      philox_seed: torch.Tensor, philox_offset: torch.Tensor, *,
                      scale: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """aten::_scaled_dot_product_flash_attention_backward on (B, H, N, D) tensors."""
        dout, q, k, v, o = (t.transpose(1, 2) for t in (grad_out, query, key, value, out))

        def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     o: torch.Tensor, lse: torch.Tensor, causal: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return self._backward(dout, q, k, v, o, lse, dropout_p, Variant(causal), scale)

        if is_causal and q.shape[1] != k.shape[1]:  # SDPA's top-left mask
            grads = top_left_backward(backward, dout, q, k, v, o, logsumexp)
        else:
            grads = backward(dout, q, k, v, o, logsumexp, is_causal)
        dq, dk, dv = (g.transpose(1, 2) for g in grads)
        return dq, dk, dv

    def flash_forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      cum_seq_q: torch.Tensor | None, cum_seq_k: torch.Tensor | None,
                      max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                      return_debug_mask: bool, *, scale: float | None = None,
                      window_size_left: int | None = None,
                      window_size_right: int | None = None,
                      seqused_k: torch.Tensor | None = None,
                      alibi_slopes: torch.Tensor | None = None,
                      block_table: torch.Tensor | None = None, num_splits: int | None = None
                      ) -> tuple[torch.Tensor, ...]:
        """aten::_flash_attention_forward: flash-attn's layout, dense (B, N, H, D) or packed
        (total, H, D) with cumulative lengths; windows and ALiBi slopes as in flash-attn."""
        self._check_forward(dropout_p, return_debug_mask)
        for name, given in (("seqused_k", seqused_k), ("block_table (a paged KV cache)",
                                                       block_table),
                            ("num_splits", num_splits)):
            if given is not None:
                raise _refused(name)
        if alibi_slopes is not None and torch.is_grad_enabled() and any(
                t.requires_grad for t in (query, key, value)):
            # The backward operator is not given the slopes: its gradients would be wrong.
            raise _refused("ALiBi slopes on inputs that require grad (the backward operator "
                           "does not receive the slopes)")
        window = _window(window_size_left, window_size_right)
        q, k, v = (_last_dim_contiguous(t) for t in (query, key, value))
        if cum_seq_q is None:
            out, lse = attention(q, k, v, causal=is_causal, softmax_scale=scale,
                                 return_lse=True, backend=self.backend, window_size=window,
                                 alibi_slopes=alibi_slopes)
        else:
            if cum_seq_k is None:
                raise InvalidInput("cum_seq_q is given but cum_seq_k is None; packed "
                                   "sequences need both cumulative-length tensors")
            out, lse = attention_varlen(q, k, v, cum_seq_q, cum_seq_k, int(max_q),
                                        int(max_k), causal=is_causal, softmax_scale=scale,
                                        window_size=window, alibi_slopes=alibi_slopes,
                                        return_lse=True, backend=self.backend)
        rng_state, unused, debug_mask = _no_rng(query)
        return out, lse, rng_state, unused, debug_mask

    def flash_forward_into(self, out: torch.Tensor, query: torch.Tensor, *args: Any,
                           **kwargs: Any) -> torch.Tensor:
        """aten::_flash_attention_forward_no_dropout_inplace: the forward, written into
        ``out`` (one copy of O; flashtune's kernels allocate their output)."""
        result, lse, *_ = self.flash_forward(query, *args, **kwargs)
        out.copy_(result)
        return lse

    def flash_backward(self, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor,
                       cum_seq_q: torch.Tensor | None, cum_seq_k: torch.Tensor | None,
                       max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                       rng_state: torch.Tensor, unused: torch.Tensor, *,
                       scale: float | None = None, window_size_left: int | None = None,
                       window_size_right: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """aten::_flash_attention_backward: dense (B, N, H, D) or packed (total, H, D) calls,
        with a causal mask or a sliding window (the features the forward served)."""
        varlen = None
        if cum_seq_q is not None and cum_seq_q.numel() > 0:
            if cum_seq_k is None:
                raise InvalidInput("cum_seq_q is given but cum_seq_k is None; packed "
                                   "sequences need both cumulative-length tensors")
            varlen = VarlenArgs(cum_seq_q, cum_seq_k, int(max_q), int(max_k))
        longest = ((int(max_q), int(max_k)) if varlen is not None
                   else (query.shape[-3], key.shape[-3]))
        variant = resolve(is_causal, _window(window_size_left, window_size_right), None, None,
                          query, 1, longest, varlen)
        deterministic = bool(torch.are_deterministic_algorithms_enabled())
        refuse_unsupported("bwddet" if deterministic else "bwd", variant.features, query,
                           "torch's flash-attention backward routed to flashtune")
        return self._backward(grad_out, query, key, value, out, logsumexp, dropout_p,
                              variant, scale)

    def _backward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dropout_p: float,
                  variant: Variant, scale: float | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dQ, dK, dV of (B, N, H, D) views, or of packed (total, H, D) tensors with an LSE
        (H, total) when ``variant`` is varlen (the forward ran flashtune on them), with the
        forward's features ``variant``."""
        if dropout_p != 0.0:
            raise _refused(f"dropout_p={dropout_p} (torch's operators carry their own "
                           "generator state; flashtune's dropout is flashtune.attention's "
                           "and flashtune.scaled_dot_product_attention's dropout_p)")
        head_dim = q.shape[-1]
        if head_dim % 8:
            raise _refused(f"head dim {head_dim} in the backward (expected a multiple of 8, "
                           "as torch's SDPA pads it)")
        softmax_scale = check_softmax_scale(scale, head_dim)
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        if variant.varlen is not None:  # the backward's packed layout: a batch dim of 1
            grad_out, q, k, v, out, lse = (t.unsqueeze(0) for t in (grad_out, q, k, v, out,
                                                                    lse))
        dq, dk, dv, _ = _bwd.backward(grad_out, q, k, v, out, lse, None, variant.causal,
                                      softmax_scale,
                                      bool(torch.are_deterministic_algorithms_enabled()),
                                      self.backend, variant)
        if variant.varlen is not None:
            return dq[0], dk[0], dv[0]
        return dq, dk, dv
