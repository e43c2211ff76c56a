"""The backward main kernel on packed sequences (varlen): ``cu_seqlens_q`` / ``cu_seqlens_k``,
per-sequence lengths with Nq != Nk, zero-length sequences (no queries, or no keys), GQA,
causal masks aligned to each sequence's bottom-right corner, and the forward's other
features per sequence (window, softcap, ALiBi with per-sequence slopes, dropout keyed by
the sequence's number), in ``bwd`` (atomic and split dQ) and ``bwddet``.

Each case builds a pack of chosen lengths from a printed seed, NaN-poisons the outputs,
runs the kernel in the emulator and checks it against the family's float64 reference,
which is itself checked against an independent one: a loop over the sequences, dense
float64 attention differentiated by torch.autograd. Zero-length sequences must give exact
zeros. The default run takes two cases (causal, and window + softcap, with their other
parts drawn from the seed); ``-m sweep`` the grid. The split mode stays bitwise equal over
shuffled block orders.
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Any, cast

import pytest
import torch
from test_bwd_features import _launch

from flashtune import families
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families.base import Inputs, random_rows
from flashtune.families.bwd import BACKWARD
from flashtune.families.bwd.reference import varlen_stats
from flashtune.families.fwd import variants
from flashtune.families.fwd.dropout import kept_tensor
from flashtune.families.fwd.reference import alibi_bias, window_visible
from flashtune.runtime.backends.emulator import LaunchOptions

pytestmark = pytest.mark.emulator

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
HEAD_DIM = 32

#: (query lengths, key lengths, heads_q, heads_kv) of a pack.
Pack = tuple[list[int], list[int], int, int]
#: Every pack has a zero-length sequence.
PACKS: dict[str, Pack] = {
    # Nq != Nk per sequence, a sequence with no queries (its keys get dK = dV = 0), GQA 2:1.
    "noq": ([20, 0, 45, 7], [50, 17, 30, 7], 4, 2),
    # A sequence with no keys (its rows get dQ = 0) and a longer key sequence, MQA 3:1.
    "nok": ([33, 12, 0, 70], [0, 40, 9, 64], 3, 1),
}
#: (switches, window or None for a drawn one).
FEATURES = {
    "plain": ({}, None),
    "causal": ({"causal": True}, None),
    "window-softcap": ({"window": True, "softcap": True}, (16, 4)),
    "window": ({"window": True}, None),
    "alibi-causal": ({"alibi": True, "causal": True}, None),
    "dropout-causal": ({"dropout": True, "causal": True}, None),
    "window-softcap-alibi-dropout": ({"window": True, "softcap": True, "alibi": True,
                                      "dropout": True}, (24, 0)),
}
CONFIGS = [KernelConfig(64, 32, 4, 1, extras={"dqmode": "atomic"}),
           KernelConfig(32, 32, 2, 2, extras={"dqmode": "split"}),
           KernelConfig(64, 16, 4, 2, extras={"dqmode": "split"})]

Case = tuple[str, str, DType, KernelConfig, str]


def packed_inputs(problem: Problem, pack: Pack, window: tuple[int, int] | None, seed: int
                  ) -> tuple[Shape, Inputs]:
    """The shape (number of sequences, heads, longest lengths) and inputs of ``pack``:
    random packed q, k, v, dO, the features' drawn values (``window`` instead of a drawn
    window when given) and the forward's LSE and D of them."""
    lens_q, lens_k, heads_q, heads_kv = pack
    shape = Shape(len(lens_q), heads_q, heads_kv, max(lens_q), max(lens_k))
    gen = torch.Generator().manual_seed(seed)
    scalars: dict[str, float] = {"softmax_scale": HEAD_DIM ** -0.5,
                                 "max_seqlen_q": float(max(lens_q))}
    drawn, tensors = variants.random_values(problem, shape, gen, "cpu")
    scalars.update(drawn)
    if window is not None:
        scalars.update(window_left=window[0], window_right=window[1])
    one = Shape(1, heads_q, heads_kv, 1, 1)
    for name, total, heads in (("q", sum(lens_q), heads_q), ("k", sum(lens_k), heads_kv),
                               ("v", sum(lens_k), heads_kv), ("do", sum(lens_q), heads_q)):
        tensors[name] = random_rows(problem, one, total, heads, gen, "cpu")
    tensors["cu_seqlens_q"] = variants.cumulative(lens_q, "cpu")
    tensors["cu_seqlens_k"] = variants.cumulative(lens_k, "cpu")
    values = variants.VariantValues.of(Inputs(tensors, scalars)).only(problem)
    tensors["lse"], tensors["dsum"] = varlen_stats(
        tensors["q"], tensors["k"], tensors["v"], tensors["do"], problem.causal,
        scalars["softmax_scale"], values)
    return shape, Inputs(tensors, scalars)


