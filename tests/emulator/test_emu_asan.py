"""The opt-in AddressSanitizer build (FLASHTUNE_EMULATOR_ASAN): out-of-bounds global and
shared accesses become EmulatorErrors, in a process started with the sanitizer runtime."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from flashtune.errors import ToolchainNotFound
from flashtune.runtime.backends.emulator import build_source
from flashtune.runtime.backends.emulator.toolchain import asan_environment, asan_loaded

pytestmark = pytest.mark.emulator

SCRIPT = textwrap.dedent(r'''
    import numpy as np
    from flashtune.errors import EmulatorError
    from flashtune.runtime.backends.emulator import build_module, i32, ptr

    code = r"""
    extern "C" __global__ void global_read(const float* x, float* y, int shift) {
      int i = threadIdx.x;
      y[i] = x[i + shift];
    }
    extern "C" __global__ void smem_write(float* y, int shift) {
      FT_DYNAMIC_SMEM(float, s);
      s[threadIdx.x + shift] = 1.0f;
      __syncthreads();
      y[threadIdx.x] = s[threadIdx.x];
    }
    """
    m = build_module(code, ["global_read", "smem_write"])
    x = np.random.default_rng().standard_normal(32).astype(np.float32)
    y = np.zeros(32, np.float32)
    m["global_read"].launch(1, 32, [ptr(x), ptr(y), i32(0)])
    assert (y == x).all()
    for name, args in [("global_read", [ptr(x), ptr(y), i32(1)]),
                       ("smem_write", [ptr(y), i32(1)])]:
        try:
            m[name].launch(1, 32, args, smem_bytes=128)
        except EmulatorError as exc:
            print(name, "DETECTED", str(exc).splitlines()[2])
        else:
            print(name, "MISSED")
    m["smem_write"].launch(1, 32, [ptr(y), i32(0)], smem_bytes=128)
    print("ALIVE", (y == 1).all())
''')


def test_asan_build_catches_out_of_bounds_accesses() -> None:
    env = {**os.environ, **asan_environment()}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "global_read DETECTED" in out and "heap-buffer-overflow" in out, out
    assert "smem_write DETECTED" in out, out
    assert "ALIVE True" in out, out


@pytest.mark.skipif(asan_loaded(), reason="this process runs under AddressSanitizer")
def test_asan_needs_a_prepared_process() -> None:
    with pytest.raises(ToolchainNotFound, match=r"LD_PRELOAD=\S+libasan\S* "
                                                r"ASAN_OPTIONS=\S*halt_on_error=0"):
        build_source('extern "C" __global__ void k() {}', "k", asan=True)
