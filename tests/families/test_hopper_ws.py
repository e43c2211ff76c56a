"""The warp-specialised sm_90a forward (``fwd90aws``: a producer warpgroup, one to three
wgmma consumer warpgroups, setmaxnreg), its knob ``pingpong`` (two consumers take turns
through named barriers; ``--fix pingpong=1`` restricts a search to them), its knob
``overlap`` (the next tile's Q K^T issued before this tile's softmax) and its load knobs
``loadq``, ``loadk``, ``loadv`` (TMA or cp.async per operand): registry and rules, NVRTC for
sm_90a (no spills; UTMALDG per TMA operand, LDGSTS with cp.async, USETMAXREG, BAR.SYNC /
BAR.ARV and HGMMA in the SASS), and planted bugs the emulator must catch with a clear
message: a wrong tensor-map box, a missing expect-tx, a stage released twice or never,
setmaxnreg rule violations (with three consumers: one skipping it, the split of two), a
ping-pong without its first turn or with a wrong hand-over count, an overlap that reads the
next S before its wait or waits for one group too few, a cp.async producer warp that never
arrives. Their numerics over the coverage grid are in test_hopper_family.py; on a GPU they
are checked by the gpu-marked test at the end. The default run compiles a fixed config of
each knob and a seeded two more (every listed one under ``-m sweep``), and runs the bug
harness without a bug on the plain config and a seeded two of the others."""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import re

import pytest
import torch
from hopper_sample import tma_loads
from sampling import seeded_part

from flashtune import families
from flashtune.codegen.abi import ArgType
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.codegen.tensormap import TensorMap
from flashtune.errors import EmulatorDeadlock, EmulatorError, InvalidProblem
from flashtune.families import fixed
from flashtune.families.base import KernelFamily
from flashtune.families.hopper import HOPPER_FORWARD, space
from flashtune.families.hopper.ws import HOPPER_WS_FORWARD
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions, Schedule
from flashtune.runtime.launch import verify
from flashtune.toolchain.compiler import compile_source
from flashtune.toolchain.cuda import find_toolchain
from flashtune.toolchain.disasm import disassemble

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
SM90A = get_arch("sm_90a")
#: Two consumers taking turns (the ping-pong knob on).
PINGPONG = {space.PINGPONG: 1}


def _problem(head_dim: int, dtype: DType, causal: bool,
             family: KernelFamily = HOPPER_WS_FORWARD) -> Problem:
    return Problem(head_dim, dtype, causal=causal, op=family.op)


def _pingpong(config: KernelConfig) -> KernelConfig:
    return dataclasses.replace(config, extras=tuple(PINGPONG.items()))


def _traits_knobs(code: str) -> tuple[str, ...]:
    """The PingPong and Overlap arguments of the rendered kernel's traits."""
    found = re.search(r"\b(true|false),\s*(true|false)>;", code)
    assert found is not None, "no traits with the ping-pong and overlap arguments"
    return found.groups()


def _overlap(config: KernelConfig) -> KernelConfig:
    """``config`` with the overlap knob on (its other knobs kept)."""
    return dataclasses.replace(config, extras=(*config.extras, (space.OVERLAP, 1)))


def _plain(config: KernelConfig) -> KernelConfig:
    """``config`` with ping-pong and overlap at 0 (the load knobs kept)."""
    return dataclasses.replace(config, extras=tuple(
        (k, v) for k, v in config.extras if k not in (space.PINGPONG, space.OVERLAP)))


