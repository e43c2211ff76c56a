"""Golden keys and rendered sources of every problem flashtune serves today.

For each family, every dtype, a spread of head dims, causal or not and every combination of
the family's feature switches, on sm_80, sm_90 and (for arch-specific families) sm_90a:
the problem key, its bucket key, the key of the default config and the sha256 of the
rendered entry source (version and digest banner lines normalised, since the digest covers
header bytes that may change without changing the entry source). A refusal is recorded by
its exception type. Keys of existing problems name files, database rows and bundles, so they
must never change without a migration; regenerate only for an intended change, reviewed:

    FLASHTUNE_UPDATE_GOLDEN=1 python -m pytest -m slow tests/codegen/test_golden_keys.py -n 0

Rendering every source takes about 12 s of a core, so the default run checks every key and
default config and the sources of a seeded eighth of the rows (``FLASHTUNE_TEST_SEED``
replays it); ``-m slow`` checks every source.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import FEATURES, DType, Problem, ProblemBucket
from flashtune.errors import FlashtuneError

GOLDEN = Path(__file__).parent / "golden_keys.json.gz"  # 9,000+ rows: 1.9 MB as plain JSON
UPDATE = os.environ.get("FLASHTUNE_UPDATE_GOLDEN", "") == "1"
HEAD_DIMS = (32, 64, 72, 96, 128, 256)

_VERSION_LINE = re.compile(r"^// flashtune \S+ generated kernel$", re.MULTILINE)
_DIGEST_LINE = re.compile(r"^// digest: [0-9a-f]{64}$", re.MULTILINE)


def _source_digest(code: str) -> str:
    code = _VERSION_LINE.sub("// flashtune <version> generated kernel", code, count=1)
    code = _DIGEST_LINE.sub("// digest: <digest>", code, count=1)
    return hashlib.sha256(code.encode()).hexdigest()


def _problems(op: str, features: frozenset[str]) -> Iterator[Problem]:
    switches = [name for name in FEATURES if name in features]
    for dtype, head_dim, causal in itertools.product(DType, HEAD_DIMS, (False, True)):
        for n in range(len(switches) + 1):
            for chosen in itertools.combinations(switches, n):
                if causal and "window" in chosen:
                    continue
                yield Problem(head_dim, dtype, causal=causal, op=op,
                              **cast(dict[str, Any], {name: True for name in chosen}))


def _entry(problem: Problem, arch_name: str, rendered: bool) -> dict[str, str]:
    family = families.of(problem)
    arch = get_arch(arch_name)
    out = {"problem": problem.key(), "bucket": ProblemBucket(problem, 1024).key(),
           "arch": arch_name}
    try:
        family.check_problem(problem)
        config = family.default_config(problem, arch)
        code = family.render(problem, config).code if rendered else None
    except FlashtuneError as exc:
        out["refused"] = type(exc).__name__
        return out
    out["config"] = config.key()
    if code is not None:
        out["source"] = _source_digest(code)
    return out


def _snapshot(rendered: Callable[[], bool]) -> list[dict[str, str]]:
    """Every row; a row's source digest where ``rendered()`` says so (asked once per row)."""
    rows: list[dict[str, str]] = []
    for family in families.all_families():
        arches = ("sm_90a",) if family.target_arch else ("sm_80", "sm_90")
        for problem in _problems(family.op, family.features):
            assert Problem.from_key(problem.key()) == problem
            rows.extend(_entry(problem, arch, rendered()) for arch in arches)
    return rows


def _check(rows: list[dict[str, str]]) -> None:
    """``rows`` against the golden file; a row without "source" is compared without it."""
    expected = json.loads(gzip.decompress(GOLDEN.read_bytes()))
    got = {(r["problem"], r["arch"]): r for r in rows}
    want = {(r["problem"], r["arch"]): r for r in expected}
    missing = sorted(set(want) - set(got))
    assert not missing, f"{len(missing)} problems no longer enumerated, e.g. {missing[:5]}"
    extra = sorted(set(got) - set(want))
    assert not extra, f"{len(extra)} problems not in the golden file, e.g. {extra[:5]}"
    for key, row in got.items():
        if "source" not in row and "config" in row:  # not rendered: compared without it
            want[key] = {k: v for k, v in want[key].items() if k != "source"}
    changed = [(k, want[k], got[k]) for k in sorted(want) if want[k] != got[k]]
    assert not changed, (f"{len(changed)} of {len(want)} problems changed key, default config "
                         f"or rendered source; first: {changed[:3]}")


def test_keys_configs_and_a_seeded_part_of_the_sources_are_unchanged() -> None:
    rng = random.Random(f"{os.environ['FLASHTUNE_TEST_SEED']}-golden")
    rows = _snapshot(lambda: rng.random() < 1 / 8)
    assert 0 < sum("source" in r for r in rows) < len(rows)
    _check(rows)


@pytest.mark.slow
def test_keys_and_sources_of_every_existing_problem_are_unchanged() -> None:
    rows = _snapshot(lambda: True)
    if UPDATE:
        text = json.dumps(rows, indent=0, sort_keys=True) + "\n"
        GOLDEN.write_bytes(gzip.compress(text.encode(), mtime=0))  # mtime 0: same bytes
        return
    _check(rows)
