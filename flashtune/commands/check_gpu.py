"""``flashtune check --gpu``: the first-use checks of the arch-specific kernels, run ahead.

On this machine's GPU (or, with FLASHTUNE_BACKEND=emulator, the emulator's virtual device of
FLASHTUNE_EMULATOR_ARCH), every arch-specific kernel the runtime would serve (the dispatcher's
choice for every compiled head dim, dtype, mask and sequence bucket: ``planned_kernels``) is
checked against float64 under the first-use deadline, and each result is recorded
(``runtime.first_use``): a serving process then needs no check of its own, inside CUDA-graph
capture too. Kernels recorded before are skipped unless ``--recheck``. A hung kernel is
recorded and stops the run (the device cannot be used by the process any more); running the
command again checks the rest. ``--list`` prints the kernels, ``--compile-only`` compiles
them in parallel into the kernel cache and launches nothing, ``--only ENTRY`` checks one
(benchmarks/gpu_check.sh compiles them, then runs each check in its own process with a
timeout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flashtune import settings
from flashtune.errors import FlashtuneError, KernelHung

if TYPE_CHECKING:
    import torch

    from flashtune.codegen.spec import KernelConfig, Problem
    from flashtune.runtime.device import DeviceInfo

#: Exit status of a run stopped by a hung kernel (1: some kernel failed its check).
HUNG_EXIT = 2
#: The ops whose calls an arch-specific family may serve: the forward and both backwards.
SERVED_OPS = ("fwd", "bwd", "bwddet")


def _device() -> tuple[torch.device, DeviceInfo]:
    """The device the checks run on and what the dispatcher knows of it."""
    import torch

    from flashtune.runtime.device import DeviceInfo

    if settings.BACKEND.get() == "emulator":
        return torch.device("cpu"), DeviceInfo.virtual(settings.EMULATOR_ARCH.get())
    if not torch.cuda.is_available():
        raise typer.BadParameter(
            "no CUDA device: --gpu checks the arch-specific kernels on this machine's GPU "
            "(FLASHTUNE_BACKEND=emulator checks them on the emulator's virtual device)",
            param_hint="--gpu")
    index = torch.cuda.current_device()
    return torch.device("cuda", index), DeviceInfo.current(index)


def arch_specific_kernels(info: DeviceInfo) -> list[tuple[Problem, KernelConfig]]:
    """The arch-specific kernels the runtime would serve on ``info`` for the forward and
    the backward (``SERVED_OPS``, in that order; none on a device that runs no
    arch-specific family)."""
    import dataclasses

    from flashtune import families
    from flashtune.runtime.precompile import ALL_BUCKETS, all_problems, planned_kernels

    device = dataclasses.replace(info, arch_specific_kernels=True)
    found = []
    for op in SERVED_OPS:  # the forward's first: a GPU check's serving stage needs them
        found += [(p, c) for p, c in planned_kernels(device, all_problems(ops=(op,)),
                                                     ALL_BUCKETS)
                  if families.of(p).target_arch is not None]
    return found


def check_gpu(*, recheck: bool, list_only: bool, only: list[str] | None,
              timeout_s: float | None, compile_only: bool = False) -> None:
    """Run (or list) the checks ahead; see the module's docstring."""
    from flashtune import families
    from flashtune.runtime import first_use
    from flashtune.runtime.backends import get_backend

    console = Console(width=max(Console().width, 110))
    device, info = _device()
    sources = [families.render(p, c) for p, c in arch_specific_kernels(info)]
    if list_only:
        for source in sources:
            console.print(source.entry, highlight=False, soft_wrap=True)
        return
    if compile_only:
        from flashtune.toolchain.compiler import compile_pairs

        results = compile_pairs([(s, info.arch) for s in sources])  # as the backend does
        bad = [f"{s.entry}: {r.failure}" for s, r in zip(sources, results, strict=True)
               if not r.ok]
        console.print(f"compiled {len(sources) - len(bad)} of {len(sources)} kernels")
        for message in bad:
            Console(stderr=True).print(f"[bold red]failure:[/] {escape(message)}",
                                       highlight=False)
        if bad:
            raise typer.Exit(1)
        return
    if only:
        unknown = sorted(set(only) - {s.entry for s in sources})
        if unknown:
            raise typer.BadParameter(f"{', '.join(unknown)}: not an arch-specific kernel served "
                                     f"on {info.name}; `flashtune check --gpu --list` lists "
                                     "them", param_hint="--only")
        sources = [s for s in sources if s.entry in only]
    if not sources:
        console.print(f"no arch-specific kernel serves on {info.name}: nothing to check")
        return
    backend = get_backend("emulator" if device.type == "cpu" else "cuda")
    table = Table("kernel", "result", title=f"first-use checks on {info.name} (recorded)")
    failed: list[str] = []
    status = Console(stderr=True).status("checking")
    try:
        with status:
            loaded = (backend.load(s) for s in sources)
            for result, fresh in first_use.check_ahead(
                    loaded, device, info.name, recheck=recheck, timeout_s=timeout_s,
                    on_start=lambda s: status.update(f"checking {s.entry}")):
                said = "pass" if result.ok else f"FAIL: {result.reason}"
                table.add_row(result.entry, said + ("" if fresh else " (recorded before)"))
                if not result.ok:
                    failed.append(f"{result.entry}: {result.reason}")
    except KernelHung as exc:
        console.print(table)
        Console(stderr=True).print(f"[bold red]hung:[/] {escape(str(exc))}; run `flashtune "
                                   "check --gpu` again (in a new process) to check the rest",
                                   highlight=False)
        raise typer.Exit(HUNG_EXIT) from None
    except FlashtuneError as exc:
        console.print(table)
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        raise typer.Exit(1) from None
    console.print(table)
    for message in failed:
        Console(stderr=True).print(f"[bold red]failure:[/] {escape(message)}", highlight=False)
    if failed:
        raise typer.Exit(1)
