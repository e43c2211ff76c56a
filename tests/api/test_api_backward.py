"""The backward pass through the public API, run by the CPU emulator.

Gradients are held to flash-attn's rule: each gradient's largest error against a float64
autograd reference is at most 3x the error of the same attention written in plain PyTorch
and run in the input dtype (the measured ratios are printed with ``-s``). The default run
samples that grid with the run's seed (default configs); ``-m sweep`` runs all of it. The
other tests run small tuned configs (a test tuning source) so that their kernels build once:
deterministic gradients bitwise equal over shuffled block orders, the LSE's gradient, the
SDPA drop-in, torch.compile, no N x N allocation anywhere in forward + backward, and a short
training loop against the same model on torch's SDPA.
"""

from __future__ import annotations

import copy
import itertools
import os
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from grad_helpers import Grads, attention_reference, error_ratios, gradients, make_inputs
from runtime_helpers import best_entry

import flashtune
from flashtune.errors import InvalidInput
from flashtune.runtime import plans

pytestmark = pytest.mark.emulator

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])


# ------------------------------------------------------------------ numerics grid

HEAD_DIMS = (32, 40, 64, 72, 96, 128, 160, 192, 224, 256)
#: (batch, seqlen_q, seqlen_k, heads_q, heads_kv): length 1, odd lengths, Nq != Nk both
#: ways (Nq > Nk causal: rows that see no key), GQA and MQA.
SHAPES = ((1, 1, 7, 2, 1), (2, 7, 7, 2, 2), (1, 77, 30, 4, 2), (1, 30, 77, 3, 1),
          (1, 300, 77, 2, 1), (1, 77, 1000, 2, 2))
SMALL_SHAPES = SHAPES[:4]
GRID = list(itertools.product(HEAD_DIMS, (torch.float16, torch.bfloat16), (False, True),
                              SHAPES))


def _sampled() -> list[tuple[int, torch.dtype, bool, tuple[int, int, int, int, int]]]:
    """One default-config case of the grid per run (bf16: the small-config tests below run
    fp16), its head dim, mask and shape drawn from the run's seed."""
    rng = random.Random(SEED)
    return [(rng.choice(HEAD_DIMS), torch.bfloat16, rng.random() < 0.5,
             rng.choice(SMALL_SHAPES))]


def _case_id(case: tuple[int, torch.dtype, bool, tuple[int, ...]]) -> str:
    hd, dtype, causal, shape = case
    return f"d{hd}-{str(dtype)[6:]}-{'causal' if causal else 'full'}-{'x'.join(map(str, shape))}"


@pytest.mark.usefixtures("dispatcher")
@pytest.mark.parametrize("case", _sampled(), ids=_case_id)
def test_gradients_within_3x_of_plain_pytorch(
        case: tuple[int, torch.dtype, bool, tuple[int, int, int, int, int]]) -> None:
    head_dim, dtype, causal, shape = case
    error_ratios(shape, head_dim, dtype, causal, SEED)


@pytest.mark.sweep
@pytest.mark.usefixtures("dispatcher")
@pytest.mark.parametrize("case", GRID, ids=_case_id)
def test_gradient_grid_within_3x_of_plain_pytorch(
        case: tuple[int, torch.dtype, bool, tuple[int, int, int, int, int]]) -> None:
    head_dim, dtype, causal, shape = case
    for deterministic in (False, True):
        error_ratios(shape, head_dim, dtype, causal, SEED, deterministic=deterministic)


# ------------------------------------------------------------------ small tuned configs

ARCH = "sm_90"
DEVICE = f"virtual-{ARCH}"
D = 32
#: Small tiles: few threads per block, so the emulator runs them quickly.
TUNED = {"fwd": "m64_n32_w4_s1", "bwd": "m32_n32_w2_s2_dqmode-atomic",
         "bwddet": "m32_n32_w2_s2_dqmode-split", "bwdpre": "m32_n16_w2_s1",
         "bwdsum": "m32_n16_w2_s1"}


