"""The benchmark suite's shared pieces and its summary of the committed results."""

import importlib.util
import pathlib
import shutil
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _module(name):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_spread():
    results_io = _module("results_io")
    s = results_io.spread([3.0, 1.0, 2.0, 10.0])
    assert (s["median"], s["min"], s["max"]) == (2.5, 1.0, 10.0)
    assert s["runs"] == [3.0, 1.0, 2.0, 10.0]


def test_summary_of_the_committed_results(tmp_path):
    """Every benchmark the runner knows has committed results, and the summary reads them all:
    each target row says met or missed, and the figures the README quotes are there."""
    run_all = _module("run_all")
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
    run_all = _module("run_all")
    shutil.copy(BENCHMARKS / "results" / "bench_server.json", tmp_path)
    rows = run_all.headline_rows(tmp_path)
    assert rows and all("server" in r[0] for r in rows)


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("bench_*.py")))
def test_every_benchmark_has_a_quick_mode_and_an_output_folder(script):
    source = (BENCHMARKS / script).read_text()
    assert '"--quick"' in source and '"--out"' in source
