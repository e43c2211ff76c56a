"""The cost model's free parameters, where their default values come from, and the model
version that names a parameter set (costmodel.py uses them; calibrate.py refits them)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from flashtune.errors import InvalidConfig

MODEL_NAME = "fa2-pipes-2"


@dataclass(frozen=True)
class ModelParams:
    """The cost model's free parameters (see the module docstring for their roles)."""

    #: Share of a warp's non-tensor pipe cycles hidden behind the tensor work of other
    #: warps on its sub-partition (applies with two or more warps per sub-partition).
    overlap: float = 0.43
    #: Memory latency a K/V pipeline wait exposes per tile when nothing else can run, ns.
    exposed_latency_ns: float = 716.0
    #: Multiplier on the GPU's tensor rate (mma.sync's; wgmma's on the sm_90a path).
    tensor_efficiency: float = 1.0
    #: Achievable share of datasheet DRAM and L2 bandwidth (an H200 copies at about 4.3 of
    #: its 4.8 TB/s; reference/attention-baselines.md).
    bandwidth_efficiency: float = 0.9
    #: Issue-to-use cycles of a local-memory access (spill) inside the main loop.
    local_access_cycles: float = 32.0
    #: Start and drain of one kernel between back-to-back launches, microseconds.
    launch_overhead_us: float = 2.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value)):
                raise InvalidConfig(f"ModelParams.{f.name}={value!r} must be a finite number")
            object.__setattr__(self, f.name, float(value))
        if not 0.0 <= self.overlap < 1.0:
            raise InvalidConfig(f"ModelParams.overlap={self.overlap} must be in [0, 1)")
        if not 0.0 < self.bandwidth_efficiency <= 1.0:
            raise InvalidConfig("ModelParams.bandwidth_efficiency must be in (0, 1]")
        for name in ("exposed_latency_ns", "local_access_cycles", "launch_overhead_us"):
            if getattr(self, name) < 0:
                raise InvalidConfig(f"ModelParams.{name} must be >= 0")
        if self.tensor_efficiency <= 0:
            raise InvalidConfig("ModelParams.tensor_efficiency must be > 0")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, float]) -> ModelParams:
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise InvalidConfig(f"unknown ModelParams field(s) {sorted(unknown)}; expected "
                                f"some of {sorted(names)}")
        return cls(**dict(data))

    @property
    def version(self) -> str:
        """Model name plus a digest of the parameter values, e.g. 'fa2-pipes-2/3f2a9c01'."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return f"{MODEL_NAME}/{hashlib.sha256(blob).hexdigest()[:8]}"


DEFAULT_PARAMS = ModelParams()

#: The source of the parameters fitted to FA2's published H100 table.
FA2_TABLE_FIT = ("least-squares fit (log time) to the published FlashAttention-2 H100 SXM5 "
                 "forward fp16 table (FlashAttention-3 paper; flashtune/perf/model/baselines.py) "
                 "on FA2's own tiles: agreement with that table is by construction")
#: Where each default parameter value comes from; every prediction says it.
PARAM_SOURCES: dict[str, str] = {
    "overlap": FA2_TABLE_FIT,
    "exposed_latency_ns": FA2_TABLE_FIT,
    "tensor_efficiency": "1: the datasheet mma.sync rate (calibrate() refits it)",
    "bandwidth_efficiency": "an H200 device-to-device copy measurement, 4.3 of its "
                            "4.8 TB/s",
    "local_access_cycles": "assumed: an L1 hit's issue-to-use latency",
    "launch_overhead_us": "assumed",
}


def parameter_sources(params: ModelParams) -> tuple[tuple[str, float, str], ...]:
    """(name, value, where the value comes from) for every model parameter."""
    defaults = DEFAULT_PARAMS.to_dict()
    return tuple((name, value, PARAM_SOURCES[name] if value == defaults[name]
                  else "set by the caller (e.g. calibrate() on measurements)")
                 for name, value in params.to_dict().items())
