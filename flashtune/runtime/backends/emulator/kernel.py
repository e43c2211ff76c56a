"""Building and launching arbitrary CUDA source in the emulator (the low-level API).

    module = build_module(code, ["my_kernel"])
    module["my_kernel"].launch((blocks, 1, 1), (128, 1, 1), [ptr(x), ptr(y), i32(n)])

Arguments are (ArgType, value) pairs in the kernel's parameter order, the packing of
``codegen.abi`` (a family's generated packers); they are checked against the parameter types
the compiler saw, so a wrong type or count is an error instead of garbage.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from flashtune import settings
from flashtune.codegen.abi import ArgType, ArgValue
from flashtune.codegen.tensormap import TensorMap
from flashtune.errors import EmulatorError, InvalidInput
from flashtune.runtime.backends.emulator import build, native
from flashtune.runtime.backends.emulator.counters import EmulatorCounters, allocate, from_native
from flashtune.runtime.tma import aligned_buffer, encode_emulator
from flashtune.toolchain import host as toolchain
from flashtune.toolchain.cache import ArtifactCache

Arg = tuple[ArgType, ArgValue]

#: Largest dynamic + static shared memory per block of any supported GPU (sm_90: 227 KiB).
DEFAULT_SMEM_LIMIT = 227 * 1024
DEFAULT_STACK_BYTES = 256 * 1024

_CODES_FOR = {ArgType.PTR: ("p",), ArgType.I32: ("i", "u"), ArgType.I64: ("l", "L"),
              ArgType.F32: ("f",), ArgType.TMAP: ("T",)}
_CODE_NAMES = {"p": "pointer", "i": "int32", "u": "uint32", "l": "int64", "L": "uint64",
               "f": "float32", "d": "float64", "T": "CUtensorMap", "b": "bool",
               "?": "unsupported type"}


class Schedule(str, Enum):
    """Order in which runnable emulated threads run (see abi.h FTEMU_SCHEDULE_*)."""

    FORWARD = "forward"
    REVERSE = "reverse"


@dataclass(frozen=True)
class LaunchOptions:
    """How a launch is emulated.

    schedule: FORWARD runs the lowest-numbered runnable thread first (warp 0 runs ahead to
        its next barrier, then warp 1, ...); REVERSE the highest. Races between warps show in
        one order or the other, so thorough checks run both.
    check_poison_operands: mma operands equal to the shared-memory poison are errors.
    check_barrier_site: all threads must reach the same __syncthreads call.
    hang_timeout_s: a thread running this long without reaching a barrier, collective or its
        end is reported as a hang (None: setting FLASHTUNE_EMULATOR_DEADLOCK_S; 0: never).
    counters: count traffic, bank conflicts and instructions (counters.EmulatorCounters,
        returned by the launch); off, each primitive pays one branch.
    block_order_seed: None runs the blocks of the grid one after another in linear order
        (x fastest, then y, then z); an int runs them in the order of a shuffle seeded by it
        (the same order for the same seed and grid on every platform), so a result that
        depends on the order of blocks (floating-point atomics, cross-block races) changes
        from seed to seed.
    """

    schedule: Schedule = Schedule.FORWARD
    stack_bytes: int = DEFAULT_STACK_BYTES
    smem_limit_bytes: int = DEFAULT_SMEM_LIMIT
    check_poison_operands: bool = True
    check_barrier_site: bool = True
    hang_timeout_s: float | None = None
    counters: bool = False
    block_order_seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        if not 16384 <= self.stack_bytes <= 1 << 26:
            raise InvalidInput(f"stack_bytes={self.stack_bytes} must be in [16 KiB, 64 MiB]")
        if self.smem_limit_bytes < 0:
            raise InvalidInput(f"smem_limit_bytes={self.smem_limit_bytes} must be >= 0")
        if self.hang_timeout_s is not None and not (
            math.isfinite(self.hang_timeout_s) and self.hang_timeout_s >= 0
        ):
            raise InvalidInput(f"hang_timeout_s={self.hang_timeout_s} must be finite and >= 0")
        seed = self.block_order_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or not 0 <= seed < 1 << 64):
            raise InvalidInput(f"block_order_seed={seed!r} must be None (linear order) or an "
                               "int in [0, 2**64)")


def ptr(array: Any) -> Arg:
    """A pointer argument to the data of a NumPy array or a CPU torch tensor."""
    if hasattr(array, "__array_interface__"):
        return (ArgType.PTR, int(array.__array_interface__["data"][0]))
    if hasattr(array, "data_ptr") and hasattr(array, "device"):
        if array.device.type != "cpu":
            raise InvalidInput(f"the emulator needs CPU tensors; got one on {array.device}")
        return (ArgType.PTR, int(array.data_ptr()))
    raise InvalidInput(f"cannot take a pointer to {type(array).__name__}; expected a NumPy "
                       "array or a CPU torch tensor")


def i32(value: int) -> Arg:
    return (ArgType.I32, int(value))


def i64(value: int) -> Arg:
    return (ArgType.I64, int(value))


def f32(value: float) -> Arg:
    return (ArgType.F32, float(value))


def _dims(value: int | Sequence[int], what: str) -> tuple[int, int, int]:
    dims = [value] if isinstance(value, int) else list(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) and d >= 1 for d in dims):
        raise InvalidInput(f"{what}={value!r} must be 1 to 3 positive ints")
    dims += [1] * (3 - len(dims))
    return dims[0], dims[1], dims[2]


def _pack_one(index: int, code: str, arg: Arg) -> ctypes._CData:
    kind, value = ArgType(arg[0]), arg[1]
    if code not in _CODES_FOR[kind]:
        raise InvalidInput(
            f"argument {index}: the kernel parameter is {_CODE_NAMES.get(code, code)} but a "
            f"{kind.value} was passed"
        )
    if kind is ArgType.TMAP:
        if not isinstance(value, TensorMap):
            raise InvalidInput(f"argument {index}: a tensor map needs a TensorMap, got "
                               f"{type(value).__name__}")
        return aligned_buffer(encode_emulator(value))
    if isinstance(value, TensorMap):
        raise InvalidInput(f"argument {index}: a TensorMap passed as {kind.value}")
    if kind is ArgType.F32:
        return ctypes.c_float(float(value))
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidInput(f"argument {index}: {kind.value} needs an int, got {value!r}")
    bits = {ArgType.PTR: 64, ArgType.I32: 32, ArgType.I64: 64}[kind]
    signed = code in ("i", "l")
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    if not lo <= value <= hi:
        raise InvalidInput(f"argument {index}: {value} does not fit a "
                           f"{_CODE_NAMES[code]} parameter")
    if kind is ArgType.PTR:
        return ctypes.c_void_p(value)
    if kind is ArgType.I32:
        return ctypes.c_int32(value) if signed else ctypes.c_uint32(value)
    return ctypes.c_int64(value) if signed else ctypes.c_uint64(value)


@dataclass
class EmulatedKernel:
    """One entry point of a built kernel library."""

    entry: str
    library: Path
    signature: str
    _launcher: Any = field(repr=False)

    def launch(
        self,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        args: Sequence[Arg],
        *,
        smem_bytes: int = 0,
        options: LaunchOptions | None = None,
    ) -> EmulatorCounters | None:
        """Run the kernel over ``grid`` with ``block`` threads per block; returns the
        launch's counters when ``options.counters`` is set, else None.

        Raises EmulatorError for a fault in the kernel (bad address, race, poison operand),
        EmulatorDeadlock for a barrier or warp collective that cannot complete, InvalidInput
        for arguments that do not match the kernel's parameters.
        """
        opts = options or LaunchOptions()
        if len(args) != len(self.signature):
            raise InvalidInput(f"{self.entry} takes {len(self.signature)} arguments "
                               f"({self.signature}), got {len(args)}")
        if smem_bytes < 0:
            raise InvalidInput(f"smem_bytes={smem_bytes} must be >= 0")
        pairs = enumerate(zip(self.signature, args, strict=True))
        values = [_pack_one(i, code, a) for i, (code, a) in pairs]
        pointers = (ctypes.c_void_p * max(1, len(values)))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values]
        )
        hang = opts.hang_timeout_s
        if hang is None:
            hang = settings.EMULATOR_TIMEOUT_S.get()
        grid_dims = _dims(grid, "grid")
        blocks = grid_dims[0] * grid_dims[1] * grid_dims[2]
        raw, per_block = allocate(blocks) if opts.counters else (None, None)
        checks = (native.CHECK_POISON_OPERANDS if opts.check_poison_operands else 0) | (
            native.CHECK_BARRIER_SITE if opts.check_barrier_site else 0)
        config = native.LaunchConfig(
            (ctypes.c_uint * 3)(*grid_dims),
            (ctypes.c_uint * 3)(*_dims(block, "block")),
            smem_bytes, opts.smem_limit_bytes, opts.stack_bytes,
            0 if opts.schedule is Schedule.FORWARD else 1, checks, float(hang),
            ctypes.pointer(raw) if raw is not None else None,
            native.BLOCK_ORDER_LINEAR if opts.block_order_seed is None
            else native.BLOCK_ORDER_SHUFFLED,
            opts.block_order_seed or 0,
        )
        message = ctypes.create_string_buffer(native.MESSAGE_BYTES)
        with native.LAUNCH_LOCK:
            status = self._launcher(ctypes.byref(config), pointers, message,
                                    native.MESSAGE_BYTES)
        native.raise_for_status(int(status), message.value.decode(errors="replace"))
        if raw is None or per_block is None:
            return None
        return from_native(raw, per_block, blocks)


class EmulatedModule:
    """A built kernel library: its entry points by name."""

    def __init__(self, built: build.BuiltLibrary) -> None:
        self.built = built
        native.load(built.runtime)  # first: the kernel library needs it by soname
        lib = native.load(built.path)
        self.kernels: dict[str, EmulatedKernel] = {}
        for entry in built.entries:
            launcher, signature = native.entry_functions(lib, entry)
            self.kernels[entry] = EmulatedKernel(entry, built.path, signature, launcher)

    def __getitem__(self, entry: str) -> EmulatedKernel:
        return self.kernels[entry]


def build_module(
    code: str,
    entries: Sequence[str],
    *,
    include_dirs: Sequence[Path] = (),
    defines: Sequence[str] = (),
    asan: bool | None = None,
    opt: Sequence[str] = build.KERNEL_OPT,
    cache: ArtifactCache | None = None,
) -> EmulatedModule:
    """Compile CUDA source ``code`` for the emulator and load it (cached by content).

    ``asan`` defaults to the setting FLASHTUNE_EMULATOR_ASAN; an ASan build can only run in a
    process started with ``toolchain.asan_environment()``.
    """
    use_asan = toolchain.asan_requested() if asan is None else asan
    if use_asan:
        toolchain.check_asan_process()
    options = build.BuildOptions(include_dirs=tuple(Path(d) for d in include_dirs),
                                 defines=tuple(defines), asan=use_asan, opt=tuple(opt))
    store = cache if cache is not None else ArtifactCache()
    built = build.kernel_library(code, list(entries), options, store)
    try:
        return EmulatedModule(built)
    except EmulatorError:
        # Not this kernel's library after all: the next build must not find it again.
        store.discard(build.NAMESPACE, built.key, ".so")
        raise


def build_source(code: str, entry: str, **kwargs: Any) -> EmulatedKernel:
    """Compile ``code`` and return its kernel ``entry`` (see build_module)."""
    return build_module(code, [entry], **kwargs)[entry]
