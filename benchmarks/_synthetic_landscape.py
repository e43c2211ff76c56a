"""A SYNTHETIC landscape: the attention forward's own search space as the cost model sees
it, with noise. Nothing in it was measured on a GPU.

The search's real test is a brute-forced landscape, and none exists of flashtune's forward
(it would take days of a GPU). This stands in to check the sampler on a space of the
forward's size and shape (thousands of legal points, ten knobs, the family's own
legality rules): every legal config of the problem on the GPU's arch gets

- an objective: the cost model's predicted TFLOP/s on the bucket's representative shapes
  (``tuner.search.prediction.Predictor``, as a tuning run predicts), times log-normal
  noise of ``NOISE`` (the model's error is unknown point by point; the noise makes the
  ranking imperfect, so that the search cannot win by trusting the model's order);
  a config the model has no prediction for (no block fits the GPU) is a runtime failure;
- a measuring time: an NVRTC compile (0.85 s wall measured for one forward kernel, times
  log-normal noise of 0.3), a fixed 0.3 s of verification and set-up, and the timing runs
  (3 warm-up and 20 timed launches of each shape at the predicted time).

The landscape is deterministic given its seed. Its name starts with ``synthetic`` and the
benchmark labels its rows as synthetic.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.dtypes import DType
from flashtune.codegen.spec import Problem, ProblemBucket
from flashtune.db.records import TrialStatus
from flashtune.perf.model.gpus import get_gpu
from flashtune.tuner.landscape import Landscape
from flashtune.tuner.measure.recorded import Config, Recorded
from flashtune.tuner.measure.workload import make_workload
from flashtune.tuner.search.encoding import KernelDomain
from flashtune.tuner.search.prediction import Predictor
from flashtune.tuner.search.space import SearchSpace

#: Spread (standard deviation of the log) of the noise on the predicted objective.
NOISE = 0.10
COMPILE_S = 0.85
COMPILE_NOISE = 0.3
SETUP_S = 0.3
LAUNCHES = 3 + 20

PREFIX = "synthetic:"


def name(gpu: str = "H100", head_dim: int = 128, dtype: str = "bf16", causal: bool = False,
         seqlen: int = 4096) -> str:
    """The benchmark's token for a synthetic landscape (``landscape_at`` builds it)."""
    return f"{PREFIX}fwd_d{head_dim}_{dtype}{'_causal' if causal else ''}_n{seqlen}_{gpu}"


def build(token: str, seed: int = 0) -> Landscape:
    """The synthetic landscape a ``name()`` token describes (module docstring)."""
    stem = token.removeprefix(PREFIX)
    _, dim, dtype, *rest = stem.split("_")
    gpu_name = rest[-1]
    seqlen = int(rest[-2].removeprefix("n"))
    causal = "causal" in rest
    gpu = get_gpu(gpu_name)
    problem = Problem(int(dim.removeprefix("d")), DType(dtype), causal=causal)
    arch = get_arch(gpu.arch)
    problem = families.served_on_virtual(problem, arch)
    domain = KernelDomain(problem, arch)
    workload = make_workload(ProblemBucket(problem, seqlen))
    predictor = Predictor(gpu)
    rng = np.random.default_rng(seed)
    space: SearchSpace = domain.space
    records: dict[Config, Recorded] = {}
    for indices in space.legal:
        point = space.point_at(indices)
        config = domain.config(point)
        compile_s = COMPILE_S * math.exp(COMPILE_NOISE * rng.standard_normal())
        prediction = predictor.predict(workload, config)
        noise = math.exp(NOISE * rng.standard_normal())
        key = tuple(point.values())
        if prediction is None:
            records[key] = Recorded(TrialStatus.RUNTIME_FAILED, None, compile_s + SETUP_S)
            continue
        run_s = LAUNCHES * len(workload.shapes) * prediction.time_ms * 1e-3
        records[key] = Recorded(TrialStatus.OK, prediction.tflops * noise,
                                compile_s + SETUP_S + run_s)
    return Landscape(Path(f"synthetic_{stem}.json"), f"synthetic_{problem.op}",
                     f"{gpu.name} (cost model)", "tflops", False, space, records)
