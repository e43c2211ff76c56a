"""The attention implementations the sweep compares, and how they are timed on a GPU.

Every implementation takes the same q, k, v: (batch, seqlen, heads, head_dim) tensors with a
contiguous last dim (flash-attn's and flashtune's layout), and returns its output in that
layout, so outputs compare element for element. SDPA gets transposed views of the very same
storage.

Checking (``reference``, ``relative_error``): each output is compared with the float64
reference of its first, middle and last (batch, head) and must be finite everywhere; the
checked call writes onto NaN-poisoned memory (``poison_next_output``).

Timing (``Timer``, ``time_cuda``): warm-up calls first, then per repeat an L2 flush (a
256 MiB write, several times any current L2) followed by the call between two CUDA events;
the caller takes the median. Inputs are random normals, never zeros.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: Bytes written between repeats to evict the inputs from L2 (H100/H200 L2 is 50-60 MB).
#: ||out - ref|| / ||ref|| above which an output is reported wrong (bf16 inputs land
#: around 3e-3 against the float64 reference; a broken kernel lands near 1).
REL_ERR_TOLERANCE = 1e-2


class Unavailable(Exception):
    """This implementation cannot run this shape here (not installed, no kernel, ...)."""


@dataclass(frozen=True)
class Prepared:
    """One implementation bound to one set of inputs.

    ``fn`` runs the forward pass and returns (batch, seqlen, heads, head_dim) output (with
    an autograd graph when the inputs require grad: the fwd+bwd pass differentiates it);
    ``context`` is entered once around warm-up, check and timing (e.g. an SDPA backend
    selection); ``config`` names what ran (kernel config or backend).
    """

    fn: Callable[[], torch.Tensor]
    config: str
    context: Callable[[], contextlib.AbstractContextManager[Any]] = field(
        default=contextlib.nullcontext)


@dataclass(frozen=True)
class Impl:
    """A named implementation; ``prepare`` raises Unavailable when it cannot run."""

    name: str
    prepare: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], Prepared]


# --- timing -----------------------------------------------------------------------------


class L2Flusher:
    """Evicts the L2 cache by writing a buffer larger than it."""

    def __init__(self, device: torch.device, nbytes: int | None = None) -> None:
        import torch

        from flashtune.runtime.launch import l2_flush_bytes

        size = l2_flush_bytes(device) if nbytes is None else nbytes
        self._buf = torch.empty(size, dtype=torch.uint8, device=device)
        self._tick = 0

    def __call__(self) -> None:
        self._tick = (self._tick + 1) % 251  # a different value each time: a real write
        self._buf.fill_(self._tick)


@dataclass(frozen=True)
class Timer:
    """How a sweep synchronises and times: CUDA events on a GPU (the only mode the command
    line uses), or the host clock on the CPU (tests of the sweep's plumbing only; such
    numbers are never performance)."""

    device: str
    warmup: int
    repeats: int

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device {self.device!r} is not 'cuda' or 'cpu'")
        if self.warmup < 1 or self.repeats < 1:
            raise ValueError(f"warmup and repeats must be >= 1, got {self.warmup}, "
                             f"{self.repeats}")

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def flusher(self) -> Callable[[], None]:
        import torch

        if self.device == "cuda":
            return L2Flusher(torch.device("cuda"))
        return lambda: None

    def time(self, fn: Callable[[], object], flush: Callable[[], None]) -> list[float]:
        """Milliseconds per repeat of ``fn``."""
        if self.device == "cuda":
            return time_cuda(fn, warmup=self.warmup, repeats=self.repeats, flush=flush)
        for _ in range(self.warmup):
            fn()
        out = []
        for _ in range(self.repeats):
            flush()
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out


def time_cuda(fn: Callable[[], object], *, warmup: int, repeats: int,
              flush: Callable[[], None]) -> list[float]:
    """Milliseconds of ``fn`` per repeat, from CUDA events, L2 flushed before each."""
    import torch

    if warmup < 1 or repeats < 1:
        raise ValueError(f"warmup and repeats must be >= 1, got {warmup}, {repeats}")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]  # type: ignore[no-untyped-call]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]  # type: ignore[no-untyped-call]
    for start, end in zip(starts, ends, strict=True):
        flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]


# --- reference ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """float64 attention of a few (batch, head) pairs: ``values[i]`` is (seqlen_q, head_dim)
    of ``picks[i]``."""

    picks: tuple[tuple[int, int], ...]
    values: torch.Tensor


def default_picks(batch: int, heads: int) -> tuple[tuple[int, int], ...]:
    """First, middle and last (batch, head): catches wrong batch and head strides too."""
    picks = ((0, 0), (batch // 2, heads // 2), (batch - 1, heads - 1))
    return tuple(dict.fromkeys(picks))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              picks: tuple[tuple[int, int], ...] | None = None) -> Reference:
    """The reference of ``picks`` (default: ``default_picks``): flashtune's one float64
    attention reference (``families.fwd.reference``, independent of every implementation
    under test), one (batch, head) at a time to bound the memory of the score matrix. The
    causal mask is aligned to the bottom-right corner (flash-attn's and flashtune's
    convention; the same as torch's when Nq == Nk); GQA heads map as h // (Hq / Hkv).
    """
    import torch

    from flashtune.families.fwd.reference import attention_reference

    chosen = picks if picks is not None else default_picks(q.shape[0], q.shape[2])
    n_q, d = q.shape[1], q.shape[3]
    group = q.shape[2] // k.shape[2]
    out = torch.empty(len(chosen), n_q, d, dtype=torch.float64, device=q.device)
    for i, (b, h) in enumerate(chosen):
        kv = h // group
        o, _ = attention_reference(q[b:b + 1, :, h:h + 1], k[b:b + 1, :, kv:kv + 1],
                                   v[b:b + 1, :, kv:kv + 1], causal, 1.0 / math.sqrt(d))
        out[i] = o[0, :, 0]
    return Reference(chosen, out)


def relative_error(out: torch.Tensor, ref: Reference) -> float:
    """||out - ref|| / ||ref|| over the reference's picks; NaN when any element of ``out``
    (all of it, not only the picks) is NaN or infinite, e.g. left unwritten over poison."""
    import torch

    if not bool(out.isfinite().all()):
        return math.nan
    got = torch.stack([out[b, :, h, :] for b, h in ref.picks]).detach().double()
    want = ref.values.double()
    return float((got - want).norm() / want.norm())


@dataclass(frozen=True)
class GradReference:
    """float64 gradients dq, dk, dv of a few (batch, head) pairs for one dO:
    ``values[name][i]`` is (seqlen, head_dim) of ``picks[i]`` (dk and dv: of its kv head,
    for that query head's share only when heads are grouped)."""

    picks: tuple[tuple[int, int], ...]
    values: dict[str, torch.Tensor]


def grad_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                   causal: bool) -> GradReference:
    """Autograd of flashtune's float64 attention reference, one (batch, head) of the default
    picks at a time; q, k and v must have equal head counts (the sweep's)."""
    import torch

    from flashtune.families.fwd.reference import attention_reference

    picks = default_picks(q.shape[0], q.shape[2])
    grads: dict[str, list[torch.Tensor]] = {"dq": [], "dk": [], "dv": []}
    for b, h in picks:
        leaves = [t[b:b + 1, :, h:h + 1].detach().double().requires_grad_(True)
                  for t in (q, k, v)]
        qh, kh, vh = leaves
        out, _ = attention_reference(qh, kh, vh, causal, 1.0 / math.sqrt(q.shape[3]))
        found = torch.autograd.grad(out, leaves, dout[b:b + 1, :, h:h + 1].double())
        for name, g in zip(("dq", "dk", "dv"), found, strict=True):
            grads[name].append(g[0, :, 0].detach())
        del out, found
    return GradReference(picks, {n: torch.stack(g) for n, g in grads.items()})


def grad_error(grads: tuple[torch.Tensor, ...], ref: GradReference) -> float:
    """The largest ||g - ref|| / ||ref|| of dq, dk and dv over the picks; NaN when any
    element of a gradient is NaN or infinite."""
    import torch

    worst = 0.0
    for name, g in zip(("dq", "dk", "dv"), grads, strict=True):
        if not bool(g.isfinite().all()):
            return math.nan
        got = torch.stack([g[b, :, h, :] for b, h in ref.picks]).double()
        want = ref.values[name].double()
        worst = max(worst, float((got - want).norm() / want.norm()))
    return worst


def poison_next_output(like: torch.Tensor) -> None:
    """Fill the memory the caching allocator hands out next for a tensor like ``like`` with
    NaN: allocating and freeing a block makes the next same-size allocation reuse it, so an
    implementation that leaves part of its output unwritten shows NaN there instead of a
    stale, possibly correct, earlier output."""
    import torch

    block = torch.full_like(like, math.nan)
    del block


# --- implementations --------------------------------------------------------------------


def _sdpa(backend_name: str) -> Callable[[Any, Any, Any, bool], Prepared]:
    def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Prepared:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name, None)
        if backend is None:
            raise Unavailable(f"this torch has no SDPBackend.{backend_name}")
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def fn() -> torch.Tensor:
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

        def context() -> contextlib.AbstractContextManager[Any]:
            return sdpa_kernel(backend)

        try:
            with context():
                fn()
        except RuntimeError as exc:  # "No available kernel" and friends
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise Unavailable(f"SDPA {backend_name}: {first[:200]}") from exc
        return Prepared(fn=fn, config=backend_name.lower(), context=context)

    return prepare


