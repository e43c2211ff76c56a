"""The warp-specialised sm_90a forward family (``fwd90aws``): FlashAttention-3's structure.

A producer warpgroup loads Q, K and V with TMA into a stage ring guarded by full/empty
mbarriers; one consumer warpgroup per 64 query rows (block_m 64, 128 or 192) runs the wgmma
math of the cp.async family (``fwd90a``), with ``setmaxnreg`` moving registers from the
producer to the consumers (space.WS_REGISTERS; templates/hopper_fwd_ws.cuh). The knob
``pingpong`` makes two consumer warpgroups take turns to issue their GEMMs (named barriers),
so one's softmax overlaps the other's GEMMs; the knob ``overlap`` makes each consumer
warpgroup issue key tile j's Q K^T together with tile j - 1's P V and run the softmax of
tile j while P V does (FA3's intra-warpgroup order: two or more stages, one S set and P, so
no accumulators more); with both a turn spans P V of tile j - 1 and Q K^T of tile j. Both
are on in the default config (``default_config``). The knobs
``loadq``, ``loadk`` and ``loadv`` choose per operand how the producer loads it: ``tma`` (one
lane issues a box, the default) or ``cpasync`` (its 128 threads copy 16-byte chunks into the
same swizzled layout; the producer then keeps 40 registers beside two or three consumers,
who get fewer: space.WS_REGISTERS, space.BUDGETS). Otherwise the
space, arguments, outputs, reference and tolerances are ``fwd90a``'s; the kernel takes three
tensor maps after the forward's arguments, built here from the launch's tensors and encoded
by the backend (runtime.tma); an operand loaded by cp.async ignores its map.

The features window, softcap, ALiBi, varlen and sinks are the forward's (``features``; their
run-time values the forward's arguments, before the tensor maps): the producer never loads
the key tiles below every row's window, the consumers mask only the tiles crossing an edge,
and with varlen the maps' row coordinate is the sequence's first packed row.

V's head dim may differ from Q/K's (``split_head_dims``: Q K^T over Q/K's, P V and O over
V's, each a whole number of 128-byte panels), and Q/K's may be 512 or 576 beside V's of at
most 256 (what each column chunk of ``api.forward`` launches): their own space
(``space.WIDE_WS_SPACE``, 32- to 64-key tiles, one or two consumer warpgroups, measured
register budgets) and a default per head dim (``WIDE_DEFAULTS``).

The config's num_warps counts the consumer warps (block_m / 16, as in ``fwd90a``); the block
has a producer warpgroup more (``threads``). It serves the forward on compute capability 9.0
devices (``serves``), each kernel checked against float64 on the device before its first
call (runtime.first_use; a failure falls back to the portable mma.sync forward). ``fwd90a``
serves nothing: it stays a family to tune and compare with.

The ping-pong kernels alone are a restriction of this family's space, not a family:
``--fix pingpong=1`` for ``flashtune tune``, ``profile``, ``compile``, ``space`` and
``show`` (families/fixed.py); the cost model reads the schedule from the knob
(``pingpong_on``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

from flashtune._lazy import lazy_module
from flashtune.codegen.abi import ArgValue, Element, EntryAbi, tensor_map
from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.features import tile_ranged
from flashtune.codegen.params import ParamSpace, Value
from flashtune.codegen.render import TemplateValue
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.codegen.tensormap import TensorMap, TmaSwizzle
from flashtune.errors import InvalidConfig, InvalidInput
from flashtune.families.base import element_type
from flashtune.families.fwd import variants
from flashtune.families.fwd.args import FWD_ABI, ExtraValues
from flashtune.families.hopper import HopperForwardFamily, space

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

#: Elements of one 128-byte swizzled panel row (16-bit types).
PANEL = 64
#: Threads of the producer warpgroup.
PRODUCER_THREADS = 128

#: The forward's arguments, then the tensor maps of Q, K and V (``hopper_fwd_ws.cu.jinja``).
WS_ABI = FWD_ABI.extended("hopper_fwd_ws", tensor_map("tmap_q", Element.Q),
                          tensor_map("tmap_k", Element.KV, wrap=True),
                          tensor_map("tmap_v", Element.KV))


def panel_map(t: torch.Tensor, rows: int) -> TensorMap:
    """The tensor map of a (batch, seq, heads, head_dim) 16-bit tensor viewed as (64
    elements, seq, head_dim / 64 panels, heads, batch), whose box (64, rows, head_dim / 64,
    1, 1) is a tile of ``rows`` rows in 128-byte-swizzled panels."""
    batch, seq, heads, dim = t.shape
    size = t.element_size()
    if t.dtype not in (torch.float16, torch.bfloat16) or t.stride(3) != 1:
        raise InvalidInput(f"a TMA tensor map needs a float16/bfloat16 tensor with a contiguous "
                           f"last dim; got {t.dtype} with strides {t.stride()}")
    dtype = element_type(t.dtype).element.tma
    s = t.stride()
    return TensorMap(dtype, t.data_ptr(), (PANEL, seq, dim // PANEL, heads, batch),
                     (s[1] * size, PANEL * size, s[2] * size, s[0] * size),
                     (PANEL, rows, dim // PANEL, 1, 1), TmaSwizzle.B128)


#: The defaults of Q/K head dims 512 and 576, in order of preference (the first the rules
#: pass): at 512 two consumer warpgroups share each 32-key K and V stage (two stages fill
#: 225 KiB) with ping-pong and overlap, as at the other head dims; at 576 one consumer
#: warpgroup (two would leave room for one stage only, which spills) with overlap; one
#: consumer warpgroup with 32 keys is the fallback of the rules at 512.
WIDE_DEFAULTS: Mapping[int, tuple[Mapping[str, Value], ...]] = {
    512: ({"block_m": 128, "block_n": 32, "num_stages": 2, space.PINGPONG: 1,
           space.OVERLAP: 1},
          {"block_m": 64, "block_n": 32, "num_stages": 2, space.OVERLAP: 1}),
    576: ({"block_m": 64, "block_n": 32, "num_stages": 2, space.OVERLAP: 1},),
}


def _register_heavy(problem: Problem) -> str | None:
    """The features of ``problem`` that need one consumer warpgroup's registers (block_m 64)
    at head dim 256, named; None when two fit."""
    if problem.head_dim != 256:
        return None
    if problem.alibi and (problem.window or problem.varlen):
        return "ALiBi with a window or varlen"
    if tile_ranged(problem.features):
        return "a block mask's tile ranges"
    return None


class HopperWsForwardFamily(HopperForwardFamily):
    """The warp-specialised attention forward on TMA and wgmma (sm_90a)."""

    op = "fwd90aws"
    title = ("attention forward for sm_90a, warp-specialised: TMA or cp.async producer, wgmma "
             "consumers")
    template = "hopper_fwd_ws.cu.jinja"
    serves: ClassVar[str | None] = "fwd"
    abi: ClassVar[EntryAbi | None] = WS_ABI
    #: Every attention feature of the forward. The window skips the key tiles outside
    #: every row's window (never loaded); softcap and ALiBi are softmax.cuh's score
    #: transforms, varlen the packed layout (the tensor maps' row coordinate is the
    #: sequence's first row), sinks sinks.cuh's denominator update, dropout dropout.cuh's
    #: mask on P's fragments (the wgmma fragments of P are mma.sync's, so the same
    #: positions draw the same mask as in the mma.sync kernels; FA3 has no dropout).
    features: ClassVar[frozenset[str]] = frozenset(
        {"window", "softcap", "alibi", "varlen", "sinks", "dropout"})
    #: Declared score modifications (traced ones included): softmax.cuh's ScoreTransform
    #: applies them to every tile's scores. A block mask's tile ranges narrow each block's
    #: key range (hopper_fwd.cuh's clip_to_block_mask: the producer never loads an empty
    #: tile) and its mask is evaluated on the partial tiles only.
    score_mods = True
    #: V's head dim may differ from Q/K's (P V and O over V's, Q K^T over Q/K's), and Q/K's
    #: may be 512 or 576 (spec.WIDE_HEAD_DIMS) beside V's of at most 256: the API's column
    #: chunks of a wider V each launch one (api/forward.py).
    split_head_dims = True
    max_head_dim = max(space.WIDE_HEAD_DIMS)
    head_dims = space.WS_HEAD_DIMS

    def space(self, problem: Problem) -> ParamSpace:
        return space.WIDE_WS_SPACE if space.wide(problem) else space.WS_SPACE

    def point(self, config: KernelConfig) -> dict[str, Value]:
        return {**super().point(config),
                **{name: space.knob(config, name) for name in space.WS_DEFAULTS}}

    def rules(self, problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
        """The space's rules, and the register limit of the features: at head dim 256 a
        window or varlen with ALiBi (row bounds, sequence offsets and the bias beside O's 128
        accumulators) or a block mask's tile ranges (the full range and the mask of partial
        tiles) spill under the 168 registers of two or three consumer warpgroups (ptxas,
        sm_90a)."""
        why = space.ws_check(problem, config, arch)
        heavy = _register_heavy(problem)
        if why is None and heavy and config.block_m > 64:
            why = (f"block_m={config.block_m}: at head dim 256 with {heavy} the kernel "
                   f"spills under the {space.ws_registers(config)[1]} registers of each of "
                   f"{config.block_m // 64} consumer warpgroups; expected block_m=64 (one "
                   "consumer warpgroup, 240 registers)")
        return why

    def smem_bytes(self, problem: Problem, config: KernelConfig) -> int:
        return space.smem_bytes(problem, config, warp_specialized=True)

    def default_config(self, problem: Problem, arch: ArchSpec) -> KernelConfig:
        """The cp.async family's default tile (block_m 128, two stages, block_n 128; 64 at
        head dim 256) with ping-pong and overlap on, FA3's structure: neither holds an
        accumulator more, so the register rule admits both wherever it admits the tile (if it
        ever did not, the tile alone). Where the features' register limit refuses two
        consumer warpgroups (``rules``), block_m 64 with overlap. Q/K head dims 512 and 576:
        WIDE_DEFAULTS's tile of the head dim (the first that passes the rules)."""
        if space.wide(problem):
            return self._wide_default(problem, arch)
        try:
            plain = super().default_config(problem, arch)
        except InvalidConfig:
            # The features' register limit (``rules``): one consumer warpgroup of 64 rows,
            # whose registers (240) hold them, with overlap (no ping-pong partner).
            narrow = self.config({"block_m": 64, "block_n": 64, "num_stages": 2,
                                  space.OVERLAP: 1})
            return self.fitting(problem, narrow, arch)
        both = self.config({**self.point(plain), space.PINGPONG: 1, space.OVERLAP: 1})
        return both if self.static_check(problem, both, arch) is None else plain

    def _wide_default(self, problem: Problem, arch: ArchSpec) -> KernelConfig:
        """The first of WIDE_DEFAULTS[head_dim] that passes the rules."""
        tiles = WIDE_DEFAULTS[problem.head_dim]
        for point in tiles:
            config = self.config(point)
            if self.static_check(problem, config, arch) is None:
                return config
        return self.fitting(problem, self.config(tiles[-1]), arch)

    def default_reason(self, problem: Problem, arch: ArchSpec) -> str:
        if space.wide(problem):
            return ("Q/K head dim above 256: a TMA producer and the widest tile whose Q rows "
                    "and two K and V stages fit shared memory (227 KiB), with overlap on; "
                    "one consumer warpgroup where two exceed it or the register rule")
        return ("a TMA producer warpgroup and two consumer warpgroups (block_m 128), two stages "
                "(FA3's sm90 choice), ping-pong and intra-warpgroup overlap on (FA3's order: no "
                "accumulators more); the widest key tile whose accumulators fit the register "
                "rule")

    def pingpong_on(self, config: KernelConfig) -> bool:
        """Whether ``config``'s consumer warpgroups take turns: its ``pingpong`` knob (the
        template's switch, and the schedule the cost model reads)."""
        return bool(space.knob(config, space.PINGPONG))

    def template_params(self, problem: Problem, config: KernelConfig
                        ) -> dict[str, TemplateValue]:
        producer, consumer = space.ws_registers(config)
        return {**super().template_params(problem, config),
                **variants.template_params(problem),
                "pingpong": self.pingpong_on(config),
                "overlap": bool(space.knob(config, space.OVERLAP)),
                **{f"tma_{name[-1]}": space.knob(config, name) == space.TMA
                   for name in space.LOAD_KNOBS},
                "producer_registers": producer, "consumer_registers": consumer,
                **({"head_dim_v": problem.v_head_dim} if problem.split_head_dims else {})}

    def threads(self, problem: Problem, config: KernelConfig) -> int:
        """The consumers' threads plus the producer warpgroup."""
        return config.threads + PRODUCER_THREADS

    def extra_values(self, config: KernelConfig) -> ExtraValues:
        """The tensor maps of Q (boxes of block_m rows), K and V (block_n rows)."""
        def maps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Mapping[str, ArgValue]:
            return {"tmap_q": panel_map(q, config.block_m),
                    "tmap_k": panel_map(k, config.block_n),
                    "tmap_v": panel_map(v, config.block_n)}
        return maps


HOPPER_WS_FORWARD = HopperWsForwardFamily()
