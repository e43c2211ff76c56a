"""The split-KV decoding family (FlashDecoding): partial attention of a few query rows per
sequence over one split of a (paged) KV cache, written as float32 partial O and LSE per
split, with the query heads of a GQA group packed into the rows of one block
(templates/decode_split.cuh). The ``combine`` family merges the splits.

It serves ``Problem(op="decode", ...)``. A call's sizes beyond its Shape (page size,
per-sequence cache lengths, appended rows, split count) are a ``DecodeCase`` carried by the
Inputs; ``Shape.seqlen_k`` is the cache capacity per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from flashtune._lazy import lazy_module
from flashtune.codegen.abi import EntryAbi
from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.dtypes import SAME_16BIT
from flashtune.codegen.features import mods_of
from flashtune.codegen.params import ParamSpace, Point, Value
from flashtune.codegen.render import TemplateValue
from flashtune.codegen.spec import WIDE_HEAD_DIMS, KernelConfig, Problem, Shape, ShapeLike
from flashtune.families.base import (
    Inputs,
    KernelFamily,
    LaunchPlan,
    Tensors,
    Verdict,
    compare_outputs,
    element_params,
    generator,
    timing_window,
    with_timing_window,
)
from flashtune.families.checks import o_and_lse_checks
from flashtune.families.decode import space
from flashtune.families.decode.args import DECODE_ABI, decode_grid, pack_decode_args
from flashtune.families.decode.inputs import DecodeCase, draw_case, make_inputs
from flashtune.families.decode.reference import decode_reference
from flashtune.families.decode.shape_class import DEFAULT_CLASSES, ShapeClass
from flashtune.families.decode.splits import (
    SplitTable,
    fitting_split_size,
    heuristic_splits,
    window_keys,
)
from flashtune.families.decode.status import STATUS_WORDS, describe
from flashtune.families.fwd import variants
from flashtune.families.fwd.args import feature_values

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

#: A reference entry (optional) adding a per-element allowance to partial O's tolerance: a
#: family whose values are far from unit scale states its rounding bound there.
O_BOUND = "o_part_bound"
#: Page sizes a generic verification draws from (None: an unpaged cache).
VERIFY_PAGE_SIZES: tuple[int | None, ...] = (None, 1, 16, 64, 256)
#: The SM count a generic verification sizes its split count for (an H100 SXM's).
NOMINAL_SMS = 132
#: The key tile the generic split count assumes.
_NOMINAL_BLOCK_N = 64
#: What a tuning bucket is timed on by default: (batch, query heads), GQA group 4.
TUNING_BATCH_HEADS = ((1, 32), (16, 32), (64, 32))
TUNING_GROUP = 4
#: Serving shapes timed beside them at the bucket's length: (GQA group, query rows), the
#: large group of a speculative-decoding step.
TUNING_SERVING = ((8, 4),)
#: Cached rows (sequences x length) a timed shape holds at most: a few GB of cache.
TUNING_TOKENS = 1 << 20
#: The cache length a tuning candidate is verified on (at most).
VERIFY_CACHE = 300


def device_sms(device: torch.device | str) -> int:
    """The SM count of a CUDA device, NOMINAL_SMS for any other (the emulator's)."""
    device = torch.device(device)
    if device.type != "cuda":
        return NOMINAL_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def nominal_splits(shape: Shape, sm_count: int = NOMINAL_SMS, block_m: int = 64) -> int:
    """The heuristic split count of ``shape`` on a GPU of ``sm_count`` SMs, for the default
    tile (64 packed rows, 64-key blocks)."""
    group_rows = shape.heads_q // shape.heads_kv * shape.seqlen_q
    blocks = shape.batch * shape.heads_kv * -(-group_rows // block_m)
    return heuristic_splits(blocks, sm_count, -(-shape.seqlen_k // _NOMINAL_BLOCK_N))


class DecodeFamily(KernelFamily):
    """Split-KV partial attention over a (paged) KV cache."""

    op = "decode"
    title = "split-KV decoding over a paged KV cache (partial O and LSE per split)"
    template = "decode_split.cu.jinja"
    dtypes = SAME_16BIT
    features = frozenset({"window", "softcap", "alibi"})
    #: Declared score modifications (traced score_mod / mask_mod included) apply to every
    #: score after softcap and ALiBi, with the row's absolute position as q_idx; a block
    #: mask's key ranges clip the key tiles each block walks (``api.decode.
    #: decode_tile_ranges``: per query block of 16 absolute positions).
    score_mods = True
    tile_ranges_refused = None
    abi: ClassVar[EntryAbi | None] = DECODE_ABI
    default_shape_classes = DEFAULT_CLASSES
    #: V's head dim may differ from Q/K's (templates: DecodeWithHeadDimV), and Q/K's may be
    #: one of WIDE_HEAD_DIMS beside V's of at most MAX_HEAD_DIM (the API runs a wider V in
    #: column chunks: ``api.decode.run_decode``).
    split_head_dims = True
    max_head_dim = max(WIDE_HEAD_DIMS)

    def space(self, problem: Problem) -> ParamSpace:
        return space.SPACE

    def config(self, point: Point) -> KernelConfig:
        """The config of a point; splits 0 (the heuristic) and split_size 0 (none) are the
        config without the knob."""
        values = dict(point)
        for knob in (space.SPLITS, space.SPLIT_SIZE):
            if values.get(knob) == 0:
                del values[knob]
        return KernelConfig.from_dict(values)

    def point(self, config: KernelConfig) -> dict[str, Value]:
        return {**config.to_dict(), space.SPLITS: space.config_splits(config),
                space.SPLIT_SIZE: space.config_split_size(config)}

    def bind(self, problem: Problem, config: KernelConfig, inputs: Inputs) -> Inputs:
        """A config with a split count launches that many splits, one with a split size
        splits every sequence into pieces of that size (a one-bucket split table, read on
        the device; raised where the capacity would need more than MAX_SPLITS pieces,
        ``splits.fitting_split_size``); without either the inputs' own splits (the
        heuristic's count, when they were drawn) stay."""
        size = space.config_split_size(config)
        if size > 0:
            t = inputs.tensors
            pages = t["block_table"].shape[1] if "block_table" in t else 1
            capacity = t["k_cache"].shape[1] * pages
            table = SplitTable((), (fitting_split_size(size, capacity),))
            words = torch.tensor(table.words(), dtype=torch.int32,
                                 device=t["q"].device).view(-1, 2)
            return Inputs({**t, "split_table": words},
                          {**inputs.scalars, "num_splits": table.grid_splits(capacity)})
        splits = space.config_splits(config)
        if splits <= 0 or (splits == inputs.scalars["num_splits"]
                           and "split_table" not in inputs.tensors):
            return inputs
        tensors = {k: v for k, v in inputs.tensors.items() if k != "split_table"}
        return Inputs(tensors, {**inputs.scalars, "num_splits": splits})

    def tuning_shapes(self, problem: Problem, seqlen: int,
                      batch_heads: Sequence[tuple[int, int]], shape_class: str = ""
                      ) -> tuple[list[Shape], Shape]:
        """Over caches of ``seqlen`` and 3/4 of it, at each (batch, heads_q) pair (default
        TUNING_BATCH_HEADS; batches cut to TUNING_TOKENS cached rows in all): a bucket of a
        shape class at its group and query rows (heads raised to a multiple of the
        group), verified at them; a bucket without one at one new query row, GQA group
        TUNING_GROUP, and the TUNING_SERVING (group, query rows) at ``seqlen``, verified
        on a small cache that spans several key tiles."""
        verify_len = min(seqlen, VERIFY_CACHE)
        shapes: list[Shape] = []
        if shape_class:
            cls = ShapeClass.parse(shape_class)
            g, rows = cls.group, cls.rows
            for batch, heads in batch_heads or TUNING_BATCH_HEADS:
                heads = -(-heads // g) * g
                for length in (seqlen, max(1, seqlen * 3 // 4)):
                    fitting = max(1, min(batch, TUNING_TOKENS // length))
                    shape = Shape(fitting, heads, heads // g, rows, length)
                    if shape not in shapes:
                        shapes.append(shape)
            heads_kv = 1 if g >= 8 else 2  # emulator time: MQA for the large groups
            return shapes, Shape(2, g * heads_kv, heads_kv, rows, verify_len)
        for batch, heads in batch_heads or TUNING_BATCH_HEADS:
            group = TUNING_GROUP if heads % TUNING_GROUP == 0 else 1
            kinds = [(group, 1, seqlen), (group, 1, max(1, seqlen * 3 // 4))]
            kinds += [(g, rows, seqlen) for g, rows in TUNING_SERVING if heads % g == 0]
            for g, rows, length in kinds:
                fitting = max(1, min(batch, TUNING_TOKENS // length))
                shape = Shape(fitting, heads, heads // g, rows, length)
                if shape not in shapes:
                    shapes.append(shape)
        return shapes, Shape(2, 8, 2, 2, verify_len)

    def check_shape_class(self, problem: Problem, shape_class: str) -> None:
        """Decoding's classes are ``shape_class.ShapeClass`` words (``g8q4p16``)."""
        if shape_class:
            ShapeClass.parse(shape_class)

    def timing_inputs(self, problem: Problem, shape: Shape, device: torch.device | str,
                      shape_class: str = "") -> Inputs:
        """Random inputs over the class's page size (a bucket without a class: drawn as a
        verification draws it), the heuristic split count for ``device``; a window problem's
        window is ``timing_window`` (verification draws it at random)."""
        if not shape_class:
            return with_timing_window(self.random_inputs(problem, shape, device), shape)
        page = ShapeClass.parse(shape_class).page_size
        case = draw_case(shape, generator(device, None), page_sizes=(page,), append=True,
                         num_splits=nominal_splits(shape, device_sms(device)))
        return with_timing_window(self.random_inputs(problem, shape, device, case=case),
                                  shape)

    def rules(self, problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
        return space.static_check(problem, config, arch)

    def default_config(self, problem: Problem, arch: ArchSpec) -> KernelConfig:
        return space.default_entry(problem, arch)[0]

    def default_reason(self, problem: Problem, arch: ArchSpec) -> str:
        return space.default_entry(problem, arch)[1]

    def template_params(self, problem: Problem, config: KernelConfig
                        ) -> dict[str, TemplateValue]:
        return {"head_dim": problem.head_dim, "head_dim_padded": problem.padded_head_dim,
                **element_params(problem), "causal": problem.causal,
                "block_m": config.block_m, "block_n": config.block_n,
                "num_warps": config.num_warps, "num_stages": config.num_stages,
                "smem_row_pad": space.SMEM_ROW_PAD, **variants.template_params(problem),
                **({"head_dim_v": problem.v_head_dim,
                    "head_dim_v_padded": problem.padded_v_head_dim}
                   if problem.split_head_dims else {})}

    def smem_bytes(self, problem: Problem, config: KernelConfig) -> int:
        return space.smem_bytes(problem, config)

    def random_inputs(self, problem: Problem, shape: Shape, device: torch.device | str,
                      seed: int | None = None, case: DecodeCase | None = None) -> Inputs:
        """Inputs of ``case``; without one, a case drawn from the same seed: a page size of
        VERIFY_PAGE_SIZES, per-sequence lengths (ending anywhere in a page), seqlen_q
        appended rows, and the heuristic split count for ``device``; then the features'
        values (the forward's draws)."""
        gen = generator(device, seed)
        if case is None:
            case = draw_case(shape, gen, page_sizes=VERIFY_PAGE_SIZES, append=True,
                             num_splits=nominal_splits(shape, device_sms(device)))
        inputs = make_inputs(problem, shape, case, device, gen)
        if not problem.features:
            return inputs
        scalars, extra = variants.random_values(problem, shape, gen, device)
        return Inputs({**inputs.tensors, **extra}, {**inputs.scalars, **scalars})

    def empty_outputs(self, problem: Problem, shape: Shape, inputs: Inputs, *,
                      poison: bool) -> dict[str, torch.Tensor]:
        """Partial O and LSE (NaN when poisoned), a zeroed status, and the caches the kernel
        appends to in place (the inputs' own tensors)."""
        q = inputs.tensors["q"]
        batch, seqlen_q, heads_q, _ = q.shape
        dim = inputs.tensors["v_cache"].shape[3]  # V's (and O's) head dim
        splits = int(inputs.scalars["num_splits"])
        o_part = torch.empty(splits, batch, heads_q, seqlen_q, dim, dtype=torch.float32,
                             device=q.device)
        lse_part = torch.empty(splits, batch, heads_q, seqlen_q, dtype=torch.float32,
                               device=q.device)
        if poison:
            o_part.fill_(float("nan"))
            lse_part.fill_(float("nan"))
        status = torch.zeros(STATUS_WORDS, dtype=torch.int32, device=q.device)
        return {"o_part": o_part, "lse_part": lse_part, "status": status,
                "k_cache": inputs.tensors["k_cache"], "v_cache": inputs.tensors["v_cache"]}

    def cache_descales(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The caches' descale factors the kernel takes last (an FP8 cache's), or None."""
        return None

    def launch_plan(self, problem: Problem, config: KernelConfig, shape: Shape,
                    inputs: Inputs, outputs: Tensors) -> LaunchPlan:
        t = inputs.tensors
        splits = int(inputs.scalars["num_splits"])
        args = pack_decode_args(t["q"], t["k_cache"], t["v_cache"], t.get("k_new"),
                                t.get("v_new"), t.get("block_table"), t["cache_seqlens"],
                                outputs["o_part"], outputs["lse_part"], outputs["status"],
                                num_splits=splits, split_table=t.get("split_table"),
                                softmax_scale=inputs.scalars["softmax_scale"],
                                trap_on_error=False, features=problem.features,
                                feature_args=feature_values(
                                    problem, variants.VariantValues.of(inputs)),
                                descales=self.cache_descales(inputs))
        batch, seqlen_q, heads_q, _ = t["q"].shape
        grid = decode_grid(batch, heads_q, t["k_cache"].shape[2], seqlen_q, config.block_m,
                           splits)
        return LaunchPlan(grid, args)

    def reference(self, problem: Problem, inputs: Inputs) -> dict[str, torch.Tensor]:
        return decode_reference(inputs, problem.causal,
                                variants.VariantValues.of(inputs).only(problem),
                                tuple(mod for _, mod in mods_of(problem.features)))

    def compare(self, problem: Problem, shape: Shape, outputs: Tensors,
                reference: Tensors) -> Verdict:
        status = [int(w) for w in outputs["status"].tolist()]
        if any(status):
            k_cache = outputs["k_cache"]
            message = describe(status, seqlen_new=0, capacity=k_cache.shape[1],
                               num_pages=k_cache.shape[0])
            return Verdict(False, float("inf"), float("inf"),
                           f"the kernel refused its inputs on {shape.key()}: {message}")
        caches = []
        for name in ("k_cache", "v_cache"):
            got, want = outputs[name], reference[name]
            same = (got == want) | (torch.isnan(got) & torch.isnan(want))
            if not bool(same.all()):
                caches.append(f"{name}: {int((~same).sum())} elements differ from the cache "
                              "with the new rows appended")
        return compare_outputs(problem, shape, outputs, reference,
                               o_and_lse_checks(problem.dtypes.o, "o_part", "lse_part",
                                                "partial "), caches,
                               {"o_part": reference[O_BOUND]} if O_BOUND in reference else None)

    def flops(self, problem: Problem, shape: ShapeLike) -> float:
        """2 B Nq Nk Hq (D + Dv) over the full cache capacity (halved when causal with
        Nq = Nk): Q K^T over Q/K's head dim D, P V over V's Dv."""
        total = (2.0 * shape.batch * shape.seqlen_q * shape.seqlen_k * shape.heads_q
                 * (problem.head_dim + problem.v_head_dim))
        return total / 2 if problem.causal and shape.seqlen_q == shape.seqlen_k else total

    def min_bytes(self, problem: Problem, shape: ShapeLike) -> float:
        """K and V of the cache read once per kv head (each at its own head dim), Q read, O
        (the input type, V's head dim) and the float32 LSE written (one split writes them
        directly), all at the full capacity; a window problem reads only the keys inside
        its rows' windows (``timing_window``, as the tuner times it)."""
        e, d, dv = problem.dtype.itemsize, problem.head_dim, problem.v_head_dim
        q_rows = shape.batch * shape.heads_q * shape.seqlen_q
        left = timing_window(shape)[0] if problem.window else -1
        kv_rows = shape.batch * shape.heads_kv * window_keys(shape.seqlen_k, shape.seqlen_q,
                                                             left)
        return float(q_rows * d * e + kv_rows * (d + dv) * e + q_rows * (e * dv + 4))


DECODE = DecodeFamily()

__all__ = ["DECODE", "DecodeCase", "DecodeFamily", "nominal_splits"]
