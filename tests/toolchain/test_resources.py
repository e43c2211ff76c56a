"""Reading resources from ptxas' verbose output, across the formats ptxas releases print."""

from __future__ import annotations

import random

import pytest

from flashtune.toolchain.resources import Resources, parse_ptxas_log


def _log(entry: str, regs: int, smem: int, cmem: list[int], frame: int, st: int, ld: int,
         *, barriers: int | None, callee: tuple[str, int, int] | None = None) -> str:
    """A ptxas -v log in the layout of CUDA 12/13 (barriers) or older releases (none)."""
    banks = ", ".join(f"{c} bytes cmem[{i}]" for i, c in enumerate(cmem) if c)
    used = f"Used {regs} registers"
    if barriers is not None:
        used += f", used {barriers} barriers"
    if smem:
        used += f", {smem} bytes smem"
    if banks:
        used += f", {banks}"
    lines = [
        "ptxas info    : 0 bytes gmem, 24 bytes cmem[4]",
        f"ptxas info    : Compiling entry function '{entry}' for 'sm_80'",
        f"ptxas info    : Function properties for {entry}",
        f"ptxas         .     {frame} bytes stack frame, {st} bytes spill stores, "
        f"{ld} bytes spill loads",
        f"ptxas info    : {used}",
        "ptxas info    : Compile time = 12.5 ms",
    ]
    if callee is not None:
        name, cst, cld = callee
        lines += [
            f"ptxas info    : Function properties for {name}",
            f"ptxas         .     8 bytes stack frame, {cst} bytes spill stores, "
            f"{cld} bytes spill loads",
        ]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("barriers", [None, 0, 1, 3])
def test_random_logs_round_trip(barriers: int | None) -> None:
    rng = random.Random()
    for _ in range(50):
        regs, smem = rng.randint(1, 255), rng.choice([0, rng.randint(1, 99_000)])
        cmem = [rng.randint(0, 600), rng.choice([0, rng.randint(1, 64)])]
        frame, st, ld = rng.choice([0, 8, 64]), rng.randint(0, 96), rng.randint(0, 96)
        callee = rng.choice([None, ("_Z6helperPf", rng.randint(0, 32), rng.randint(0, 32))])
        log = _log("flashtune_k", regs, smem, cmem, frame, st, ld, barriers=barriers,
                   callee=callee)
        dyn, threads = rng.randint(0, 200_000), rng.choice([64, 128, 256])
        res = parse_ptxas_log(log, "flashtune_k", dynamic_smem=dyn, max_threads=threads)
        extra_st, extra_ld = (callee[1], callee[2]) if callee else (0, 0)
        assert res == Resources(
            registers=regs, spill_stores=st + extra_st, spill_loads=ld + extra_ld,
            static_smem=smem, dynamic_smem=dyn, stack_frame=frame, cmem=sum(cmem),
            max_threads=threads, barriers=barriers or 0,
        )
        assert res.spill_bytes == st + ld + extra_st + extra_ld
        assert res.smem_bytes == smem + dyn


def test_the_named_entry_is_chosen_among_several() -> None:
    log = (_log("first", 40, 0, [380], 0, 0, 0, barriers=1)
           + _log("second", 96, 2048, [380], 0, 0, 0, barriers=1))
    assert parse_ptxas_log(log, "second", dynamic_smem=0, max_threads=128).registers == 96
    assert parse_ptxas_log(log, "first", dynamic_smem=0, max_threads=128).static_smem == 0


def test_missing_entry_is_an_error_naming_what_was_seen() -> None:
    log = _log("other", 40, 0, [380], 0, 0, 0, barriers=1)
    with pytest.raises(ValueError, match=r"no 'Used N registers' line for entry 'mine'.*other"):
        parse_ptxas_log(log, "mine", dynamic_smem=0, max_threads=128)
    with pytest.raises(ValueError, match="--ptxas-options=-v"):
        parse_ptxas_log("", "mine", dynamic_smem=0, max_threads=128)


def test_resources_validate_and_round_trip() -> None:
    res = Resources(registers=128, spill_stores=4, spill_loads=8, static_smem=0,
                    dynamic_smem=49152, stack_frame=16, cmem=380, max_threads=256, barriers=1)
    assert Resources.from_dict(res.to_dict()) == res
    with pytest.raises(ValueError, match="registers must be a non-negative int"):
        Resources(**{**res.to_dict(), "registers": -1})
    with pytest.raises(ValueError, match="unknown Resources field"):
        Resources.from_dict({**res.to_dict(), "lmem": 3})
