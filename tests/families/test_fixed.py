"""A restriction of a family's space (``--fix NAME=VALUE``, families/fixed.py): names and
values checked against the family's declared space, the restricted space, which configs lie
in it, a config moved into it, and the command line's ``space`` and ``compile --all`` over
it. The tuner's use is in tests/tuner/test_tuner_cli.py."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.errors import InvalidConfig
from flashtune.families import fixed
from flashtune.families.decode import DECODE
from flashtune.families.fwd import FORWARD
from flashtune.families.hopper import space as hopper_space
from flashtune.families.hopper.ws import HOPPER_WS_FORWARD

WS = Problem(128, DType.BF16, op="fwd90aws")
FWD = Problem(64, DType.FP16)


def test_parse_checks_names_and_values_against_the_declared_space() -> None:
    assert fixed.parse(HOPPER_WS_FORWARD, WS, ["pingpong=1"]) == (("pingpong", 1),)
    # in the space's order, whatever the order given; a repeat of one value is one fix
    assert fixed.parse(FORWARD, FWD, ["order=longest", "swizzle=1", "swizzle=1"]) == (
        ("swizzle", 1), ("order", "longest"))
    with pytest.raises(InvalidConfig, match=r"'ping' is not a knob of the 'fwd90aws' family; "
                                            r"its knobs are \['block_m', 'block_n'"):
        fixed.parse(HOPPER_WS_FORWARD, WS, ["ping=1"])
    with pytest.raises(InvalidConfig, match=re.escape("its values are [0, 1]")):
        fixed.parse(HOPPER_WS_FORWARD, WS, ["pingpong=2"])
    with pytest.raises(InvalidConfig, match="its values are \\['tma', 'cpasync'\\]"):
        fixed.parse(HOPPER_WS_FORWARD, WS, ["loadk=TMA"])
    with pytest.raises(InvalidConfig, match="not NAME=VALUE"):
        fixed.parse(HOPPER_WS_FORWARD, WS, ["pingpong"])
    with pytest.raises(InvalidConfig, match="two values"):
        fixed.parse(HOPPER_WS_FORWARD, WS, ["pingpong=1", "pingpong=0"])


def test_the_restricted_space_holds_exactly_the_configs_with_the_fixed_values() -> None:
    pp = fixed.parse(HOPPER_WS_FORWARD, WS, ["pingpong=1"])
    whole = HOPPER_WS_FORWARD.search_space(WS)
    kept = [c for c in whole if fixed.matches(HOPPER_WS_FORWARD, c, pp)]
    assert kept and len(kept) * 2 == len(whole)  # pingpong takes two values
    assert all(c.extra("pingpong", 0) == 1 for c in kept)
    restricted = fixed.restrict(HOPPER_WS_FORWARD.space(WS), pp)
    assert restricted["pingpong"].values == (1,)
    assert restricted.size * 2 == HOPPER_WS_FORWARD.space(WS).size
    assert [HOPPER_WS_FORWARD.config(p) for p in restricted.points()] == kept
    # a knob fixed at its default: the configs without it
    off = fixed.parse(HOPPER_WS_FORWARD, WS, ["pingpong=0"])
    assert all(fixed.matches(HOPPER_WS_FORWARD, c, off) != (c in kept) for c in whole)
    # the default (ping-pong and overlap on) moved out of the restriction and back
    default = HOPPER_WS_FORWARD.default_config(WS, get_arch("sm_90a"))
    assert default.extra(hopper_space.PINGPONG, 0) == 1
    moved = fixed.apply(HOPPER_WS_FORWARD, default, off)
    assert moved == KernelConfig(default.block_m, default.block_n, default.num_warps,
                                 default.num_stages,
                                 extras=tuple(e for e in default.extras
                                              if e[0] != hopper_space.PINGPONG))
    assert fixed.apply(HOPPER_WS_FORWARD, moved, pp) == default
    assert fixed.text(fixed.parse(DECODE, Problem(64, DType.FP16, op="decode"),
                                  ["splits=4", "block_n=64"])) == "block_n=64+splits=4"


def test_space_and_compile_all_walk_the_restriction() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["space", "--op", "fwd90aws", "--arch", "sm_90a",
                                 "--head-dim", "128", "--fix", "pingpong=1"],
                           env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    whole = HOPPER_WS_FORWARD.space(WS).size
    legal = [c for c in HOPPER_WS_FORWARD.search_space(Problem(128, DType.FP16, op="fwd90aws"))
             if c.extra("pingpong", 0) == 1]
    text = " ".join(result.output.split())
    assert (f"with pingpong=1: {whole // 2} declared points, {len(legal)} legal configs"
            in text), text
    assert "knobs of fwd90aws on sm_90a: block_m [64, 128, 192]" in text
    assert "pingpong [0, 1]" in text
    bad = runner.invoke(app, ["space", "--op", "decode", "--fix", "splits=3"])
    assert bad.exit_code == 2
    assert "[0, 1, 2, 4, 8, 16, 32, 64, 128]" in re.sub(r"[\s│]+", " ", bad.output)
