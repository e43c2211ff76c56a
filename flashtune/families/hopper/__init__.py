"""The sm_90a forward family: FlashAttention's forward on wgmma for compute capability 9.0.

Same arguments, outputs, reference and tolerances as the mma.sync forward; it serves no op
(the warp-specialised family, ``ws.py``, serves "fwd" on cc 9.0 devices): a family to tune,
profile and compare (``--op fwd90a``). S = Q K^T by wgmma with Q and K in
128-byte-swizzled shared memory, P V by wgmma with P in registers and V MN-major in shared
memory, K/V tiles by cp.async into a stage ring guarded by full/empty mbarriers
(templates/hopper_fwd.cuh). Head dims 64, 128 and 256; one to three warpgroups of 64 query
rows (block_m 64, 128, 192) and key tiles of 64 to 256 rows in steps of 16 (space.py). The
warp-specialised family (``ws.py``) also takes head dim 192 (``head_dims``), V's head dim
other than Q/K's and Q/K head dims 512 and 576 (``max_head_dim``, ``split_head_dims``).
"""

from __future__ import annotations

from typing import ClassVar

from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.dtypes import SAME_16BIT
from flashtune.codegen.params import ParamSpace, Point, Value
from flashtune.codegen.render import TemplateValue
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.errors import InvalidConfig, InvalidProblem
from flashtune.families.base import element_params
from flashtune.families.fwd import ForwardFamily
from flashtune.families.hopper import space


class HopperForwardFamily(ForwardFamily):
    """The attention forward on wgmma (sm_90a) with cp.async consumers (serves no op)."""

    op = "fwd90a"
    title = "attention forward on wgmma for sm_90a (O and LSE)"
    template = "hopper_fwd.cu.jinja"
    dtypes = SAME_16BIT
    target_arch: ClassVar[str | None] = "sm_90a"
    serves: ClassVar[str | None] = None
    #: No attention features yet: problems with them are served by the mma.sync forward
    #: (``families.served_problem`` skips a family that refuses a problem).
    features: ClassVar[frozenset[str]] = frozenset()
    #: Q/K's and V's head dims up to 256 (whole 128-byte swizzle panels).
    head_dims: ClassVar[tuple[int, ...]] = space.HEAD_DIMS

    def check_problem(self, problem: Problem) -> None:
        super().check_problem(problem)
        # Q/K's head dims above 256 where the family takes them (its max_head_dim; the
        # warp-specialised one), V's never (O's accumulators).
        qk_dims = self.head_dims + tuple(d for d in space.WIDE_HEAD_DIMS
                                         if d <= self.max_head_dim)
        if problem.head_dim not in qk_dims:
            raise InvalidProblem(
                f"head_dim={problem.head_dim}: the sm_90a forward takes head dims "
                f"{qk_dims} (whole 128-byte swizzle panels); the mma.sync forward "
                "serves the others")
        if problem.v_head_dim not in self.head_dims:
            raise InvalidProblem(
                f"head_dim_v={problem.v_head_dim}: the sm_90a forward takes V head dims "
                f"{self.head_dims} (whole 128-byte swizzle panels, O's accumulators at most "
                "256); the mma.sync forward serves the others")

    def space(self, problem: Problem) -> ParamSpace:
        return space.SPACE

    def config(self, point: Point) -> KernelConfig:
        """The config of a point: num_warps from block_m; knobs at their defaults left out."""
        block_m = point["block_m"]
        if not isinstance(block_m, int):
            raise InvalidConfig(f"block_m={block_m!r} must be an int")
        return KernelConfig.from_dict(space.without_defaults(
            {**point, "num_warps": space.warps(block_m)}))

    def point(self, config: KernelConfig) -> dict[str, Value]:
        return {"block_m": config.block_m, "block_n": config.block_n,
                "num_stages": config.num_stages}

    def rules(self, problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
        return space.static_check(problem, config, arch)

    def default_config(self, problem: Problem, arch: ArchSpec) -> KernelConfig:
        """Two warpgroups (block_m 128), two stages as FA3 uses on sm90; the widest block_n
        whose accumulators stay within the register rule (128; 64 where Q/K's or V's head
        dim is above 128)."""
        block_n = 64 if max(problem.head_dim, problem.v_head_dim) > 128 else 128
        config = KernelConfig(block_m=128, block_n=block_n, num_warps=space.warps(128),
                              num_stages=2)
        return self.fitting(problem, config, arch)

    def default_reason(self, problem: Problem, arch: ArchSpec) -> str:
        return ("two consumer warpgroups (block_m 128) and two stages (FA3's sm90 choice); the "
                "widest key tile whose S, O and P accumulators fit the register rule")

    def template_params(self, problem: Problem, config: KernelConfig
                        ) -> dict[str, TemplateValue]:
        return {"head_dim": problem.head_dim, **element_params(problem),
                "causal": problem.causal, "block_m": config.block_m,
                "block_n": config.block_n, "num_warps": config.num_warps,
                "num_stages": config.num_stages}

    def smem_bytes(self, problem: Problem, config: KernelConfig) -> int:
        return space.smem_bytes(problem, config)


HOPPER_FORWARD = HopperForwardFamily()