@pytest.fixture
def small(source: Any, dispatcher: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tuned entries (the emulator's virtual sm_90) for every family at head dim 32, in the
    test tuning source of the runtime tests' ``source`` fixture (conftest.ListSource)."""
    monkeypatch.setenv("FLASHTUNE_EMULATOR_ARCH", ARCH)
    for (op, config), dtype, mask in itertools.product(TUNED.items(), ("fp16", "bf16"),
                                                       ("full", "causal")):
        if mask == "causal" and op in ("bwdpre", "bwdsum"):
            continue
        source.entries.append(best_entry(DEVICE, ARCH, f"{op}_d{D}_{dtype}_{mask}", 128,
                                         config))


def _run(shape: tuple[int, int, int, int, int], causal: bool, backend: str,
         deterministic: bool, seed: int = SEED) -> Grads:
    inputs, dout = make_inputs(shape, D, torch.float16, seed)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = flashtune.attention(q, k, v, causal=causal, backend=backend,
                                  deterministic=deterministic)
        assert isinstance(out, torch.Tensor)
        return out

    return gradients(fn, inputs, dout)


@pytest.mark.usefixtures("small")
def test_deterministic_gradients_are_bitwise_equal_over_block_orders(
        shuffled: list[str]) -> None:
    """7 key tiles over 2 kv heads, 2 dQ slices (4 virtual SMs): blocks add several key
    tiles each, in whatever order the blocks run."""
    shape = (1, 100, 200, 4, 2)
    runs = [_run(shape, True, name, True) for name in ["emulator", *shuffled]]
    for other in runs[1:]:
        for name in ("dq", "dk", "dv"):
            assert torch.equal(other[name], runs[0][name]), name
    # Each family's kernel comes from its own tuned entry, independently of the others.
    configs = {key[-1]: plan.source.config.key() for key, plan in plans.cached().items()
               if key[0] == shuffled[0]}
    assert configs == {op: TUNED[op] for op in ("fwd", "bwddet", "bwdpre", "bwdsum")}


@pytest.mark.usefixtures("small")
def test_atomic_gradients_vary_with_block_order_within_tolerance(
        shuffled: list[str]) -> None:
    # The float32 sums differ in their last bits, but dQ is fp16: a difference survives the
    # rounding only where a sum lies near an fp16 rounding boundary (a few elements in
    # 10^4), so a fixed input may show none. Fresh inputs are drawn until one does.
    shape = (1, 64, 256, 4, 1)
    for attempt in range(6):
        seed = SEED + attempt
        runs = [_run(shape, False, name, False, seed) for name in ["emulator", *shuffled]]
        if any(not torch.equal(r["dq"], runs[0]["dq"]) for r in runs[1:]):
            break
    else:
        raise AssertionError("float32 atomics in shuffled block orders never changed dQ's "
                             f"last bits over 6 inputs (seeds {SEED}..{seed})")
    for r in runs[1:]:
        scale = float(runs[0]["dq"].abs().max())
        assert float((r["dq"] - runs[0]["dq"]).abs().max()) <= 2e-3 * scale


@pytest.mark.usefixtures("small")
def test_torch_deterministic_algorithms_select_the_deterministic_kernel() -> None:
    previous = torch.are_deterministic_algorithms_enabled()
    plans.clear_caches()
    torch.use_deterministic_algorithms(True)
    try:
        inputs, dout = make_inputs((1, 20, 20, 2, 2), D, torch.float16, SEED)
        gradients(lambda q, k, v: flashtune.attention(q, k, v, backend="emulator"), inputs, dout)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert {key[-1] for key in plans.cached()} >= {"bwddet"}
    assert "bwd" not in {key[-1] for key in plans.cached()}
    with pytest.raises(InvalidInput, match="deterministic"):
        flashtune.attention(*inputs, backend="emulator", deterministic=1)  # type: ignore[call-overload]


@pytest.mark.usefixtures("small")
def test_error_ratios_with_the_deterministic_mode() -> None:
    """fp16, causal with Nq > Nk (rows that see no key), GQA, dQ in slices."""
    error_ratios((1, 77, 30, 4, 2), D, torch.float16, True, SEED, deterministic=True)


@pytest.mark.usefixtures("small")
def test_gradient_through_the_lse() -> None:
    """loss = <O, W> + <LSE, U>: the LSE's gradient enters as D - dLSE."""
    inputs, dout = make_inputs((2, 33, 47, 2, 1), D, torch.float16, SEED)
    weight = torch.randn(2, 2, 33, generator=torch.Generator().manual_seed(SEED))

    def loss(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
             tensors: tuple[torch.Tensor, ...]) -> Grads:
        leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
        out, lse = fn(*leaves)
        ((out.double() * dout.double()).sum() + (lse.double() * weight.double()).sum()
         ).backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        return {n: t.grad for n, t in zip(("dq", "dk", "dv"), leaves, strict=True)}  # type: ignore[misc]

    got = loss(lambda q, k, v: flashtune.attention(q, k, v, return_lse=True,
                                                   backend="emulator"), inputs)
    ref = loss(lambda q, k, v: attention_reference(q, k, v, False, D ** -0.5),
               tuple(t.double() for t in inputs))
    for name in ("dq", "dk", "dv"):
        err = float((got[name].double() - ref[name]).abs().max())
        assert err <= 1e-2 * float(ref[name].abs().max()), name


def flashtune_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return flashtune.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                  backend="emulator")


def torch_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True)


@pytest.mark.usefixtures("small")
def test_sdpa_drop_in_gets_gradients() -> None:
    inputs, dout = make_inputs((2, 40, 40, 4, 2), D, torch.float16, SEED)
    bhnd = tuple(t.transpose(1, 2).contiguous() for t in inputs)

    got = gradients(flashtune_sdpa, bhnd, dout.transpose(1, 2))
    ref = gradients(torch_sdpa, tuple(t.double() for t in bhnd), dout.transpose(1, 2))
    for name in ("out", "dq", "dk", "dv"):
        err = float((got[name].double() - ref[name]).abs().max())
        assert err <= 1e-2 * float(ref[name].abs().max()), name


