"""Replayed landscapes: the simulated clock, failures as data, free re-proposals, the
guided sampler on a small synthetic space, the benchmark's --quick mode and the CLI."""

from __future__ import annotations

import csv
import gzip
import itertools
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.codegen.params import Param, ParamSpace, Point
from flashtune.db.records import TrialStatus
from flashtune.errors import TuningError
from flashtune.tuner.landscape import (
    PACKAGED_DIR,
    Landscape,
    packaged_landscapes,
    parse_budget,
    resolve_landscape,
)
from flashtune.tuner.measure.recorded import RecordedMeasurer
from flashtune.tuner.replay import replay, warm_start_prior
from flashtune.tuner.search.sampler import GuidedSampler
from flashtune.tuner.search.space import SearchSpace

runner = CliRunner()
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

X = (1, 2, 4, 8, 16, 32)
Y = (1, 2, 3, 4, 5, 6, 7, 8)
Z = (0, 1)


def _time(x: int, y: int, z: int, shift: float) -> float:
    """A smooth bowl with an interaction (best x depends on z); minimum 1.0."""
    return 1.0 + (math.log2(x) - 3 - z - shift) ** 2 + 0.3 * (y - 5) ** 2 + 0.5 * z


def write_landscape(path: Path, *, shift: float = 0.0, seed: int = 0) -> Path:
    """A T4 file: x*y > 128 is not recorded (a restriction), y == 1 fails to compile, and
    (x, y, z) == (32, 2, 1) fails at runtime."""
    rng = np.random.default_rng(seed)
    results = []
    for x, y, z in itertools.product(X, Y, Z):
        if x * y > 128:
            continue
        compile_ms = float(rng.uniform(500, 1500))
        result: dict[str, Any] = {"configuration": {"x": x, "y": y, "z": z, "fixed": 7},
                  "times": {"compilation": compile_ms, "framework": 10.0,
                            "search_algorithm": 0, "validation": 0},
                  "objectives": ["time"]}
        if y == 1:
            result |= {"invalidity": "compile", "correctness": 0,
                       "measurements": [{"name": "time", "value": "CompileFailedConfig"}]}
        elif (x, y, z) == (32, 2, 1):
            result |= {"invalidity": "runtime", "correctness": 0,
                       "measurements": [{"name": "time", "value": "RuntimeFailedConfig"}]}
        else:
            t = _time(x, y, z, shift)
            result["times"]["runtimes"] = [t, t]
            result |= {"invalidity": "correct", "correctness": 1,
                       "measurements": [{"name": "time", "value": t, "unit": "ms"}]}
        results.append(result)
    with gzip.open(path, "wt") as f:
        json.dump({"schema_version": "1.0.0", "metadata": {"timeunit": "miliseconds"},
                   "results": results}, f)
    return path


@pytest.fixture(scope="module")
def landscapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("landscapes")
    write_landscape(root / "bowl_GPUA.json.gz")
    write_landscape(root / "bowl_GPUB.json.gz", shift=0.5, seed=1)
    return root


def test_a_landscape_is_a_space_with_recorded_legality(landscapes: Path) -> None:
    land = Landscape.load(landscapes / "bowl_GPUA.json.gz")
    assert (land.kernel, land.device, land.objective, land.minimize) == \
        ("bowl", "GPUA", "time", True)
    assert land.space.names == ("x", "y", "z", "fixed")
    assert land.space.choices == ("x", "y", "z")  # a constant is no choice
    assert len(land.space.legal) == len(land.records)
    reason = land.space.legality({"x": 32, "y": 8, "z": 0, "fixed": 7})
    assert reason is not None and "not in the recorded space" in reason
    assert land.optimum == pytest.approx(1.0)
    assert land.quality(2.0) == pytest.approx(0.5) and land.quality(None) == 0.0
    assert land.sibling("GPUB").name == "bowl_GPUB.json.gz"
    with pytest.raises(TuningError, match="no landscape of bowl on H100"):
        land.sibling("H100")


