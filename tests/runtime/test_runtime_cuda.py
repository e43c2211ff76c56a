"""The cuda backend's host logic without a GPU: CuPy is replaced by a recorder, so these tests
check what would be handed to the driver (argument types, block, shared memory, stream, the
dynamic shared memory opt-in, per-device module caching); the GPU tests run it for real."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from flashtune.codegen.abi import ArgType
from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.errors import OutOfResources
from flashtune.families import render
from flashtune.runtime import device
from flashtune.runtime.backends import cuda


@dataclass
class FakeFunction:
    name: str
    ptr: int = 1234
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
                 shared_mem: int = 0, stream: Any = None) -> None:
        self.calls.append({"grid": grid, "block": block, "args": args,
                           "shared_mem": shared_mem, "stream": stream})


@dataclass
class FakeCupy:
    """The parts of CuPy the backend touches, recording what it is asked to do."""

    current: int = 0
    modules: list[bytes] = field(default_factory=list)
    functions: list[FakeFunction] = field(default_factory=list)
    attributes: list[tuple[int, int, int]] = field(default_factory=list)
    switched_to: list[int] = field(default_factory=list)

    @property
    def cuda(self) -> Any:
        fake = self

        class Module:
            def load(self, cubin: bytes) -> None:
                fake.modules.append(cubin)

            def get_function(self, name: str) -> FakeFunction:
                fn = FakeFunction(name)
                fake.functions.append(fn)
                return fn

        @contextlib.contextmanager
        def device_ctx(index: int) -> Any:
            fake.switched_to.append(index)
            yield

        class Stream:
            @staticmethod
            def from_external(obj: Any) -> Any:
                return SimpleNamespace(ptr=obj.__cuda_stream__()[1])

        driver = SimpleNamespace(
            CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8,
            funcSetAttribute=lambda ptr, attr, value: fake.attributes.append(
                (ptr, attr, value)),
            CUDADriverError=RuntimeError)
        runtime = SimpleNamespace(getDevice=lambda: fake.current,
                                  CUDARuntimeError=RuntimeError)
        return SimpleNamespace(function=SimpleNamespace(Module=Module), Device=device_ctx,
                               Stream=Stream, driver=driver, runtime=runtime)


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> FakeCupy:
    fake = FakeCupy()
    monkeypatch.setattr(cuda, "_cupy", lambda: fake)
    monkeypatch.setattr(cuda, "compile_cubin", lambda source, arch: f"{arch}:{source.entry}"
                        .encode())
    monkeypatch.setattr(cuda, "load_shipped", lambda source, arch: None)
    monkeypatch.setattr(device.DeviceInfo, "current",
                        classmethod(lambda cls, index=None: cls.virtual("sm_90")))
    cuda._streams.clear()
    return fake


SMALL = render(Problem(head_dim=32, dtype=DType.FP16),
               KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=1))
LARGE = render(Problem(head_dim=128, dtype=DType.BF16, causal=True),
               KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=2))


def test_load_once_per_device_and_smem_opt_in(fake_cupy: FakeCupy) -> None:
    backend = cuda.CudaBackend()
    assert SMALL.smem_bytes <= cuda.DEFAULT_SMEM_LIMIT < LARGE.smem_bytes
    small = backend.load(SMALL)
    assert backend.load(SMALL) is small  # cached
    large = backend.load(LARGE)
    other_device = backend.load(LARGE, device_index=1)
    assert other_device is not large and other_device.device_index == 1
    assert fake_cupy.modules == [b"sm_90:" + s.entry.encode() for s in (SMALL, LARGE, LARGE)]
    # only kernels above 48 KB opt in, with exactly their dynamic shared memory
    assert fake_cupy.attributes == [(1234, 8, LARGE.smem_bytes)] * 2


def test_launch_arguments_block_smem_and_stream(fake_cupy: FakeCupy) -> None:
    kernel = cuda.CudaBackend().load(LARGE)
    args = [(ArgType.PTR, 1 << 40), (ArgType.I32, 7), (ArgType.I64, 1 << 33),
            (ArgType.F32, 0.125)]
    kernel.launch((3, 8, 2), args, stream=0xABC)
    (call,) = fake_cupy.functions[0].calls
    assert call["grid"] == (3, 8, 2) and call["block"] == (256, 1, 1)
    assert call["shared_mem"] == LARGE.smem_bytes and call["stream"].ptr == 0xABC
    values = call["args"]
    assert [type(x) for x in values] == [int, np.int32, int, np.float32]
    assert values == (1 << 40, 7, 1 << 33, 0.125)
    fake_cupy.current = 1  # another device is current: switch for the launch only
    kernel.launch((1, 1, 1), args, stream=0xABC)
    assert fake_cupy.switched_to[-1] == 0


def test_shared_memory_over_the_device_limit(fake_cupy: FakeCupy,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device.DeviceInfo, "current",
                        classmethod(lambda cls, index=None: cls.virtual("sm_86")))
    big = render(Problem(head_dim=256, dtype=DType.FP16),
                 KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=2))
    with pytest.raises(OutOfResources, match="dynamic shared memory"):
        cuda.CudaBackend().load(big)