def test_registered_as_the_family_serving_the_forward_beside_the_cp_async_one() -> None:
    assert families.get("fwd90aws") is HOPPER_WS_FORWARD
    assert HOPPER_WS_FORWARD.serves == "fwd" and HOPPER_WS_FORWARD.target_arch == "sm_90a"
    assert HOPPER_FORWARD.serves is None  # kept to tune and compare with
    generic = Problem(128, DType.BF16)
    assert families.served_problem(generic, SM90A).op == HOPPER_WS_FORWARD.op
    problem = _problem(128, DType.BF16, True)
    default = HOPPER_WS_FORWARD.default_config(problem, SM90A)
    # the cp.async family's tile with both of FA3's overlaps on (the rule admits them)
    config = _plain(default)
    assert config == HOPPER_FORWARD.default_config(dataclasses.replace(problem, op="fwd90a"),
                                                   SM90A)
    assert default == _overlap(_pingpong(config))
    source = families.render(problem, config)
    assert _traits_knobs(families.render(problem, default).code) == ("true", "true")
    assert source.threads == 384 and source.target == "sm_90a"  # producer + 2 consumers
    assert source.smem_bytes == HOPPER_FORWARD.smem_bytes(problem, config) + 8  # Q's barrier
    assert "CUtensorMap tmap_q" in source.code and "__launch_bounds__(384, 1)" in source.code
    # the ping-pong kernels alone are a restriction of this space (--fix), not a family
    with pytest.raises(InvalidProblem, match="fwd90aws"):
        families.get("fwd90awspp")
    pp = fixed.parse(HOPPER_WS_FORWARD, problem, ["pingpong=1"])
    assert pp == (("pingpong", 1),)
    assert fixed.apply(HOPPER_WS_FORWARD, config, pp) == _pingpong(config)
    assert HOPPER_WS_FORWARD.pingpong_on(_pingpong(config))
    assert not HOPPER_WS_FORWARD.pingpong_on(config)
    assert _traits_knobs(families.render(problem, _pingpong(config)).code) == ("true", "false")
    one = HOPPER_WS_FORWARD.static_check(problem, _pingpong(KernelConfig(64, 64, 4, 2)), SM90A)
    assert one is not None and "exactly two consumer warpgroups" in one


