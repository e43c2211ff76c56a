"""The sample tuning bundle shipped with flashtune, for trying sharing without a GPU.

``h100-sample.json`` holds 72 fp16 forward trials (head dim 128, causal and not, buckets 1k,
4k and 16k) of a device named "NVIDIA H100 80GB HBM3 (flashtune sample)" on the host
``flashtune-sample``. They are NOT measurements: the best config of each bucket runs at
FlashAttention-2's published H100 forward TFLOP/s and the others slower by the ratio of
their cost-model predictions (docs/sample_bundle.py derives them and regenerates the file).
No GPU reports that device name, so the sample serves a real GPU only through the
fallback (same_arch) tier, which needs the import to be trusted (``--trust``).
"""

from __future__ import annotations

from pathlib import Path

#: The bundle file (package data).
SAMPLE_BUNDLE = Path(__file__).resolve().parent / "h100-sample.json"
#: The provenance ``source`` an import of the sample records (what ``db show`` and
#: ``explain`` print as its origin).
SAMPLE_SOURCE = ("flashtune sample bundle h100-sample.json: derived from published H100 "
                 "figures, not measured")
#: The sample's device: a name no GPU reports.
SAMPLE_DEVICE = "NVIDIA H100 80GB HBM3 (flashtune sample)"