def autograd_reference(problem: Problem, inputs: Inputs) -> dict[str, torch.Tensor]:
    """float64 dK, dV and the unscaled dQ sum (dQ / scale, (1, Hq, total_q, D)) of the loss
    sum(O * dO), sequence by sequence: dense attention written out here (scores, cap, bias,
    masks, softmax, the dropout mask from the host generator) and differentiated by
    torch.autograd."""
    t, s = inputs.tensors, inputs.scalars
    scale = s["softmax_scale"]
    q, k, v, dout = (t[n][0].double() for n in ("q", "k", "v", "do"))
    heads_q, group = q.shape[1], q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    cq, ck = t["cu_seqlens_q"].tolist(), t["cu_seqlens_k"].tolist()
    for b in range(len(cq) - 1):
        rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        nq, nk = rows.stop - rows.start, keys.stop - keys.start
        if nq == 0 or nk == 0:
            continue
        qb, kb, vb = (x.detach().clone().requires_grad_(True)
                      for x in (q[rows], k[keys], v[keys]))
        ke, ve = kb.repeat_interleave(group, 1), vb.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qb, ke) * scale
        if problem.softcap:
            scores = s["softcap"] * torch.tanh(scores / s["softcap"])
        if problem.alibi:
            slopes = t["alibi_slopes"][b] if t["alibi_slopes"].dim() == 2 else t["alibi_slopes"]
            scores = scores + alibi_bias(slopes, 1, nq, nk)[0]
        visible = torch.ones(nq, nk, dtype=torch.bool)
        if problem.causal:  # bottom-right aligned: row i sees keys j <= i + nk - nq
            visible &= torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + nk - nq
        if problem.window:
            visible &= window_visible(nq, nk, int(s["window_left"]), int(s["window_right"]))
        scores = scores.masked_fill(~visible, float("-inf"))
        seen = visible.any(-1)[None, :, None]
        probs = torch.softmax(scores.masked_fill(~seen, 0.0), -1).masked_fill(~seen, 0.0)
        if problem.has("dropout"):
            p = s["dropout_p"]
            kept = kept_tensor(int(s["dropout_seed"]), int(s["dropout_offset"]), p, heads_q,
                               nq, nk, range(b, b + 1))[0]
            probs = probs * kept / (1.0 - float(torch.tensor(p, dtype=torch.float32)))
        out = torch.einsum("hqk,khd->qhd", probs, ve)
        (out * dout[rows]).sum().backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        for grad, leaf, where in ((dq, qb, rows), (dk, kb, keys), (dv, vb, keys)):
            assert leaf.grad is not None
            grad[where] = leaf.grad
    return {"dk": dk[None], "dv": dv[None], "dq_accum": (dq / scale).transpose(0, 1)[None]}


def _zero_parts(inputs: Inputs, outputs: dict[str, torch.Tensor]) -> None:
    """Keys of a sequence with no queries have dK = dV = 0, rows of a sequence with no keys
    a zero accumulator: exactly."""
    cq, ck = inputs.tensors["cu_seqlens_q"].tolist(), inputs.tensors["cu_seqlens_k"].tolist()
    accum = outputs["dq_accum"].sum(0)
    for b in range(len(cq) - 1):
        if cq[b] == cq[b + 1]:
            for name in ("dk", "dv"):
                assert torch.equal(outputs[name][0, ck[b]:ck[b + 1]],
                                   torch.zeros_like(outputs[name][0, ck[b]:ck[b + 1]])), name
        if ck[b] == ck[b + 1]:
            assert torch.equal(accum[0, :, cq[b]:cq[b + 1]],
                               torch.zeros_like(accum[0, :, cq[b]:cq[b + 1]]))


