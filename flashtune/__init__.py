"""flashtune: autotuned, code-generated FlashAttention kernels for NVIDIA GPUs."""

from __future__ import annotations

__version__ = "0.1.0"
