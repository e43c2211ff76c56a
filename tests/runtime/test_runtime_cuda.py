"""The cuda backend's host logic without a GPU: CuPy is replaced by a recorder, so these tests
check what would be handed to the driver (argument types, block, shared memory, stream, the
dynamic shared memory opt-in, per-device module caching); the GPU tests run it for real.

The recorder is as strict about types as CuPy 14: ``Function.__call__`` takes ``tuple grid,
tuple block, args, size_t shared_mem, stream`` (a stream with ``.ptr``), ``Module.load``
takes ``bytes``, ``driver.funcSetAttribute`` a Python int pointer and C ints,
``Stream.from_external`` an object with ``__cuda_stream__``. It is stricter where CuPy would
silently change a launch (a float or zero grid dimension); ``test_the_stub_agrees_with_cupy``
holds it to real CuPy's type checks, which run before any driver call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import flashtune
from flashtune.codegen.abi import ArgType
from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.errors import OutOfResources
from flashtune.families import render
from flashtune.runtime import device
from flashtune.runtime.backends import cuda, register_backend, unregister_backend

#: The C ``int`` the driver takes for grid, block, shared memory and attribute values.
INT_MAX = 2**31 - 1
#: The numpy scalar types CuPy passes as kernel arguments as they are.
NUMPY_ARG_TYPES = frozenset(np.dtype(code).type for code in "?bhilqBHILQefdFD")


def _c_int(what: str, value: Any, low: int = 0) -> None:
    """A C int in [low, INT_MAX]: a Python or numpy integer (no bool, no float)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}: an integer is required, got {type(value).__name__}")
    if not low <= int(value) <= INT_MAX:
        raise OverflowError(f"{what}={value} is outside [{low}, {INT_MAX}]")


def _pointer_int(what: str, value: Any) -> None:
    """What Cython's ``intptr_t`` arguments of ``cupy.cuda.driver`` take: a Python int."""
    if type(value) is not int:
        raise TypeError(f"{what}: an integer is required, got {type(value).__name__}")


def _dims(what: str, value: Any) -> None:
    if type(value) is not tuple:
        raise TypeError(f"Argument '{what}' has incorrect type (expected tuple, got "
                        f"{type(value).__name__})")
    if not 1 <= len(value) <= 3:
        raise ValueError(f"{what}={value!r} must have 1 to 3 dimensions")
    for x in value:
        _c_int(f"{what} dimension", x, low=1)


def _kernel_arg(value: Any) -> None:
    if value is None or type(value) in NUMPY_ARG_TYPES:
        return
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        raise OverflowError(f"kernel argument {value} does not fit int64")
    if not isinstance(value, (int, float, complex)):
        raise TypeError(f"Unsupported type {type(value)}")


@dataclass
class FakeFunction:
    """A ``cupy.cuda.function.Function`` that checks and records its launches."""

    name: str
    ptr: int = 1234
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, grid: Any, block: Any, args: Any, shared_mem: Any = 0,
                 stream: Any = None, enable_cooperative_groups: bool = False) -> None:
        _dims("grid", grid)
        _dims("block", block)
        len(args)  # CuPy sizes the argument list first: a generator is refused
        for arg in args:
            _kernel_arg(arg)
        _c_int("shared_mem", shared_mem)
        if stream is not None and type(stream.ptr) is not int:  # AttributeError without .ptr
            raise TypeError(f"stream.ptr: an integer is required, got {stream.ptr!r}")
        self.calls.append({"grid": grid, "block": block, "args": tuple(args),
                           "shared_mem": shared_mem, "stream": stream})


class FakeModule:
    """A ``cupy.cuda.function.Module`` that records the images it loads."""

    def __init__(self, fake: FakeCupy) -> None:
        self._fake = fake

    def load(self, cubin: Any) -> None:
        if type(cubin) is not bytes:  # CuPy: `cpdef load(self, bytes cubin)`
            raise TypeError(f"Argument 'cubin' has incorrect type (expected bytes, got "
                            f"{type(cubin).__name__})")
        if not cubin:
            raise ValueError("an empty module image")
        self._fake.modules.append(cubin)

    def get_function(self, name: Any) -> FakeFunction:
        if not isinstance(name, (str, bytes)):
            raise TypeError(f"a kernel name is a str, got {type(name).__name__}")
        fn = FakeFunction(name.decode() if isinstance(name, bytes) else name)
        self._fake.functions.append(fn)
        return fn


