"""Decoding throughput: flashtune.attention_with_kvcache (and torch's SDPA, and flash-attn's
flash_attn_with_kvcache where installed) against the copy bandwidth of the same GPU,
measured in the same run.

Decoding reads the whole KV cache once per step, so its speed limit is memory bandwidth:
each point reports the bytes it must move (K and V of every sequence once per kv head, Q,
the new rows and the output) over its median time, and that bandwidth as a share of the
device's copy bandwidth (a large device-to-device copy, read + write, timed the same way).

Sweep: 1 or 4 new query rows per sequence (appended into the cache, causal), 32 query
heads of dim 128 in bf16; batch 1 to 128, cache length 1k to 128k, GQA group 1, 4, 8 and
16, unpaged or paged with 1-, 16-, 64- and 256-row pages. Points whose cache would exceed
--memory-gb are skipped (and listed). torch's SDPA runs unpaged caches only (it has no
block table: the gather would be what is timed): the new rows are copied into the cache
and SDPA attends over the whole capacity with a bottom-right causal mask. Each
implementation is checked first (sequence 0 of its output against a float32 reference of
its keys; the output lands on NaN-poisoned memory), then timed with CUDA events after
warm-up, L2 flushed before each repeat; the median is reported.

    python benchmarks/decode.py --out .bench/decode                # the full sweep
    python benchmarks/decode.py --batches 1,64 --cache-lens 4096,65536 --time-budget 120
    python benchmarks/decode.py --dry                               # print the plan, no GPU

Writes DIR/decode.csv (rewritten after every point) and DIR/decode_env.json. Exit status:
0 ok, 1 some flashtune output was wrong or failed, 2 no GPU (or bad arguments), 124 stopped
by SIGTERM after writing what was measured.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _attention_impls import REL_ERR_TOLERANCE, L2Flusher, Unavailable, time_cuda  # noqa: E402
from _common import (  # noqa: E402
    Deadline,
    Stats,
    add_benchmarks_to_path,
    environment_info,
    write_csv,
    write_json,
)

HEADS_Q = 32
HEAD_DIM = 128
BATCHES = (1, 4, 16, 64, 128)
CACHE_LENS = (1024, 4096, 16384, 65536, 131072)
GROUPS = (1, 4, 8, 16)
PAGE_SIZES: tuple[int | None, ...] = (None, 1, 16, 64, 256)
QUERY_ROWS = (1, 4)
IMPLS = ("flashtune", "torch-sdpa", "flash-attn")
COPY_BYTES = 1 << 30
CSV_FIELDS = ("date_utc", "gpu", "impl", "batch", "cache_len", "group", "heads_kv",
              "page_size", "query_rows", "status", "median_ms", "min_ms", "max_ms", "repeats",
              "gb_per_s", "share_of_copy", "copy_gb_per_s", "rel_err", "note")


@dataclass(frozen=True)
class Point:
    """One point of the sweep."""

    batch: int
    cache_len: int
    group: int
    page_size: int | None
    query_rows: int = 1

    @property
    def heads_kv(self) -> int:
        return HEADS_Q // self.group

    @property
    def cache_bytes(self) -> int:
        """K and V of the whole cache (bf16)."""
        return 2 * self.batch * self.cache_len * self.heads_kv * HEAD_DIM * 2

    @property
    def min_bytes(self) -> int:
        """What a step must move: the cache once, Q and the new K/V rows read, the new rows
        and O written."""
        q_rows = self.batch * HEADS_Q * self.query_rows
        new_rows = self.batch * self.heads_kv * self.query_rows
        return self.cache_bytes + (2 * q_rows + 4 * new_rows) * HEAD_DIM * 2

    def label(self) -> str:
        paged = "unpaged" if self.page_size is None else f"page{self.page_size}"
        return f"b{self.batch} n{self.cache_len} g{self.group} q{self.query_rows} {paged}"


@dataclass(frozen=True)
class Result:
    point: Point
    impl: str
    status: str  # ok, wrong, error, unavailable, skipped, planned
    stats: Stats | None = None
    rel_err: float | None = None
    note: str = ""

    def gb_per_s(self) -> float | None:
        if self.stats is None or self.status != "ok":
            return None
        return self.point.min_bytes / (self.stats.median * 1e-3) / 1e9

    def row(self, gpu: str, copy_gb_per_s: float | None) -> dict[str, Any]:
        p, bw = self.point, self.gb_per_s()
        return {"gpu": gpu, "impl": self.impl, "batch": p.batch, "cache_len": p.cache_len,
                "group": p.group, "heads_kv": p.heads_kv, "page_size": p.page_size or "",
                "query_rows": p.query_rows, "status": self.status,
                "median_ms": self.stats.median if self.stats else None,
                "min_ms": self.stats.minimum if self.stats else None,
                "max_ms": self.stats.maximum if self.stats else None,
                "repeats": self.stats.count if self.stats else None, "gb_per_s": bw,
                "share_of_copy": bw / copy_gb_per_s if bw and copy_gb_per_s else None,
                "copy_gb_per_s": copy_gb_per_s, "rel_err": self.rel_err, "note": self.note}


def plan(batches: Sequence[int], cache_lens: Sequence[int], groups: Sequence[int],
         page_sizes: Sequence[int | None], query_rows: Sequence[int] = (1,)) -> list[Point]:
    return [Point(b, n, g, p, r) for r in query_rows for g in groups for p in page_sizes
            for n in cache_lens for b in batches]


def describe_plan(points: Sequence[Point], impls: Sequence[str], too_big: Sequence[Point],
                  memory_gb: float) -> str:
    """The plan as text: its axes, how many points each implementation runs, and the
    largest cache it touches."""
    def axis(values: set[Any]) -> str:
        return ", ".join("none" if v is None else str(v) for v in
                         sorted(values, key=lambda v: -1 if v is None else v))

    runs = [p for p in points if p not in too_big]
    lines = [
        f"decode sweep: {len(points)} points, {HEADS_Q} query heads of dim {HEAD_DIM}, bf16, "
        "causal, new rows appended",
        f"  batch:       {axis({p.batch for p in points})}",
        f"  cache len:   {axis({p.cache_len for p in points})}",
        f"  GQA group:   {axis({p.group for p in points})}",
        f"  query rows:  {axis({p.query_rows for p in points})}",
        f"  page size:   {axis({p.page_size for p in points})}",
        f"  skipped:     {len(too_big)} points whose cache exceeds {memory_gb} GB",
        "  peak:        a device-to-device copy of "
        f"{COPY_BYTES >> 20} MiB, timed once in the same run",
        "  figures:     GB/s = bytes a step must move / median time; share of the copy's GB/s",
    ]
    for impl in impls:
        runnable = [p for p in runs if impl != "torch-sdpa" or p.page_size is None]
        lines.append(f"  {impl:12s} {len(runnable)} points"
                     + (" (unpaged only)" if impl == "torch-sdpa" else "")
                     + (" (page sizes that are multiples of 256, when installed)"
                        if impl == "flash-attn" else ""))
    if runs:
        most = max(runs, key=lambda p: p.cache_bytes)
        lines.append(f"  largest:     {most.label()} ({most.cache_bytes / 1e9:.1f} GB of K/V)")
    return "\n".join(lines)


# --- inputs and implementations ------------------------------------------------------------


@dataclass
class DecodeInputs:
    """One step: q (B, R, Hq, D), the cache (unpaged or pages in random order), lengths
    cache_len - R and R new K/V rows per sequence (R = the point's query rows)."""

    q: Any
    k_cache: Any
    v_cache: Any
    cache_seqlens: Any
    block_table: Any
    k_new: Any
    v_new: Any


def make_inputs(point: Point, gen: Any, device: str = "cuda") -> DecodeInputs:
    import torch

    dev, dt = device, torch.bfloat16
    b, hkv, nq = point.batch, point.heads_kv, point.query_rows

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=dev, dtype=dt)

    q = randn(b, nq, HEADS_Q, HEAD_DIM)
    if point.page_size is None:
        shape: tuple[int, ...] = (b, point.cache_len, hkv, HEAD_DIM)
        table = None
    else:
        slots = -(-point.cache_len // point.page_size)
        order = torch.randperm(b * slots, generator=gen, device=dev)
        table = order.view(b, slots).to(torch.int32)
        shape = (b * slots, point.page_size, hkv, HEAD_DIM)
    lengths = torch.full((b,), point.cache_len - nq, dtype=torch.int32, device=dev)
    return DecodeInputs(q, randn(*shape), randn(*shape), lengths, table,
                        randn(b, nq, hkv, HEAD_DIM), randn(b, nq, hkv, HEAD_DIM))


def reference_first(x: DecodeInputs, point: Point) -> Any:
    """float32 O (R, Hq, D) of sequence 0, from its cache rows and the new rows (query row
    i sees keys j <= n + i, n its cache length: bottom-right causal)."""
    import torch

    n = point.cache_len - point.query_rows
    positions = torch.arange(n, device=x.q.device)
    if x.block_table is None:
        keys, values = x.k_cache[0, :n], x.v_cache[0, :n]
    else:
        page_size = x.k_cache.shape[1]
        pages = x.block_table[0, positions // page_size].long()
        keys = x.k_cache[pages, positions % page_size]
        values = x.v_cache[pages, positions % page_size]
    keys = torch.cat([keys, x.k_new[0]]).float().repeat_interleave(point.group, dim=1)
    values = torch.cat([values, x.v_new[0]]).float().repeat_interleave(point.group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", x.q[0].float(), keys) / math.sqrt(HEAD_DIM)
    rows = torch.arange(point.query_rows, device=x.q.device)[:, None]
    cols = torch.arange(keys.shape[0], device=x.q.device)[None, :]
    scores = scores.masked_fill(cols > rows + n, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)


def prepare(impl: str, x: DecodeInputs, point: Point) -> Callable[[], Any]:
    """The call of ``impl`` on these inputs (Unavailable when it cannot run here)."""
    if impl == "flashtune":
        import flashtune

        return lambda: flashtune.attention_with_kvcache(
            x.q, x.k_cache, x.v_cache, x.cache_seqlens, block_table=x.block_table,
            k=x.k_new, v=x.v_new, causal=True)
    if impl == "torch-sdpa":
        return _sdpa(x, point)
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError as exc:
        raise Unavailable(f"flash-attn is not installed ({exc})") from None
    if point.page_size is not None and point.page_size % 256:
        raise Unavailable("flash-attn's paged KV needs a page size that is a multiple of 256")
    return lambda: flash_attn_with_kvcache(
        x.q, x.k_cache, x.v_cache, k=x.k_new, v=x.v_new, cache_seqlens=x.cache_seqlens,
        block_table=x.block_table, causal=True)


def _sdpa(x: DecodeInputs, point: Point) -> Callable[[], Any]:
    """torch's SDPA on an unpaged cache: the new rows copied in, then attention over the
    cache's rows with a bottom-right causal mask (GQA by ``enable_gqa``)."""
    import torch
    import torch.nn.functional as F

    if x.block_table is not None:
        raise Unavailable("torch SDPA has no paged KV (a gather would be what is timed)")
    n, nq = point.cache_len - point.query_rows, point.query_rows
    rows = torch.arange(nq, device=x.q.device)[:, None]
    mask = torch.arange(point.cache_len, device=x.q.device)[None, :] <= rows + n
    q = x.q.transpose(1, 2)

    def call() -> Any:
        x.k_cache[:, n:n + nq] = x.k_new
        x.v_cache[:, n:n + nq] = x.v_new
        out = F.scaled_dot_product_attention(q, x.k_cache.transpose(1, 2),
                                             x.v_cache.transpose(1, 2), attn_mask=mask,
                                             enable_gqa=point.group > 1)
        return out.transpose(1, 2)

    return call


def copy_bandwidth(warmup: int, repeats: int) -> float:
    """GB/s of a device-to-device copy of COPY_BYTES (bytes read + written per time)."""
    import torch

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    times = time_cuda(lambda: dst.copy_(src), warmup=warmup, repeats=repeats,
                      flush=lambda: None)
    return 2 * COPY_BYTES / (Stats.of(times).median * 1e-3) / 1e9


def measure(impl: str, point: Point, x: DecodeInputs, ref: Any, *, warmup: int,
            repeats: int, flush: Callable[[], None]) -> Result:
    import torch

    try:
        fn = prepare(impl, x, point)
        out = fn()
        torch.cuda.synchronize()
        err = float((out[0].float() - ref).norm() / ref.norm())
        if not (bool(out.isfinite().all()) and err <= REL_ERR_TOLERANCE):
            return Result(point, impl, "wrong", rel_err=err,
                          note=f"relative error {err:.3g} > {REL_ERR_TOLERANCE}")
        times = time_cuda(fn, warmup=warmup, repeats=repeats, flush=flush)
    except Unavailable as exc:
        return Result(point, impl, "unavailable", note=str(exc))
    except Exception as exc:  # one failure must not end the sweep
        return Result(point, impl, "error", note=f"{type(exc).__name__}: {exc}"[:300])
    return Result(point, impl, "ok", Stats.of(times), rel_err=err)


# --- command line ------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", ",").split(",") if x]


def _pages(text: str) -> list[int | None]:
    return [None if x in ("none", "0") else int(x) for x in text.split(",") if x]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=_ints, default=list(BATCHES))
    p.add_argument("--cache-lens", type=_ints, default=list(CACHE_LENS))
    p.add_argument("--groups", type=_ints, default=list(GROUPS),
                   help=f"GQA group sizes dividing {HEADS_Q} (default 1,4,8,16)")
    p.add_argument("--query-rows", type=_ints, default=list(QUERY_ROWS),
                   help="new query rows per sequence (default 1,4)")
    p.add_argument("--page-sizes", type=_pages, default=list(PAGE_SIZES),
                   help="comma list of page sizes, 'none' for an unpaged cache")
    p.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS))
    p.add_argument("--memory-gb", type=float, default=40.0,
                   help="skip points whose K/V cache exceeds this many GB (default 40)")
    p.add_argument("--out", type=Path, default=Path(".bench/decode"))
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry", action="store_true",
                   help="print the plan, write it (status 'planned') and exit; needs no GPU")
    args = p.parse_args(argv)
    for g in args.groups:
        if g < 1 or HEADS_Q % g:
            p.error(f"--groups: {g} must divide {HEADS_Q}")
    for name in args.impls:
        if name not in IMPLS:
            p.error(f"--impls: {name!r} is not one of {list(IMPLS)}")
    if not args.batches or not args.cache_lens or min(args.batches) < 1 or min(
            args.cache_lens) < 2:
        p.error("--batches must be >= 1 and --cache-lens >= 2 (a cached row and the new one)")
    if not args.query_rows or min(args.query_rows) < 1 or min(args.cache_lens) <= max(
            args.query_rows):
        p.error("--query-rows must be >= 1 and below every --cache-lens")
    if any(s is not None and s < 1 for s in args.page_sizes):
        p.error("--page-sizes must be >= 1 (or none)")
    if args.warmup < 1 or args.repeats < 1:
        p.error("--warmup and --repeats must be >= 1")
    return args


