"""The one factory of measurers (tuner/measure/factory.py): names, aliases, factories
named ``module:function``, and the error for an unknown name; a compile worker that dies."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
from tuner_synthetic import SyntheticMeasurer, dying_compiler

from flashtune.errors import TuningError
from flashtune.tuner.measure.base import TimingPlan
from flashtune.tuner.measure.dry import DryRunMeasurer
from flashtune.tuner.measure.factory import make_measurer, measurer_names
from flashtune.tuner.measure.kernels import CompilePool, KernelMeasurement


def test_a_dry_run_by_name_or_alias_is_untimed_for_its_arch() -> None:
    for name in ("dry-run", "emulator"):
        measurer = make_measurer(name, arch="sm_80")
        assert isinstance(measurer, DryRunMeasurer)
        assert measurer.arch.name == "sm_80" and not measurer.timed


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(TuningError) as info:
        make_measurer("tpu")
    message = str(info.value)
    assert "unknown measurer 'tpu'" in message
    assert all(name in message for name in ("cuda", "dry-run", "gpu", "emulator"))
    assert set(measurer_names()) == {"cuda", "dry-run", "gpu", "emulator"}


def test_a_factory_named_module_function_gets_its_options() -> None:
    measurer = make_measurer("tuner_synthetic:synthetic_measurer",
                             options={"peak_tflops": 123.0})
    assert isinstance(measurer, SyntheticMeasurer) and measurer.peak_tflops == 123.0
    with pytest.raises(TuningError, match="cannot import"):
        make_measurer("tuner_synthetic:nothing_here")
    with pytest.raises(TuningError, match="takes no options"):
        make_measurer("dry-run", options={"peak_tflops": 1.0})


def test_a_dead_compile_worker_stops_the_run_with_what_to_do() -> None:
    with CompilePool(dying_compiler, workers=1) as pool:
        workload = cast(Any, SimpleNamespace(problem="problem"))
        measurement = KernelMeasurement(cast(Any, None), workload, pool, TimingPlan(0, 1), 0)
        started = measurement.start(cast(Any, "config"))
        with pytest.raises(TuningError, match="compile worker process ended abruptly") as info:
            measurement.finish(cast(Any, "config"), started)
    assert "--resume" in str(info.value) and "--compile-workers" in str(info.value)
