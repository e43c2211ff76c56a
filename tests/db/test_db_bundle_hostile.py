"""Hostile and broken bundles: each is rejected with a BundleError and changes nothing."""

from __future__ import annotations

import copy
import json
import random
import re
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from dbfactories import A100, CONFIGS, DEVICES, H100, PROBLEMS, random_trials, trial

from flashtune.db import (
    TrialStatus,
    TuningStore,
    dumps,
    export_bundle,
    import_bundle,
    parse_bundle,
    read_bundle,
)
from flashtune.db import bundle as bundle_module
from flashtune.db.bundle import to_dict
from flashtune.errors import BundleError

FIXED = datetime(2026, 6, 1, tzinfo=timezone.utc)
Mutation = Callable[[dict[str, Any]], None]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[TuningStore, TuningStore]]:
    """A source with a known mix of trials, and a target that already holds data.

    Shared by the tests of this module: each one checks that the target is unchanged.
    """
    rng = random.Random(7)
    tmp_path = tmp_path_factory.mktemp("hostile")
    source = TuningStore(tmp_path / "source.db")
    target = TuningStore(tmp_path / "target.db")
    for store in (source, target):
        for device in DEVICES:
            store.record_device(device)
    source.record_trials([
        trial(H100, PROBLEMS[0], 4096, CONFIGS[0], median_ms=1.5, rng=rng),
        trial(H100, PROBLEMS[0], 4096, CONFIGS[1], status=TrialStatus.WRONG_RESULT, rng=rng),
        trial(A100, PROBLEMS[1], 1024, CONFIGS[2], status=TrialStatus.COMPILE_FAILED, rng=rng),
        trial(A100, PROBLEMS[1], 1024, CONFIGS[3], median_ms=0.25, rng=rng),
    ])
    target.record_trials(random_trials(rng, 10))
    yield source, target
    source.close()
    target.close()


def _valid(source: TuningStore) -> dict[str, Any]:
    return to_dict(export_bundle(source))


