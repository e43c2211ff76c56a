"""Knobs, API arguments and command lines a careless user gets wrong: each ends in a clear,
typed error naming what was wrong and what is legal, never a traceback or a silent default
(issue: hardening, "Knobs, API, CLI")."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import flashtune
from flashtune import settings
from flashtune.api.limits import MAX_SEQLEN, MAX_SOFTMAX_SCALE, check_softmax_scale
from flashtune.api.validate import check_attention_inputs
from flashtune.cli import app
from flashtune.errors import InvalidInput, SettingError, TuningError
from flashtune.tuner.options import TuneOptions

BAD_KNOBS: list[tuple[str, str, str]] = [
    # (variable, value, what the message must say is legal)
    ("FLASHTUNE_EMULATOR_DEADLOCK_S", "-1", "(0, 86400]"),
    ("FLASHTUNE_EMULATOR_DEADLOCK_S", "nan", "(0, 86400]"),
    ("FLASHTUNE_EMULATOR_DEADLOCK_S", "inf", "(0, 86400]"),
    ("FLASHTUNE_EMULATOR_DEADLOCK_S", "0", "(0, 86400]"),
    ("FLASHTUNE_EMULATOR_DEADLOCK_S", "ten", "(0, 86400]"),
    ("FLASHTUNE_COMPILE_WORKERS", "0", "[1, 1024]"),
    ("FLASHTUNE_COMPILE_WORKERS", "-3", "[1, 1024]"),
    ("FLASHTUNE_COMPILE_WORKERS", "2.5", "[1, 1024]"),
    ("FLASHTUNE_COMPILE_WORKERS", "99999999999999999999999", "[1, 1024]"),
    ("FLASHTUNE_CACHE_DIR", "/dev/null", "real file system"),
    ("FLASHTUNE_CACHE_DIR", "/proc/x", "real file system"),
    ("FLASHTUNE_CACHE_DIR", "~no-such-user-flashtune/x", "absolute path"),
    ("FLASHTUNE_CACHE_DIR", "relative/cache", "absolute path"),
    ("FLASHTUNE_CUDA_HOME", "/nonexistent-cuda-home", "existing directory"),
    ("FLASHTUNE_CXX", "g++ -O2", "one command name or path"),
    ("FLASHTUNE_CXX", "/nonexistent/g++", "existing file"),
    ("FLASHTUNE_DB_BUSY_TIMEOUT_S", "-5", "(0, 3600]"),
    ("FLASHTUNE_TRUSTED_SOURCES", "everyone", "'local', 'all'"),
    ("FLASHTUNE_PRECOMPILED_DIR", "/nonexistent-shipped", "existing directory"),
    ("FLASHTUNE_BACKEND", "gpu", "['auto', 'cuda', 'emulator']"),
]


@pytest.mark.parametrize(("name", "value", "legal"), BAD_KNOBS,
                         ids=[f"{n}={v}" for n, v, _ in BAD_KNOBS])
def test_bad_knob_names_knob_value_and_legal_range(monkeypatch: pytest.MonkeyPatch, name: str,
                                                   value: str, legal: str) -> None:
    knob = next(k for k in settings.ALL if k.name == name)
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingError) as info:
        knob.get()
    text = str(info.value)
    assert name in text and repr(value) in text and legal in text, text


def test_file_in_the_way_of_the_cache_dir(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("FLASHTUNE_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with pytest.raises(SettingError, match="is not a directory"):
        settings.CACHE_DIR.get()


def test_compile_workers_zero_is_a_message_not_a_traceback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: FLASHTUNE_COMPILE_WORKERS=0 was a traceback in `compile --all`."""
    monkeypatch.setenv("FLASHTUNE_COMPILE_WORKERS", "0")
    # --fix narrows the space to a few configs: the message is the same, the rendering of
    # every config first (14 s) is not needed to reach it.
    result = CliRunner().invoke(app, ["compile", "--head-dim", "64", "--all",
                                      "--fix", "block_m=64", "--fix", "block_n=64",
                                      "--fix", "num_warps=4"])
    assert result.exit_code == 1, result.output
    assert "FLASHTUNE_COMPILE_WORKERS='0' is invalid" in " ".join(result.output.split())
    assert isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("value", ["-5", "1.0"])
def test_tie_tolerance_must_be_a_fraction(value: str) -> None:
    """Regression: `tune --tie-tolerance -5` ran; 1.0 passed the option and failed only
    after the search, in the winner's selection."""
    result = CliRunner().invoke(app, ["tune", "--head-dim", "64", "--dry-run",
                                      "--tie-tolerance", value])
    assert result.exit_code == 2 and "--tie-tolerance" in result.output
    with pytest.raises(TuningError, match=r"must be in \[0, 1\)"):
        TuneOptions(tie_tolerance=float(value))


