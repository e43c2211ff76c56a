"""Element types per operand: one table of spellings, mixed keys, the families' dtype gate."""

from __future__ import annotations

import dataclasses
import itertools
from typing import ClassVar

import pytest
import torch

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.dtypes import ELEMENTS, FP8_ELEMENTS, SAME_16BIT, DType, Dtypes
from flashtune.codegen.spec import Problem
from flashtune.codegen.tensormap import TmaDType
from flashtune.db.physics import min_bytes
from flashtune.db.records import Keyed
from flashtune.errors import InvalidProblem
from flashtune.families.base import element_params, element_type, torch_dtype
from flashtune.families.lse import LSE, RowLseFamily

MIXED = [Dtypes(q, kv, o) for q, kv, o in itertools.product(DType, DType, DType)
         if len({q, kv, o}) > 1]


def test_every_dtype_has_one_row_of_spellings() -> None:
    assert set(ELEMENTS) == set(DType)
    expected = {DType.FP16: ("__half", "f16", torch.float16, TmaDType.FLOAT16, 2),
                DType.BF16: ("__nv_bfloat16", "bf16", torch.bfloat16, TmaDType.BFLOAT16, 2)}
    for dtype, (cpp, ptx, torch_type, tma, size) in expected.items():
        row = dtype.element
        assert (row.cpp, row.ptx, row.tma, row.itemsize, dtype.itemsize) == (cpp, ptx, tma,
                                                                              size, size)
        assert torch_dtype(dtype) is torch_type
        assert element_type(torch_type) is dtype
        assert torch.empty(0, dtype=torch_type).element_size() == row.itemsize


def test_each_rows_unit_roundoff_is_torchs_half_epsilon() -> None:
    rows = ELEMENTS | FP8_ELEMENTS
    assert len(rows) == 4
    for row in rows.values():
        assert row.unit_roundoff == torch.finfo(getattr(torch, row.torch)).eps / 2, row.cpp
    with pytest.raises(InvalidProblem, match=r"8 mantissa bits; expected 1 to 7 in 1 bytes"):
        dataclasses.replace(FP8_ELEMENTS[next(iter(FP8_ELEMENTS))], mantissa=8)


def test_an_unknown_torch_dtype_is_refused_naming_the_legal_ones() -> None:
    with pytest.raises(InvalidProblem, match=r"torch.float16 or torch.bfloat16"):
        element_type(torch.float32)


def test_uniform_problems_keep_their_keys_and_dicts() -> None:
    for dtype in DType:
        plain = Problem(128, dtype, causal=True)
        same = Problem(128, dtype, causal=True, kv_dtype=dtype, o_dtype=dtype.value)
        assert same == plain and hash(same) == hash(plain)
        assert plain.key() == f"fwd_d128_{dtype.value}_causal"
        assert plain.to_dict() == {"op": "fwd", "head_dim": 128, "dtype": dtype.value,
                                   "causal": True}
        assert plain.dtypes == Dtypes.same(dtype) and plain.dtypes.uniform
        assert (plain.kv_dtype, plain.o_dtype) == (None, None)


@pytest.mark.parametrize("dtypes", MIXED, ids=lambda d: d.word)
def test_a_mixed_problem_names_each_operand_and_round_trips(dtypes: Dtypes) -> None:
    problem = Problem(64, dtypes.q, kv_dtype=dtypes.kv, o_dtype=dtypes.o, softcap=True)
    assert problem.dtypes == dtypes and not dtypes.uniform
    key = problem.key()
    assert key == f"fwd_d64_{dtypes.q.value}-{dtypes.kv.value}-{dtypes.o.value}_full_softcap"
    assert Problem.from_key(key) == problem
    assert Problem.from_dict(problem.to_dict()) == problem
    assert Dtypes.parse(dtypes.word) == dtypes
    # As the database stores it: its key and its fields, read back by codegen's value type.
    stored = Keyed.of(problem)
    assert stored.key == key
    assert Problem.from_dict(stored.as_dict()) == problem


def test_replacing_dtype_keeps_a_uniform_problem_uniform() -> None:
    problem = Problem(64, DType.FP16)
    assert dataclasses.replace(problem, dtype=DType.BF16) == Problem(64, DType.BF16)
    mixed = Problem(64, DType.FP16, kv_dtype=DType.BF16)
    assert dataclasses.replace(mixed, dtype=DType.BF16) == Problem(64, DType.BF16)


@pytest.mark.parametrize("key", ["fwd_d64_fp16-fp16-fp16_full", "fwd_d64_fp16-bf16_full",
                                 "fwd_d64_fp16-bf16-fp32_full", "fwd_d64_fp16--bf16_full"])
def test_non_canonical_or_unknown_element_types_in_a_key_are_malformed(key: str) -> None:
    with pytest.raises(InvalidProblem, match="expected e.g. 'fwd_d128_bf16_causal'"):
        Problem.from_key(key)


def test_bad_operand_dtype_says_what_is_expected() -> None:
    with pytest.raises(InvalidProblem, match=r"kv_dtype='fp8' is not supported; expected one "
                                             r"of \['fp16', 'bf16', 'e4m3', 'e5m2'\]"):
        Problem(64, DType.FP16, kv_dtype="fp8")
    with pytest.raises(InvalidProblem, match="unknown problem field"):
        Problem.from_dict({"head_dim": 64, "dtype": "fp16", "acc_dtype": "fp32"})


