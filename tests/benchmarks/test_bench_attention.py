"""benchmarks/attention.py: sweep plan, reference, result classification, outputs.

Everything here runs on the CPU: the sweep machinery is exercised with SDPA on CPU tensors
and host-clock timing (Timer("cpu")), which tests plumbing, never performance.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import attention
import numpy as np
import pytest
import torch
from _attention_impls import (
    IMPLS,
    Impl,
    Prepared,
    Timer,
    default_picks,
    poison_next_output,
    reference,
    relative_error,
)
from _common import Deadline, Stats


def _np_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> np.ndarray:
    """float64 attention of one head: (Nq, D) and (Nk, D) inputs; the causal mask lets
    query i see key j when j <= i + Nk - Nq (bottom-right aligned)."""
    s = q @ k.T / math.sqrt(q.shape[-1])
    if causal:
        i = np.arange(q.shape[0])[:, None]
        j = np.arange(k.shape[0])[None, :]
        s = np.where(j > i + k.shape[0] - q.shape[0], -np.inf, s)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    out: np.ndarray = (p / p.sum(axis=-1, keepdims=True)) @ v
    return out


def _inputs(b: int, n: int, h: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(b, n, h, d).to(dtype) for _ in range(3))


def test_full_sweep_is_the_standard_one() -> None:
    shapes = attention.plan_sweep(["fp16", "bf16"], [64, 128], [False, True], subset=False)
    assert len(shapes) == 2 * 2 * 2 * 6
    points = sorted({(s.batch, s.seqlen) for s in shapes}, key=lambda p: p[1])
    assert points == [(32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)]
    for s in shapes:
        assert s.heads * s.head_dim == 2048
        assert s.flops == 4 * s.batch * s.seqlen**2 * s.heads * s.head_dim / (2 if s.causal
                                                                               else 1)
    subset = attention.plan_sweep(["bf16"], [128], [False], subset=True)
    assert {(s.batch, s.seqlen) for s in subset} <= set(points) and len(subset) == 3
    picked = attention.plan_sweep(["bf16"], [64], [True], subset=False, seqlens=[512, 8192])
    assert [(s.batch, s.seqlen) for s in picked] == [(32, 512), (2, 8192)]
    with pytest.raises(ValueError, match="divide"):
        attention.Shape("bf16", 96, False, 1, 512)


@pytest.mark.parametrize(("causal", "n_q"), [(False, 37), (True, 37), (True, 20)])
def test_reference_against_float64(causal: bool, n_q: int) -> None:
    q = torch.randn(3, n_q, 4, 16).to(torch.bfloat16)
    k, v = (torch.randn(3, 37, 4, 16).to(torch.bfloat16) for _ in range(2))
    ref = reference(q, k, v, causal)
    assert ref.picks == default_picks(3, 4) == ((0, 0), (1, 2), (2, 3))
    assert ref.values.shape == (3, n_q, 16)
    for i, (b, h) in enumerate(ref.picks):
        qh, kh, vh = (t[b, :, h].double().numpy() for t in (q, k, v))
        want = _np_attention(qh, kh, vh, causal)
        np.testing.assert_allclose(ref.values[i].numpy(), want, rtol=1e-4, atol=1e-5)


def test_relative_error_flags_nan_and_wrong_outputs() -> None:
    q, k, v = _inputs(2, 32, 3, 16, torch.float16)
    everything = ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2))
    full = reference(q, k, v, False, picks=everything).values
    good = full.reshape(2, 3, 32, 16).permute(0, 2, 1, 3).to(torch.float16)
    ref = reference(q, k, v, False)
    assert relative_error(good, ref) < 1e-3
    noisy = good + 0.05 * torch.randn_like(good) * full.norm() / math.sqrt(full.numel())
    assert 0.02 < relative_error(noisy, ref) < 0.1
    wrong_head = good.clone()
    wrong_head[1, :, 2] = good[1, :, 1]  # a head-stride bug in the last batch
    assert relative_error(wrong_head, ref) > 0.1
    poisoned = good.clone()
    poisoned[0, 5, 1, 3] = float("nan")  # outside the picks: still caught
    assert math.isnan(relative_error(poisoned, ref))


@pytest.mark.gpu
def test_poison_next_output_lands_where_the_next_output_goes() -> None:
    like = torch.randn(4, 1000, 8, 64, device="cuda").to(torch.bfloat16)
    poison_next_output(like)
    assert bool(torch.empty_like(like).isnan().all())


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_adapter_keeps_the_layout(causal: bool) -> None:
    """SDPA gets (B, H, N, D) views of (B, N, H, D) inputs and hands back (B, N, H, D)."""
    q, k, v = _inputs(2, 48, 4, 32, torch.bfloat16)
    prepared = IMPLS["sdpa-flash"].prepare(q, k, v, causal)
    with prepared.context():
        out = prepared.fn()
    assert out.shape == q.shape
    assert relative_error(out, reference(q, k, v, causal)) < 1e-2


def _fixed(name: str, make_out: object) -> Impl:
    def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Prepared:
        if isinstance(make_out, Exception):
            raise make_out
        return Prepared(fn=lambda: make_out(q), config="test")  # type: ignore[operator]
    return Impl(name, prepare)


def test_run_sweep_classifies_and_times(tmp_path: Path) -> None:
    shapes = [attention.Shape("bf16", 128, c, 1, 64) for c in (False, True)]
    impls = [IMPLS["sdpa-flash"], IMPLS["sdpa-cudnn"],
             _fixed("garbage", lambda q: torch.randn_like(q)),
             _fixed("broken", RuntimeError("launch failed"))]
    seen: list[int] = []
    results = attention.run_sweep(shapes, impls, timer=Timer("cpu", 1, 3),
                                  deadline=Deadline(None), seed=1,
                                  on_result=lambda so_far: seen.append(len(so_far)))
    assert seen == list(range(1, 9))
    status = {(r.shape.causal, r.impl): r for r in results}
    for causal in (False, True):
        base = status[(causal, "sdpa-flash")]
        assert base.status == "ok" and base.stats is not None and base.stats.count == 3
        assert base.rel_err is not None and base.rel_err < 1e-2
        assert base.ratio_vs_sdpa == pytest.approx(1.0)
        assert status[(causal, "sdpa-cudnn")].status == "unavailable"
        assert status[(causal, "garbage")].status == "wrong"
        assert status[(causal, "broken")].status == "error"
        assert "launch failed" in status[(causal, "broken")].note


def test_time_budget_stops_cleanly() -> None:
    shapes = attention.plan_sweep(["fp16"], [64], [False], subset=True)
    deadline = Deadline(1e-6)
    results = attention.run_sweep(shapes, [IMPLS["sdpa-flash"]], timer=Timer("cpu", 1, 1),
                                  deadline=deadline, seed=0, on_result=lambda r: None)
    assert [r.status for r in results] == ["skipped"] * 3
    assert all("time budget" in r.note for r in results)


def _ok(shape: attention.Shape, impl: str, ms: float) -> attention.Result:
    return attention.Result(shape, impl, "ok", "c", Stats(ms, ms, ms, 1), rel_err=1e-3)


def test_ratios_tables_csv_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                    ) -> None:
    a = attention.Shape("bf16", 128, False, 4, 4096)
    b = attention.Shape("bf16", 128, True, 4, 4096)
    results = attention.with_ratios([_ok(a, "sdpa-flash", 2.0), _ok(a, "flashtune", 4.0),
                                     _ok(b, "flashtune", 1.0),
                                     attention.Result(b, "sdpa-flash", "error", note="x")])
    assert results[1].ratio_vs_sdpa == pytest.approx(0.5)
    assert results[1].tflops == pytest.approx(a.flops / 4e-3 / 1e12)
    assert results[2].ratio_vs_sdpa is None  # no baseline on that shape
    attention.print_table(results, ["flashtune", "sdpa-flash"], "test GPU")
    out = capsys.readouterr().out
    assert f"{results[1].tflops:.1f}" in out and "0.50" in out and "error" in out
    attention.plot(results, tmp_path / "p.png", "title")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_only_writes_the_plan(tmp_path: Path) -> None:
    rc = attention.main(["--subset", "--dtypes", "bf16", "--head-dims", "64,128",
                         "--causal", "full", "--plan-only", "--out", str(tmp_path)])
    assert rc == 0
    with (tmp_path / "attention.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 3 * len(IMPLS)
    assert {r["status"] for r in rows} == {"planned"}
    assert {int(r["heads"]) * int(r["head_dim"]) for r in rows} == {2048}
    assert (tmp_path / "attention_env.json").is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert attention.main(["--subset", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "attention.csv").exists()


def test_bad_arguments_exit_2() -> None:
    for argv in (["--dtypes", "fp32"], ["--head-dims", "96"], ["--impls", "nope"],
                 ["--time-budget", "0"], ["--seqlens", "3000"]):
        with pytest.raises(SystemExit) as exc:
            attention.parse_args(argv)
        assert exc.value.code == 2


@pytest.mark.gpu
def test_gpu_subset_sweep(tmp_path: Path) -> None:
    """On a GPU: one real shape, every implementation checked against the reference."""
    rc = attention.main(["--dtypes", "bf16", "--head-dims", "128", "--causal", "full",
                         "--seqlens", "1024", "--repeats", "3", "--time-budget", "60",
                         "--out", str(tmp_path)])
    with (tmp_path / "attention.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert rc == 0, rows
    by_impl = {r["impl"]: r for r in rows}
    assert len(rows) == len(by_impl) == len(IMPLS)
    for name in ("flashtune", "flashtune-default", "sdpa-flash"):
        row = by_impl[name]
        assert row["status"] == "ok", row
        assert float(row["rel_err"]) < 1e-2 and float(row["tflops"]) > 1.0
    assert (tmp_path / "attention.png").is_file()


@pytest.mark.emulator
def test_flashtune_adapters_compute_attention() -> None:
    """Both flashtune entries of the sweep, run in the emulator on a ragged shape (one
    kernel: the dispatcher falls back to the default config with nothing tuned)."""
    from _flashtune_adapter import default_call, tuned_call

    q, k, v = _inputs(1, 70, 2, 128, torch.bfloat16)
    ref = reference(q, k, v, False)
    for adapter in (tuned_call, default_call):
        fn, label = adapter(q, k, v, False, backend="emulator")
        assert label.endswith("(default)"), label
        out = fn()
        assert out.shape == q.shape
        assert relative_error(out, ref) < 1e-2, adapter.__name__


def test_forward_backward_pass_is_planned_checked_and_timed() -> None:
    """fwd+bwd shapes count 3.5x the forward's FLOPs; an implementation's gradients are
    checked against float32 autograd (a wrong backward is caught), then timed."""
    fwd, both = attention.plan_sweep(["bf16"], [128], [True], subset=True, seqlens=[1024],
                                     passes=["fwd", "fwdbwd"])
    assert (fwd.passes, both.passes) == ("fwd", "fwdbwd") and both.backward
    assert both.flops == pytest.approx(3.5 * fwd.flops)

    class WrongBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x

        @staticmethod
        def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
            return 2 * g

    sdpa = IMPLS["sdpa-flash"]

    def wrong(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Prepared:
        inner = sdpa.prepare(q, k, v, causal)
        return Prepared(fn=lambda: WrongBackward.apply(inner.fn()),  # type: ignore[no-untyped-call]  # unannotated in torch
                        config="x2 grads")

    shapes = [attention.Shape("bf16", 128, c, 1, 64, "fwdbwd") for c in (False, True)]
    results = attention.run_sweep(shapes, [sdpa, Impl("wrong-bwd", wrong)],
                                  timer=Timer("cpu", 1, 2), deadline=Deadline(None), seed=3,
                                  on_result=lambda r: None)
    status = {(r.shape.causal, r.impl): r for r in results}
    for causal in (False, True):
        good = status[(causal, "sdpa-flash")]
        assert good.status == "ok" and good.rel_err is not None and good.rel_err < 1e-2
        bad = status[(causal, "wrong-bwd")]
        assert bad.status == "wrong" and bad.rel_err is not None and bad.rel_err > 0.5


@pytest.mark.gpu
def test_gpu_forward_backward_sweep(tmp_path: Path) -> None:
    """On a GPU: forward + backward of one shape, flashtune's gradients checked too."""
    rc = attention.main(["--dtypes", "bf16", "--head-dims", "64", "--causal", "causal",
                         "--seqlens", "1024", "--passes", "fwdbwd", "--repeats", "3",
                         "--impls", "flashtune,flashtune-default,sdpa-flash",
                         "--time-budget", "120", "--out", str(tmp_path)])
    with (tmp_path / "attention.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert rc == 0, rows
    for row in rows:
        assert row["pass"] == "fwdbwd" and row["status"] == "ok", row
        assert float(row["rel_err"]) < 1e-2 and float(row["tflops"]) > 1.0