def test_pingpong_is_a_knob_of_the_space_for_two_consumers_only() -> None:
    problem = _problem(64, DType.FP16, True)
    assert space.WS_SPACE.names == ("block_m", "block_n", "num_stages", "pingpong", "overlap",
                                    "loadq", "loadk", "loadv")
    configs = HOPPER_WS_FORWARD.search_space(problem)
    assert len(configs) == 3 * 13 * 3 * 2 * 2 * 2 ** 3
    on = [c for c in HOPPER_WS_FORWARD.candidates(problem, SM90A)
          if space.knob(c, space.PINGPONG)]
    assert on and all(c.block_m == 128 for c in on)
    pp = _pingpong(KernelConfig(128, 64, 8, 2))
    assert pp.key() == "m128_n64_w8_s2_pingpong-1" and HOPPER_WS_FORWARD.point(pp)["pingpong"] == 1
    assert HOPPER_WS_FORWARD.config(HOPPER_WS_FORWARD.point(pp)) == pp
    default = HOPPER_WS_FORWARD.default_config(problem, SM90A)
    assert HOPPER_WS_FORWARD.point(default)["pingpong"] == 1
    for block_m in (64, 192):
        why = HOPPER_WS_FORWARD.static_check(problem, _pingpong(
            KernelConfig(block_m, 64, block_m // 16, 2)), SM90A)
        assert why is not None and "exactly two consumer warpgroups" in why, why
    why = HOPPER_WS_FORWARD.static_check(
        problem, KernelConfig(128, 64, 8, 2, extras=(("pingpong", 2),)), SM90A)
    assert why is not None and "pingpong=2: expected one of (0, 1)" in why
    why = HOPPER_FORWARD.static_check(dataclasses.replace(problem, op="fwd90a"), pp, SM90A)
    assert why is not None and "not knobs of the 'fwd90a' family" in why
    source = families.render(problem, pp)
    assert source.threads == 384 and _traits_knobs(source.code) == ("true", "false")
    assert _traits_knobs(families.render(problem, KernelConfig(128, 64, 8, 2)).code) == (
        "false", "false")


def test_overlap_is_a_knob_with_two_or_more_stages_and_no_second_s_set() -> None:
    problem = _problem(128, DType.BF16, False)
    plain = KernelConfig(128, 96, 8, 2)
    config = _overlap(plain)
    assert config.key() == "m128_n96_w8_s2_overlap-1"
    assert HOPPER_WS_FORWARD.point(config)["overlap"] == 1
    assert HOPPER_WS_FORWARD.config(HOPPER_WS_FORWARD.point(config)) == config
    # FA3's order holds one S set and P: no registers more
    assert (space.accumulator_registers(problem, config)
            == space.accumulator_registers(problem, plain) == 96 // 2 + 128 // 2 + 96 // 4)
    assert HOPPER_WS_FORWARD.static_check(problem, config, SM90A) is None
    both = _overlap(_pingpong(plain))
    assert HOPPER_WS_FORWARD.static_check(problem, both, SM90A) is None
    one = HOPPER_WS_FORWARD.static_check(problem, _overlap(KernelConfig(128, 96, 8, 1)), SM90A)
    assert one is not None and "overlap=1 with num_stages=1" in one, one
    # admitted at FA3's tiles: 128x128 and 128x176 (with ping-pong too)
    for block_n in (128, 176):
        fa3 = KernelConfig(128, block_n, 8, 2)
        assert HOPPER_WS_FORWARD.static_check(problem, _overlap(fa3), SM90A) is None
        assert HOPPER_WS_FORWARD.static_check(problem, _overlap(_pingpong(fa3)), SM90A) is None
    # its own budget where it keeps more live than the plain schedule (measured)
    d64 = _problem(64, DType.BF16, False)
    wide = _overlap(KernelConfig(128, 256, 8, 2))
    assert HOPPER_WS_FORWARD.static_check(d64, _plain(wide), SM90A) is None
    why = HOPPER_WS_FORWARD.static_check(d64, wide, SM90A)
    assert why is not None and "224 registers per thread (S, O and P), over the 212" in why, why
    assert "at head dim 64 with overlap" in why, why
    why = HOPPER_WS_FORWARD.static_check(problem, dataclasses.replace(
        plain, extras=(("overlap", 2),)), SM90A)
    assert why is not None and "overlap=2: expected one of (0, 1)" in why
    assert _traits_knobs(families.render(problem, config).code) == ("false", "true")
    default = HOPPER_WS_FORWARD.default_config(problem, SM90A)
    assert space.knob(default, space.OVERLAP)


def _loads(config: KernelConfig, **loads: str) -> KernelConfig:
    """``config`` with operands loaded as given, e.g. ``loadk="cpasync"`` (its knobs kept)."""
    return dataclasses.replace(config, extras=(*config.extras, *loads.items()))


def _loads_line(code: str) -> str:
    """The WsLoads arguments of the rendered kernel (TMA for Q, K, V)."""
    found = re.search(r"ft::WsLoads<(\w+), (\w+),\s*(\w+)>", code)
    assert found is not None, "no WsLoads binding"
    return ",".join(found.groups())


def test_loads_are_knobs_per_operand_with_the_cp_async_register_split() -> None:
    problem = _problem(128, DType.BF16, True)
    plain = KernelConfig(128, 128, 8, 2)
    config = _loads(plain, loadk="cpasync", loadv="cpasync")
    assert config.key() == "m128_n128_w8_s2_loadk-cpasync_loadv-cpasync"
    point = HOPPER_WS_FORWARD.point(config)
    assert (point["loadq"], point["loadk"], point["loadv"]) == ("tma", "cpasync", "cpasync")
    assert HOPPER_WS_FORWARD.config(point) == config
    assert HOPPER_WS_FORWARD.config(HOPPER_WS_FORWARD.point(plain)) == plain  # defaults: no knob
    assert not space.cp_async_producer(HOPPER_WS_FORWARD.default_config(problem, SM90A))
    # A TMA producer keeps 24 registers beside two consumers; a cp.async one 40 (FA3's split).
    assert space.ws_registers(plain) == (24, 240) and space.ws_registers(config) == (40, 232)
    assert space.ws_registers(_loads(KernelConfig(192, 64, 12, 2), loadq="cpasync")) == (40, 152)
    assert space.ws_registers(_loads(KernelConfig(64, 64, 4, 2), loadv="cpasync")) == (56, 256)
    source = families.render(problem, config)
    assert _loads_line(source.code) == "true,false,false"
    assert "kProducer == 40" in source.code and "kConsumer == 232" in source.code
    assert _loads_line(families.render(problem, plain).code) == "true,true,true"
    assert HOPPER_WS_FORWARD.static_check(problem, config, SM90A) is None
    # The cp.async budget: two consumers at head dim 128 with one stage hold 184, not 196.
    one_stage = KernelConfig(128, 176, 8, 1)
    assert HOPPER_WS_FORWARD.static_check(problem, one_stage, SM90A) is None
    why = HOPPER_WS_FORWARD.static_check(problem, _loads(one_stage, loadq="cpasync"), SM90A)
    assert why is not None and "accumulators need 196 registers" in why, why
    assert "232 registers (setmaxnreg's count for 2 consumer warpgroups beside a cp.async " \
           "producer)" in why and "over the 184 that compile without spills" in why
    assert HOPPER_WS_FORWARD.static_check(
        problem, _loads(KernelConfig(128, 160, 8, 1), loadq="cpasync"), SM90A) is None
    why = HOPPER_WS_FORWARD.static_check(problem, _loads(plain, loadk="ldg"), SM90A)
    assert why is not None and "loadk='ldg': expected one of ('tma', 'cpasync')" in why


def test_three_consumer_warpgroups_take_the_split_of_three() -> None:
    problem = _problem(64, DType.BF16, False)
    config = KernelConfig(192, 64, 12, 2)
    assert HOPPER_WS_FORWARD.static_check(problem, config, SM90A) is None
    source = families.render(problem, config)
    assert source.threads == 512 and "__launch_bounds__(512, 1)" in source.code
    assert "kProducer == 32" in source.code and "kConsumer == 160" in source.code
    # 160 registers per consumer thread: at head dim 64, key tiles up to 176 rows fit.
    assert space.register_limit(config, warp_specialized=True) == 160
    assert HOPPER_WS_FORWARD.static_check(problem, KernelConfig(192, 176, 12, 2), SM90A) is None
    wide = HOPPER_WS_FORWARD.static_check(problem, KernelConfig(192, 192, 12, 2), SM90A)
    assert wide is not None and "accumulators need 176 registers" in wide, wide
    assert "160 registers (setmaxnreg's count for 3 consumer warpgroups)" in wide


def _compiled(head_dim: int, dtype: DType, causal: bool, config: KernelConfig | None = None,
              family: KernelFamily = HOPPER_WS_FORWARD) -> None:
    problem = _problem(head_dim, dtype, causal, family)
    config = config or family.default_config(problem, SM90A)
    assert family.static_check(problem, config, SM90A) is None
    source = families.render(problem, config)
    kernel = compile_source(source, "sm_90")
    res = kernel.resources
    assert kernel.arch == "sm_90a" and res.spill_bytes == 0, res
    assert 0 < res.registers <= 65536 // source.threads and res.dynamic_smem == source.smem_bytes
    if find_toolchain().nvdisasm is None:
        return
    sass = disassemble(kernel.cubin)
    found = collections.Counter(re.findall(
        r"\b(UTMALDG\.5D|LDGSTS\.E\S*|USETMAXREG\.\w+(?:\.\w+)?)\b", sass))
    by_tma = sum(space.knob(config, name) == space.TMA for name in space.LOAD_KNOBS)
    assert found["UTMALDG.5D"] == by_tma, found  # one box per operand by TMA
    assert any(k.startswith("LDGSTS") for k in found) == (by_tma < 3), found
    assert found["USETMAXREG.DEALLOC.CTAPOOL"] == 1 and found["USETMAXREG.TRY_ALLOC.CTAPOOL"] == 1
    bars = collections.Counter(re.findall(r"\b(BAR\.SYNC|BAR\.ARV)\b", sass))
    if space.knob(config, space.PINGPONG):  # the first turn, then a wait and hand-over a tile
        assert bars["BAR.ARV"] >= 2 and bars["BAR.SYNC"] >= 2, bars
    # G: an HGMMA, E: the softmax's exp, W: a wait for every wgmma group, w: a wait that
    # leaves one in flight, in listing order, runs collapsed. With overlap, Q K^T of tile j
    # and P V of tile j - 1 issue together and S alone is waited for (G w); without it every
    # GEMM is waited for before the softmax. (ptxas places the wait for P V after the row
    # max's first shuffle, before the exps, in the configs measured: "GwWE".)
    order = re.sub(r"(.)\1+", r"\1", "".join(
        "G" if m[0].startswith("H") else "E" if m[0].startswith("M") else "wW"[m[1] == "0"]
        for m in re.findall(r"\b(HGMMA\.64x\d+x16|MUFU\.EX2|WARPGROUP\.DEPBAR\.LE gsb0, "
                            r"0x(\d))", sass)))
    assert ("Gw" in order) == bool(space.knob(config, space.OVERLAP)), order
    hgmma = collections.Counter(re.findall(r"\bHGMMA\.64x(\d+)x16\.F32(?:\.BF16)?\b", sass))
    assert hgmma[str(config.block_n)] >= head_dim // 16, hgmma
    assert hgmma[str(head_dim)] >= config.block_n // 16, hgmma


#: Compiled in every run: the defaults at the narrowest and widest head dims (ping-pong and
#: overlap together), ping-pong alone, three consumer warpgroups with Q by cp.async, and
#: overlap with V by cp.async (a mixed producer).
NVRTC_FIXED = [(64, DType.BF16, True, None),
               (256, DType.FP16, False, None),
               (128, DType.BF16, True, _pingpong(KernelConfig(128, 128, 8, 2))),
               (64, DType.FP16, False, _loads(KernelConfig(192, 160, 12, 2), loadq="cpasync")),
               (128, DType.FP16, True, _loads(_overlap(KernelConfig(128, 96, 8, 2)),
                                              loadv="cpasync"))]
#: More tiles and combinations of the same knobs: a seeded two per run, all under sweep.
NVRTC_MORE = [(128, DType.BF16, False, _overlap(KernelConfig(128, 176, 8, 2))),
              (128, DType.FP16, False, _overlap(_pingpong(KernelConfig(128, 176, 8, 2)))),
              (64, DType.FP16, True, KernelConfig(192, 128, 12, 2)),
              (128, DType.BF16, False, KernelConfig(128, 176, 8, 2)),
              (128, DType.FP16, True, _overlap(KernelConfig(128, 96, 8, 2))),
              (64, DType.BF16, False, _overlap(_pingpong(KernelConfig(128, 128, 8, 2)))),
              (128, DType.BF16, True, _loads(KernelConfig(128, 128, 8, 2), loadk="cpasync",
                                             loadv="cpasync"))]


@pytest.mark.parametrize("case", [*NVRTC_FIXED, *seeded_part(NVRTC_MORE, 2, "ws-nvrtc")],
                         ids=lambda c: f"d{c[0]}-{c[1].value}-{'causal' if c[2] else 'full'}-"
                                       f"{c[3].key() if c[3] else 'default'}")
def test_nvrtc_compiles_for_sm90a_without_spills(
        case: tuple[int, DType, bool, KernelConfig | None]) -> None:
    _compiled(*case)


def _loads_sample(configs: list[KernelConfig], rng: random.Random) -> list[KernelConfig]:
    """Of passing configs: those with every operand by TMA or every one by cp.async, and per
    config of the other knobs one drawn mixed load (the register rule is measured on the
    all-cp.async producer; a mixed one loads less)."""
    groups: dict[KernelConfig, list[KernelConfig]] = collections.defaultdict(list)
    for c in configs:
        groups[tma_loads(c)].append(c)
    picked: list[KernelConfig] = []
    for members in groups.values():
        kinds = {c: len({space.knob(c, n) for n in space.LOAD_KNOBS}) for c in members}
        picked += [c for c in members if kinds[c] == 1]
        mixed = [c for c in members if kinds[c] == 2]
        picked += [rng.choice(mixed)] if mixed else []
    return picked


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.value)
@pytest.mark.parametrize("head_dim", space.WS_HEAD_DIMS)
def test_nvrtc_compiles_every_passing_config_without_spills(head_dim: int, dtype: DType) -> None:
    rng = random.Random(f"{SEED}{head_dim}{dtype.value}")
    passing = HOPPER_WS_FORWARD.candidates(_problem(head_dim, dtype, True), SM90A)
    for config in _loads_sample(passing, rng):
        _compiled(head_dim, dtype, True, config)


# ------------------------------------------------------------------ planted bugs

#: Five key tiles of 64 (two rounds of the two-stage ring and one more), GQA.
BUG_SHAPE = Shape(1, 2, 1, 70, 300)
BUG_CONFIG = KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
#: The same with ping-pong, with three consumer warpgroups, and with overlap.
BUG_PINGPONG = _pingpong(BUG_CONFIG)
BUG_THREE = KernelConfig(block_m=192, block_n=64, num_warps=12, num_stages=2)
BUG_OVERLAP = _overlap(BUG_CONFIG)
#: Q and K by cp.async, V by TMA: Q's barrier counts the producer's 128 threads, a stage's
#: full barrier the TMA arrival and 128 cp.async ones.
BUG_CPASYNC = _loads(BUG_CONFIG, loadq="cpasync", loadk="cpasync")
#: Q alone by cp.async: the producer's warps 1..3 have no K/V work after Q.
BUG_CPASYNC_Q = _loads(BUG_CONFIG, loadq="cpasync")


def _run_planted(bug: int, *, box_rows: int | None = None,
                 schedule: Schedule = Schedule.FORWARD,
                 config: KernelConfig = BUG_CONFIG, shape: Shape = BUG_SHAPE) -> None:
    family = HOPPER_WS_FORWARD
    problem = _problem(64, DType.FP16, False, family)
    source = families.render(problem, config)
    if bug:
        source = dataclasses.replace(source, options=(*source.options,
                                                      f"-DFT_WS_PLANTED_BUG={bug}"))
    kernel = EmulatorBackend(options=LaunchOptions(schedule=schedule, hang_timeout_s=120)
                             ).load(source)
    inputs = family.random_inputs(problem, shape, "cpu", seed=SEED)
    outputs = family.empty_outputs(problem, shape, inputs, poison=True)
    plan = family.launch_plan(problem, config, shape, inputs, outputs)
    args = list(plan.args)
    if box_rows is not None:  # the K map with a box of box_rows rows instead of block_n
        kind, value = args[-2]
        assert kind is ArgType.TMAP and isinstance(value, TensorMap)
        args[-2] = (kind, dataclasses.replace(value, box=(64, box_rows, 1, 1, 1)))
    kernel.launch(plan.grid, args)
    if not bug and box_rows is None:
        ref = family.reference(problem, inputs)
        verdict = family.compare(problem, shape, outputs, ref)
        assert verdict.ok, verdict.message


@pytest.mark.parametrize("config", [BUG_CONFIG, *seeded_part(
    [BUG_PINGPONG, BUG_THREE, BUG_OVERLAP, BUG_CPASYNC, BUG_CPASYNC_Q], 2, "ws-harness")],
                         ids=lambda c: c.key())
def test_the_bug_harness_passes_without_a_bug(config: KernelConfig) -> None:
    """The plain config and a seeded two of the other planted bugs' configs (all under
    ``-m sweep``; their numerics are also covered in test_hopper_family.py)."""
    _run_planted(0, config=config)


def test_wrong_tensor_map_box_deadlocks_on_the_stage_barrier() -> None:
    # K boxes of 32 rows: the stage receives fewer bytes than its expect-tx.
    with pytest.raises(EmulatorDeadlock, match=r"mbarrier at dynamic shared memory offset \d+ .*"
                       r"for phase 0 \(parity 0\) to complete: 0 of 1 arrivals missing, "
                       r"transaction count 4096"):
        _run_planted(0, box_rows=32)
    # K boxes of 128 rows: twice the stage, into the next one's load in flight.
    with pytest.raises(EmulatorError, match=r"tma_load at .*already the destination of a TMA "
                       r"load in flight \(issued by thread 0 .* at .*hopper_fwd_ws.cuh:\d+\)"):
        _run_planted(0, box_rows=128)


def test_missing_expect_tx_is_caught_at_the_early_read() -> None:
    with pytest.raises(EmulatorError, match=r"wgmma_mma_async \(B operand\) at .*whose "
                       r"asynchronous copy \(issued by thread 0 at .*hopper_fwd_ws.cuh:\d+\) "
                       r"lands only when phase 1 of the mbarrier .*missing expect-tx"):
        _run_planted(1)


def test_stage_released_twice_is_caught() -> None:
    """The extra arrivals complete the empty barrier's next phase early, so the producer
    refills a stage one consumer warpgroup has not read: in one thread order that warpgroup
    then waits for a full-barrier phase that never comes, in the other the producer's wait
    sees two phases complete."""
    with pytest.raises(EmulatorDeadlock, match=r"warp 8: lanes 0-31 wait in mbarrier_try_wait "
                       r".* for phase 2 \(parity 0\) to complete: 1 of 1 arrivals missing"):
        _run_planted(2, schedule=Schedule.FORWARD)
    with pytest.raises(EmulatorError, match=r"thread 0 waited for phase 0 of the mbarrier .*"
                       r"completed phase 1 as well .* a stage is reused before every consumer "
                       r"released it"):
        _run_planted(2, schedule=Schedule.REVERSE)


def test_stage_never_released_deadlocks_naming_the_empty_barrier() -> None:
    with pytest.raises(EmulatorDeadlock, match=r"for phase 0 \(parity 0\) to complete: 8 of 8 "
                       r"arrivals missing"):
        _run_planted(3)


def test_setmaxnreg_rules_are_checked() -> None:
    with pytest.raises(EmulatorError, match=r"setmaxnreg.inc at .*count 236 must be a multiple "
                       r"of 8 in 24..256"):
        _run_planted(4)
    with pytest.raises(EmulatorError, match=r"setmaxnreg: thread 160 \(warp 5\) of warpgroup 1 "
                       r"executed 0 setmaxnreg but thread 128 executed 1"):
        _run_planted(5)


def test_pingpong_without_the_first_turn_deadlocks_naming_the_named_barrier() -> None:
    with pytest.raises(EmulatorDeadlock, match=r"warp 4: lanes 0-31 wait in bar.sync at "
                       r".*hopper_fwd_ws.cuh:\d+ on named barrier 1 for phase 0 to complete: "
                       r"128 of 256 threads arrived"):
        _run_planted(6, config=BUG_PINGPONG)


def test_pingpong_hand_over_with_a_wrong_count_is_caught() -> None:
    with pytest.raises(EmulatorError, match=r"bar.arrive 2, 128 at .*hopper_fwd_ws.cuh:\d+: "
                       r"phase 0 of named barrier 2 was started with a count of 256 threads"):
        _run_planted(7, config=BUG_PINGPONG)


def test_third_consumer_without_setmaxnreg_is_caught() -> None:
    with pytest.raises(EmulatorError, match=r"setmaxnreg: warpgroup 3 \(threads 384..511\) "
                       r"executed no setmaxnreg, but warpgroup 0 did \(setmaxnreg.dec 32 at "
                       r".*hopper_fwd_ws.cuh:\d+\)"):
        _run_planted(8, config=BUG_THREE)


def test_three_consumers_with_the_split_of_two_are_caught() -> None:
    # 24 x 128 + 3 x 240 x 128 registers: more than the block's 64 Ki.
    with pytest.raises(EmulatorError, match=r"final requests add up to 95232 registers"):
        _run_planted(9, config=BUG_THREE)


def test_overlap_reading_the_next_s_before_its_wait_is_caught() -> None:
    """Planted: no wait for S_j before the softmax first reads it (after the first tile)."""
    with pytest.raises(EmulatorError, match=r"wgmma_fence_operands at .*hopper_fwd_ws.cuh:\d+: "
                       r"thread \d+ reads accumulators that the wgmma at .*hopper_fwd.cuh:\d+ "
                       r"still writes \(its group has 1 committed after it; 2 committed groups "
                       r"pending\)"):
        _run_planted(10, config=BUG_OVERLAP)


def test_overlap_waiting_for_one_group_too_few_is_caught() -> None:
    """Planted: wait_group<1> where O += P V must be complete (<0>) before the stage is
    released and the next softmax rescales O."""
    with pytest.raises(EmulatorError, match=r"wgmma_fence_operands at .*hopper_fwd_ws.cuh:\d+: "
                       r"thread \d+ reads accumulators that the wgmma at .*hopper_fwd.cuh:\d+ "
                       r"still writes \(its group has 0 committed after it; 1 committed groups "
                       r"pending\)"):
        _run_planted(11, config=BUG_OVERLAP)


def test_cp_async_producer_warp_that_never_arrives_deadlocks_naming_the_count() -> None:
    """Planted: producer warp 0 copies its share of each cp.async stage but never arrives;
    the consumers wait on the full barrier with 32 of its 129 arrivals missing."""
    with pytest.raises(EmulatorDeadlock, match=r"for phase 0 \(parity 0\) to complete: 32 of "
                       r"129 arrivals missing"):
        _run_planted(12, config=BUG_CPASYNC)


def test_producer_exit_with_copies_in_flight_is_caught() -> None:
    """Planted: no producer tail. A producer thread arrives on the last stage's full barrier
    (a deferred cp.async arrival) and returns while its copies are still in flight; with Q
    alone by cp.async, the producer's warps 1..3 return right after Q's copies."""
    with pytest.raises(EmulatorError, match=r"thread \d+ returned with cp.async copies in flight "
                       r"\(the one at .*\), tracked by cp.async_mbarrier_arrive on the mbarrier "
                       r"at dynamic shared memory offset \d+, whose phase \d+ has not completed"):
        _run_planted(13, config=BUG_CPASYNC)
    with pytest.raises(EmulatorError, match=r"returned with cp.async copies in flight"):
        _run_planted(13, config=BUG_CPASYNC_Q)


def test_a_producer_with_one_key_tile_waits_for_its_q_copies() -> None:
    """Q by cp.async, K and V by TMA, one key tile and more stages: the TMA-issuing lane has
    no stage to wait for and must still wait for its Q copies before it exits."""
    _run_planted(0, config=BUG_CPASYNC_Q, shape=Shape(1, 2, 1, 70, 40))


# ------------------------------------------------------------------ GPU


#: The configs the GPU test runs per problem: the default (ping-pong and overlap), its tile
#: with neither and with ping-pong alone, with every operand by cp.async and with V alone by
#: cp.async (a stage's barrier counting a TMA arrival and the producer's 128), the widest key
#: tile the rules pass with overlap alone (two consumer warpgroups, two stages), and the
#: widest key tile the rules pass with two stages for one and for three consumer warpgroups.
GPU_VARIANTS = ("default", "plain", "pingpong", "cpasync", "cpasync-v", "overlap", "widest-m64",
                "widest-m192")


def _variant(problem: Problem, name: str) -> KernelConfig | None:
    default = HOPPER_WS_FORWARD.default_config(problem, SM90A)
    if name == "default":
        return default
    if name in ("plain", "pingpong"):
        plain = _plain(default)
        return _pingpong(plain) if name == "pingpong" else plain
    if name.startswith("cpasync"):
        operands = "v" if name == "cpasync-v" else "qkv"
        config = _loads(default, **{f"load{o}": space.CP_ASYNC for o in operands})
        return config if HOPPER_WS_FORWARD.static_check(problem, config, SM90A) is None else None
    overlap = name == "overlap"
    block_m = 128 if overlap else int(name.rpartition("m")[2])
    fits = [c for c in HOPPER_WS_FORWARD.candidates(problem, SM90A)
            if c.block_m == block_m and c.num_stages == 2
            and space.knob(c, space.OVERLAP) == overlap and not space.knob(c, space.PINGPONG)
            and not space.cp_async_producer(c)]
    return max(fits, key=lambda c: c.block_n) if fits else None


@pytest.mark.gpu
@pytest.mark.parametrize("variant", GPU_VARIANTS)
@pytest.mark.parametrize("case", [(128, DType.BF16, True, Shape(2, 8, 2, 1000, 1000)),
                                  (64, DType.FP16, False, Shape(1, 4, 4, 333, 777)),
                                  (256, DType.BF16, False, Shape(1, 2, 1, 200, 130))],
                         ids=lambda c: f"d{c[0]}-{c[1].value}-{c[2]}-{c[3].key()}")
def test_matches_float64_on_a_gpu(case: tuple[int, DType, bool, Shape], variant: str) -> None:
    """Driver-encoded tensor maps, real TMA, setmaxnreg and wgmma on a cc 9.0 device."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90a kernels run on compute capability 9.0 only")
    from flashtune.runtime.backends.cuda import CudaBackend

    head_dim, dtype, causal, shape = case
    problem = _problem(head_dim, dtype, causal)
    config = _variant(problem, variant)
    if config is None:
        pytest.skip(f"no {variant} config passes the rules at head dim {head_dim}")
    source = families.render(problem, config)
    verdict = verify(CudaBackend().load(source), shape, "cuda", seed=SEED)
    assert verdict.ok, f"{config.key()}: {verdict.message}"
