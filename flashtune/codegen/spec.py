"""The core value types of code generation: Problem, KernelConfig, KernelSource.

All are frozen and validate themselves on construction, so a value that exists is legal.
Each has one canonical, filename-safe ``key()`` used for file names, database rows, logs
and memo keys, and a ``from_key`` that inverts it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from flashtune.errors import InvalidConfig, InvalidProblem

#: Head dims a kernel is compiled for; other multiples of 8 up to 256 are padded up.
COMPILED_HEAD_DIMS: tuple[int, ...] = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = 256
#: Sequence buckets are powers of two clamped to this range.
MIN_SEQ_BUCKET = 64
MAX_SEQ_BUCKET = 1 << 20


class Op(str, Enum):
    """Which kernel family a Problem asks for."""

    FWD = "fwd"
    BWD = "bwd"
    DECODE = "decode"


class DType(str, Enum):
    """Element type of Q, K, V and O."""

    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def cuda_type(self) -> str:
        return "__half" if self is DType.FP16 else "__nv_bfloat16"

    @property
    def itemsize(self) -> int:
        return 2


def _enum(cls: type[Any], value: object, what: str) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        legal = [m.value for m in cls]
        raise InvalidProblem(
            f"{what}={value!r} is not supported; expected one of {legal}"
        ) from None


def _check_int(value: object, what: str, exc: type[Exception]) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise exc(f"{what} must be an int, got {type(value).__name__} {value!r}")
    return value


def padded_head_dim(head_dim: int) -> int:
    """The compiled head dim that serves ``head_dim`` (the next one of COMPILED_HEAD_DIMS)."""
    for size in COMPILED_HEAD_DIMS:
        if head_dim <= size:
            return size
    raise InvalidProblem(f"head_dim={head_dim} exceeds the maximum {MAX_HEAD_DIM}")


def seq_bucket(seqlen: int) -> int:
    """Power-of-two tuning bucket of a sequence length (clamped to [64, 2**20])."""
    if seqlen < 1:
        raise InvalidProblem(f"sequence length must be >= 1, got {seqlen}")
    bucket = 1 << max(0, math.ceil(math.log2(seqlen)))
    return min(max(bucket, MIN_SEQ_BUCKET), MAX_SEQ_BUCKET)


@dataclass(frozen=True)
class Problem:
    """What is compiled into a kernel: op, head dim, dtype and feature switches.

    Sizes that vary per call (batch, sequence lengths, head counts, strides) are run-time
    arguments and are not part of a Problem; ``bucket()`` maps them to a tuning bucket.
    """

    head_dim: int
    dtype: DType
    causal: bool = False
    op: Op = Op.FWD

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _enum(DType, self.dtype, "dtype"))
        object.__setattr__(self, "op", _enum(Op, self.op, "op"))
        hd = _check_int(self.head_dim, "head_dim", InvalidProblem)
        if hd < 8 or hd > MAX_HEAD_DIM or hd % 8:
            raise InvalidProblem(
                f"head_dim={hd} is not supported; expected a multiple of 8 in [8, {MAX_HEAD_DIM}]"
                " (other sizes: pad the head dim of q, k and v with zeros)"
            )
        if not isinstance(self.causal, bool):
            raise InvalidProblem(f"causal must be a bool, got {self.causal!r}")
        if self.op is not Op.FWD:
            raise InvalidProblem(f"op={self.op.value!r} has no kernel yet; expected 'fwd'")

    @property
    def padded_head_dim(self) -> int:
        return padded_head_dim(self.head_dim)

    def key(self) -> str:
        """Canonical key, e.g. ``fwd_d128_bf16_causal``."""
        mask = "causal" if self.causal else "full"
        return f"{self.op.value}_d{self.head_dim}_{self.dtype.value}_{mask}"

    _KEY_RE = re.compile(r"^(fwd|bwd|decode)_d(\d{1,3})_(fp16|bf16)_(causal|full)$")

    @classmethod
    def from_key(cls, key: str) -> Problem:
        match = cls._KEY_RE.match(key)
        if not match:
            raise InvalidProblem(
                f"problem key {key!r} is malformed; expected e.g. 'fwd_d128_bf16_causal'"
            )
        op, hd, dt, mask = match.groups()
        return cls(head_dim=int(hd), dtype=DType(dt), causal=mask == "causal", op=Op(op))

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op.value, "head_dim": self.head_dim, "dtype": self.dtype.value,
                "causal": self.causal}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Problem:
        unknown = set(data) - {"op", "head_dim", "dtype", "causal"}
        if unknown:
            raise InvalidProblem(f"unknown problem field(s) {sorted(unknown)}")
        return cls(head_dim=data["head_dim"], dtype=data["dtype"],
                   causal=data.get("causal", False), op=data.get("op", "fwd"))

    def bucket(self, seqlen_q: int, seqlen_k: int) -> ProblemBucket:
        """The tuning bucket of a call with these sequence lengths."""
        return ProblemBucket(self, seq_bucket(max(seqlen_q, seqlen_k)))


@dataclass(frozen=True)
class ProblemBucket:
    """A Problem plus a power-of-two sequence-length bucket: the unit of tuning."""

    problem: Problem
    seqlen: int

    def __post_init__(self) -> None:
        n = _check_int(self.seqlen, "seqlen bucket", InvalidProblem)
        if n < MIN_SEQ_BUCKET or n > MAX_SEQ_BUCKET or n & (n - 1):
            raise InvalidProblem(
                f"seqlen bucket {n} is not a power of two in [{MIN_SEQ_BUCKET}, {MAX_SEQ_BUCKET}]"
            )

    def key(self) -> str:
        return f"{self.problem.key()}_n{self.seqlen}"

    @classmethod
    def from_key(cls, key: str) -> ProblemBucket:
        head, sep, n = key.rpartition("_n")
        if not sep or not n.isdigit():
            raise InvalidProblem(f"bucket key {key!r} is malformed; expected e.g. "
                                 "'fwd_d128_bf16_causal_n4096'")
        return cls(Problem.from_key(head), int(n))


LEGAL_WARPS = (1, 2, 4, 8, 16)
LEGAL_STAGES = (1, 2, 3, 4)
MAX_THREADS = 1024


@dataclass(frozen=True)
class KernelConfig:
    """The tunables of the forward kernel.

    block_m (B_r): query rows per thread block, split across warps in slabs of 16 rows.
    block_n (B_c): key/value rows per tile streamed through shared memory.
    num_warps: warps per block; each owns block_m / num_warps query rows.
    num_stages: K/V tiles in flight in the cp.async pipeline (1 = no prefetch).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_warps", "num_stages"):
            _check_int(getattr(self, name), name, InvalidConfig)
        if self.num_warps not in LEGAL_WARPS:
            raise InvalidConfig(f"num_warps={self.num_warps} is illegal; expected one of "
                                f"{LEGAL_WARPS}")
        if self.num_stages not in LEGAL_STAGES:
            raise InvalidConfig(f"num_stages={self.num_stages} is illegal; expected one of "
                                f"{LEGAL_STAGES}")
        if not (16 <= self.block_m <= 256 and self.block_m % 16 == 0):
            raise InvalidConfig(f"block_m={self.block_m} is illegal; expected a multiple of 16 "
                                "in [16, 256]")
        if not (16 <= self.block_n <= 256 and self.block_n % 16 == 0):
            raise InvalidConfig(f"block_n={self.block_n} is illegal; expected a multiple of 16 "
                                "in [16, 256]")
        if self.block_m % (16 * self.num_warps):
            raise InvalidConfig(
                f"block_m={self.block_m} cannot be split into 16-row slabs over "
                f"num_warps={self.num_warps}; use block_m a multiple of {16 * self.num_warps} "
                "or fewer warps"
            )
        if self.threads > MAX_THREADS:
            raise InvalidConfig(f"{self.threads} threads per block exceed {MAX_THREADS}")

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def rows_per_warp(self) -> int:
        return self.block_m // self.num_warps

    def key(self) -> str:
        """Canonical key, e.g. ``m128_n64_w4_s2``."""
        return f"m{self.block_m}_n{self.block_n}_w{self.num_warps}_s{self.num_stages}"

    _KEY_RE = re.compile(r"^m(\d{1,3})_n(\d{1,3})_w(\d{1,2})_s(\d)$")

    @classmethod
    def from_key(cls, key: str) -> KernelConfig:
        match = cls._KEY_RE.match(key)
        if not match:
            raise InvalidConfig(f"config key {key!r} is malformed; expected e.g. 'm128_n64_w4_s2'")
        m, n, w, s = (int(g) for g in match.groups())
        return cls(block_m=m, block_n=n, num_warps=w, num_stages=s)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KernelConfig:
        fields = {"block_m", "block_n", "num_warps", "num_stages"}
        unknown = set(data) - fields
        missing = fields - set(data)
        if unknown or missing:
            raise InvalidConfig(f"config fields: unknown {sorted(unknown)}, missing "
                                f"{sorted(missing)}; expected exactly {sorted(fields)}")
        return cls(**{k: data[k] for k in fields})


@dataclass(frozen=True)
class KernelSource:
    """A rendered kernel, ready to compile for any arch.

    ``digest`` covers everything that changes the binary apart from the target arch and the
    compiler: the rendered code, the contents of every header it includes, the compile
    options and the flashtune version.
    """

    problem: Problem
    config: KernelConfig
    code: str
    entry: str
    headers: Mapping[str, str] = field(repr=False)
    options: tuple[str, ...]
    digest: str
    smem_bytes: int
    threads: int

    @property
    def name(self) -> str:
        """Readable, filename-safe variant name (also the entry point)."""
        return self.entry

    def grid(self, batch: int, heads_q: int, seqlen_q: int) -> tuple[int, int, int]:
        """Launch grid: (query blocks, heads, batch)."""
        blocks = max(1, -(-seqlen_q // self.config.block_m))
        return (blocks, heads_q, batch)