class _Terminated(Exception):
    pass


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    add_benchmarks_to_path()
    points = plan(args.batches, args.cache_lens, args.groups, args.page_sizes,
                  args.query_rows)
    env = environment_info(probe_gpu=not args.dry)
    env["command"] = " ".join(["python", *sys.argv]) if argv is None else " ".join(argv)
    csv_path, gpu = args.out / "decode.csv", str(env.get("gpu") or "no GPU")
    results: list[Result] = []
    copy_bw: list[float] = []

    def save() -> None:
        bw = copy_bw[0] if copy_bw else None
        write_csv(csv_path, CSV_FIELDS, [{"date_utc": env["date_utc"], **r.row(gpu, bw)}
                                         for r in results])

    too_big = [p for p in points if p.cache_bytes > args.memory_gb * 1e9]
    if args.dry:
        results += [Result(p, i, "skipped" if p in too_big else "planned",
                           note="over --memory-gb" if p in too_big else "")
                    for p in points for i in args.impls]
        save()
        write_json(args.out / "decode_env.json", env)
        print(describe_plan(points, args.impls, too_big, args.memory_gb))
        print(f"planned {len(points) - len(too_big)} points x {len(args.impls)} "
              f"implementations ({len(too_big)} over {args.memory_gb} GB skipped) -> "
              f"{csv_path}")
        return 0

    import torch

    if not torch.cuda.is_available():
        print("error: benchmarks/decode.py needs a CUDA GPU and torch sees none; pass --dry "
              "to list the sweep", file=sys.stderr)
        return 2
    write_json(args.out / "decode_env.json", env)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    status = 0
    try:
        copy_bw.append(copy_bandwidth(args.warmup, args.repeats))
        print(f"copy bandwidth: {copy_bw[0]:.0f} GB/s")
        flush = L2Flusher(torch.device("cuda"))
        gen = torch.Generator(device="cuda").manual_seed(args.seed)
        deadline = Deadline(args.time_budget)
        for point in points:
            if point in too_big or deadline.expired():
                note = "over --memory-gb" if point in too_big else "time budget spent"
                results += [Result(point, i, "skipped", note=note) for i in args.impls]
                continue
            x = make_inputs(point, gen)
            ref = reference_first(x, point)
            for impl in args.impls:
                results.append(measure(impl, point, x, ref, warmup=args.warmup,
                                       repeats=args.repeats, flush=flush))
                save()
                r = results[-1]
                bw = r.gb_per_s()
                shown = f"{bw:.0f} GB/s ({bw / copy_bw[0]:.0%} of copy)" if bw else r.status
                print(f"{impl:10s} {point.label():28s} {shown} {r.note}")
            del x, ref
            torch.cuda.empty_cache()
    except (_Terminated, KeyboardInterrupt):
        print("interrupted: reporting what was measured", file=sys.stderr)
        status = 124
    finally:
        signal.signal(signal.SIGTERM, previous)
        save()
    bad = [r for r in results if r.impl == "flashtune" and r.status in ("wrong", "error")]
    for r in bad:
        print(f"FAILED flashtune {r.point.label()}: {r.status}: {r.note}", file=sys.stderr)
    print(f"wrote {csv_path}")
    return status or (1 if bad else 0)


if __name__ == "__main__":
    sys.exit(main())
