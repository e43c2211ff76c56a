"""The one factory of measurers (tuner/measure/factory.py): names, aliases, factories
named ``module:function``, and the error for an unknown name."""

from __future__ import annotations

import pytest
from tuner_synthetic import SyntheticMeasurer

from flashtune.errors import TuningError
from flashtune.tuner.measure.dry import DryRunMeasurer
from flashtune.tuner.measure.factory import make_measurer, measurer_names


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
