"""Property-based fuzzing (hypothesis), bounded so the default run stays fast.

- API inputs (shapes, GQA, strides, storage offsets, dtypes, masks, scales) through
  ``flashtune.attention`` on the CPU emulator against the float64 reference, outputs
  poisoned with NaN first;
- mutated bundles against a database: each is refused with a BundleError and changes
  nothing, or is a legal bundle and imports;
- knob values: each parses to a legal value or raises a SettingError naming the knob and the
  value;
- the count of a bundle's structure before parsing agrees with a string-aware reference.

Every test is seeded with the run's seed (FLASHTUNE_TEST_SEED, printed in the report
header), so a failure replays with that variable set; hypothesis prints the failing example.
Example counts are small on purpose: the tier costs well under a minute of CPU with a warm
kernel cache (the two emulator kernels are the ones tests/runtime/test_runtime_emulator.py
builds).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from dbfactories import A100, H100, random_trials
from hardening_helpers import RUN_SEED
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

import flashtune
from flashtune import families
from flashtune import settings as ft_settings
from flashtune.api import forward
from flashtune.codegen.spec import DType, Problem, Shape
from flashtune.db import TuningStore, dumps, export_bundle, import_bundle, parse_bundle
from flashtune.db.bundle import content_digest, structure_counts, to_dict
from flashtune.errors import BundleError, SettingError
from flashtune.families.base import Inputs
from flashtune.runtime import plans
from flashtune.runtime.dispatch import Dispatcher, set_dispatcher

FIXED = datetime(2026, 6, 1, tzinfo=timezone.utc)
COMMON = settings(database=None, deadline=None, derandomize=False, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------ API on the emulator

#: (dtype, causal, head_dim): the emulator kernels tests/runtime already builds.
EMULATED = [(torch.float16, True, 40), (torch.bfloat16, False, 64)]
LAYOUTS = ("contiguous", "bhnd", "offset", "padded_rows")


@dataclass(frozen=True)
class Call:
    dtype: torch.dtype
    causal: bool
    head_dim: int
    batch: int
    heads_kv: int
    group: int
    seqlen_q: int
    seqlen_k: int
    scale: float | None
    layout: str

    @property
    def shape(self) -> Shape:
        return Shape(self.batch, self.heads_kv * self.group, self.heads_kv, self.seqlen_q,
                     self.seqlen_k)


@st.composite
def calls(draw: st.DrawFn) -> Call:
    dtype, causal, head_dim = draw(st.sampled_from(EMULATED))
    exponent = draw(st.none() | st.floats(-2.0, 0.9))
    return Call(dtype, causal, head_dim, draw(st.integers(1, 2)), draw(st.integers(1, 2)),
                draw(st.integers(1, 2)), draw(st.integers(1, 40)), draw(st.integers(1, 40)),
                None if exponent is None else 10.0 ** exponent, draw(st.sampled_from(LAYOUTS)))


def _tensor(gen: torch.Generator, batch: int, seqlen: int, heads: int, dim: int,
            dtype: torch.dtype, layout: str, extra: int) -> torch.Tensor:
    """Random (batch, seqlen, heads, dim) data in one of several memory layouts, all legal
    for the kernel (last dim contiguous, other strides multiples of 8 elements)."""
    data = torch.randn(batch, seqlen, heads, dim, generator=gen).to(dtype)
    if layout == "bhnd":  # torch's (B, H, N, D) memory seen through a transpose
        return data.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "offset":  # a view at a 16-byte aligned storage offset
        flat = torch.zeros(data.numel() + 8 * extra, dtype=dtype)
        view = flat[8 * extra:].view(batch, seqlen, heads, dim)
        view.copy_(data)
        return view
    if layout == "padded_rows":  # rows longer than head_dim
        wide = torch.zeros(batch, seqlen, heads, dim + 8 * extra, dtype=dtype)
        wide[..., :dim] = data
        return wide[..., :dim]
    return data


@contextlib.contextmanager
def _emulator_defaults() -> Iterator[None]:
    """Default configs (no database) and NaN-poisoned outputs, restored afterwards."""
    real = forward.empty_outputs

    def poisoned(q: torch.Tensor, head_dim_v: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = real(q, head_dim_v)
        return out.fill_(math.nan), lse.fill_(math.nan)

    set_dispatcher(Dispatcher(lambda: _NoResults()))
    plans.clear_caches()
    forward.empty_outputs = poisoned
    try:
        yield
    finally:
        forward.empty_outputs = real
        set_dispatcher(None)
        plans.clear_caches()


class _NoResults:
    def all_best(self) -> list[Any]:
        return []


@pytest.mark.emulator
@seed(RUN_SEED)
@settings(COMMON, max_examples=10)
@given(call=calls(), extra=st.integers(1, 3), data_seed=st.integers(0, 2**31 - 1))
def test_api_inputs_match_the_float64_reference(call: Call, extra: int, data_seed: int) -> None:
    gen = torch.Generator().manual_seed(data_seed)
    shape = call.shape
    q = _tensor(gen, call.batch, call.seqlen_q, shape.heads_q, call.head_dim, call.dtype,
                call.layout, extra)
    k, v = (_tensor(gen, call.batch, call.seqlen_k, call.heads_kv, call.head_dim, call.dtype,
                    call.layout, extra) for _ in range(2))
    with _emulator_defaults():
        out, lse = flashtune.attention(q, k, v, causal=call.causal, softmax_scale=call.scale,
                                       return_lse=True, backend="emulator")
    scale = call.scale if call.scale is not None else call.head_dim ** -0.5
    problem = Problem(call.head_dim, DType.FP16 if call.dtype == torch.float16 else DType.BF16,
                      call.causal)
    family = families.of(problem)  # its float64 reference and tolerances
    expected = family.reference(problem, Inputs({"q": q, "k": k, "v": v},
                                                {"softmax_scale": scale}))
    verdict = family.compare(problem, shape, {"o": out, "lse": lse}, expected)
    assert verdict.ok, f"{call} (data seed {data_seed}): {verdict.message}"


# ------------------------------------------------------------------ bundle mutations


def _valid_bundle() -> dict[str, Any]:
    with TuningStore("sqlite://") as store:
        for device in (H100, A100):
            store.record_device(device)
        store.record_trials(random_trials(random.Random(11), 8, (H100, A100)))
        return to_dict(export_bundle(store))


VALID = _valid_bundle()


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _paths(value, (*prefix, index))
    return found


PATHS = _paths(VALID)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=3),
    max_leaves=6)


def _mutate(data: dict[str, Any], path: tuple[Any, ...], action: str, value: Any) -> None:
    parent: Any = data
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if action == "delete":
        del parent[last]
    elif action == "duplicate" and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[last]))
    else:
        parent[last] = value


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TuningStore]:
    path = Path(tmp_path_factory.mktemp("fuzz")) / "target.db"
    with TuningStore(path) as store:
        for device in (H100, A100):
            store.record_device(device)
        store.record_trials(random_trials(random.Random(12), 10, (H100, A100)))
        yield store


@seed(RUN_SEED)
@settings(COMMON, max_examples=60)
@given(mutations=st.lists(st.tuples(st.sampled_from(PATHS),
                                    st.sampled_from(("set", "delete", "duplicate")),
                                    JSON_VALUES), min_size=1, max_size=3),
       rehash=st.booleans())
def test_mutated_bundles_are_refused_cleanly_or_import(
        target: TuningStore, mutations: list[tuple[tuple[Any, ...], str, Any]],
        rehash: bool) -> None:
    data = copy.deepcopy(VALID)
    for path, action, value in mutations:
        with contextlib.suppress(KeyError, IndexError, TypeError):  # path gone already
            _mutate(data, path, action, value)
    if rehash:  # get past the checksum, into the field, semantic and physics checks
        with contextlib.suppress(Exception):
            data["content_sha256"] = content_digest(data)
    raw = json.dumps(data).encode()
    before = dumps(export_bundle(target, created_at=FIXED))
    try:
        bundle = parse_bundle(raw)
    except BundleError as exc:
        event(f"refused: {str(exc).split(':')[1].strip()[:30] if ':' in str(exc) else exc}")
        assert dumps(export_bundle(target, created_at=FIXED)) == before
        return
    try:
        import_bundle(target, bundle)
        event("imported")
    except BundleError:  # e.g. conflicts with what the database holds
        event("refused by the database")
        assert dumps(export_bundle(target, created_at=FIXED)) == before


# ------------------------------------------------------------------ knob values

# annotated: mypy infers a bare ("Cs",) as tuple[str], not a Collection of category names
SURROGATES: tuple[Literal["Cs"]] = ("Cs",)
ENV_TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=SURROGATES),
                   max_size=30)
NUMBERS = st.one_of(st.integers(-(10**20), 10**20).map(str),
                    st.floats(allow_nan=True, allow_infinity=True).map(repr))


def _legal(name: str, value: Any) -> bool:
    if name == "FLASHTUNE_COMPILE_WORKERS":
        return isinstance(value, int) and 1 <= value <= ft_settings.MAX_COMPILE_WORKERS
    if name in ("FLASHTUNE_EMULATOR_DEADLOCK_S", "FLASHTUNE_DB_BUSY_TIMEOUT_S"):
        return isinstance(value, float) and math.isfinite(value) and value > 0
    if name in ("FLASHTUNE_CACHE_DIR", "FLASHTUNE_CUDA_HOME"):
        return value is None or (isinstance(value, Path) and value.is_absolute())
    if name == "FLASHTUNE_PRECOMPILED_DIR":
        return all(p.is_absolute() and p.is_dir() for p in value)
    return value is not None


@seed(RUN_SEED)
@settings(COMMON, max_examples=200)
@given(knob=st.sampled_from(ft_settings.ALL), raw=st.one_of(ENV_TEXT, NUMBERS))
def test_setting_values_parse_or_say_what_is_legal(knob: ft_settings.Setting[Any],
                                                   raw: str) -> None:
    saved = os.environ.get(knob.name)
    os.environ[knob.name] = raw
    try:
        value = knob.get()
    except SettingError as exc:
        assert knob.name in str(exc) and repr(raw) in str(exc), str(exc)
    else:
        assert _legal(knob.name, value), (knob.name, raw, value)
    finally:
        if saved is None:
            del os.environ[knob.name]
        else:
            os.environ[knob.name] = saved


# ------------------------------------------------------------------ the pre-parse count

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _reference_counts(raw: bytes) -> tuple[int, int]:
    """Objects/lists and values outside strings, by blanking every string first."""
    skeleton = _STRING.sub(b'""', raw)
    containers = skeleton.count(b"{") + skeleton.count(b"[")
    return containers, containers + skeleton.count(b",")


@seed(RUN_SEED)
@settings(COMMON, max_examples=150)
@given(value=JSON_VALUES, chunk=st.integers(1, 64))
def test_structure_count_ignores_strings(value: Any, chunk: int) -> None:
    raw = json.dumps(value, ensure_ascii=False).encode()
    assert structure_counts(raw, chunk) == _reference_counts(raw)