def test_the_clock_charges_recorded_times_failures_are_data_and_repeats_are_free(
        landscapes: Path) -> None:
    land = Landscape.load(landscapes / "bowl_GPUA.json.gz")
    m = RecordedMeasurer(land.records, land.path.name)
    ok, failed = (8, 4, 0, 7), (4, 1, 0, 7)
    first = m.finish(ok, m.start(ok))
    rec = land.records[ok]
    assert first.status is TrialStatus.OK and first.objective == pytest.approx(_time(8, 4, 0, 0))
    assert first.charged_s == pytest.approx(rec.seconds) and m.now() == pytest.approx(rec.seconds)
    with gzip.open(landscapes / "bowl_GPUA.json.gz") as f:
        results = json.load(f)["results"]
    raw = next(r for r in results if tuple(r["configuration"].values()) == ok)
    times = raw["times"]  # compile + framework + both runs, in seconds
    assert rec.seconds == pytest.approx(
        (times["compilation"] + times["framework"] + sum(times["runtimes"])) / 1e3)
    bad = m.finish(failed, m.start(failed))
    assert bad.status is TrialStatus.COMPILE_FAILED and bad.objective is None
    assert bad.attrs()["error"] == "recorded compile_failed"
    assert m.now() == pytest.approx(rec.seconds + land.records[failed].seconds)
    again = m.finish(ok, m.start(ok))  # a re-proposal costs nothing
    assert again.charged_s == 0.0 and again.objective == first.objective
    assert m.now() == pytest.approx(rec.seconds + land.records[failed].seconds)
    assert land.brute_force_s == pytest.approx(sum(r.seconds for r in land.records.values()))
    assert parse_budget("10%", land) == pytest.approx(land.brute_force_s / 10)
    for bad_budget in ("0%", "101%", "x%"):
        with pytest.raises(TuningError):
            parse_budget(bad_budget, land)


@pytest.mark.parametrize("sampler", ["guided", "random", "tpe"])
def test_a_replayed_run_spends_its_budget_and_never_measures_twice(
        landscapes: Path, sampler: str) -> None:
    land = Landscape.load(landscapes / "bowl_GPUA.json.gz")
    budget = 0.3 * land.brute_force_s
    summary = replay(land, sampler=sampler, seed=3, budget_s=budget)
    configs = [p.config for p in summary.trace]
    assert len(configs) == len(set(configs))  # re-proposals were answered by the study
    assert all(c in land.records for c in configs)  # never an unrecorded (illegal) point
    # the loop stops once the clock passes the budget (the evaluation in progress finishes)
    assert summary.trace[-2].clock_s < budget <= summary.clock_s + 1e-9 \
        or len(configs) == len(land.records)
    statuses = {p.config: p.status for p in summary.trace}
    assert all(statuses[c] is land.records[c].status for c in configs)
    best = min(p.objective for p in summary.trace if p.objective is not None)
    assert summary.best == best and summary.quality_at(budget) == pytest.approx(1.0 / best)
    assert summary.quality_at(0.0) == 0.0


def test_trials_limit_and_stop_at_the_optimum(landscapes: Path) -> None:
    land = Landscape.load(landscapes / "bowl_GPUA.json.gz")
    assert len(replay(land, sampler="random", seed=0, trials=7).trace) == 7
    summary = replay(land, sampler="guided", seed=0, budget_s=land.brute_force_s,
                     stop_at=land.optimum)
    assert summary.best == pytest.approx(land.optimum)
    assert len(summary.trace) < len(land.records)
    with pytest.raises(TuningError, match="needs a budget"):
        replay(land)


