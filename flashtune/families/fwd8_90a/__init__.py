"""The FP8 forward on sm_90a wgmma (FlashAttention-3's FP8 forward): e4m3 or e5m2 Q, K and V
with descale factors per (batch, KV head), a 16-bit O and the float32 LSE, served for
``fwd8`` problems on compute capability 9.0 (``serves``; what it refuses runs on the mma.sync
FP8 forward, ``fwd8``).

The kernel (``templates/hopper_fwd_fp8.cuh``): S = Q K^T by wgmma m64nNk32 with both FP8
operands K-major in 128-byte-swizzled shared memory; V transposed on chip (every thread
permutes its share of the stage's V tile into a K-major V^T buffer, ``hopper_fp8.cuh``:
no pass through global memory); the probabilities times 2^8 rounded to FP8 straight from the
S accumulators into P V's 8-bit A registers (a key order shared with V^T, so no value moves
between threads); O += P V^T by wgmma m64nNk32 with P from registers. Descales as ``fwd8``
folds them: ``q_descale * k_descale`` into the softmax scale, ``v_descale`` (with 2^-8) into
O. K/V tiles by cp.async into a stage ring guarded by full/empty mbarriers; one consumer
warpgroup per 64 query rows. Plain and causal masks, GQA; head dims 64, 128 and 256.

Numerics: as ``fwd8`` except P, which is rounded to the FP8 format instead of O's type: half
an ulp relative above the format's normals (2^-4 for e4m3, 2^-3 for e5m2) and half its
denormal spacing below them (2^-18 / 2^-25 in probability units after the 2^8 offset). So O
is checked element by element against the float64 attention of the dequantised inputs
within that rounding's bound (``p_rounding``, which ``reference`` returns as
``o_bound``) plus O's own rounding; the LSE, from fp32 sums of the unrounded
probabilities, within the forward's LSE tolerance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from flashtune._lazy import lazy_module
from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.dtypes import Fp8Type
from flashtune.codegen.params import Param, ParamSpace, Point, Value
from flashtune.codegen.render import TemplateValue
from flashtune.codegen.spec import KernelConfig, Problem, Shape
from flashtune.errors import InvalidConfig, InvalidProblem
from flashtune.families.base import (
    Tensors,
    Tolerance,
    Verdict,
    compare_outputs,
    element_params,
    resource_reason,
)
from flashtune.families.checks import LSE_TOLERANCE
from flashtune.families.fwd8 import O_BOUND, Fp8ForwardFamily, fp8_params, twin

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

HEAD_DIMS = (64, 128, 256)
BLOCK_M = (64, 128)
#: Multiples of 32 (P V's k32 steps) from 64 to 256 (the N of Q K^T's wgmma).
BLOCK_N = tuple(range(64, 257, 32))
NUM_STAGES = (1, 2, 3)
SPACE = ParamSpace((Param("block_m", BLOCK_M), Param("block_n", BLOCK_N),
                    Param("num_stages", NUM_STAGES)))
#: Accumulator registers per thread (S and O f32, P's FP8 registers) past which NVRTC 13
#: spills at sm_90a.
MAX_ACCUMULATORS = 200
#: Per format: P's absolute half spacing below the normals (half the smallest subnormal,
#: e4m3 2^-10 and e5m2 2^-17, in probability units after the kernel's 2^8 offset); above
#: them P's error is relative, the format's unit roundoff.
P_SUBNORMAL_ROUNDING = {Fp8Type.E4M3: 2.0**-18, Fp8Type.E5M2: 2.0**-25}
#: The fp32 scores, exp2 and sums, relative to the probability-weighted |V|.
FP32_SHARE = 1e-5


def head_dim_refusal(problem: Problem) -> str | None:
    """Why the kernel cannot take ``problem``'s head dim, or None."""
    if problem.head_dim in HEAD_DIMS:
        return None
    return (f"head_dim={problem.head_dim}: the sm_90a FP8 forward takes head dims {HEAD_DIMS} "
            "(whole k32 steps in 128-byte swizzled rows); the mma.sync FP8 forward (fwd8) "
            "serves the others")


def accumulators(problem: Problem, config: KernelConfig) -> int:
    """Per thread: S (block_n / 2 floats), O (head_dim / 2) and P (block_n / 8 registers)."""
    return config.block_n // 2 + problem.head_dim // 2 + config.block_n // 8


