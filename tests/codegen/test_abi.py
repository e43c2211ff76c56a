"""The launch ABI declarations (codegen.abi): one declaration per kernel entry point, from
which the template's parameter list, the packers and the emulator's expected signature are
generated; a changed declaration changes all three, and a bad one is refused."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, cast

import pytest
import torch

from flashtune import families
from flashtune.codegen.abi import (
    ArgType,
    Element,
    EntryAbi,
    scalar,
    size,
    stride,
    strides,
    tensor,
    tensor_map,
)
from flashtune.codegen.arch import ArchSpec, get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.errors import InvalidInput
from flashtune.families.base import KernelFamily
from flashtune.families.decode.args import pack_decode_args
from flashtune.families.lse import LSE, LSE_ABI, RowLseFamily


def _rendered_params(code: str, entry: str) -> str:
    """The parameter list of the rendered entry point."""
    found = re.search(re.escape(entry) + r"\(\n(.*?)\) \{\n", code, re.DOTALL)
    assert found is not None, f"no entry point {entry} in the source"
    return found.group(1)


def test_every_family_renders_its_declared_signature() -> None:
    """Each family with an ABI: the rendered entry point's parameters are the declaration's
    (for each of its feature switches on its own), and its emulator codes are its types."""
    for family in families.all_families():
        if family.abi is None:
            continue
        for features in [(), *((name,) for name in sorted(family.features))]:
            dtypes = min(family.dtypes, key=str)  # fp16 where the family takes it
            problem = Problem(64, dtypes.q, op=family.op, kv_dtype=dtypes.kv, o_dtype=dtypes.o,
                              **cast(dict[str, Any], dict.fromkeys(features, True)))
            source = family.render(problem, family.default_config(problem, _arch(family)))
            assert _rendered_params(source.code, source.entry) == family.abi.signature(
                problem.features, family.abi_aliases), (family.op, features)
            codes = family.abi.emulator_signature(problem.features)
            assert len(codes) == len(family.abi.active(problem.features))


def _arch(family: KernelFamily) -> ArchSpec:
    # FP8 mma and conversions: sm_89 and later
    fp8 = any(dtypes.fp8 for dtypes in family.dtypes)
    return get_arch(family.target_arch or ("sm_89" if fp8 else "sm_80"))


def test_a_changed_declaration_changes_signature_packer_and_emulator_codes() -> None:
    """A scalar added to a copy of the row-wise LSE's ABI: the rendered signature, the packed
    arguments and the emulator's expected codes all carry it, in its place."""
    extended = LSE_ABI.extended("row_lse_bias", scalar("bias", Element.FLOAT))
    assert extended.signature() == LSE_ABI.signature() + ", float bias"
    assert extended.emulator_signature() == LSE_ABI.emulator_signature() + "f"
    assert extended.inputs() == (*LSE_ABI.inputs(), "bias")

    class Biased(RowLseFamily):
        op = "lsebiastest"
        abi = extended

    problem = Problem(64, DType.FP16, op=Biased.op)
    config = KernelConfig(32, 64, 2, 1)
    families.register(Biased())
    try:
        source = families.render(problem, config)
    finally:
        families.unregister(Biased.op)
    plain = LSE.render(Problem(64, DType.FP16, op="lse"), config)
    params = _rendered_params(source.code, source.entry)
    assert params == _rendered_params(plain.code, plain.entry) + ", float bias"

    q, k = torch.randn(2, 5, 3, 64).half(), torch.randn(2, 7, 1, 64).half()
    lse = torch.empty(2, 3, 5)
    packed = extended.pack({"q": q, "k": k, "lse": lse, "softmax_scale": 0.125, "bias": 2.5})
    assert packed == LSE_ABI.pack({"q": q, "k": k, "lse": lse, "softmax_scale": 0.125}) + (
        (ArgType.F32, 2.5),)
    assert packed[3:7] == ((ArgType.I32, 5), (ArgType.I32, 7), (ArgType.I32, 3),
                           (ArgType.I32, 1))
    with pytest.raises(InvalidInput, match=r"inputs \['bias'\] are missing"):
        extended.pack({"q": q, "k": k, "lse": lse, "softmax_scale": 0.125})


def test_feature_arguments_follow_their_switch() -> None:
    abi = EntryAbi("demo", (tensor("x", Element.Q, const=True), scalar("n", Element.INT,
                                                                          size("x", 1)),
                            scalar("cap", Element.FLOAT, feature="softcap"),
                            tensor_map("tmap_x", Element.Q, wrap=True)))
    assert abi.signature() == ("    const Element* __restrict__ x, int n,\n"
                               "    const __grid_constant__ CUtensorMap tmap_x")
    assert abi.signature(("softcap",)) == ("    const Element* __restrict__ x, int n, "
                                           "float cap,\n"
                                           "    const __grid_constant__ CUtensorMap tmap_x")
    assert abi.emulator_signature() == "piT" and abi.emulator_signature(["softcap"]) == "pifT"
    x = torch.zeros(2, 9)
    packed: tuple[object, ...] = abi.packer()(x, "map")  # "map" stands in for a TensorMap
    assert packed == ((ArgType.PTR, x.data_ptr()), (ArgType.I32, 9), (ArgType.TMAP, "map"))
    assert abi.packer(("softcap",)) is abi.packer(["softcap"])  # generated once
    custom = {Element.Q: "QElement", Element.KV: "KvElement", Element.O: "OElement"}
    assert abi.signature(aliases=custom).startswith("    const QElement* __restrict__ x")


def test_optional_tensors_pack_as_null_with_defaults() -> None:
    """The decode kernel without appended rows, a block table, a split table or direct
    outputs."""
    q = torch.zeros(2, 3, 4, 64, dtype=torch.float16)
    k_cache = torch.zeros(2, 32, 2, 64, dtype=torch.float16)
    v_cache = torch.zeros(2, 32, 2, 64, dtype=torch.float16)
    lens = torch.zeros(2, dtype=torch.int32)
    o_part, lse_part, status = torch.zeros(5), torch.zeros(6), torch.zeros(4, dtype=torch.int32)
    args = pack_decode_args(q, k_cache, v_cache, None, None, None, lens, o_part, lse_part,
                            status, num_splits=3, softmax_scale=0.5, trap_on_error=True)
    values = [value for _, value in args]
    assert values[3:6] == [0, 0, 0]                      # k_new, v_new, block_table
    assert values[10:13] == [0, 0, 0]                    # split_table, o, lse
    assert values[13:23] == [3, 0, 4, 2, 3, 0, 32, 1, 2, 1]  # seqlen_q .. trap_on_error
    assert values[23:26] == list(q.stride()[:3])
    assert values[26:29] == list(k_cache.stride()[:3])
    assert values[32:42] == [0] * 10 and values[42] == 0.5  # kn, vn, o, bt strides; the scale
    assert len(args) == len(families.get("decode").abi.active())  # type: ignore[union-attr]


@pytest.mark.parametrize("bad, match", [
    (lambda: tensor("1x", Element.Q), "identifier"),
    (lambda: scalar("n", Element.Q), "must be one of"),
    (lambda: dataclasses.replace(tensor("x", Element.Q), source=stride("x", 0)),
     "takes a pointer"),
    (lambda: EntryAbi("dup", (tensor("x", Element.Q), *strides("x"), tensor("x", Element.KV))),
     "declared twice"),
    (lambda: tensor_map("m", Element.FLOAT), "must name an operand"),
])
def test_bad_declarations_are_refused(bad, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidInput, match=match):
        bad()
