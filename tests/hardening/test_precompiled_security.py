"""The shipped precompiled directories' ancestors (FLASHTUNE_PRECOMPILED_DIR): a parent that
lets another user replace the directory is refused as the kernel cache's is (regression:
with a parent writable by every user and no sticky bit, another user replaced the directory
and its manifest and their cubin was served)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hardening_helpers import is_root

from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.errors import CacheError
from flashtune.families import render
from flashtune.runtime import precompile as shipped
from flashtune.runtime.precompile import KERNELS_DIR, load_shipped, write_manifest

SOURCE = render(Problem(head_dim=64, dtype=DType.FP16),
                KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2))
CUBIN = b"the attacker's cubin"


def _ship(directory: Path) -> None:
    """A shipped directory as `flashtune precompile` writes it (without NVRTC: the
    artifact wraps stand-in bytes; the checks under test never look inside a cubin)."""
    (directory / KERNELS_DIR).mkdir(parents=True)
    for d in (directory, directory / KERNELS_DIR):
        d.chmod(0o755)
    rel = shipped._relative(SOURCE, "sm_90")
    data = shipped._pack(SOURCE, "sm_90", CUBIN)
    shipped._write_readonly(directory / rel, data)
    import hashlib

    write_manifest(directory, {rel: hashlib.sha256(data).hexdigest()})


@pytest.mark.parametrize("sticky", [False, True])
def test_parent_writable_by_everyone_needs_the_sticky_bit(tmp_path: Path, sticky: bool) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o1777 if sticky else 0o777)
    ship = parent / "ship"
    _ship(ship)
    if sticky:  # like /tmp: nobody else can rename the directory away
        assert load_shipped(SOURCE, "sm_90", [ship]) == CUBIN
        return
    with pytest.raises(CacheError) as info:
        load_shipped(SOURCE, "sm_90", [ship])
    text = str(info.value)
    assert str(ship) in text and f"parent directory {parent}" in text
    assert "writable by every user without the sticky bit" in text
    assert "FLASHTUNE_PRECOMPILED_DIR" in text and "chmod" in text  # the fix


@pytest.mark.skipif(not is_root(), reason="needs root to give directories away")
def test_parent_owned_by_a_third_user_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "theirs"
    ship = parent / "ship"
    _ship(ship)
    os.chown(parent, 65534, 65534)  # neither root, nor you, nor the directory's owner
    with pytest.raises(CacheError, match=rf"parent directory {parent} belongs to another "
                                         r"user \(owned by .*uid 65534"):
        load_shipped(SOURCE, "sm_90", [ship])


@pytest.mark.skipif(not is_root(), reason="needs root to give directories away")
def test_parents_owned_by_the_directory_owner_are_served(tmp_path: Path) -> None:
    """The documented use: an application installed by another user, under its own home."""
    parent = tmp_path / "app"
    ship = parent / "ship"
    _ship(ship)
    for path in (parent, ship, *ship.rglob("*")):
        os.chown(path, 65534, 65534)
    assert load_shipped(SOURCE, "sm_90", [ship]) == CUBIN
