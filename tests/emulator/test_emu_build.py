"""Building kernels for the emulator: content-keyed caching (source, included headers,
defines), compile errors with the log and the saved source."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flashtune.errors import CompileError
from flashtune.runtime.backends.emulator import build_module, i32, ptr

pytestmark = pytest.mark.emulator

SOURCE = r"""
#include "value.h"
extern "C" __global__ void value(int* out, int add) {
  out[threadIdx.x] = VALUE + EXTRA + add;
}
"""


def _value(include: Path, defines: list[str]) -> tuple[int, float, str]:
    module = build_module(SOURCE, ["value"], include_dirs=[include], defines=defines)
    out = np.zeros(32, dtype=np.int32)
    module["value"].launch(1, 32, [ptr(out), i32(5)])
    assert (out == out[0]).all()
    return int(out[0]), module.built.build_seconds, module.built.key


def test_cache_follows_headers_and_defines(tmp_path: Path) -> None:
    (tmp_path / "value.h").write_text("#define VALUE 100\n")
    first, built, key = _value(tmp_path, ["EXTRA=1"])
    assert first == 106 and built > 0
    again, rebuilt, same_key = _value(tmp_path, ["EXTRA=1"])
    assert (again, rebuilt, same_key) == (106, 0.0, key)  # served from the cache, no build
    (tmp_path / "value.h").write_text("#define VALUE 200\n")
    changed, _, header_key = _value(tmp_path, ["EXTRA=1"])
    assert changed == 206 and header_key != key
    other, _, define_key = _value(tmp_path, ["EXTRA=2"])
    assert other == 207 and define_key not in (key, header_key)


def test_compile_error_keeps_log_and_source() -> None:
    broken = 'extern "C" __global__ void broken(int* out) { out[0] = undefined_name; }'
    with pytest.raises(CompileError) as info:
        build_module(broken, ["broken"])
    error = info.value
    assert "undefined_name" in error.log
    assert error.source_path is not None and "undefined_name" in error.source_path.read_text()
    assert "FTEMU_DEFINE_LAUNCHER(broken)" in error.source_path.read_text()


def test_invalid_build_inputs() -> None:
    with pytest.raises(ValueError, match="not a C identifier"):
        build_module(SOURCE, ["bad-name"])
    with pytest.raises(ValueError, match="malformed"):
        build_module(SOURCE, ["value"], defines=["X=1; rm"])