def smem_bytes(problem: Problem, config: KernelConfig) -> int:
    """Q, num_stages K and V tiles (rows of whole 128-byte panels), two V^T buffers (head_dim
    rows of block_n key bytes, whole panels), the barriers, alignment slack: the template's
    HopperFp8Traits::kSmemBytes."""
    row = max(problem.head_dim, 128)
    vt = problem.head_dim * 128 * -(-config.block_n // 128)
    return (row * (config.block_m + 2 * config.num_stages * config.block_n) + 2 * vt
            + 16 * config.num_stages + 1024)


class HopperFp8ForwardFamily(Fp8ForwardFamily):
    """The FP8 attention forward on wgmma for sm_90a (serves ``fwd8`` on cc 9.0)."""

    op = "fwd890a"
    title = "FP8 attention forward on wgmma for sm_90a (e4m3/e5m2 Q, K, V with descales)"
    template = "hopper_fwd_fp8.cu.jinja"
    target_arch: ClassVar[str | None] = "sm_90a"
    serves: ClassVar[str | None] = "fwd8"
    #: Plain and causal masks only: problems with features run on the mma.sync FP8 forward.
    features: ClassVar[frozenset[str]] = frozenset()

    @staticmethod
    def refusal(problem: Problem, arch: ArchSpec) -> str | None:
        """Why no config runs ``problem``: a head dim off ``HEAD_DIMS`` (any arch this
        family builds for has FP8 wgmma; ``static_check`` refuses the others first)."""
        return head_dim_refusal(problem)

    def check_problem(self, problem: Problem) -> None:
        """The forward's checks, then the head dims: InvalidProblem naming the family that
        serves the others (``families.served_problem`` then keeps ``fwd8``)."""
        super().check_problem(problem)
        why = head_dim_refusal(problem)
        if why is not None:
            raise InvalidProblem(why)

    def space(self, problem: Problem) -> ParamSpace:
        return SPACE

    def config(self, point: Point) -> KernelConfig:
        block_m = point["block_m"]
        if not isinstance(block_m, int):
            raise InvalidConfig(f"block_m={block_m!r} must be an int")
        return KernelConfig.from_dict({**point, "num_warps": block_m // 16})

    def point(self, config: KernelConfig) -> dict[str, Value]:
        return {"block_m": config.block_m, "block_n": config.block_n,
                "num_stages": config.num_stages}

    def rules(self, problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
        why = self.refusal(problem, arch)
        if why is not None:
            return why
        if config.block_m not in BLOCK_M or config.block_n not in BLOCK_N:
            return (f"block_m={config.block_m}, block_n={config.block_n}: the sm_90a FP8 "
                    f"forward takes block_m in {BLOCK_M} (warpgroups of 64 rows) and block_n "
                    "a multiple of 32 in 64..256 (P V's k32 steps, Q K^T's N)")
        if config.num_warps != config.block_m // 16:
            return (f"num_warps={config.num_warps}: one warpgroup per 64 query rows, "
                    f"{config.block_m // 16} warps for block_m={config.block_m}")
        if config.num_stages not in NUM_STAGES:
            return f"num_stages={config.num_stages}: expected one of {NUM_STAGES}"
        return resource_reason(smem_bytes(problem, config), accumulators(problem, config),
                               arch, MAX_ACCUMULATORS)

    def default_config(self, problem: Problem, arch: ArchSpec) -> KernelConfig:
        """Two warpgroups and two stages (FA3's FP8 choice) with the widest key tile that the
        rules pass (128 at head dims 64 and 128, 64 at 256)."""
        why = self.refusal(problem, arch)
        if why is not None:
            raise InvalidConfig(f"no config runs {problem.key()} on {arch.name}: {why}")
        for block_n in (128, 96, 64):
            config = KernelConfig(block_m=128, block_n=block_n, num_warps=8, num_stages=2)
            if self.static_check(problem, config, arch) is None:
                return config
        raise InvalidConfig(f"no default config fits {problem.key()} on {arch.name}")

    def default_reason(self, problem: Problem, arch: ArchSpec) -> str:
        return ("two consumer warpgroups and two stages (FA3's sm90 FP8 choice); the widest "
                "key tile within shared memory and the accumulator rule")

    def template_params(self, problem: Problem, config: KernelConfig
                        ) -> dict[str, TemplateValue]:
        return {**element_params(twin(problem)), **fp8_params(problem),
                "head_dim": problem.head_dim, "causal": problem.causal,
                "block_m": config.block_m, "block_n": config.block_n,
                "num_warps": config.num_warps, "num_stages": config.num_stages}

    def smem_bytes(self, problem: Problem, config: KernelConfig) -> int:
        return smem_bytes(problem, config)

    def p_rounding(self, problem: Problem, values: Tensors,
                   weighted: torch.Tensor) -> torch.Tensor:
        """P is rounded to the FP8 format instead of O's type: (u + FP32_SHARE) P |V| +
        a sum |V| (over every key of the row's KV head), u the format's unit roundoff and a
        its ``P_SUBNORMAL_ROUNDING``."""
        fmt = problem.dtypes.q
        if not isinstance(fmt, Fp8Type):
            raise InvalidProblem(f"{problem.key()}: the FP8 forward's inputs are e4m3 or e5m2")
        group = values["q"].shape[2] // values["v"].shape[2]
        v_sum = values["v"].abs().sum(dim=1, keepdim=True).repeat_interleave(group, dim=2)
        return ((fmt.element.unit_roundoff + FP32_SHARE) * weighted
                + P_SUBNORMAL_ROUNDING[fmt] * v_sum)

    def compare(self, problem: Problem, shape: Shape, outputs: Tensors,
                reference: Tensors) -> Verdict:
        """O within P's rounding bound plus its own rounding, the LSE within the forward's
        tolerance; unwritten (NaN) elements fail."""
        # O's own rounding: its type's unit roundoff, relative (1e-7 absolute for zeros).
        o_rounding = Tolerance(1e-7, problem.dtypes.o.element.unit_roundoff)
        return compare_outputs(problem, shape, outputs, reference,
                               [("O", "o", o_rounding), ("LSE", "lse", LSE_TOLERANCE)],
                               bounds={"o": reference[O_BOUND]})

FORWARD_FP8_90A = HopperFp8ForwardFamily()