def test_compile_output_directory_under_proc() -> None:
    """Regression: `compile --ptx-dir /proc/x` was a traceback."""
    for option in ("--ptx-dir", "--sass-dir"):
        result = CliRunner().invoke(app, ["compile", "--head-dim", "64", option,
                                          "/proc/flashtune-x"])
        assert result.exit_code == 2, result.output
        assert "cannot create the directory" in " ".join(result.output.split())


def test_check_sizes_its_reference_before_allocating() -> None:
    """Regression: `check --seqlen-q 10000000000` tried to allocate terabytes."""
    result = CliRunner().invoke(app, ["check", "--head-dim", "64", "--seqlen-q", "10000000000",
                                      "--no-compile"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "exceed the limit" in text
    result = CliRunner().invoke(app, ["check", "--head-dim", "64", "--seqlen-q", "400000",
                                      "--no-compile"])
    assert result.exit_code == 2 and "GiB of host memory" in " ".join(result.output.split())


# ------------------------------------------------------------------ the API


def _meta(batch: int, seqlen_q: int, seqlen_k: int, heads: int = 1, dim: int = 64
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tensors that cost no memory, for the size checks."""
    q = torch.empty(batch, seqlen_q, heads, dim, dtype=torch.float16, device="meta")
    k = torch.empty(batch, seqlen_k, heads, dim, dtype=torch.float16, device="meta")
    return q, k, k


@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(MAX_SEQLEN + 1, 8), (8, MAX_SEQLEN + 1),
                                                    (2**31 - 1, 2**31 - 1)])
def test_lengths_near_2_31_are_refused_with_the_limit(seqlen_q: int, seqlen_k: int) -> None:
    """The kernel adds two lengths and a tile in 32-bit arithmetic (m_end + seqlen_k -
    seqlen_q, n_end + kBlockN - 1): lengths that validation allowed overflowed it."""
    with pytest.raises(InvalidInput, match=f"exceed the limit {MAX_SEQLEN}"):
        check_attention_inputs(*_meta(1, seqlen_q, seqlen_k))
    check_attention_inputs(*_meta(1, MAX_SEQLEN, MAX_SEQLEN))  # the limit itself is fine


@pytest.mark.parametrize("scale", [1e37, 10**400, MAX_SOFTMAX_SCALE * 1.01, math.inf,
                                   math.nan, -1.0, 0.0])
def test_softmax_scale_out_of_range(scale: object) -> None:
    """Regression: 1e37 gave NaN outputs, 10**400 an OverflowError."""
    with pytest.raises(InvalidInput, match=r"expected a finite float in \(0, 1e\+25\]"):
        check_softmax_scale(scale, 64)
    q, k, v = (torch.zeros(1, 8, 1, 64, dtype=torch.float16) for _ in range(3))
    with pytest.raises(InvalidInput, match="softmax_scale"):
        flashtune.attention(q, k, v, softmax_scale=scale, backend="emulator")  # type: ignore[call-overload]  # ill-typed on purpose


def test_softmax_scale_limit_cannot_overflow_fp16_scores() -> None:
    """The limit is where the largest fp16 score, scaled by log2(e), stays finite."""
    worst = 256 * 65504.0**2
    assert MAX_SOFTMAX_SCALE * math.log2(math.e) * worst < torch.finfo(torch.float32).max
    assert check_softmax_scale(MAX_SOFTMAX_SCALE, 64) == MAX_SOFTMAX_SCALE


def test_sparse_and_nested_tensors_are_explained() -> None:
    dense = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    with pytest.raises(InvalidInput, match=r"layout torch.sparse_coo.*to_dense\(\)"):
        check_attention_inputs(dense.to_sparse(), dense, dense)
    nested = torch.nested.nested_tensor([torch.randn(8, 2, 64, dtype=torch.float16),
                                         torch.randn(5, 2, 64, dtype=torch.float16)],
                                        layout=torch.jagged)
    with pytest.raises(InvalidInput, match="nested tensor"):
        check_attention_inputs(nested, nested, nested)


def test_settings_command_shows_bad_values_without_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHTUNE_EMULATOR_DEADLOCK_S", "nan")
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["settings"])
    assert result.exit_code == 0 and "FLASHTUNE_EMULATOR_DEADLOCK_S" in result.output


def test_hang_detection_cannot_be_disabled_by_a_bad_knob(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: DEADLOCK_S=-1 or nan silently disabled hang detection in launches."""
    from flashtune.runtime.backends.emulator import LaunchOptions
    from flashtune.runtime.backends.emulator.kernel import EmulatedKernel

    monkeypatch.setenv("FLASHTUNE_EMULATOR_DEADLOCK_S", "-1")
    kernel = EmulatedKernel("k", Path(os.devnull), "", lambda *a: 0)
    with pytest.raises(SettingError, match="FLASHTUNE_EMULATOR_DEADLOCK_S"):
        kernel.launch(1, 32, [], options=LaunchOptions())
