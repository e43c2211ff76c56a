"""Validation of the packed tensors and cumulative lengths of ``attention_varlen``.

Metadata (types, ranks, dtypes, devices, shapes, strides) is checked on every call without
reading tensor data. The lengths' values (starting at 0, non-decreasing, ending at the packed
row count, none longer than the stated maximum) need the data: they are checked for CPU
tensors (the emulator) always, and for CUDA tensors only with FLASHTUNE_CHECK_INPUTS=1 (one
synchronisation per call), so that a plain call never synchronises with the host.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import torch

from flashtune import settings
from flashtune.api.limits import MAX_GRID_YZ, MAX_SEQLEN
from flashtune.api.validate import check_attention_inputs
from flashtune.errors import InvalidInput

_LAYOUT = "(total_tokens, heads, head_dim)"


def _check_packed(q: object, k: object, v: object) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidInput(f"{name} must be a torch.Tensor {_LAYOUT}, got "
                               f"{type(t).__name__}")
        if t.dim() != 3:
            raise InvalidInput(f"{name} has {t.dim()} dims (shape {tuple(t.shape)}); expected "
                               f"3 dims {_LAYOUT}: the sequences packed along the first dim "
                               "(flash-attn's varlen layout)")


def _check_max(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidInput(f"{name}={value!r} must be an int: the longest sequence's length")
    if not 0 <= int(value) <= MAX_SEQLEN:
        raise InvalidInput(f"{name}={value} is outside [0, {MAX_SEQLEN}]")
    return int(value)


def _check_cu(cu: object, name: str, q: torch.Tensor) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        raise InvalidInput(f"{name} must be a torch.Tensor of int32 cumulative lengths, got "
                           f"{type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise InvalidInput(f"{name} has dtype {cu.dtype}; expected torch.int32 (convert with "
                           f"{name}.int())")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise InvalidInput(f"{name} has shape {tuple(cu.shape)}; expected (batch + 1,) "
                           "cumulative lengths (0, len_0, len_0 + len_1, ...), batch >= 1")
    if cu.device != q.device:
        raise InvalidInput(f"{name} is on {cu.device} but q is on {q.device}; move it with "
                           f"{name}.to(q.device)")
    return cu if cu.stride(0) == 1 else cu.contiguous()


def _check_values(cu: torch.Tensor, name: str, total: int, longest: int,
                  longest_name: str) -> None:
    values = cu.tolist()
    if values[0] != 0:
        raise InvalidInput(f"{name} starts at {values[0]}; expected 0 (cumulative lengths "
                           "(0, len_0, len_0 + len_1, ...))")
    lengths = [b - a for a, b in zip(values, values[1:], strict=False)]
    bad = [i for i, n in enumerate(lengths) if n < 0]
    if bad:
        raise InvalidInput(f"{name} is not monotone: it decreases after index {bad[0]} "
                           f"({values[bad[0]]} -> {values[bad[0] + 1]}); expected "
                           "non-decreasing cumulative lengths")
    if values[-1] != total:
        raise InvalidInput(f"{name} ends at {values[-1]} but the packed tensor has {total} "
                           f"rows; expected {name}[-1] == the total number of tokens")
    if max(lengths) > longest:
        raise InvalidInput(f"{longest_name}={longest} but sequence {lengths.index(max(lengths))} "
                           f"of {name} has {max(lengths)} tokens; pass the longest length")


def check_varlen_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cu_seqlens_q: object, cu_seqlens_k: object, max_seqlen_q: object,
                        max_seqlen_k: object,
                        check: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
                        = check_attention_inputs
                        ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) validated; InvalidInput with
    the fix otherwise. q is (total_q, Hq, D), k and v (total_k, Hkv, D) with non-empty
    packed tensors (see the module doc for which value checks run); ``check`` validates the
    tensors as one batch entry (the FP8 forward passes its own)."""
    _check_packed(q, k, v)
    if q.shape[0] == 0 or k.shape[0] == 0:
        raise InvalidInput(f"q has {q.shape[0]} rows and k {k.shape[0]}; expected at least one "
                           "token in each packed tensor")
    check(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
    cu_q = _check_cu(cu_seqlens_q, "cu_seqlens_q", q)
    cu_k = _check_cu(cu_seqlens_k, "cu_seqlens_k", q)
    if cu_q.shape != cu_k.shape:
        raise InvalidInput(f"cu_seqlens_q has {cu_q.shape[0]} entries but cu_seqlens_k "
                           f"{cu_k.shape[0]}; expected one (query, key) sequence pair per "
                           "batch entry: batch + 1 entries each")
    if cu_q.shape[0] - 1 > MAX_GRID_YZ:
        raise InvalidInput(f"{cu_q.shape[0] - 1} sequences; expected at most {MAX_GRID_YZ} "
                           "(CUDA grid limit). Split the call")
    longest_q = _check_max(max_seqlen_q, "max_seqlen_q")
    longest_k = _check_max(max_seqlen_k, "max_seqlen_k")
    if q.device.type == "cpu" or (q.device.type == "cuda" and settings.CHECK_INPUTS.get()):
        _check_values(cu_q, "cu_seqlens_q", q.shape[0], longest_q, "max_seqlen_q")
        _check_values(cu_k, "cu_seqlens_k", k.shape[0], longest_k, "max_seqlen_k")
    return cu_q, cu_k, longest_q, longest_k
