"""``flashtune db verify``: re-check the configs a database serves, on the installed kernels.

Each best entry (optionally only some devices or problems) is rendered from the installed
templates and checked through the tuner's measurers, so this is exactly the
verification a tuning run does:

- without a GPU (or with ``--backend emulator``): NVRTC compiles for the entry's arch and the
  CPU emulator runs the kernel on fresh random inputs against the float64 reference;
- on a GPU: the same numerics on the device, and the entry's bucket is timed again (only for
  entries of this very device): the report shows the new median next to the stored one.

Every check is recorded (``ft_verifications``): a pass on the installed sources makes a
stale entry servable again, a failure keeps an entry from being served.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashtune.db.records import BestEntry, TrialStatus, printable, truncate_error
from flashtune.errors import FlashtuneError
from flashtune.runtime.installed import installed_digest

if TYPE_CHECKING:
    from flashtune.db.store import TuningStore
    from flashtune.tuner.measure.base import Measurer

#: Measured / stored median outside this range is flagged in the report.
TIMING_RATIO_WARN = 2.0
#: Verification lengths in the emulator stay small (it runs every thread on the CPU).
EMULATOR_VERIFY_CAP = 72


@dataclass(frozen=True)
class Checked:
    """The outcome of re-checking one best entry."""

    entry: BestEntry
    digest: str | None
    passed: bool
    detail: str
    measured_ms: float | None = None


def _time(measurer: Measurer, entry: BestEntry, verify_cap: int | None
          ) -> tuple[float, str]:
    """The geometric-mean median of the entry's bucket shapes on ``measurer``, and a note."""
    from flashtune.tuner.measure.base import TimingPlan
    from flashtune.tuner.measure.workload import geomean, make_workload

    bucket, config = entry.trial.problem_bucket(), entry.trial.kernel_config()
    shapes = make_workload(bucket, verify_cap=verify_cap or 1024).shapes
    timings = measurer.time(bucket.problem, config, shapes,
                            TimingPlan(shape_class=bucket.shape_class))
    measured = geomean([t.median_ms for t in timings])
    ratio = measured / entry.median_ms
    flag = ("" if 1 / TIMING_RATIO_WARN <= ratio <= TIMING_RATIO_WARN
            else f"; differs from the stored time by more than {TIMING_RATIO_WARN:g}x")
    return measured, (f"measured {measured:.4g} ms, stored {entry.median_ms:.4g} ms "
                      f"(x{ratio:.3g}){flag}")


def check_entry(measurer: Measurer, entry: BestEntry, *,
                verify_cap: int | None = None, time_it: bool = False) -> Checked:
    """Re-check one entry's config on the installed kernel sources with ``measurer``."""
    from flashtune.tuner.measure.workload import make_workload

    digest = installed_digest(entry.problem, entry.config.key)
    try:
        bucket, config = entry.trial.problem_bucket(), entry.trial.kernel_config()
        workload = make_workload(bucket, verify_cap=verify_cap or 1024)
        outcome = measurer.verify(bucket.problem, config, workload.verify_shape)
    except FlashtuneError as exc:
        return Checked(entry, digest, False, truncate_error(f"{type(exc).__name__}: {exc}"))
    if outcome.status is not TrialStatus.OK:
        return Checked(entry, digest, False,
                       truncate_error(f"{outcome.status.value}: {outcome.error or ''}"))
    detail = f"numerics ok (max abs error {outcome.max_abs_error:.3g})"
    if not time_it:
        return Checked(entry, digest, True, detail)
    try:
        measured, note = _time(measurer, entry, verify_cap)
    except FlashtuneError as exc:
        return Checked(entry, digest, False, truncate_error(f"timing failed: {exc}"))
    return Checked(entry, digest, True, f"{detail}; {note}", measured)


def verify_store(store: TuningStore, entries: Sequence[BestEntry],
                 measurer_of: Callable[[str], Measurer], *,
                 verify_cap: int | None = None,
                 on_result: Callable[[Checked], None] | None = None) -> list[Checked]:
    """Check every entry (``measurer_of(arch)`` gives the measurer of an arch) and record
    each verdict in ``store``. Timing happens only on a timed measurer, for entries of the
    measurer's own device."""
    results: list[Checked] = []
    measurers: dict[str, Measurer] = {}
    for entry in entries:
        if entry.arch not in measurers:
            measurers[entry.arch] = measurer_of(entry.arch)
        measurer = measurers[entry.arch]
        time_it = measurer.timed and measurer.device.name == entry.device
        checked = check_entry(measurer, entry, verify_cap=verify_cap, time_it=time_it)
        if checked.digest is not None:
            name = "cuda" if measurer.timed else "emulator"  # FLASHTUNE_BACKEND's names
            store.record_verification(entry.trial.uid, checked.digest, checked.passed, name,
                                      checked.detail)
        results.append(checked)
        if on_result is not None:
            on_result(checked)
    return results


def measurer_for(kind: str) -> tuple[Callable[[str], Measurer], int | None]:
    """``measurer_of(arch)`` and the verification length cap for ``--backend`` (auto: the
    GPU if there is one, else the emulator)."""
    import torch

    from flashtune.tuner.measure.factory import ALIASES, make_measurer

    name = ("cuda" if torch.cuda.is_available() else "dry-run") if kind == "auto" else kind
    if ALIASES.get(name, name) == "cuda":
        gpu = make_measurer(name)
        return (lambda arch: gpu), None
    return (lambda arch: make_measurer(name, arch=arch)), EMULATOR_VERIFY_CAP


#: The columns of ``db verify``'s report (``result_cells`` gives a row).
RESULT_COLUMNS = ("device", "bucket", "config", "sources", "result", "detail")


def result_cells(checked: Checked) -> list[str]:
    """One row of the report, printable; the detail is whole (printed below a table)."""
    entry = checked.entry
    sources = "installed" if entry.trial.template_digest == checked.digest else "other"
    return [printable(str(cell)) for cell in (
        entry.device, entry.trial.bucket, entry.config.key, sources,
        "pass" if checked.passed else "FAIL", checked.detail.strip())]
