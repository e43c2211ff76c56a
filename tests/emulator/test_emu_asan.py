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
from flashtune.toolchain.host import asan_environment, asan_loaded

#: Both ASan tests on one xdist worker: the first builds the ASan runtime (about 25 s of one
#: core), the second takes it from the cache instead of waiting on the other worker's build.
pytestmark = [pytest.mark.emulator, pytest.mark.xdist_group("asan")]

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


@pytest.mark.slow  # the ASan runtime's build: about 40 s of CPU
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


FORWARD_SCRIPT = textwrap.dedent(r'''
    import sys
    import numpy as np
    import torch
    sys.path.insert(0, sys.argv[1])
    from emu_helpers import attention_reference
    from flashtune.families.fwd.defaults import default_config
    from flashtune.families import render
    from flashtune.codegen.spec import DType, Problem
    from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions, Schedule
    from flashtune.families.fwd.args import pack_args
    from flashtune.families.launch_args import grid

    problem = Problem(128, DType.FP16, causal=True)
    source = render(problem, default_config(problem, "sm_90"))
    # seqlen_q > seqlen_k: several blocks, and rows that see no key (O = 0, LSE = +inf).
    b, sq, sk, h = 1, 160, 96, 2
    kernel = EmulatorBackend().load(source)
    for schedule in Schedule:
        kernel.options = LaunchOptions(schedule=schedule)
        q, k, v = (torch.randn(b, n, h, 128).half() for n in (sq, sk, sk))
        o = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, sq), float("nan"))
        kernel.launch(grid(sq, h, b, source.config.block_m),
                      pack_args(q, k, v, o, lse, 128 ** -0.5))
        ref_o, ref_lse = attention_reference(q.float().numpy(), k.float().numpy(),
                                             v.float().numpy(), True, 128 ** -0.5)
        tol = 2e-3 * float(v.abs().max())
        np.testing.assert_allclose(o.float().numpy(), ref_o, rtol=0, atol=tol)
        np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=0, atol=1e-4)
        assert np.isposinf(lse.numpy()).sum() == h * (sq - sk)
        print(schedule.value, "PASSED", grid(sq, h, b, source.config.block_m))
''')


@pytest.mark.slow
def test_asan_forward_kernel_reuses_fiber_stacks_across_blocks() -> None:
    """Blocks after the first reuse the fiber stacks of the finished ones: the forward
    kernel (d128 causal, default sm_90 config, several blocks) runs clean under ASan in both
    schedules and matches the float64 reference."""
    env = {**os.environ, **asan_environment()}
    helpers = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", FORWARD_SCRIPT, helpers], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "AddressSanitizer" not in proc.stderr, proc.stderr[-4000:]
    for schedule in ("forward", "reverse"):
        assert f"{schedule} PASSED" in proc.stdout, proc.stdout + proc.stderr[-4000:]
