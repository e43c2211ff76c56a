"""`flashtune show` and `flashtune compile` end to end through typer's CliRunner."""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from flashtune import families
from flashtune.cli import app
from flashtune.codegen.arch import get_arch
from flashtune.codegen.render import translation_unit
from flashtune.codegen.spec import DType, KernelConfig, KernelSource, Problem
from flashtune.commands import codegen as codegen_cmd
from flashtune.families import render
from flashtune.families.fwd import FORWARD, space
from flashtune.families.fwd.defaults import default_config
from flashtune.toolchain.compiler import compile_source

WIDE = {"COLUMNS": "240"}


def run(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), env=WIDE)


def _rows(output: str) -> dict[tuple[str, str], list[str]]:
    """Table rows of `flashtune compile` by (config, arch)."""
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == 6 and re.fullmatch(r"m\d+_n\d+_w\d+_s\d(_[a-z0-9-]+)*", cells[0]):
            rows[(cells[0], cells[1])] = cells[2:]
    return rows


def test_show_prints_the_rendered_source() -> None:
    result = run("show", "--head-dim", "64", "--dtype", "bf16", "--causal",
                 "--config", "m64_n32_w4_s2")
    assert result.exit_code == 0, result.output
    expected = render(Problem(64, DType.BF16, causal=True), KernelConfig(64, 32, 4, 2))
    assert result.stdout == translation_unit(expected)  # the headers inlined


def test_show_fields_override_the_base_config() -> None:
    result = run("show", "--config", "m64_n32_w4_s2", "--block-n", "128", "--stages", "1")
    assert result.exit_code == 0, result.output
    assert result.stdout == translation_unit(render(Problem(128, DType.FP16),
                                                    KernelConfig(64, 128, 4, 1)))


def test_without_head_dim_each_family_takes_its_default_and_the_help_says_so() -> None:
    """128, except where a family serves another (MLA: 64, its RoPE width)."""
    help_text = " ".join(run("show", "--help").stdout.split())
    for family in families.all_families():
        if family.default_head_dim != 128:
            assert f"{family.default_head_dim} for --op {family.op}" in help_text, help_text
        result = run("show", "--op", family.op)
        assert result.exit_code == 0, (family.op, result.output)
        problem = re.search(r"// problem: (\S+)", result.stdout)
        assert problem and f"_d{family.default_head_dim}_" in problem.group(1), result.stdout


def test_show_uses_the_default_config_of_the_arch() -> None:
    result = run("show", "--head-dim", "128", "--arch", "sm_86")
    assert result.exit_code == 0, result.output
    problem = Problem(128, DType.FP16)
    expected = default_config(problem, get_arch("sm_86"))
    assert space.static_check(problem, expected, get_arch("sm_86")) is None
    assert f"config: {expected.key()}" in result.stdout


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--dtype", "fp32"], ["--dtype", "fp16", "bf16"]),
        (["--head-dim", "100"], ["--head-dim", "multiple of 8"]),
        (["--arch", "sm_75"], ["--arch", "sm_80", "sm_90"]),
        (["--config", "m128-n64"], ["--config", "m128_n64_w4_s2"]),
        (["--block-m", "48"], ["block_m=48", "multiple of 64"]),
        (["--warps", "3"], ["num_warps=3", "(1, 2, 4, 8, 12, 16)"]),
        (["--fix", "nosuch=1"], ["--fix", "'nosuch' is not a knob of the 'fwd' family",
                                 "'swizzle', 'qregs'"]),
        (["--fix", "minblocks=5"], ["--fix", "its values are [0, 2, 3, 4]"]),
        (["--fix", "swizzle"], ["--fix", "is not NAME=VALUE"]),
    ],
)
@pytest.mark.parametrize("command", ["show", "compile"])
def test_bad_options_say_what_is_expected(command: str, args: list[str],
                                          needles: list[str]) -> None:
    result = run(command, *args)
    assert result.exit_code == 2
    text = re.sub(r"[\s│]+", " ", result.output)  # undo the error box's line wrapping
    for needle in needles:
        assert needle in text, result.output