def _flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Prepared:
    try:
        import flash_attn
        from flash_attn import flash_attn_func
    except ImportError as exc:
        raise Unavailable(f"flash-attn is not importable ({exc})") from exc

    def fn() -> torch.Tensor:
        out = flash_attn_func(q, k, v, causal=causal)
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result

    return Prepared(fn=fn, config=f"flash-attn {getattr(flash_attn, '__version__', '?')}")


@contextlib.contextmanager
def _flashtune_errors() -> Iterator[None]:
    try:
        yield
    except ImportError as exc:
        raise Unavailable(f"flashtune runtime is not importable ({exc})") from exc


def _flashtune_tuned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     causal: bool) -> Prepared:
    with _flashtune_errors():
        from _flashtune_adapter import tuned_call
    fn, config = tuned_call(q, k, v, causal)
    return Prepared(fn=fn, config=config)


def _flashtune_default(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       causal: bool) -> Prepared:
    with _flashtune_errors():
        from _flashtune_adapter import default_call, defaults_only
    fn, config = default_call(q, k, v, causal)
    if q.requires_grad:
        return Prepared(fn=fn, config=config, context=defaults_only)
    return Prepared(fn=fn, config=config)


IMPLS: dict[str, Impl] = {
    impl.name: impl
    for impl in (
        Impl("flashtune", _flashtune_tuned),
        Impl("flashtune-default", _flashtune_default),
        Impl("sdpa-flash", _sdpa("FLASH_ATTENTION")),
        Impl("sdpa-cudnn", _sdpa("CUDNN_ATTENTION")),
        Impl("flash-attn", _flash_attn),
    )
}
#: The implementation every ratio is taken against.
BASELINE = "sdpa-flash"
