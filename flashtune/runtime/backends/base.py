"""The small interface every kernel backend implements (CUDA on a GPU, the CPU emulator).

A backend turns a KernelSource into a loaded kernel and launches it with packed arguments.
Runtime, tuner and tests depend on this interface only, so the emulator stands in for the
GPU wherever no GPU exists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from flashtune.codegen.abi import ArgType, ArgValue
from flashtune.codegen.spec import KernelSource


@runtime_checkable
class LoadedKernel(Protocol):
    """A kernel ready to launch."""

    source: KernelSource

    def launch(
        self,
        grid: tuple[int, int, int],
        args: Sequence[tuple[ArgType, ArgValue]],
        *,
        stream: int = 0,
    ) -> None:
        """Run the kernel over ``grid`` with ``source.threads`` threads and
        ``source.smem_bytes`` bytes of dynamic shared memory. Pointers in ``args`` must
        address memory this backend can reach (device memory for CUDA, host memory for the
        emulator). ``stream`` is a raw CUDA stream handle (ignored by the emulator)."""
        ...

    def bind(
        self,
        grid: tuple[int, int, int],
        args: Sequence[tuple[ArgType, ArgValue]],
        *,
        stream: int = 0,
    ) -> Callable[[], None]:
        """``launch`` with every argument converted once: calling the result enqueues the
        kernel again with nothing converted (what a timing loop repeats)."""
        ...


@runtime_checkable
class Backend(Protocol):
    """Loads kernels for one kind of execution target."""

    name: str

    def load(self, source: KernelSource) -> LoadedKernel:
        """Compile (or fetch from the caches) and load ``source``."""
        ...
