"""The sm_90a backward family: FlashAttention's backward main kernel on wgmma for compute
capability 9.0 (``--op bwd90a``).

Same arguments, outputs, reference and tolerances as the mma.sync backward (``bwd``), whose
preprocess and convert row kernels surround it: one block per key tile (one warpgroup per 64
keys) steps over the query tiles, with S^T = K Q^T and dP^T = V dO^T by wgmma from swizzled
shared memory, P^T recomputed from the LSE, dV += P^T dO and dK += dS^T Q by wgmma with A
from registers (kept in float32 registers across the query loop), and dQ = dS K by wgmma
from the dS tile in shared memory, added to the float32 accumulator with atomics or, with
``dqmode=split``, into the block's own slice (deterministic: bitwise equal over block
orders). Loads are by all threads with cp.async (no producer warpgroup, TMA or stage ring in
this version; templates/hopper_bwd.cuh). Head dims 64, 128 and 256 (at 256, two warpgroups
per 64 keys, each owning half of the head dim of dK and dV), causal with the query tiles
above the diagonal skipped, GQA/MQA (dK, dV summed over the group in the block), and the
features window (query tiles outside a key tile's window skipped), softcap and varlen with
the mma.sync backward's declarations, and declared score modifications (their functor and
derivative, as flash_bwd.cuh applies them, at head dims 64 and 128, with a block mask's
tile ranges in their column form: each key tile skips the query tiles no row of which sees
it). It
serves ``bwd`` and ``bwddet`` on compute capability 9.0 after the first-use check.
"""

from __future__ import annotations

from typing import ClassVar

from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.features import mods_of
from flashtune.codegen.params import ParamSpace, Point, Value
from flashtune.codegen.render import TemplateValue
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.errors import FeatureNotSupported, InvalidConfig, InvalidProblem
from flashtune.families.base import element_params
from flashtune.families.bwd import BackwardFamily
from flashtune.families.bwd90a import space
from flashtune.families.fwd import variants

#: The largest head dim whose kernels hold a score modification's functor without spilling:
#: at 128 two warpgroups share each 64 keys, each owning half of dK and dV
#: (``space.dim_groups``); at 256 a half is 128 float registers per thread again.
MAX_MOD_HEAD_DIM = 128