def _space() -> tuple[SearchSpace, dict[tuple[int, ...], float | None]]:
    """A 6 x 8 x 2 space: some points illegal, some failing, a smooth objective."""
    params = ParamSpace((Param("x", X), Param("y", Y), Param("z", Z)))

    def legality(point: Point) -> str | None:
        return "x*y too large" if int(point["x"]) * int(point["y"]) > 128 else None

    space = SearchSpace(params, legality)
    values: dict[tuple[int, ...], float | None] = {}
    for idx in space.legal:
        x, y, z = (int(v) for v in space.point_at(idx).values())
        values[idx] = None if y == 1 else _time(x, y, z, 0.0)
    return space, values


def _drive(sampler: GuidedSampler, space: SearchSpace,
           values: dict[tuple[int, ...], float | None], n: int) -> list[tuple[int, ...]]:
    study = optuna.create_study(direction="minimize", sampler=sampler)
    asked = []
    for _ in range(n):
        trial = study.ask(space.distributions())
        idx = space.raw_indices(trial.params)
        asked.append(idx)
        value = values[idx]
        if value is None:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)  # a failure: data
        else:
            study.tell(trial, value)
    return asked


def test_the_guided_sampler_proposes_only_new_legal_points_and_finds_the_optimum() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space, values = _space()
    best = min(v for v in values.values() if v is not None)
    found = []
    for seed in range(3):
        asked = _drive(GuidedSampler(space, seed=seed), space, values, 30)
        assert len(set(asked)) == len(asked)  # no duplicates, failures are never retried
        assert all(space.legality(space.point_at(i)) is None for i in asked)
        found.append(min(v for i in asked if (v := values[i]) is not None))
    # 30 of 76 legal points (68 that run): a random sample finds the optimum about 40 % of
    # the time, the guided search every time on this smooth space
    assert found == [best] * 3


def test_a_prior_seeds_the_initial_design() -> None:
    space, values = _space()
    prior = {i: (v if v is not None else 99.0) for i, v in values.items()}
    top = sorted(prior, key=lambda i: prior[i])[:3]
    asked = _drive(GuidedSampler(space, seed=0, prior=prior), space, values, 3)
    assert asked == top  # half the initial design is the prior's best, best first


def test_warm_start_prior_maps_another_devices_results(landscapes: Path) -> None:
    target = Landscape.load(landscapes / "bowl_GPUA.json.gz")
    source = Landscape.load(landscapes / "bowl_GPUB.json.gz")
    prior, note = warm_start_prior(target, source)
    assert "warm start from GPUB" in note
    ok = {c for c, r in source.records.items() if r.objective is not None}
    assert len(prior) == len(ok)
    for idx, score in prior.items():
        config = tuple(target.space.point_at(idx).values())
        assert score == pytest.approx(math.log(source.records[config].objective or 0))