def test_every_family_declares_its_dtypes_and_refuses_others_by_name() -> None:
    for family in families.all_families():
        assert family.dtypes, f"{family.op} declares no element types"
        for dtypes in MIXED:
            problem = Problem(64, dtypes.q, op=family.op, kv_dtype=dtypes.kv,
                              o_dtype=dtypes.o)
            if dtypes in family.dtypes:
                continue
            with pytest.raises(InvalidProblem) as info:
                family.check_problem(problem)
            message = str(info.value)
            assert f"the {family.op!r} kernel family" in message
            assert str(dtypes) in message and problem.key() in message
            assert ", ".join(sorted(map(str, family.dtypes))) in message


def test_the_builtin_families_take_one_16_bit_type_for_every_operand() -> None:
    """... but the FP8 forwards (mma.sync and sm_90a wgmma) and backward, which take e4m3 or
    e5m2 inputs and a 16-bit O (dO, dK, dV), decoding over an e4m3 KV cache (q and O of
    one 16-bit type), and MLA decoding, which also takes an e4m3 latent cache beside bf16 Q
    and O."""
    from flashtune.codegen.dtypes import FP8_INPUTS
    from flashtune.families.decode.fp8 import E4M3_CACHE
    from flashtune.families.mla import FP8_CACHE

    special = {"decode8": E4M3_CACHE}
    for family in families.all_families():
        fp8 = family.op in ("fwd8", "fwd890a", "bwd8", "bwd8det")
        extra = {FP8_CACHE} if family.op == "mla" else set()
        want = special.get(family.op, FP8_INPUTS if fp8 else SAME_16BIT | extra)
        assert family.dtypes == want, family.op
    with pytest.raises(InvalidProblem, match=r"it takes: bf16, fp16 \(one word"):
        families.get("fwd").check_problem(Problem(128, DType.BF16, kv_dtype=DType.FP16))


def test_a_family_that_declares_no_dtypes_takes_none() -> None:
    class Undeclared(RowLseFamily):
        op = "lsebare"
        dtypes: ClassVar[frozenset[Dtypes]] = frozenset()

    with pytest.raises(InvalidProblem, match=r"declares no `dtypes`"):
        Undeclared().check_problem(Problem(64, DType.FP16, op="lsebare"))


def test_a_family_that_declares_a_mixed_combination_accepts_it() -> None:
    mixed = Dtypes(DType.BF16, DType.FP16, DType.BF16)

    class Mixed(RowLseFamily):
        op = "lsemixed"
        dtypes: ClassVar[frozenset[Dtypes]] = SAME_16BIT | {mixed}

    family = Mixed()
    family.check_problem(Problem(64, DType.BF16, op="lsemixed", kv_dtype=DType.FP16))
    with pytest.raises(InvalidProblem, match=r"q=bf16 kv=fp16 o=bf16"):
        family.check_problem(Problem(64, DType.FP16, op="lsemixed", kv_dtype=DType.BF16))


def test_templates_bind_the_element_type_from_the_table() -> None:
    for dtype in DType:
        params = element_params(Problem(64, dtype, op="lse"))
        assert params == {"element": dtype.element.cpp, "element_ptx": dtype.element.ptx}
        problem = Problem(64, dtype, op="lse")
        source = LSE.render(problem, LSE.default_config(problem, get_arch("sm_80")))
        assert f"using Element = {dtype.element.cpp};" in source.code
    with pytest.raises(InvalidProblem, match="one element type for Q, K, V and O"):
        element_params(Problem(64, DType.BF16, op="lse", o_dtype=DType.FP16))


def test_minimum_bytes_use_the_narrowest_operand() -> None:
    plain = Problem(64, DType.FP16)
    assert min_bytes(plain, 4096) == 2.0 * (4096 // 2 + 1) * 64 * 2
    mixed = Problem(64, DType.FP16, kv_dtype=DType.BF16)
    assert min_bytes(mixed, 4096) == min_bytes(plain, 4096)



def test_fp8_inputs_have_their_own_key_and_a_16bit_output() -> None:
    """e4m3 Q and K/V beside a 16-bit O: three words in the key (a key of its own), parsed
    back; an FP8 output, or FP8 for every operand, is refused naming out_dtype."""
    from flashtune.codegen.dtypes import E4M3_INPUTS, Fp8Type

    for o in DType:
        problem = Problem(128, "e4m3", op="fwd8", causal=True, o_dtype=o)
        assert problem.key() == f"fwd8_d128_e4m3-e4m3-{o.value}_causal"
        assert Problem.from_key(problem.key()) == problem
        assert problem.dtypes in E4M3_INPUTS and problem.dtypes.fp8
        assert problem.dtype.itemsize == 1
    assert not Problem(64, DType.BF16).dtypes.fp8
    with pytest.raises(InvalidProblem, match=r"o_dtype \(out_dtype\) one of \['fp16', 'bf16'\]"):
        Problem(64, Fp8Type.E4M3)
    with pytest.raises(InvalidProblem, match=r"o dtype='e4m3': the output is a 16-bit type"):
        Problem(64, DType.BF16, o_dtype="e4m3")
    with pytest.raises(InvalidProblem, match="q and kv of"):
        Problem.from_key("fwd8_d64_e4m3-e4m3-e4m3_full")
