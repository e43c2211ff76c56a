"""Batch-invariant decoding and the split choice made on the device.

* ``batch_invariant=True``: one sequence alone and inside batches of other sizes and
  lengths (whose longer sequences take more splits, and whose capacity is larger) gives
  bitwise the same O and LSE, paged and unpaged, GQA and MQA (and equals float64
  attention within tolerance).
* The split table: two sequences of different context buckets in one launch take their
  buckets' split sizes (the partial LSE shows each one's splits); a warm call with other
  lengths makes the same launches (grid, table) and reads nothing back to the host: every
  Tensor -> host conversion raises during it. The emulator's own input checks read the
  lengths on the host by design (the GPU's FLASHTUNE_CHECK_INPUTS=1 path); they are
  replaced during the warm call.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from decode_cases import assert_close_to_float64

import flashtune
from flashtune.api import decode as api_decode
from flashtune.errors import InvalidInput
from flashtune.families.base import Inputs
from flashtune.families.decode.args import decode_grid, pack_decode_args
from flashtune.families.decode.splits import SplitTable

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
DIM = 64


def _sequences(gen: torch.Generator, lengths: list[int], heads: tuple[int, int],
               seqlen_q: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(q (seqlen_q, Hq, D), k and v (length, Hkv, D)) fp16 per sequence."""
    hq, hkv = heads
    return [tuple(torch.randn(*size, generator=gen).half() for size in  # type: ignore[misc]
                  ((seqlen_q, hq, DIM), (n, hkv, DIM), (n, hkv, DIM))) for n in lengths]