def test_cli_replay_runs_the_search_with_its_display(landscapes: Path) -> None:
    path = landscapes / "bowl_GPUA.json.gz"
    result = runner.invoke(app, ["tune", "--replay", str(path), "--budget", "20%",
                                 "--seed", "1"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "no warm start" in text and "simulated minutes" in text and "of it" in text
    assert "bowl_GPUA.json.gz" in text  # the live table's title
    assert re.search(r"best time [0-9.e+-]+ ms, optimum [0-9.e+-]+ ms", text), text
    warm = runner.invoke(app, ["tune", "--replay", str(path), "--trials", "5",
                               "--warm-start-from", "GPUB"])
    assert warm.exit_code == 0, warm.output
    assert "warm start from GPUB" in " ".join(warm.output.split())
    assert "5 evaluations" in " ".join(warm.output.split())
    for args, expected in ((["--budget", "3"], None), ([], "needs a budget"),
                           (["--budget", "5%", "--warm-start-from", "H100"], "no landscape"),
                           (["--budget", "5%", "--sampler", "annealing"], "expected one of")):
        bad = runner.invoke(app, ["tune", "--replay", str(path), *args])
        if expected is None:
            assert bad.exit_code == 0, bad.output
        else:
            assert bad.exit_code == 1 and expected in " ".join(bad.output.split()), bad.output


def test_cli_replay_interrupted_says_how_far_it_got_and_that_nothing_is_saved(
        landscapes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flashtune.commands.tune_progress import ReplayProgress

    evaluated = ReplayProgress.evaluated

    def ctrl_c_at_the_fourth(self: ReplayProgress, summary: Any, point: Any) -> None:
        evaluated(self, summary, point)
        if len(summary.trace) == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(ReplayProgress, "evaluated", ctrl_c_at_the_fourth)
    result = runner.invoke(app, ["tune", "--replay", str(landscapes / "bowl_GPUA.json.gz"),
                                 "--trials", "10", "--seed", "1"])
    assert result.exit_code == 130, result.output
    text = " ".join(result.output.split())
    assert re.search(r"interrupted after 4 evaluations \(best so far [01]\.\d{3} of the "
                     r"optimum\): a replay writes nothing", text), text
    assert "Traceback" not in text and "simulated minutes" not in text, text


def _search_efficiency() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import search_efficiency
    finally:
        sys.path.remove(str(BENCHMARKS))
    return search_efficiency


def test_benchmark_quick_mode(landscapes: Path, tmp_path: Path) -> None:
    search_efficiency = _search_efficiency()
    assert search_efficiency.main([str(landscapes), "--quick", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "search_efficiency.csv").open()))
    assert {r["strategy"] for r in rows} == {"flashtune", "random"}
    for row in rows:
        mean, p10, se = float(row["mean"]), float(row["p10"]), float(row["mean_se"])
        assert 0.0 <= p10 <= mean <= 1.0  # a 1 % budget of 88 configs may hold none
        assert 0.0 <= se <= 0.5 and int(row["runs"]) == 3


def test_benchmark_journal_resumes_a_stopped_run(landscapes: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """With --journal each finished run is a line of the journal; a rerun takes them
    instead of running again (a cut last line, as a kill leaves, is run again and replaced)
    and writes the same table (but for the CPU times), wherever the landscapes' folder is."""
    search_efficiency = _search_efficiency()
    log = tmp_path / "runs.jsonl"
    argv = [str(landscapes), "--quick", "--out", str(tmp_path / "a"), "--journal", str(log)]
    assert search_efficiency.main(argv) == 0
    lines = log.read_text().splitlines()
    assert len(lines) == 2 * 3  # flashtune and random, three seeds, one landscape
    log.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    ran: list[object] = []
    real = search_efficiency.run

    def counted(task: object) -> object:
        ran.append(task)
        return real(task)
    monkeypatch.setattr(search_efficiency, "run", counted)
    argv[3] = str(tmp_path / "b")
    assert search_efficiency.main(argv) == 0
    assert len(ran) == 1, ran
    assert [json.loads(line)["task"]["seed"] for line in log.read_text().splitlines()] \
        == [json.loads(line)["task"]["seed"] for line in lines]  # the cut line replaced
    tables = [[{k: v for k, v in row.items() if k != "cpu_ms_per_eval"}  # CPU time varies
               for row in csv.DictReader((tmp_path / d / "search_efficiency.csv").open())]
              for d in "ab"]
    assert tables[0] == tables[1]
    moved = tmp_path / "elsewhere"  # the same files in another folder: the runs are taken
    shutil.copytree(landscapes, moved)
    ran.clear()
    assert search_efficiency.main([str(moved), *argv[1:]]) == 0
    assert ran == []


def test_benchmark_runs_the_seeds_it_is_given(landscapes: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """--seeds runs exactly the listed seeds (a gap in a journal can be left out of a table)
    and refuses a malformed list, naming it."""
    search_efficiency = _search_efficiency()
    assert search_efficiency.seed_list("5, 0-2,2") == (0, 1, 2, 5)
    assert search_efficiency.format_seeds((0, 1, 2, 5, 7, 8)) == "0-2, 5, 7-8"
    log = tmp_path / "runs.jsonl"
    argv = [str(landscapes), "--seeds", "1,3-4", "--strategies", "random", "--no-transfer",
            "--jobs", "1", "--overhead", "0", "--only", "bowl_GPUA", "--out", str(tmp_path),
            "--journal", str(log)]
    assert search_efficiency.main(argv) == 0
    assert "seeds 1, 3-4 for every strategy" in capsys.readouterr().out
    assert sorted(json.loads(line)["task"]["seed"] for line in log.read_text().splitlines()) \
        == [1, 3, 4]
    rows = list(csv.DictReader((tmp_path / "search_efficiency.csv").open()))
    assert {int(r["runs"]) for r in rows} == {3}
    for bad in ("3-1", "x", "1,,2"):
        with pytest.raises(SystemExit) as stop:
            search_efficiency.main([*argv[:1], "--seeds", bad])
        assert stop.value.code == 2
        assert "--seeds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        search_efficiency.main([*argv[:1], "--seeds", "1", "--repeats", "3"])


def test_benchmark_verdict_gives_the_noise_of_a_miss(landscapes: Path) -> None:
    search_efficiency = _search_efficiency()
    path = str(landscapes / "bowl_GPUA.json.gz")
    rng = np.random.default_rng(int(os.environ["FLASHTUNE_TEST_SEED"]))
    theirs = rng.uniform(0.6, 0.98, (25, 2))
    # a miss at 1 %, a win at 2 % (per run, so in the mean and the 10th percentile too)
    ours = theirs[rng.permutation(25)] + [-0.01, 0.02]
    results = [search_efficiency.RunResult(search_efficiency.Task(path, strategy, seed), (),
                                           tuple(q[seed]), 1, 0.0)
               for strategy, q in (("flashtune", ours), ("tpe", theirs)) for seed in range(25)]
    rows = {r.strategy: r for r in search_efficiency.summarise(results, (0.01, 0.02))}
    for strategy, q in (("flashtune", ours), ("tpe", theirs)):
        np.testing.assert_allclose(rows[strategy].means, q.mean(0))
        np.testing.assert_allclose(rows[strategy].sems, q.std(0, ddof=1) / 5.0)
    line, cells = search_efficiency.verdicts(list(rows.values()), (0.01, 0.02))
    se = np.hypot(ours[:, 0].std(ddof=1), theirs[:, 0].std(ddof=1)) / 5.0
    se_p10 = math.hypot(rows["flashtune"].p10_se(0), rows["tpe"].p10_se(0))
    assert 0.0 < se_p10 < 0.2
    # 0.01 behind with a standard error of about 0.05: within the seeds' noise
    assert line == ("bowl_GPUA: flashtune vs tpe: not above it at 1% within s.e. (mean -0.010 "
                    f"+- {se:.3f} s.e., p10 -0.010 +- {se_p10:.3f} s.e.)"), line
    assert cells == "cells (landscape x rival x budget): 1 ahead, 1 within s.e., 0 behind"
    one_run = [search_efficiency.Row("land", name, (mean,), (mean,), (math.nan,), mean, 1, 1.0)
               for name, mean in (("flashtune", 0.5), ("tpe", 0.6))]
    assert search_efficiency.verdicts(one_run, (0.01,))[0] == (
        "land: flashtune vs tpe: not above it at 1% behind (mean -0.100 (one run: no s.e.), "
        "p10 -0.100 (one run: no s.e.))")
    # equal everywhere (both at the optimum) is at or above it
    equal = [search_efficiency.Row("land", name, (1.0,), (1.0,), (0.0,), 1.0, 5, 1.0, (0.0,))
             for name in ("flashtune", "gp")]
    assert search_efficiency.verdicts(equal, (0.01,))[0] == (
        "land: flashtune vs gp: at or above it at every budget (mean and p10)")
    table = search_efficiency.markdown_table(equal, (0.01,))
    assert table[2] == "| land | flashtune | 1.000 / 1.000 |"
    assert table[3] == "|  | gp | 1.000 / 1.000 (ahead) |"


def test_charged_proposals_advance_the_simulated_clock(landscapes: Path) -> None:
    land = Landscape.load(landscapes / "bowl_GPUA.json.gz")
    free = replay(land, sampler="random", seed=5, trials=12)
    charged = replay(land, sampler="random", seed=5, trials=12, charge_proposals=True)
    assert [p.config for p in free.trace] == [p.config for p in charged.trace]
    assert len(charged.proposal_s) >= 12 and all(t >= 0 for t in charged.proposal_s)
    assert not free.charged_proposals and charged.charged_proposals
    # each evaluation's clock: the recorded seconds so far plus the proposals made so far
    recorded = np.cumsum([land.records[p.config].seconds for p in charged.trace])
    proposals = np.cumsum(charged.proposal_s)[: len(charged.trace)]
    np.testing.assert_allclose([p.clock_s for p in charged.trace], recorded + proposals)
    np.testing.assert_allclose([p.clock_s for p in free.trace], recorded)


def _benchmark_module(name: str) -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize("strategy", ["random-penalty", "random-constraints", "cmaes",
                                      pytest.param("gp", marks=pytest.mark.sweep)])
def test_peers_are_told_illegal_and_failed_points_in_their_own_terms(strategy: str) -> None:
    """Both modes with a random sampler inside (the mode does not depend on the sampler;
    a GP decision takes a second, so the GP itself runs in the sweep), and CMA-ES (its
    ``cmaes`` package is the benchmark's optional extra ``search-bench``)."""
    if strategy == "cmaes":
        pytest.importorskip("cmaes", reason="CMA-ES needs the optional extra search-bench")
    peers = _benchmark_module("_peer_samplers")
    params = ParamSpace((Param("x", tuple(range(8))), Param("y", tuple(range(8)))))
    # half the points are illegal; x == 0 fails when measured
    space = SearchSpace(params, lambda p: "odd" if (int(p["x"]) + int(p["y"])) % 2 else None)
    # the GP from its 4th result (its default waits for 10; each decision takes a second)
    inner: optuna.samplers.BaseSampler = optuna.samplers.RandomSampler(seed=3)
    if strategy == "gp":
        inner = optuna.samplers.GPSampler(seed=3, n_startup_trials=4)
    elif strategy == "cmaes":
        inner = optuna.samplers.CmaEsSampler(seed=3)
    constrained = strategy in ("gp", "random-constraints")
    sampler = peers.LegalOnly(inner, space, "constraints" if constrained else "penalty")
    study = optuna.create_study(sampler=sampler)
    values = {}
    for _ in range(10 if strategy == "gp" else 24):
        trial = study.ask(space.distributions())
        point = space.decode(trial.params)
        assert not isinstance(point, str), point  # the loop only ever sees legal points
        if point["x"] == 0:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            continue
        values[trial.number] = 1.0 + (int(point["x"]) - 5) ** 2 + (int(point["y"]) - 2) ** 2
        study.tell(trial, values[trial.number])
    study.ask(space.distributions())  # folds the last result in
    assert sampler.illegal_asks > 0
    shadow = sampler._shadow.get_trials(deepcopy=False)
    measured = [t for t in shadow if t.user_attrs.get("measured")]
    assert sorted(t.value for t in measured) == sorted(values.values())
    bad = [t for t in shadow if not t.user_attrs.get("measured")
           and t.state is not optuna.trial.TrialState.RUNNING]
    assert len(bad) >= sampler.illegal_asks
    for t in bad:
        failed_here = t.params["x"] == 0 or (t.params["x"] + t.params["y"]) % 2
        assert failed_here
        if t.state is optuna.trial.TrialState.COMPLETE:  # the worst objective seen before
            assert min(values.values()) <= t.value <= max(values.values())
            if constrained:
                assert t.system_attrs["constraints:legal"] == 1.0
            else:
                assert "constraints:legal" not in t.system_attrs
        else:  # before any success there is no worst: failed, which neither reads
            assert t.state is optuna.trial.TrialState.FAIL
    assert any(t.state is optuna.trial.TrialState.COMPLETE for t in bad)
    if constrained:
        assert all(t.system_attrs["constraints:legal"] == 0.0 for t in measured)


def test_the_synthetic_landscape_is_the_forwards_space_as_the_model_predicts_it() -> None:
    synthetic = _benchmark_module("_synthetic_landscape")
    from flashtune.codegen.arch import get_arch
    from flashtune.codegen.dtypes import DType
    from flashtune.codegen.spec import Problem, ProblemBucket
    from flashtune.perf.model.gpus import get_gpu
    from flashtune.tuner.measure.workload import make_workload
    from flashtune.tuner.search.encoding import KernelDomain
    from flashtune.tuner.search.prediction import Predictor

    token = synthetic.name(gpu="H100", head_dim=64, dtype="fp16", causal=True, seqlen=1024)
    land = synthetic.build(token)
    assert land.path.name.startswith("synthetic_") and "cost model" in land.device
    assert not land.minimize  # TFLOP/s
    problem = Problem(64, DType("fp16"), causal=True)
    domain = KernelDomain(problem, get_arch("sm_90"))
    assert land.space.names == domain.space.names
    assert len(land.records) == len(domain.space.legal) > 10
    workload = make_workload(ProblemBucket(problem, 1024))
    predictor = Predictor(get_gpu("H100"))
    ratios = []
    for indices in land.space.legal:
        point = land.space.point_at(indices)
        record = land.records[tuple(point.values())]
        prediction = predictor.predict(workload, domain.config(point))
        assert record.seconds > synthetic.SETUP_S
        if prediction is None:
            assert record.status is TrialStatus.RUNTIME_FAILED
            continue
        ratios.append(math.log(record.objective / prediction.tflops))
    # log-normal noise around the prediction, of the declared spread
    assert abs(float(np.mean(ratios))) < 0.05
    assert abs(float(np.std(ratios)) - synthetic.NOISE) < 0.04
    assert synthetic.build(token).records == land.records  # deterministic


def test_packaged_landscapes_replay_by_name_from_a_clone(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's replay commands run from the repository alone: the landscapes they name
    ship as package data and are found by name (or file name); paths work as before."""
    assert packaged_landscapes() == ["convolution_A100", "convolution_A6000"]
    assert (PACKAGED_DIR / "LICENSE").is_file()
    for name in ("convolution_A6000", "convolution_A6000.json.gz"):
        assert resolve_landscape(name) == PACKAGED_DIR / "convolution_A6000.json.gz"
    land = Landscape.load("convolution_A6000")
    assert (land.kernel, land.device, len(land.records)) == ("convolution", "A6000", 4362)
    assert land.sibling("A100") == PACKAGED_DIR / "convolution_A100.json.gz"
    monkeypatch.chdir(tmp_path)  # no ../shared here: the name alone must do
    result = runner.invoke(app, ["tune", "--replay", "convolution_A6000", "--trials", "5",
                                 "--warm-start-from", "A100", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert "best config:" in result.output
    with pytest.raises(TuningError, match=r"convolution_A100', 'convolution_A6000"):
        resolve_landscape("convolution_H100")
    assert resolve_landscape(tmp_path / "x.json.gz") == tmp_path / "x.json.gz"  # a path


def test_benchmark_overhead_times_every_proposal_of_a_long_run(landscapes: Path) -> None:
    search_efficiency = _search_efficiency()
    path = str(landscapes / "bowl_GPUA.json.gz")
    o = search_efficiency.overhead(path, "random", trials=30)
    land = Landscape.load(path)
    assert o.landscape == "bowl_GPUA" and o.configs == len(land.space.legal)
    assert o.proposals >= 30  # one per measured config, plus any refused re-proposals
    assert 0.0 <= o.mean_s <= o.p95_s <= o.max_s < 1.0