def _compiled_equals_eager(compile_backend: str) -> None:
    import torch._dynamo

    inputs, dout = make_inputs((1, 50, 70, 2, 1), D, torch.float16, SEED)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = flashtune.attention(q, k, v, causal=True, backend="emulator",
                                  deterministic=True)
        assert isinstance(out, torch.Tensor)
        return out * 2

    torch._dynamo.reset()
    eager = gradients(fn, inputs, dout)
    compiled = gradients(torch.compile(fn, fullgraph=True, backend=compile_backend), inputs,
                         dout)
    for name in ("out", "dq", "dk", "dv"):
        assert torch.equal(compiled[name], eager[name]), name


@pytest.mark.usefixtures("small")
def test_compiled_backward_equals_eager() -> None:
    """torch.compile (Dynamo and AOTAutograd, aot_eager backend) traces the forward and the
    backward through the custom ops' fake implementations without graph breaks."""
    _compiled_equals_eager("aot_eager")


@pytest.mark.sweep
@pytest.mark.usefixtures("small")
def test_inductor_compiled_backward_equals_eager() -> None:
    """The same with inductor, which generates and compiles C++ for the surrounding ops (about
    a minute of g++ on a small CPU, hence behind -m sweep)."""
    _compiled_equals_eager("inductor")


@pytest.mark.usefixtures("small")
def test_the_backward_op_passes_opcheck() -> None:
    from flashtune.api import ops

    (q, k, v), dout = make_inputs((1, 20, 24, 2, 1), D, torch.float16, SEED)
    out, lse = ops.attention_fwd(q, k, v, True, 0.2, "emulator", True)
    torch.library.opcheck(ops.attention_bwd, (dout, q, k, v, out, lse, None, True, 0.2, True,
                                              "emulator"))


@pytest.mark.usefixtures("small")
def test_forward_and_backward_allocate_no_n_by_n_buffer() -> None:
    """Every CPU allocation of a forward + backward at N = 512 (recorded by the profiler, so
    also those inside the custom ops) is smaller than an N x N fp16 matrix; the largest is
    the float32 dQ accumulator."""
    from torch.profiler import ProfilerActivity, profile

    n = 512
    inputs, dout = make_inputs((1, n, n, 1, 1), D, torch.float16, SEED)
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    for deterministic in (False, True):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = flashtune.attention(*leaves, causal=True, backend="emulator",
                                      deterministic=deterministic)
            out.backward(dout)  # type: ignore[no-untyped-call]  # unannotated in torch
        sizes = [e.nbytes() for e in prof.profiler.kineto_results.events()
                 if e.name() == "[memory]" and e.nbytes() > 0]
        slices = 4 if deterministic else 1  # the virtual device's 4 SMs, one kv head
        accumulator = slices * n * D * 4
        assert sizes and max(sizes) <= accumulator, (max(sizes), accumulator)
        assert accumulator < n * n * 2


class TinyAttentionModel(torch.nn.Module):
    """Embeddings -> one causal self-attention layer (GQA) -> a linear head."""

    def __init__(self, attend: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.attend = attend
        self.qkv = torch.nn.Linear(48, (4 + 2 + 2) * D)
        self.proj = torch.nn.Linear(4 * D, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split([4 * D, 2 * D, 2 * D], dim=-1)
        q = q.reshape(b, n, 4, D).transpose(1, 2).half()
        k = k.reshape(b, n, 2, D).transpose(1, 2).half()
        v = v.reshape(b, n, 2, D).transpose(1, 2).half()
        out = self.attend(q, k, v)
        projected: torch.Tensor = self.proj(out.transpose(1, 2).reshape(b, n, 4 * D).float())
        return projected + x


@pytest.mark.usefixtures("small")
def test_a_short_training_loop_follows_torch_sdpa() -> None:
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(2, 24, 48, generator=gen)
    target = torch.randn(2, 24, 48, generator=gen)

    torch.manual_seed(SEED)
    model = TinyAttentionModel(flashtune_sdpa)
    twin = copy.deepcopy(model)
    twin.attend = torch_sdpa
    curves = []
    for net in (model, twin):
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        losses = []
        for _ in range(6):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), target)
            loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
            opt.step()
            losses.append(float(loss.detach()))
        curves.append(losses)
    print("loss curves (flashtune, torch SDPA):", curves)
    ours_curve, sdpa_curve = curves
    assert ours_curve[-1] < ours_curve[0], "the loss goes down"
    for a, b in zip(ours_curve, sdpa_curve, strict=True):
        assert abs(a - b) <= 2e-3 * abs(b), curves
    for p, r in zip(model.parameters(), twin.parameters(), strict=True):
        assert float((p - r).detach().abs().max()) <= 1e-3 * max(1.0, float(r.detach().abs().max()))