def _from_external(obj: Any) -> Any:
    protocol = getattr(obj, "__cuda_stream__", None)
    if protocol is None:
        raise TypeError(f"Object of type {type(obj).__name__} does not implement the CUDA "
                        "stream protocol (__cuda_stream__ method)")
    handle = protocol()
    if type(handle) is not tuple or len(handle) != 2 or not all(
            type(x) is int for x in handle):
        raise TypeError(f"__cuda_stream__ must return (version, handle) ints, got {handle!r}")
    return SimpleNamespace(ptr=handle[1])


@dataclass
class FakeCupy:
    """The parts of CuPy the backend touches, checking and recording what it is asked."""

    current: int = 0
    modules: list[bytes] = field(default_factory=list)
    functions: list[FakeFunction] = field(default_factory=list)
    attributes: list[tuple[int, int, int]] = field(default_factory=list)
    switched_to: list[int] = field(default_factory=list)

    def func_set_attribute(self, ptr: Any, attr: Any, value: Any) -> None:
        _pointer_int("f", ptr)
        _c_int("attribute", attr)
        _c_int("value", value)
        self.attributes.append((ptr, attr, value))

    @property
    def cuda(self) -> Any:
        fake = self

        @contextlib.contextmanager
        def device_ctx(index: Any) -> Any:
            _c_int("device", index)
            fake.switched_to.append(index)
            yield

        driver = SimpleNamespace(
            CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8,
            funcSetAttribute=self.func_set_attribute, CUDADriverError=RuntimeError)
        runtime = SimpleNamespace(getDevice=lambda: fake.current,
                                  CUDARuntimeError=RuntimeError)
        return SimpleNamespace(function=SimpleNamespace(Module=lambda: FakeModule(fake)),
                               Device=device_ctx,
                               Stream=SimpleNamespace(from_external=_from_external),
                               driver=driver, runtime=runtime)


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


# --- the stub against CuPy ----------------------------------------------------------------

_STREAM = SimpleNamespace(ptr=0)


class _ProtocolOnly:
    """A stream object that offers the CUDA stream protocol but no ``.ptr``."""

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, 5)


def _launch(**overrides: Any) -> Callable[[Any], None]:
    call: dict[str, Any] = {"grid": (2, 1, 1), "block": (128, 1, 1),
                            "args": (1 << 40, np.int32(2), np.float32(0.5), 1.5, None),
                            "shared_mem": 49152, "stream": _STREAM}
    call.update(overrides)

    def launch(cp: Any) -> None:
        kwargs = dict(call)
        cp.function(kwargs.pop("grid"), kwargs.pop("block"), kwargs.pop("args"), **kwargs)

    return launch


#: (what is done, whether CuPy 14 refuses it by type) through a namespace with ``function``
#: (a Function), ``module`` (a fresh Module), ``driver`` and ``Stream`` of CuPy or the stub.
CUPY_CASES: dict[str, tuple[Callable[[Any], Any], bool]] = {
    "launch": (_launch(), False),
    "grid as a list": (_launch(grid=[2, 1, 1]), True),
    "block as a list": (_launch(block=[128, 1, 1]), True),
    "grid as a tuple subclass": (_launch(grid=type("G", (tuple,), {})((2, 1, 1))), True),
    "grid dimension over a C int": (_launch(grid=(1, 2**31, 1)), True),
    "grid dimension as a string": (_launch(grid=("2", 1, 1)), True),
    "arguments as a generator": (_launch(args=(x for x in (1, 2))), True),
    "a string argument": (_launch(args=(1, "x")), True),
    "an object argument": (_launch(args=(object(),)), True),
    "an argument over int64": (_launch(args=(2**64,)), True),
    "negative shared memory": (_launch(shared_mem=-1), True),
    "a raw stream handle": (_launch(stream=5), True),
    "a stream without .ptr": (_launch(stream=_ProtocolOnly()), True),
    "load bytes": (lambda cp: cp.module.load(b"\x7fELF"), False),
    "load a bytearray": (lambda cp: cp.module.load(bytearray(b"\x7fELF")), True),
    "load a memoryview": (lambda cp: cp.module.load(memoryview(b"\x7fELF")), True),
    "load a str": (lambda cp: cp.module.load("\x7fELF"), True),
    "get_function by str": (lambda cp: cp.module.get_function("k"), False),
    "get_function by int": (lambda cp: cp.module.get_function(5), True),
    "funcSetAttribute ints": (lambda cp: cp.driver.funcSetAttribute(
        0, cp.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 100_000), False),
    "funcSetAttribute numpy value": (lambda cp: cp.driver.funcSetAttribute(
        0, cp.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, np.int64(100)), False),
    "funcSetAttribute numpy function": (lambda cp: cp.driver.funcSetAttribute(
        np.int64(0), cp.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 100), True),
    "funcSetAttribute value over a C int": (lambda cp: cp.driver.funcSetAttribute(
        0, cp.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 2**40), True),
    "from_external with the protocol": (lambda cp: cp.Stream.from_external(_ProtocolOnly()),
                                        False),
    "from_external of a raw handle": (lambda cp: cp.Stream.from_external(5), True),
}

