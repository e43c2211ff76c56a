"""The search space of the backward main kernel: legal values, static rules, resources.

``SPACE`` declares the tunables (the base four and ``dqmode``); ``static_check`` says, for
one arch, why a config can never work (or None), each rule with a reason a person can read.
The shared-memory formula must equal ``BwdTraits::kSmemBytes`` (the template asserts it).
"""

from __future__ import annotations

import math

from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.params import Param, ParamSpace
from flashtune.codegen.spec import MAX_HEAD_DIM, KernelConfig, Problem
from flashtune.families.base import DEFAULT_SM_COUNT, resource_reason

BLOCK_M = (32, 64, 128)
BLOCK_N = (16, 32, 64, 128)
NUM_WARPS = (2, 4, 8)
NUM_STAGES = (1, 2)
#: How dQ is summed over key tiles: float32 atomics into one accumulator, or one float32
#: slice per block summed in a fixed order by the convert kernel (deterministic).
DQ_ATOMIC = "atomic"
DQ_SPLIT = "split"
DQ_MODES = (DQ_ATOMIC, DQ_SPLIT)

SPACE = ParamSpace((Param("block_m", BLOCK_M), Param("block_n", BLOCK_N),
                    Param("num_warps", NUM_WARPS), Param("num_stages", NUM_STAGES),
                    Param("dqmode", DQ_MODES)))
#: The deterministic family's space: the split mode only.
DETERMINISTIC_SPACE = ParamSpace((*SPACE.params[:4], Param("dqmode", (DQ_SPLIT,))))

#: Output column chunks of a Q/K head dim above MAX_HEAD_DIM (spec.WIDE_HEAD_DIMS): a block
#: accumulates dK, dV and dQ over 1 / chunks of the head dims, recomputing S and dP once per
#: chunk (templates: WithBwdColumnChunks). One chunk keeps the whole dK and dV of a key tile
#: in registers (narrow key tiles only); more chunks allow wider key tiles for recomputation.
CHUNKS = (1, 2, 4)
#: The spaces of such head dims: the plain ones with the chunk count.
WIDE_SPACE = ParamSpace((*SPACE.params, Param("chunks", CHUNKS)))
WIDE_DETERMINISTIC_SPACE = ParamSpace((*DETERMINISTIC_SPACE.params, Param("chunks", CHUNKS)))

#: Shared-memory rows are padded by this many 16-bit elements (16 bytes), which makes the
#: eight 16-byte row addresses of an ldmatrix phase fall in distinct banks.
SMEM_ROW_PAD = 8

#: A config whose accumulators (dK and dV for the whole key tile, plus the larger of S and
#: dP or one dQ chunk) need more 32-bit registers per thread than this cannot avoid spilling
#: within the 255-register limit (measured with NVRTC; see defaults.py).
MAX_ACCUMULATOR_REGISTERS = 192

#: Head-dim columns of dQ computed at once (the kernel's kDqChunk, in n8 tiles).
DQ_CHUNK_COLUMNS = 64


def dq_mode(config: KernelConfig) -> str:
    """The config's dQ mode (atomic when the config does not name one)."""
    return str(config.extra("dqmode", DQ_ATOMIC))


def chunks(config: KernelConfig) -> int:
    """The config's output column chunks (1 when the config does not name them)."""
    value = config.extra("chunks", 1)
    return value if isinstance(value, int) else int(str(value))


def space_of(problem: Problem, deterministic: bool) -> ParamSpace:
    """The search space of ``problem``: with the chunk count for a wide Q/K head dim."""
    if problem.head_dim > MAX_HEAD_DIM:
        return WIDE_DETERMINISTIC_SPACE if deterministic else WIDE_SPACE
    return DETERMINISTIC_SPACE if deterministic else SPACE