def _case_seed(case: Case) -> int:
    return random.Random(f"{SEED}-{_id(case)}").randrange(2**31)


def _id(case: Case) -> str:
    features, pack, dtype, config, op = case
    return f"{op}-{features}-{pack}-{dtype.value}-{config.key()}"


def run_case(case: Case) -> None:
    features, pack, dtype, config, op = case
    switches, window = FEATURES[features]
    problem = Problem(HEAD_DIM, dtype, op=op, varlen=True,
                      **cast(dict[str, Any], switches))
    seed = _case_seed(case)
    shape, inputs = packed_inputs(problem, PACKS[pack], window, seed)
    where = (f"{_id(case)} {PACKS[pack]} "
             f"{ {k: v for k, v in inputs.scalars.items() if k != 'softmax_scale'} } "
             f"seed={seed}")
    family = families.of(problem)
    reference = family.reference(problem, inputs)
    exact = autograd_reference(problem, inputs)
    for name, value in exact.items():  # the family's reference is the autograd one
        scale = float(value.abs().max()) or 1.0
        assert torch.allclose(reference[name], value, rtol=1e-4, atol=1e-5 * scale), (
            f"{where}: the family's reference {name} differs from autograd's")
    outputs, _ = _launch(problem, config, shape, inputs)
    verdict = family.compare(problem, shape, outputs, reference)
    assert verdict.ok, f"{where}: {verdict.message}"
    _zero_parts(inputs, outputs)


def _grid() -> list[Case]:
    return [(features, pack, dtype, config, op)
            for features, pack, dtype, config, op in itertools.product(
                FEATURES, PACKS, DType, CONFIGS, ("bwd", "bwddet"))
            if not (op == "bwddet" and config.extra("dqmode", "") == "atomic")]


def _sample() -> list[Case]:
    """Causal, and window + softcap, each on a pack, dtype, config and op drawn from the
    seed (every combination under ``-m sweep``)."""
    rng = random.Random(SEED)
    out = []
    for features, pack in (("causal", rng.choice(list(PACKS))),
                           ("window-softcap", rng.choice(list(PACKS)))):
        op = rng.choice(("bwd", "bwddet"))
        config = rng.choice([c for c in CONFIGS
                             if op == "bwd" or c.extra("dqmode", "") == "split"])
        out.append((features, pack, rng.choice(list(DType)), config, op))
    return out


def test_the_backward_families_declare_varlen() -> None:
    for op in ("bwd", "bwddet"):
        assert "varlen" in families.get(op).features
    source = families.render(Problem(HEAD_DIM, DType.FP16, op="bwd", varlen=True),
                             CONFIGS[0]).code
    assert "const int* __restrict__ cu_seqlens_q" in source
    assert "max_seqlen_q" not in source  # the grid's size is the host's business


#: The seeded sample, then the rest of the grid under ``-m sweep``.
CASES = [*_sample(), *(pytest.param(c, marks=pytest.mark.sweep) for c in _grid()
                       if c not in _sample())]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_varlen_gradients_match_float64(case: Case) -> None:
    run_case(case)


def test_varlen_split_mode_is_bitwise_equal_over_block_orders() -> None:
    """bwddet with ALiBi, dropout and causal masks over a pack of two sequences and one kv
    head (two dQ slices): every shuffled block order gives the same bits."""
    problem = Problem(HEAD_DIM, DType.BF16, op="bwddet", varlen=True, causal=True,
                      alibi=True, dropout=True)
    config = KernelConfig(32, 16, 2, 1, extras={"dqmode": "split"})
    shape, inputs = packed_inputs(problem, ([40, 0, 90], [70, 8, 55], 2, 1), None, SEED)
    runs = [_launch(problem, config, shape, inputs, LaunchOptions(block_order_seed=s))[0]
            for s in (None, 1, 2)]
    assert runs[0]["dq_accum"].shape[0] > 1, "the pack should give several dQ slices"
    verdict = BACKWARD.compare(problem, shape, runs[0], BACKWARD.reference(problem, inputs))
    assert verdict.ok, verdict.message
    for other in runs[1:]:
        for name in ("dk", "dv", "dq_accum"):
            assert torch.equal(other[name], runs[0][name]), name