def test_compile_one_config_for_two_archs() -> None:
    result = run("compile", "--arch", "sm_80", "--arch", "sm_90", "--head-dim", "64",
                 "--dtype", "bf16", "--causal", "--config", "m64_n64_w4_s2")
    assert result.exit_code == 0, result.output
    rows = _rows(result.stdout)
    source = render(Problem(64, DType.BF16, causal=True), KernelConfig(64, 64, 4, 2))
    assert set(rows) == {("m64_n64_w4_s2", "sm_80"), ("m64_n64_w4_s2", "sm_90")}
    for arch in ("sm_80", "sm_90"):
        res = compile_source(source, arch).resources
        assert rows[("m64_n64_w4_s2", arch)] == [
            str(res.registers), f"{res.spill_stores}/{res.spill_loads}",
            f"{res.static_smem}+{res.dynamic_smem}", "ok"]


def test_compile_all_lists_every_config_and_exclusions() -> None:
    # The deterministic backward at head dim 256 (13 kernels over both archs, most of its
    # space excluded by shared memory): the forward's space (10^5 configs) is too large to
    # compile here.
    result = run("compile", "--all", "--arch", "sm_80", "--arch", "sm_86", "--head-dim", "256",
                 "--op", "bwddet")
    assert result.exit_code == 0, result.output
    rows = _rows(result.stdout)
    problem = Problem(256, DType.FP16, op="bwddet")
    family = families.get("bwddet")
    configs = family.search_space(problem)
    passing = {a: family.candidates(problem, get_arch(a)) for a in ("sm_80", "sm_86")}
    assert set(rows) == {(c.key(), a) for a, cs in passing.items() for c in cs}
    assert all(status[-1] == "ok" for status in rows.values())
    assert len(passing["sm_80"]) < len(configs)  # some are excluded, counted not listed
    text = " ".join(result.stdout.split())
    for arch, cs in passing.items():
        assert (f"space of {problem.key()} on {arch}: {family.space(problem).size} declared "
                f"points, {len(configs)} legal configs, {len(cs)} pass") in text


def test_space_prints_the_forward_space_with_its_knobs() -> None:
    result = run("space", "--arch", "sm_90", "--head-dim", "128", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    problem = Problem(128, DType.BF16)
    passing = len(FORWARD.candidates(problem, get_arch("sm_90")))
    assert passing >= 1000
    assert (f"space of fwd_d128_bf16_full on sm_90: {FORWARD.space(problem).size} declared "
            f"points, {len(FORWARD.search_space(problem))} legal configs, {passing} pass"
            ) in " ".join(result.stdout.split())


def test_compile_writes_ptx_and_sass(tmp_path: Path) -> None:
    result = run("compile", "--arch", "sm_80", "--arch", "sm_90", "--config", "m64_n32_w4_s1",
                 "--head-dim", "64", "--ptx-dir", str(tmp_path / "ptx"),
                 "--sass-dir", str(tmp_path / "sass"))
    assert result.exit_code == 0, result.output
    entry = render(Problem(64, DType.FP16), KernelConfig(64, 32, 4, 1)).entry
    for arch in ("sm_80", "sm_90"):
        ptx = (tmp_path / "ptx" / f"{entry}.{arch}.ptx").read_text()
        assert re.search(rf"^\.target\s+{arch}\b", ptx, re.MULTILINE)
        assert "mma.sync.aligned.m16n8k16" in ptx
        sass = (tmp_path / "sass" / f"{entry}.{arch}.sass").read_text()
        assert re.search(rf"\.target\s+{arch}\b", sass) and "HMMA.16816" in sass


def test_compile_failure_exits_non_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(problem: Problem, config: KernelConfig) -> KernelSource:
        src = render(problem, config)
        code = src.code + "\n#error flashtune cli failure test\n"
        return replace(src, code=code, digest=hashlib.sha256(code.encode()).hexdigest())

    monkeypatch.setattr(codegen_cmd, "render", broken)
    result = run("compile", "--arch", "sm_80", "--config", "m64_n32_w4_s1")
    assert result.exit_code == 1
    assert "FAILED" in result.stdout
    assert "flashtune cli failure test" in result.stderr
    assert "failing source saved at" in result.stderr
    assert "1 of 1 kernels failed to compile" in result.stderr


def test_compile_all_rejects_a_config() -> None:
    result = run("compile", "--all", "--config", "m64_n32_w4_s1")
    assert result.exit_code == 2
    assert "--all" in result.output
