"""The emulator behind the Backend / LoadedKernel interface of backends/base.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flashtune import families
from flashtune.codegen.abi import ArgType, ArgValue
from flashtune.codegen.render import templates_dir
from flashtune.codegen.spec import KernelSource
from flashtune.errors import EmulatorError, InvalidProblem
from flashtune.runtime.backends.emulator.counters import EmulatorCounters
from flashtune.runtime.backends.emulator.kernel import (
    EmulatedKernel,
    LaunchOptions,
    build_module,
)
from flashtune.toolchain.cache import ArtifactCache


def source_defines(source: KernelSource) -> tuple[str, ...]:
    """The -D options of a KernelSource (its other NVRTC options do not apply on the host)."""
    return tuple(opt[2:] for opt in source.options if opt.startswith("-D") and len(opt) > 2)


def expected_signature(source: KernelSource) -> str | None:
    """The parameter type codes the declaration of ``source``'s entry point says its library
    exports (its family's ``abi``), None when no registered family declares one."""
    try:
        abi = families.of(source.problem).abi
    except InvalidProblem:
        return None
    return None if abi is None else abi.emulator_signature(source.problem.features)


def check_signature(source: KernelSource, kernel: EmulatedKernel) -> None:
    """EmulatorError when the built library's parameters differ from the declaration: the
    template's signature and its family's ABI have drifted apart."""
    expected = expected_signature(source)
    if expected is not None and kernel.signature != expected:
        raise EmulatorError(
            f"{source.entry}: the built kernel's parameters are {kernel.signature!r} but its "
            f"family's ABI declares {expected!r} (p pointer, i int32, l int64, f float32, T "
            "tensor map); render the template's parameter list from the ABI (its "
            "``signature``)")


@dataclass
class EmulatorLoadedKernel:
    """A rendered kernel built for the emulator; launches run on the CPU. With
    ``options.counters`` set, ``last_counters`` holds the counters of the latest launch."""

    source: KernelSource
    kernel: EmulatedKernel
    options: LaunchOptions = field(default_factory=LaunchOptions)
    last_counters: EmulatorCounters | None = None

    def launch(
        self,
        grid: tuple[int, int, int],
        args: Sequence[tuple[ArgType, ArgValue]],
        *,
        stream: int = 0,
    ) -> None:
        """Run over ``grid`` with ``source.threads`` threads and ``source.smem_bytes`` of
        dynamic shared memory; pointers must address host memory. ``stream`` is ignored."""
        del stream
        self.last_counters = self.kernel.launch(grid, (self.source.threads, 1, 1), args,
                                                smem_bytes=self.source.smem_bytes,
                                                options=self.options)

    def bind(
        self,
        grid: tuple[int, int, int],
        args: Sequence[tuple[ArgType, ArgValue]],
        *,
        stream: int = 0,
    ) -> Callable[[], None]:
        """``launch`` as a callable (the emulator converts arguments per launch anyway)."""
        frozen = tuple(args)
        return lambda: self.launch(grid, frozen, stream=stream)


class EmulatorBackend:
    """Runs generated kernels on the CPU (name "emulator")."""

    name = "emulator"

    def __init__(self, cache: ArtifactCache | None = None,
                 options: LaunchOptions | None = None) -> None:
        self._cache = cache
        self._options = options or LaunchOptions()

    def load(self, source: KernelSource) -> EmulatorLoadedKernel:
        """Compile (or fetch from the cache) and load ``source``; its parameters are checked
        against its family's ABI (``check_signature``)."""
        module = build_module(source.code, [source.entry], include_dirs=[templates_dir()],
                              defines=source_defines(source), cache=self._cache)
        kernel = module[source.entry]
        check_signature(source, kernel)
        return EmulatorLoadedKernel(source, kernel, self._options)