def _set(path: str, value: Any) -> Mutation:
    """A mutation that sets the field at a dotted path (list indices as numbers)."""
    def mutate(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[int(last) if last.isdigit() else last] = value
    return mutate


def _ok(name: str, value: Any) -> Mutation:
    """A mutation of a field of the first ok trial."""
    return lambda data: _trial_of_status(data, "ok").update({name: value})


def _trial_of_status(data: dict[str, Any], status: str) -> dict[str, Any]:
    return next(t for t in data["trials"] if t["status"] == status)


def _best_is_wrong_result(data: dict[str, Any]) -> None:
    data["best"].append(_trial_of_status(data, "wrong_result")["uid"])


def _best_twice_in_bucket(data: dict[str, Any]) -> None:
    extra = copy.deepcopy(_trial_of_status(data, "ok"))
    extra["uid"] = "f" * 32
    data["trials"].append(extra)
    data["best"].append(extra["uid"])


def _rename_config(data: dict[str, Any]) -> None:
    """Give a config a legal key that does not match its fields, consistently everywhere."""
    old = data["configs"][0]["key"]
    new = "m16_n16_w1_s1"
    data["configs"][0]["key"] = new
    for t in data["trials"]:
        if t["config"] == old:
            t["config"] = new


def _delete(path: str) -> Mutation:
    def mutate(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        del node[int(last) if last.isdigit() else last]
    return mutate


SQL = "x'); DROP TABLE ft_trials; --"
CUDA = 'asm volatile("trap;"); __global__ void evil() {}'

MUTATIONS: dict[str, tuple[Mutation, str]] = {
    # strings, bools and floats where ints belong
    "sm_count as string": (_set("devices.0.sm_count", "132"), "must be an integer"),
    "seqlen as string": (_set("trials.0.seqlen", "4096"), "must be an integer"),
    "count as float": (_ok("count", 10.0), "must be an integer"),
    "cc_major as bool": (_set("devices.0.cc_major", True), "must be an integer"),
    "median as string": (_ok("median_ms", "1.5"), "must be a number"),
    "schema_version as string": (_set("schema_version", "1"), "must be an integer"),
    "block_m as string": (_set("configs.0.fields.block_m", "64"), "must be an int"),
    # out of range and absurd values
    "negative memory": (_set("devices.0.memory_bytes", -1), "out of range"),
    "absurd sm_count": (_set("devices.0.sm_count", 10**9), "out of range"),
    "cc_minor 10": (_set("devices.0.cc_minor", 10), "out of range"),
    "absurd median": (_ok("median_ms", 1e300), "out of range"),
    "negative median": (_ok("median_ms", -1.0), "out of range"),
    "min above median": (_ok("min_ms", 1e6), "min_ms <= median_ms"),
    "absurd tflops": (_ok("tflops", 1e12), "out of range"),
    "absurd count": (_ok("count", 10**12), "out of range"),
    "seqlen not a bucket": (_set("trials.0.seqlen", 3000), "power of two"),
    "huge seqlen": (_set("trials.0.seqlen", 1 << 40), "out of range"),
    "illegal head_dim": (_set("problems.0.fields.head_dim", 100), "head_dim"),
    "illegal warps": (_set("configs.0.fields.num_warps", 3), "num_warps"),
    "timings on a failure": (lambda d: _trial_of_status(d, "compile_failed").update(
        median_ms=1.0), "has no timings"),
    "ancient timestamp": (_set("trials.0.created_at", "1970-01-01T00:00:00+00:00"),
                          "plausible"),
    "naive timestamp": (_set("trials.0.created_at", "2026-01-01T00:00:00"), "time zone"),
    "garbage timestamp": (_set("created_at", "yesterday"), "created_at"),
    "bad status": (_set("trials.0.status", "great"), "status"),
    "status in capitals": (_set("trials.0.status", "OK"), "status"),
    "bad digest": (_set("trials.0.template_digest", "XYZ"), "template_digest"),
    # unknown or missing fields
    "unknown top field": (_set("extra", 1), "unknown fields ['extra']"),
    "unknown device field": (_set("devices.0.pci_id", "0000:01"), "unknown fields"),
    "unknown trial field": (_set("trials.0.sql", "SELECT 1"), "unknown fields"),
    "unknown problem field": (_set("problems.0.fields.sliding", 5), "unknown problem field"),
    "feature switch not a bool": (_set("problems.0.fields.window", 5), "window must be a bool"),
    "illegal config field": (_set("configs.0.fields.swizzle", -2), "outside"),
    "missing trial field": (_delete("trials.0.host"), "lacks fields ['host']"),
    "devices not a list": (_set("devices", {"a": 1}), "must be a JSON list"),
    "nested field value": (_set("problems.0.fields.dtype", ["bf16"]), "JSON scalar"),
    # versions and formats
    "newer schema": (_set("schema_version", 2), "newer than this flashtune"),
    "other format": (_set("format", "optuna-journal"), "not a flashtune tuning bundle"),
    # SQL and CUDA text in names and keys
    "sql in device name": (_set("devices.0.name", SQL), "characters outside"),
    "sql in trial device": (_set("trials.0.device", SQL), "characters outside"),
    "sql in host": (_set("trials.0.host", "a;rm -rf /"), "characters outside"),
    "sql in study": (_set("trials.0.study", SQL), "characters outside"),
    "cuda in config key": (_set("configs.0.key", CUDA), "characters outside"),
    "cuda in problem field": (_set("problems.0.fields.dtype", "bf16;asm"), "characters"),
    "cuda in device name": (_set("devices.0.name", "#include <evil.h>"), "characters outside"),
    "escape codes in error": (lambda d: _trial_of_status(d, "compile_failed").update(
        error="\x1b[2J\x1b[31mpwned"), "control character"),
    "overlong device name": (_set("devices.0.name", "A" * 129), "1 to 128 characters"),
    "overlong error": (lambda d: _trial_of_status(d, "compile_failed").update(
        error="e" * 20000), "at most 16384"),
    # consistency and references
    "non-canonical config key": (_rename_config, "canonical key is"),
    "unknown trial device": (_set("trials.0.device", "NVIDIA B200"), "not listed"),
    "unknown config ref": (_set("trials.0.config", "m16_n16_w1_s1"), "not listed"),
    "best of wrong_result": (_best_is_wrong_result, "only 'ok' trials"),
    "best unknown uid": (lambda d: d["best"].append("0" * 32), "not among the trials"),
    "two best in a bucket": (_best_twice_in_bucket, "two best trials"),
    "duplicate uid": (lambda d: d["trials"].append(copy.deepcopy(d["trials"][0])),
                      "appears twice"),
    "digest list mismatch": (lambda d: d["template_digests"].pop(), "template_digests"),
    "unused problem": (lambda d: d["problems"].append(
        {"key": "fwd_d32_fp16_full", "fields": {"op": "fwd", "head_dim": 32, "dtype": "fp16",
                                                "causal": False}}), "used by no trial"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_hostile_field_is_rejected_and_nothing_changes(
        name: str, stores: tuple[TuningStore, TuningStore]) -> None:
    source, target = stores
    mutate, expected = MUTATIONS[name]
    data = _valid(source)
    mutate(data)  # content_sha256 no longer matches: the field check must speak first
    before = dumps(export_bundle(target, created_at=FIXED))
    with pytest.raises(BundleError) as info:
        import_bundle(target, parse_bundle(json.dumps(data).encode()))
    assert expected in str(info.value), str(info.value)
    assert dumps(export_bundle(target, created_at=FIXED)) == before


RAW: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "truncated": (lambda raw: raw[: len(raw) // 2], "not valid JSON"),
    "empty": (lambda raw: b"", "not valid JSON"),
    "not utf-8": (lambda raw: b"\xff\xfe" + raw, "not valid JSON"),
    "NaN": (lambda raw: raw.replace(b'"median_ms": 1.5', b'"median_ms": NaN'), "NaN"),
    "duplicate key": (lambda raw: raw.replace(b'"schema_version": 1',
                                              b'"schema_version": 1, "schema_version": 1'),
                      "duplicate key"),
    "deep nesting": (lambda raw: b"[" * 200_000 + b"]" * 200_000, "not a flashtune bundle"),
    "huge integer": (lambda raw: raw.replace(b'"schema_version": 1',
                                             b'"schema_version": 1' + b"0" * 5000),
                     "not valid JSON"),
    "top-level list": (lambda raw: b"[" + raw + b"]", "must be a JSON object"),
    "edited after export": (lambda raw: raw.replace(b'"median_ms": 1.5', b'"median_ms": 1.4'),
                            "content_sha256 does not match"),
}


@pytest.mark.parametrize("name", sorted(RAW))
def test_broken_file_is_rejected(name: str, stores: tuple[TuningStore, TuningStore],
                                 tmp_path: Path) -> None:
    source, target = stores
    transform, expected = RAW[name]
    raw = dumps(export_bundle(source)).encode()
    assert b'"median_ms": 1.5' in raw and b'"schema_version": 1' in raw
    path = tmp_path / "bundle.json"
    path.write_bytes(transform(raw))
    before = dumps(export_bundle(target, created_at=FIXED))
    with pytest.raises(BundleError, match=expected):
        import_bundle(target, read_bundle(path))
    assert dumps(export_bundle(target, created_at=FIXED)) == before


@pytest.mark.parametrize("checksum", ["deleted", "null", "stale"])
def test_bundle_without_a_matching_checksum_is_refused(
        stores: tuple[TuningStore, TuningStore], tmp_path: Path, checksum: str) -> None:
    """The content hash is required: an edited bundle cannot pass by dropping it."""
    data = _valid(stores[0])
    next(t for t in data["trials"] if t["median_ms"] == 1.5)["host"] = "edited-by-hand"
    if checksum == "deleted":
        del data["content_sha256"]
    elif checksum == "null":
        data["content_sha256"] = None
    expected = {"deleted": "lacks fields ['content_sha256']", "null": "content_sha256",
                "stale": "content_sha256 does not match"}[checksum]
    with TuningStore(tmp_path / "fresh.db") as target:
        with pytest.raises(BundleError, match=re.escape(expected)):
            parse_bundle(json.dumps(data).encode())
        assert target.trials() == []


def test_oversized_file_is_rejected_before_reading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "huge.json"
    with path.open("wb") as handle:  # sparse: costs no disk
        handle.truncate(bundle_module.MAX_BUNDLE_BYTES + 1)

    def no_parsing(*args: object, **kwargs: object) -> None:
        raise AssertionError("an oversized bundle must not be parsed")

    monkeypatch.setattr(bundle_module, "parse_bundle", no_parsing)
    monkeypatch.setattr(json, "loads", no_parsing)
    with pytest.raises(BundleError, match="more than the limit"):
        read_bundle(path)


def test_size_cap_also_bounds_in_memory_input(stores: tuple[TuningStore, TuningStore]) -> None:
    raw = dumps(export_bundle(stores[0])).encode()
    with pytest.raises(BundleError, match="larger than the limit"):
        parse_bundle(raw, max_bytes=len(raw) - 1)
    assert parse_bundle(raw, max_bytes=len(raw)).trials
