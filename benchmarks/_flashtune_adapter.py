"""flashtune as the benchmarks call it: through the dispatcher (tuned config) or pinned to
the built-in default config.

Both take q, k, v as (batch, seqlen, heads, head_dim) tensors and return a zero-argument
callable producing the output in that layout, plus a label of the config that runs.
``flashtune.attention`` has no way to pin a config, so the default config is launched
through the backend directly, with the same argument packing and launch as the dispatcher's
path (``runtime.forward``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def tuned_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               backend: str = "cuda") -> tuple[Callable[[], torch.Tensor], str]:
    """flashtune.attention as users call it; the label is the dispatcher's config and tier."""
    import flashtune

    decision = flashtune.explain(q, k, v, causal=causal, backend=backend)

    def fn() -> torch.Tensor:
        out = flashtune.attention(q, k, v, causal=causal, backend=backend)
        assert not isinstance(out, tuple)
        return out

    return fn, f"{decision.config.key()} ({decision.tier.value})"


class _NothingTuned:
    """A tuning source without entries: every decision falls back to the defaults."""

    def all_best(self) -> list[object]:
        return []


@contextlib.contextmanager
def defaults_only() -> Iterator[None]:
    """Within: every family's dispatcher decision is its built-in default (the process-wide
    dispatcher is swapped, and the memoised plans dropped on the way in and out)."""
    from flashtune.runtime import plans
    from flashtune.runtime.dispatch import Dispatcher, get_dispatcher, set_dispatcher

    previous = get_dispatcher()
    set_dispatcher(Dispatcher(_NothingTuned))  # type: ignore[arg-type]
    plans.clear_caches()
    try:
        yield
    finally:
        set_dispatcher(previous)
        plans.clear_caches()


def default_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 backend: str = "cuda") -> tuple[Callable[[], torch.Tensor], str]:
    """The built-in default config of this problem on this device, bypassing the dispatcher.

    The kernel is compiled (or read from the caches) and loaded here, not in ``fn``. Inputs
    that require grad (the fwd+bwd pass) go through ``flashtune.attention`` instead, to be
    called within ``defaults_only()`` (the default configs of every backward kernel too).
    """
    if q.requires_grad:
        call, _ = tuned_call(q, k, v, causal, backend)
        with defaults_only():
            import flashtune

            config = flashtune.explain(q, k, v, causal=causal, backend=backend).config
        return call, f"{config.key()} (default, fwd+bwd)"
    import torch

    import flashtune
    from flashtune.families import render
    from flashtune.families.fwd.args import pack_args
    from flashtune.families.launch_args import grid
    from flashtune.runtime.backends import get_backend
    from flashtune.runtime.dispatch import default_config

    decision = flashtune.explain(q, k, v, causal=causal, backend=backend)
    config = default_config(decision.problem, decision.arch)
    source = render(decision.problem, config)
    if q.is_cuda:
        with torch.cuda.device(q.device):
            kernel = get_backend(backend).load(source)
    else:
        kernel = get_backend(backend).load(source)
    batch, seqlen_q, heads_q, head_dim = q.shape
    launch_grid = grid(seqlen_q, heads_q, batch, source.config.block_m)
    scale = 1.0 / math.sqrt(head_dim)

    def fn() -> torch.Tensor:
        out = torch.empty_like(q)
        lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
        stream = torch.cuda.current_stream(q.device).cuda_stream if q.is_cuda else 0
        kernel.launch(launch_grid, pack_args(q, k, v, out, lse, scale), stream=stream)
        return out

    return fn, f"{config.key()} (default)"