class HopperBackwardFamily(BackwardFamily):
    """The attention backward main kernel on wgmma (sm_90a); serves ``bwd`` on cc 9.0."""

    op = "bwd90a"
    title = "attention backward on wgmma for sm_90a (dK, dV and the float32 dQ accumulator)"
    template = "hopper_bwd.cu.jinja"
    target_arch: ClassVar[str | None] = "sm_90a"
    serves: ClassVar[str | None] = "bwd"
    #: The sliding window, softcap and varlen; problems with other features stay on the
    #: mma.sync backward.
    features: ClassVar[frozenset[str]] = frozenset({"window", "softcap", "varlen"})
    #: Declared score modifications with their derivatives (P of the modified score, dS
    #: times the slope, the dscore buffer for captured tensors' gradients), and a block
    #: mask's tile ranges in their column form (each key tile walks only the query tiles
    #: holding a row that sees one of its keys; the mask is evaluated on partial tiles).
    score_mods = True

    def check_problem(self, problem: Problem) -> None:
        super().check_problem(problem)
        if mods_of(problem.features) and problem.head_dim > MAX_MOD_HEAD_DIM:
            raise FeatureNotSupported(
                f"the {self.op!r} kernel family takes score modifications up to head dim "
                f"{MAX_MOD_HEAD_DIM}: at {problem.head_dim} its dK and dV accumulators leave "
                "the functor no registers even split over two warpgroups (NVRTC 13 spills "
                "8-72 B at 256); the mma.sync backward ('bwd') serves them")
        if problem.head_dim not in space.HEAD_DIMS:
            raise InvalidProblem(
                f"head_dim={problem.head_dim}: the sm_90a backward takes head dims "
                f"{space.HEAD_DIMS} (whole 128-byte swizzle panels, dK and dV in registers); "
                "the mma.sync backward (op 'bwd') serves the others")

    def space(self, problem: Problem) -> ParamSpace:
        return space.DETERMINISTIC_SPACE if self.deterministic else space.SPACE

    def config(self, point: Point) -> KernelConfig:
        """The config of a point: num_warps is a warpgroup's 4 (one 16-row slab each of the
        64-row query tile); the block has one such warpgroup per 64 keys (``threads``)."""
        block_m = point["block_m"]
        if not isinstance(block_m, int):
            raise InvalidConfig(f"block_m={block_m!r} must be an int")
        return KernelConfig.from_dict({**point, "num_warps": space.WARPS})

    def threads(self, problem: Problem, config: KernelConfig) -> int:
        """128 threads (a warpgroup) per 64 keys of the key tile."""
        return space.threads(problem, config)

    def compute_warps(self, problem: Problem, config: KernelConfig) -> int:
        """Every warp of the block issues wgmma (no producer warpgroup)."""
        return space.threads(problem, config) // 32

    def point(self, config: KernelConfig) -> dict[str, Value]:
        return {"block_m": config.block_m, "block_n": config.block_n,
                "num_stages": config.num_stages, "dqmode": space.dq_mode(config)}

    def rules(self, problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
        return space.static_check(problem, config, arch, deterministic=self.deterministic)

    def default_config(self, problem: Problem, arch: ArchSpec) -> KernelConfig:
        """Two warpgroups over 128 keys (FA3's block_n at head dims 64 and 128), or at head
        dim 256 over 64 keys (each owning half of dK and dV; FA3's 64 x 64 tile at d256),
        query tiles of 64 rows, dQ by float32 atomics (the deterministic family: slices)."""
        block_n = 64 if space.dim_groups(problem) > 1 else 128
        mode = space.DQ_SPLIT if self.deterministic else space.DQ_ATOMIC
        config = self.config({"block_m": 64, "block_n": block_n, "num_stages": 1,
                              "dqmode": mode})
        return self.fitting(problem, config, arch)

    def default_reason(self, problem: Problem, arch: ArchSpec) -> str:
        mode = ("per-block slices summed in a fixed order" if self.deterministic
                else "float32 atomics")
        if space.dim_groups(problem) > 1:
            why = ("FA3's sm90 tile at head dim 256" if problem.head_dim > 128 else
                   "the registers of a score modification's functor")
            return ("two warpgroups over 64 keys, each owning half of the head dim of dK and "
                    f"dV, and query tiles of 64 rows ({why}); dQ by {mode}")
        return ("two warpgroups over 128 keys and query tiles of 64 rows (FA3's sm90 tiles at "
                f"head dims 64 and 128); dQ by {mode}")

    def template_params(self, problem: Problem, config: KernelConfig
                        ) -> dict[str, TemplateValue]:
        return {"head_dim": problem.head_dim, **element_params(problem),
                "causal": problem.causal, "block_m": config.block_m,
                "block_n": config.block_n,
                "dq_split": space.dq_mode(config) == space.DQ_SPLIT,
                **variants.template_params(problem)}

    def smem_bytes(self, problem: Problem, config: KernelConfig) -> int:
        return space.smem_bytes(problem, config)


class HopperDeterministicBackwardFamily(HopperBackwardFamily):
    """The sm_90a backward main kernel of ``deterministic=True``: dQ in per-block slices
    only (bitwise equal over block orders); serves ``bwddet`` on cc 9.0."""

    op = "bwd90adet"
    title = ("attention backward on wgmma for sm_90a, deterministic (dQ slices summed in a "
             "fixed order)")
    serves: ClassVar[str | None] = "bwddet"
    deterministic = True


HOPPER_BACKWARD = HopperBackwardFamily()
HOPPER_BACKWARD_DETERMINISTIC = HopperDeterministicBackwardFamily()