#: Refused by the stub only: CuPy would run these, silently changing the launch.
STUB_STRICTER: dict[str, Callable[[Any], Any]] = {
    "a float grid dimension": _launch(grid=(2.0, 1, 1)),
    "a zero grid dimension": _launch(grid=(0, 1, 1)),
    "four grid dimensions": _launch(grid=(1, 1, 1, 2)),
    "shared memory over a C int": _launch(shared_mem=2**31),
    "an empty image": lambda cp: cp.module.load(b""),
}

_REFUSALS = (TypeError, OverflowError, AttributeError, ValueError)


def _stub_namespace() -> Any:
    fake = FakeCupy()
    cp = fake.cuda
    return SimpleNamespace(function=FakeFunction("k"), module=cp.function.Module(),
                           driver=cp.driver, Stream=cp.Stream)


def _refused(action: Callable[[Any], Any], namespace: Any) -> bool:
    """Whether ``action`` is refused by a type check (a driver error means it passed them)."""
    try:
        action(namespace)
    except _REFUSALS:
        return True
    except Exception:  # CuPy without a driver: the call got past every type check
        return False
    return False


@pytest.mark.parametrize("case", sorted(CUPY_CASES))
def test_the_stub_refuses_what_cupy_refuses(case: str) -> None:
    action, refused = CUPY_CASES[case]
    assert _refused(action, _stub_namespace()) is refused


@pytest.mark.parametrize("case", sorted(STUB_STRICTER))
def test_the_stub_refuses_launches_cupy_would_change(case: str) -> None:
    assert _refused(STUB_STRICTER[case], _stub_namespace())


def test_the_stub_agrees_with_cupy() -> None:
    """Real CuPy checks argument types before it needs a driver: on a machine without a GPU
    each case is either refused by type or fails later for want of a driver."""
    cupy = pytest.importorskip("cupy")
    if torch.cuda.is_available():
        pytest.skip("runs CuPy's launch path on a null function: only where no GPU is")
    from cupy.cuda import function as cupy_function

    verdicts = {}
    for case, (action, _) in CUPY_CASES.items():
        real = SimpleNamespace(function=cupy_function.Function.__new__(
            cupy_function.Function), module=cupy_function.Module(),
            driver=cupy.cuda.driver, Stream=cupy.cuda.Stream)
        verdicts[case] = (_refused(action, real), _refused(action, _stub_namespace()))
    disagree = {case: v for case, v in verdicts.items() if v[0] != v[1]}
    assert not disagree, f"(CuPy {cupy.__version__} refuses, stub refuses): {disagree}"
    assert {case: v[0] for case, v in verdicts.items()} == {
        case: refused for case, (_, refused) in CUPY_CASES.items()}


def test_attention_reaches_cupy_with_what_cupy_takes(fake_cupy: FakeCupy,
                                                     dispatcher: Any) -> None:
    """The public call, from flashtune.attention down to the CuPy launch, on CPU tensors
    through the cuda backend (registered for CPU tensors here): every value handed to CuPy
    passes the strict stub, the grid covers the problem and the pointers are the tensors'."""
    register_backend("cuda_on_cpu", "cpu", cuda.CudaBackend)
    try:
        q = torch.randn(2, 300, 8, 128, dtype=torch.bfloat16)
        k = torch.randn(2, 300, 2, 128, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        flashtune.attention(q, k, v, causal=True, backend="cuda_on_cpu")
    finally:
        unregister_backend("cuda_on_cpu")
    (fn,) = fake_cupy.functions
    (call,) = fn.calls
    (module,) = fake_cupy.modules
    assert module == f"sm_90:{fn.name}".encode()
    block_m = int(fn.name.split("_m")[1].split("_")[0])
    assert call["grid"] == (-(-300 // block_m), 8, 2)
    assert call["args"][1:3] == (k.data_ptr(), v.data_ptr())
    assert call["args"][0] == q.data_ptr()
    assert call["args"][-1] == np.float32(128 ** -0.5)
