"""The benchmark suite's shared pieces and its summary of the committed results."""

import pathlib
import shutil
import time

import pytest

from benchmarks import run_all
from benchmarks.results_io import markdown_table
from benchmarks.timing import Candidate, calls_per_sample, spread, time_in_turns

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def test_spread():
    s = spread([3.0, 1.0, 2.0, 10.0], threads=2)
    assert (s["median"], s["min"], s["max"], s["threads"]) == (2.5, 1.0, 10.0, 2)
    assert s["runs"] == [3.0, 1.0, 2.0, 10.0]
    assert "threads" not in spread([1.0])


def test_time_in_turns_takes_turns_after_the_warm_up():
    calls = []
    timings = time_in_turns({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                            repeats=3, warmup=2)
    assert calls == ["a", "b"] * 5                      # each round runs every candidate once
    assert [len(v) for v in timings.seconds.values()] == [3, 3]   # warm-up rounds not kept
    assert timings.threads >= 1
    assert timings.spread("a")["threads"] == timings.threads


def test_time_in_turns_clock_prepare_and_number():
    made = iter(range(100))
    prepared = []
    timings = time_in_turns({
        "own clock": Candidate(lambda: next(made), clock=lambda value: float(value)),
        "slow prepare": Candidate(lambda: "ran", prepare=lambda: (prepared.append(1),
                                                                  time.sleep(0.02)))},
        repeats=2, warmup=1)
    assert timings.seconds["own clock"] == [1.0, 2.0]  # 0 came from the warm-up round
    assert len(prepared) == 3 and timings.last["slow prepare"] == "ran"
    assert max(timings.seconds["slow prepare"]) < 0.02  # the preparation is not timed
    assert timings.ratio_per_run("own clock", "own clock", 2) == [1.0, 1.0]
    counted = []
    time_in_turns({"x": lambda: counted.append(1)}, repeats=2, warmup=0, number=5)
    assert len(counted) == 10
    assert calls_per_sample(lambda: None) > 1            # a no-op is far below 0.5 ms


@pytest.mark.parametrize("bad", [dict(repeats=0), dict(repeats=1, warmup=-1),
                                 dict(repeats=1, number=0)])
def test_time_in_turns_refuses_bad_counts(bad):
    with pytest.raises(ValueError, match="repeats"):
        time_in_turns({"x": lambda: None}, **bad)


def test_time_in_turns_refuses_an_own_clock_with_several_calls():
    with pytest.raises(ValueError, match="number=1"):
        time_in_turns({"x": Candidate(lambda: 1.0, clock=float)}, repeats=1, number=3)


def test_markdown_table():
    assert markdown_table(["a", "b", "c"], [[1, "x", ""]], "lr") == [
        "| a | b | c |", "|---|---:|---|", "| 1 | x |  |"]


def test_summary_of_the_committed_results(tmp_path):
    """Every benchmark the runner knows has committed results, and the summary reads them all:
    each target row says met or missed, and the figures the README quotes are there."""
    for _, name, _ in run_all.BENCHMARKS:
        shutil.copy(BENCHMARKS / "results" / f"{name}.json", tmp_path)
    shutil.copy(BENCHMARKS / "results" / "run_all.json", tmp_path)
    text = run_all.write_summary(tmp_path, None)
    rows = run_all.headline_rows(tmp_path)
    targets = [r for r in rows if r[2]]
    assert len(targets) >= 8
    assert all(r[3] in ("met", "**missed**") for r in targets)
    for words in ("KV cache vs no cache, 400 new tokens", "long-tailed", "torchao",
                  "distinct of 64 loaded", "64 concurrent clients"):
        assert any(words in r[0] for r in rows), words
    assert "cores" in text and "min**" in text  # the machine, and the total time


def test_summary_covers_only_the_benchmarks_that_ran(tmp_path):
    shutil.copy(BENCHMARKS / "results" / "bench_server.json", tmp_path)
    rows = run_all.headline_rows(tmp_path)
    assert rows and all("server" in r[0] for r in rows)


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("bench_*.py")))
def test_every_benchmark_has_a_quick_mode_and_an_output_folder(script):
    source = (BENCHMARKS / script).read_text()
    assert '"--quick"' in source and '"--out"' in source


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("bench_*.py")))
def test_every_benchmark_times_with_the_shared_helper(script):
    """One way to time things: every benchmark goes through ``benchmarks.timing``, and
    imports the installed package rather than editing ``sys.path``."""
    source = (BENCHMARKS / script).read_text()
    assert "time_in_turns(" in source
    assert "sys.path" not in source


def test_run_all_knows_every_benchmark():
    assert sorted(s for s, _, _ in run_all.BENCHMARKS) == sorted(
        p.name for p in BENCHMARKS.glob("bench_*.py"))
