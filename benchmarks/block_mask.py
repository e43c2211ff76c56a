"""A block mask's build cost and the tiles it lets the forward and the backward skip, for
document masking.

A causal document mask over one packed sequence of ``--tokens`` tokens (8192 by default) cut
into documents of random lengths (seeded) is built with ``flashtune.create_block_mask``
(median of ``--repeats`` builds), and, for the query and key tile sizes of the forward's
default configs, the key tiles each query tile walks are counted against the dense count
(every query tile walking every key tile), with the walked tiles that are full (the kernel
evaluates no mask there); and, for the tiles of the backward's default configs (``bwd``),
the query tiles each key tile walks (the block mask's column form). torch's own
``create_block_mask`` on the same
mask is timed beside it when torch has it.

All figures are CPU figures on this host: build times in milliseconds of host time, and tile
counts that are exact properties of the mask and the tile sizes. No GPU time is measured.

    python benchmarks/block_mask.py
    python benchmarks/block_mask.py --tokens 16384 --documents 12 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_benchmarks_to_path  # noqa: E402

add_benchmarks_to_path()

import torch  # noqa: E402

from flashtune.api import flex_mods  # noqa: E402
from flashtune.api.block_mask import create_block_mask  # noqa: E402
from flashtune.codegen.arch import ARCHS  # noqa: E402
from flashtune.codegen.spec import DType, Problem  # noqa: E402
from flashtune.families.bwd import BACKWARD  # noqa: E402
from flashtune.families.fwd import FORWARD  # noqa: E402


def documents(tokens: int, count: int, seed: int) -> torch.Tensor:
    """int64 (tokens,): the document of each position, ``count`` documents of random
    lengths."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(tokens - 1, generator=gen)[: count - 1].add(1).sort().values
    ids = torch.zeros(tokens, dtype=torch.int64)
    for cut in cuts.tolist():
        ids[cut:] += 1
    return ids


def tile_sizes(head_dim: int, op: str = "fwd") -> list[tuple[str, int, int]]:
    """(arch, block_m, block_n) of the default configs of the forward (``op`` "fwd") or of
    the backward's main kernel ("bwd") for this head dim."""
    family = FORWARD if op == "fwd" else BACKWARD
    out = []
    for arch in ("sm_80", "sm_90"):
        config = family.default_config(Problem(head_dim, DType.FP16, op=op), ARCHS[arch])
        out.append((arch, config.block_m, config.block_n))
    return out


def measure(tokens: int, count: int, repeats: int, seed: int, head_dim: int = 128
            ) -> dict[str, Any]:
    """The build times and tile counts (see the module doc)."""
    mask_mod = flex_mods.document(documents(tokens, count, seed))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mask = create_block_mask(mask_mod, None, None, tokens, tokens)
        times.append(time.perf_counter() - start)
    tables = {}
    for op in ("fwd", "bwd"):
        rows = []
        for arch, block_m, block_n in tile_sizes(head_dim, op):
            ranges = mask.tiles(block_m, block_n, torch.device("cpu"), columns=op == "bwd")
            walked = int((ranges[..., 1] - ranges[..., 0]).sum())
            full = int((ranges[..., 3] - ranges[..., 2]).sum())
            dense = -(-tokens // block_m) * -(-tokens // block_n)
            rows.append({"arch": arch, "block_m": block_m, "block_n": block_n,
                         "tiles_walked": walked, "tiles_full": full, "tiles_dense": dense,
                         "skipped_fraction": 1 - walked / dense})
        tables[op] = rows
    result: dict[str, Any] = {"tokens": tokens, "documents": count, "seed": seed,
                              "build_ms_median": 1e3 * statistics.median(times),
                              "tiles": tables["fwd"], "backward_tiles": tables["bwd"],
                              "figures": "CPU host time; no GPU timing"}
    try:
        from torch.nn.attention.flex_attention import create_block_mask as torch_build
    except ImportError:
        return result
    torch_times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(repeats):
            start = time.perf_counter()
            torch_build(mask_mod, None, None, tokens, tokens, device="cpu")
            torch_times.append(time.perf_counter() - start)
    result["torch_build_ms_median"] = 1e3 * statistics.median(torch_times)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = measure(args.tokens, args.documents, args.repeats, args.seed)
    print(f"causal document mask, {result['tokens']} tokens, {result['documents']} documents "
          f"(seed {result['seed']}); CPU figures, no GPU timing")
    print(f"  flashtune.create_block_mask: {result['build_ms_median']:.1f} ms (median of "
          f"{args.repeats}, host CPU)")
    if "torch_build_ms_median" in result:
        print(f"  torch create_block_mask:     {result['torch_build_ms_median']:.1f} ms "
              "(same mask, host CPU)")
    for row in result["tiles"]:
        print(f"  {row['arch']} default tiles {row['block_m']}x{row['block_n']}: "
              f"{row['tiles_walked']} of {row['tiles_dense']} tiles walked "
              f"({row['tiles_full']} of them full: no mask evaluated), "
              f"{100 * row['skipped_fraction']:.1f}% skipped")
    for row in result["backward_tiles"]:
        print(f"  {row['arch']} backward default tiles {row['block_m']}x{row['block_n']}: "
              f"{row['tiles_walked']} of {row['tiles_dense']} tiles walked "
              f"({row['tiles_full']} of them full), "
              f"{100 * row['skipped_fraction']:.1f}% skipped")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
