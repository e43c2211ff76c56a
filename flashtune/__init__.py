"""flashtune: autotuned, code-generated FlashAttention kernels for NVIDIA GPUs.

The public API is imported lazily (on first attribute access), so ``import flashtune`` and
the command line stay fast and do not import torch until attention is used.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from flashtune._lazy import lazy_exports
from flashtune._version import __version__

_EXPORTS: dict[str, str] = {
    "attention": "flashtune.api.ops",
    "scaled_dot_product_attention": "flashtune.api.ops",
    "explain": "flashtune.api.ops",
    "attention_with_kvcache": "flashtune.api.kvcache_ops",
    "attention_varlen": "flashtune.api.varlen_ops",
    "attention_fp8": "flashtune.api.fp8_train",
    "flex_attention": "flashtune.api.flex_call",
    "create_block_mask": "flashtune.api.block_mask",
    "BlockMask": "flashtune.api.block_mask",
    "register_transformers": "flashtune.api.hf_transformers",
    "register_sdpa": "flashtune.api.sdpa_routing",
    "explain_kvcache": "flashtune.api.kvcache_ops",
    "quantize_mla_latent": "flashtune.api.mla",
    "BackwardNotAvailable": "flashtune.errors",
    "FeatureNotSupported": "flashtune.errors",
    "Decision": "flashtune.runtime.dispatch",
    "Tier": "flashtune.runtime.dispatch",
    "Problem": "flashtune.codegen.spec",
    "ProblemBucket": "flashtune.codegen.spec",
    "KernelConfig": "flashtune.codegen.spec",
    "DType": "flashtune.codegen.spec",
    "families": "flashtune.families",
    "DeviceInfo": "flashtune.runtime.device",
    "precompile": "flashtune.runtime.precompile",
}

__all__ = [
    "BackwardNotAvailable",
    "BlockMask",
    "DType",
    "FeatureNotSupported",
    "Decision",
    "DeviceInfo",
    "KernelConfig",
    "Problem",
    "ProblemBucket",
    "families",
    "flex_attention",
    "Tier",
    "__version__",
    "attention",
    "attention_fp8",
    "attention_varlen",
    "attention_with_kvcache",
    "create_block_mask",
    "explain",
    "explain_kvcache",
    "precompile",
    "quantize_mla_latent",
    "register_sdpa",
    "register_transformers",
    "scaled_dot_product_attention",
]

if TYPE_CHECKING:
    from flashtune import families
    from flashtune.api.block_mask import BlockMask, create_block_mask
    from flashtune.api.flex_call import flex_attention
    from flashtune.api.fp8_train import attention_fp8
    from flashtune.api.hf_transformers import register_transformers
    from flashtune.api.kvcache_ops import attention_with_kvcache, explain_kvcache
    from flashtune.api.mla import quantize_mla_latent
    from flashtune.api.ops import (
        attention,
        explain,
        scaled_dot_product_attention,
    )
    from flashtune.api.sdpa_routing import register_sdpa
    from flashtune.api.varlen_ops import attention_varlen
    from flashtune.codegen.spec import DType, KernelConfig, Problem, ProblemBucket
    from flashtune.errors import BackwardNotAvailable, FeatureNotSupported
    from flashtune.runtime.device import DeviceInfo
    from flashtune.runtime.dispatch import Decision, Tier
    from flashtune.runtime.precompile import precompile


def _configure_logging() -> None:
    """With FLASHTUNE_LOG_LEVEL set, log the 'flashtune' logger to stderr at that level
    (e.g. ``debug`` shows every dispatch decision). Unset, logging is left to the
    application."""
    from flashtune import settings
    from flashtune.errors import SettingError

    if not settings.LOG_LEVEL.is_set():
        return
    logger = logging.getLogger("flashtune")
    try:
        logger.setLevel(settings.LOG_LEVEL.get().upper())
    except SettingError as exc:
        logger.warning("%s", exc)
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
    logger.addHandler(handler)


_configure_logging()

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