def _batch(seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], page: int | None,
           capacity: int, rng: random.Random) -> Inputs:
    """The sequences as one call's inputs: an unpaged cache of ``capacity`` rows, or pages
    of ``page`` rows in a shuffled pool; rows no sequence owns hold NaN."""
    batch, hkv = len(seqs), seqs[0][1].shape[1]
    q = torch.stack([s[0] for s in seqs])
    lengths = torch.tensor([s[1].shape[0] for s in seqs], dtype=torch.int32)
    tensors: dict[str, torch.Tensor] = {"q": q, "cache_seqlens": lengths}
    if page is None:
        caches = [torch.full((batch, capacity, hkv, DIM), float("nan"), dtype=torch.half)
                  for _ in range(2)]
        for b, (_, k, v) in enumerate(seqs):
            caches[0][b, :k.shape[0]] = k
            caches[1][b, :v.shape[0]] = v
    else:
        slots = -(-capacity // page)
        order = list(range(batch * slots + 2))
        rng.shuffle(order)
        table = torch.tensor(order[:batch * slots], dtype=torch.int32).view(batch, slots)
        caches = [torch.full((len(order), page, hkv, DIM), float("nan"), dtype=torch.half)
                  for _ in range(2)]
        for b, (_, k, v) in enumerate(seqs):
            for j in range(k.shape[0]):
                caches[0][table[b, j // page], j % page] = k[j]
                caches[1][table[b, j // page], j % page] = v[j]
        tensors["block_table"] = table
    tensors["k_cache"], tensors["v_cache"] = caches
    tensors["k_cache_before"], tensors["v_cache_before"] = caches[0], caches[1]
    return Inputs(tensors, {"softmax_scale": DIM ** -0.5, "num_splits": 0})


def _call(inputs: Inputs, causal: bool, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    t = inputs.tensors
    out, lse = flashtune.attention_with_kvcache(
        t["q"], t["k_cache"], t["v_cache"], t["cache_seqlens"], block_table=t.get("block_table"),
        causal=causal, return_lse=True, backend="emulator", **kwargs)
    return out, lse


@pytest.mark.emulator
@pytest.mark.parametrize("page, heads, seqlen_q, causal", [
    (16, (8, 2), 1, False), (None, (4, 1), 2, True)], ids=["paged-gqa", "unpaged-mqa"])
def test_a_sequence_is_bitwise_the_same_in_any_batch(page: int | None, heads: tuple[int, int],
                                                     seqlen_q: int, causal: bool) -> None:
    """The default split table splits 200 keys in one piece (no combine) and 500-700 keys
    in two or more: the sequence alone runs one split, inside the batches it shares a grid
    of several (with the combine), next to other lengths, at other batch positions and
    capacities."""
    gen = torch.Generator().manual_seed(SEED)
    rng = random.Random(SEED)
    target = _sequences(gen, [rng.randrange(150, 250)], heads, seqlen_q)[0]
    others = _sequences(gen, [rng.randrange(500, 700) for _ in range(5)] + [0, 37], heads,
                        seqlen_q)
    alone = _batch([target], page, 256, rng)
    out, lse = _call(alone, causal, batch_invariant=True)
    assert_close_to_float64(alone, causal, out, lse)
    for members, where, capacity in (([others[0], others[6]], 1, 720),
                                      ([others[5], others[1], others[2], others[3]], 4, 704)):
        members = list(members)
        members.insert(where, target)
        mixed = _batch(members, page, capacity, rng)
        got_o, got_lse = _call(mixed, causal, batch_invariant=True)
        assert torch.equal(got_o[where], out[0]), "O differs inside the batch"
        assert torch.equal(got_lse[where], lse[0]), "LSE differs inside the batch"
        assert_close_to_float64(mixed, causal, got_o, got_lse)


def test_batch_invariance_refuses_a_split_count() -> None:
    q = torch.zeros(1, 1, 4, DIM, dtype=torch.half)
    cache = torch.zeros(1, 32, 1, DIM, dtype=torch.half)
    with pytest.raises(InvalidInput, match="batch_invariant"):
        flashtune.attention_with_kvcache(q, cache, cache, torch.zeros(1, dtype=torch.int32),
                                         num_splits=2, batch_invariant=True,
                                         backend="emulator")


_SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def _no_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every Tensor -> host conversion raises (on a GPU each is a synchronisation)."""
    def refuse(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"the warm call read a tensor back to the host ({name})")
        return call

    with monkeypatch.context() as patch:
        for name in _SYNCS:
            patch.setattr(torch.Tensor, name, refuse(name))
        patch.setattr(api_decode, "check_cache_values", lambda *a, **k: None)
        patch.setattr(api_decode, "report_status", lambda *a, **k: None)
        yield


@pytest.mark.emulator
def test_the_split_is_chosen_per_sequence_on_the_device(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """A tuned table (64 keys per split up to 256 keys, then 256): one launch splits a
    sequence of each bucket by its own size; the warm call, with the lengths swapped,
    makes the same launch with no host read and follows the new lengths."""
    table = SplitTable((256,), (64, 256))
    monkeypatch.setattr(api_decode, "tuned_split_table", lambda *a, **k: (table, True))
    seen: list[dict[str, Any]] = []

    def spy_pack(*args: Any, **kwargs: Any) -> Any:
        seen.append({"lse_part": args[8], **kwargs})
        return pack_decode_args(*args, **kwargs)

    def spy_grid(*args: Any) -> tuple[int, int, int]:
        grid = decode_grid(*args)
        seen.append({"grid": grid})
        return grid

    monkeypatch.setattr("flashtune.api.decode.pack_decode_args", spy_pack)
    monkeypatch.setattr("flashtune.api.decode.decode_grid", spy_grid)
    gen = torch.Generator().manual_seed(SEED)
    rng = random.Random(SEED)
    rounds: list[tuple[object, ...]] = []
    for lengths in ((rng.randrange(129, 250), rng.randrange(400, 600)),
                    (rng.randrange(400, 600), rng.randrange(129, 250))):
        inputs = _batch(_sequences(gen, list(lengths), (8, 2), 1), 16, 640, rng)
        seen.clear()
        if rounds:  # the warm call
            with _no_host_reads(monkeypatch):
                out, lse = _call(inputs, False)
        else:
            out, lse = _call(inputs, False)
        assert_close_to_float64(inputs, False, out, lse)
        grid, packed = seen[0]["grid"], seen[1]
        lse_part = packed["lse_part"]  # (splits, batch, heads_q, seqlen_q)
        taken = [int(torch.isfinite(lse_part[:, b, 0, 0]).sum()) for b in range(2)]
        assert taken == [-(-n // table.size_for(n)) for n in lengths], (lengths, taken)
        rounds.append((grid, tuple(packed["split_table"].flatten().tolist()),
                       packed["num_splits"]))
    assert rounds[0] == rounds[1]  # one launch sequence for both sets of lengths
    assert rounds[0][2] == 4  # ceil(256 / 64): the most any capacity-640 sequence takes


def test_the_split_table_is_built_from_the_tuned_buckets(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Each sequence bucket's tuned ``splitsize`` (here 1024 up to 4096 keys, and at 1M
    keys 256, raised to 8192 as the tuner timed it: no more than MAX_SPLITS pieces) enters
    the table; the other buckets keep DEFAULT_SPLIT_TABLE's sizes; without any tuned size
    the table is marked untuned (the heuristic then serves calls that are not
    batch-invariant)."""
    import dataclasses

    from flashtune.codegen.spec import KernelConfig
    from flashtune.families.decode.splits import DEFAULT_SPLIT_TABLE, MAX_SPLITS
    from flashtune.runtime import plans

    real = plans.decide

    def decide(q: torch.Tensor, causal: bool, backend: str | None, op: str,
               features: tuple[str, ...], seqlen: int, arch: str | None = None,
               shape_class: str = "", operands: plans.Operands = plans.AS_Q) -> Any:
        decision, entry = real(q, causal, backend, op, features, seqlen, arch,
                               shape_class=shape_class, operands=operands)
        size = 1024 if seqlen <= 4096 else 256 if seqlen == 1 << 20 else 0
        if not size:
            return decision, entry
        config = KernelConfig.from_dict({**decision.config.to_dict(), "splitsize": size})
        return dataclasses.replace(decision, config=config), entry

    q = torch.empty(1, 1, 8, DIM, dtype=torch.half)
    plans.clear_caches()
    monkeypatch.setattr(plans, "decide", decide)
    try:
        table, tuned = api_decode.tuned_split_table(q, False, "emulator")
    finally:
        plans.clear_caches()
    assert tuned
    for total in (1, 64, 1000, 4096):
        assert table.size_for(total) == 1024
    for total in (4097, 20000, 131072):
        assert table.size_for(total) == DEFAULT_SPLIT_TABLE.size_for(total), total
    assert table.size_for((1 << 19) + 1) == table.size_for(1 << 20) == 8192
    assert table.size_for(1 << 22) == (1 << 22) // MAX_SPLITS  # past the last bound
    assert table.grid_splits(1 << 20) <= MAX_SPLITS
    assert table.grid_splits(1 << 23) == MAX_SPLITS
    monkeypatch.setattr(plans, "decide", real)
    untuned, tuned = api_decode.tuned_split_table(q, False, "emulator")
    plans.clear_caches()
    assert not tuned
    assert all(untuned.size_for(n) == DEFAULT_SPLIT_TABLE.size_for(n)
               for n in (1, 300, 5000, 100000, 1 << 21))


@pytest.mark.emulator
def test_the_kernel_splits_each_sequence_by_its_bucket_against_float64() -> None:
    """The decode family with a split table (16 keys per split up to 40 keys, then 64) on
    NaN-poisoned partials: each sequence's partials equal the float64 partials of its own
    bucket's pieces, appended rows and an empty sequence included; a config's
    ``splitsize`` binds a one-bucket table and the grid's split count."""
    from flashtune.codegen.arch import get_arch
    from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
    from flashtune.families import render
    from flashtune.families.decode import DECODE, DecodeCase
    from flashtune.runtime.backends.emulator import EmulatorBackend
    from flashtune.runtime.launch import prepare

    problem = Problem(DIM, DType.BF16, causal=True, op="decode")
    table = SplitTable((40,), (16, 64))
    shape = Shape(3, 8, 2, 2, 300)
    capacity = DecodeCase(16, (0, 0, 0), 2, 1).capacity(shape)
    case = DecodeCase(16, (35, capacity - 2, 0), 2, table.grid_splits(capacity), table)
    inputs = DECODE.random_inputs(problem, shape, "cpu", seed=SEED, case=case)
    config = DECODE.default_config(problem, get_arch("sm_90"))  # the API tests' build
    launch = prepare(EmulatorBackend().load(render(problem, config)), shape, "cpu",
                     inputs=inputs, poison=True)
    launch.run()
    assert launch.verdict().ok, launch.verdict().message
    # A length past the table's reach (16 keys x 128 splits): pieces raised to 32 keys.
    small = SplitTable((), (16,))
    long_shape = Shape(1, 4, 1, 1, 2100)
    long_case = DecodeCase(16, (2099,), 1, small.grid_splits(2112), small)
    long_inputs = DECODE.random_inputs(problem, long_shape, "cpu", seed=SEED, case=long_case)
    launch = prepare(EmulatorBackend().load(render(problem, config)), long_shape, "cpu",
                     inputs=long_inputs, poison=True)
    launch.run()
    assert launch.verdict().ok, launch.verdict().message
    bound = DECODE.bind(problem, KernelConfig(64, 64, 4, 2, extras=(("splitsize", 256),)),
                        inputs)
    assert bound.tensors["split_table"].flatten().tolist() == [2**31 - 1, 256]
    assert bound.scalars["num_splits"] == 2  # 304 keys of capacity in pieces of 256


def test_split_tables_are_validated_and_cover_every_length() -> None:
    """Pieces of a table partition every length in aligned runs of the bucket's size; bad
    tables and grids beyond MAX_SPLITS are refused naming what to fix."""
    from flashtune.families.decode.splits import DEFAULT_SPLIT_TABLE, MAX_SPLITS, SPLIT_ALIGN

    rng = random.Random(SEED)
    for _ in range(200):
        total = rng.randrange(0, 300000)
        per = DEFAULT_SPLIT_TABLE.size_for(total)
        pieces = [DEFAULT_SPLIT_TABLE.split_range(total, s) for s in range(-(-total // per))]
        assert [k for b, e in pieces for k in (b, e)][1:-1:2] == [b for b, _ in pieces][1:]
        assert all(b % SPLIT_ALIGN == 0 and e - b <= per for b, e in pieces)
        assert (pieces[0][0], pieces[-1][1]) == (0, total) if pieces else total == 0
        assert DEFAULT_SPLIT_TABLE.grid_splits(max(total, 1)) >= len(pieces)
    for bounds, sizes, words in (((), (10,), "multiples of 16"), ((64, 32), (16, 16, 16),
                                 "ascending"), ((64,), (16,), "one entry more")):
        with pytest.raises(InvalidInput, match=words):
            SplitTable(bounds, sizes)
    # A length past the table's reach is split in MAX_SPLITS pieces at most.
    small = SplitTable((), (16,))
    assert small.size_for(16 * MAX_SPLITS + 1) == 32
    assert small.grid_splits(16 * MAX_SPLITS + 1) == MAX_SPLITS
    assert max(-(-n // small.size_for(n)) for n in range(1, 5000)) == MAX_SPLITS