def mma_head_dim(problem: Problem) -> int:
    """The head dim the tensor cores work on: the real one rounded up to 16."""
    return -(-problem.head_dim // 16) * 16


def _mma_v_head_dim(problem: Problem) -> int:
    """V's (and dO's, dV's) head dim rounded up to the k16 step."""
    return -(-problem.v_head_dim // 16) * 16


def smem_bytes(problem: Problem, config: KernelConfig) -> int:
    """K and V tiles, num_stages Q and dO tiles (and LSE and D), and the P and dS tiles
    (V's and dO's rows of V's head dim: WithBwdHeadDimV)."""
    row = mma_head_dim(problem) + SMEM_ROW_PAD
    v_row = _mma_v_head_dim(problem) + SMEM_ROW_PAD
    elems = ((config.block_n + config.num_stages * config.block_m) * (row + v_row)
             + 2 * config.block_m * (config.block_n + SMEM_ROW_PAD))
    return 2 * elems + 2 * config.num_stages * config.block_m * 4


def warp_split(config: KernelConfig) -> tuple[int, int]:
    """(warps over keys, warps over the head dim) of the dK / dV products."""
    over_keys = min(config.num_warps, config.block_n // 16)
    return over_keys, config.num_warps // over_keys


def accumulator_registers(problem: Problem, config: KernelConfig) -> int:
    """32-bit registers per thread held by accumulator fragments at the busiest point (dK
    and dV of one output column chunk)."""
    n = chunks(config)
    d = mma_head_dim(problem)
    threads = config.threads
    dk_dv = config.block_n * (d + _mma_v_head_dim(problem)) // (n * threads)
    s_dp = 2 * config.block_m * config.block_n // threads
    dq = config.block_m * min(d // n, DQ_CHUNK_COLUMNS) // threads
    return dk_dv + max(s_dp, dq)


def dq_mode_reason(config: KernelConfig, deterministic: bool) -> str | None:
    """Why ``config``'s dQ mode is refused (not a mode, or atomics in a deterministic
    family), or None."""
    mode = dq_mode(config)
    if mode not in DQ_MODES:
        return f"dqmode={mode!r} is not a dQ mode; expected one of {list(DQ_MODES)}"
    if deterministic and mode != DQ_SPLIT:
        return (f"dqmode={mode!r} sums dQ with float32 atomics in an unspecified order; the "
                f"deterministic backward needs dqmode={DQ_SPLIT!r}")
    return None


def static_check(problem: Problem, config: KernelConfig, arch: ArchSpec, *,
                 deterministic: bool = False) -> str | None:
    """Why ``config`` cannot run ``problem`` on ``arch``, or None when it may."""
    why = dq_mode_reason(config, deterministic)
    if why is not None:
        return why
    if config.num_stages not in NUM_STAGES:
        return f"num_stages={config.num_stages}: the kernel keeps one or two Q/dO buffers"
    over_keys, over_dim = warp_split(config)
    why = chunks_reason(problem, config, over_dim)
    if why is not None:
        return why
    for what, dim, mma in (("head dim", problem.head_dim, mma_head_dim(problem)),
                           ("V head dim", problem.v_head_dim, _mma_v_head_dim(problem))):
        tiles = mma // 8
        if tiles % over_dim:
            return (f"{config.num_warps} warps over {config.block_n} keys leave {over_dim} "
                    f"warps to split the {what}'s {tiles} n8 tiles ({what} {dim}); use fewer "
                    "warps or more keys per tile")
    return resource_reason(smem_bytes(problem, config), accumulator_registers(problem, config),
                           arch, MAX_ACCUMULATOR_REGISTERS)


def chunks_reason(problem: Problem, config: KernelConfig, over_dim: int) -> str | None:
    """Why ``config``'s output column chunks cannot split ``problem``'s head dims (more
    than one only for a Q/K head dim above MAX_HEAD_DIM; each chunk of either head dim in
    whole n8 tiles per warp of the head-dim split), or None."""
    n = chunks(config)
    if n not in CHUNKS:
        return f"chunks={n} is not a chunk count; expected one of {list(CHUNKS)}"
    if n == 1:
        return None
    if problem.head_dim <= MAX_HEAD_DIM:
        return (f"chunks={n}: output column chunks serve Q/K head dims above {MAX_HEAD_DIM} "
                f"only (got {problem.head_dim}); use chunks=1")
    step = n * 8 * over_dim
    for what, dim in (("head dim", problem.head_dim), ("V head dim", problem.v_head_dim)):
        if dim % step:
            return (f"chunks={n} with {over_dim} warps over the head dim needs the {what} "
                    f"({dim}) to be a multiple of {step} (whole n8 tiles per warp and "
                    "chunk); use fewer chunks or warps")
    return None


#: At most this many dQ slices: the accumulator is then at most 16 float32 copies of dQ
#: (a small batch x heads gets fewer blocks than SMs rather than a larger buffer).
MAX_DQ_SLICES = 16


def dq_slices(sm_count: int | None, batch: int, heads_kv: int, seqlen_k: int,
              block_n: int) -> int:
    """dQ slices (blocks per kv head) of the deterministic mode: about one block per SM
    over the batch and kv heads, never more than there are key tiles or MAX_DQ_SLICES. The
    accumulator is that many float32 copies of dQ, a constant factor: memory stays linear
    in the sequence length. Fixed by the shape and the device, so results repeat bitwise
    on one device."""
    sms = sm_count or DEFAULT_SM_COUNT
    key_tiles = -(-seqlen_k // block_n)
    return max(1, min(key_tiles, MAX_DQ_SLICES, math.ceil(sms / (batch * heads_kv))))
