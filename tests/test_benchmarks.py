"""The benchmark suite's shared pieces and its summary of the committed results."""

import os
import pathlib
import shutil
import time

import pytest

from benchmarks import run_all
from benchmarks.results_io import markdown_table
from benchmarks.timing import (Candidate, busy_share, calls_per_sample, spread, time_in_turns,
                               timed_once, wait_until_idle)

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def test_spread():
    s = spread([3.0, 1.0, 2.0, 10.0], threads=2)
    assert (s["median"], s["min"], s["max"], s["threads"]) == (2.5, 1.0, 10.0, 2)
    assert s["runs"] == [3.0, 1.0, 2.0, 10.0]
    assert "threads" not in spread([1.0])


def test_busy_share_sees_a_busy_core_and_the_idle_wait_gives_up_in_time():
    """A thread that spins shows up in the busy share; wait_until_idle stops at its bound
    while the spinning goes on, and returns at once when the bar is above any load."""
    import threading

    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        share = busy_share(0.2)
        waited = wait_until_idle(below=0.0, window=0.05, at_most=0.3)
    finally:
        stop.set()
        spinner.join()
    cores = os.cpu_count() or 1
    assert share is not None and share > 0.8 / cores     # one spinning core of `cores`
    assert 0.3 <= waited < 1.0
    assert wait_until_idle(below=1.01, window=0.05) < 0.5


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


def test_timed_once_returns_what_the_call_returned_and_its_time():
    value, seconds = timed_once(lambda: (time.sleep(0.02), "done")[1])
    assert value == "done" and 0.02 <= seconds < 1.0


def test_time_in_turns_alternates_the_order_when_asked():
    calls = []
    time_in_turns({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                  repeats=2, warmup=1, alternate=True)
    assert calls == ["a", "b", "b", "a", "a", "b"]


def test_side_by_side_takes_turns_and_keeps_the_timed_ones(monkeypatch):
    """serving.side_by_side (the vLLM and the transformers serve comparisons): every level on
    both servers in each turn, the order reversed from turn to turn, an idle wait before each
    run when asked, the untimed round left out; different_texts names the prompts that
    differ."""
    from benchmarks import serving

    order = []

    class Stub:
        def __init__(self, name):
            self.name = name

        def run(self, clients, new_tokens):
            order.append((self.name, clients))
            return {"seconds": 0.01 * len(order), "texts": {"Jack": [self.name]}}

    monkeypatch.setattr(serving, "wait_until_idle", lambda: 0.25)
    runs = serving.side_by_side({"ours": Stub("ours"), "vllm": Stub("vllm")}, [1, 16], 8,
                                turns=2, idle_first=True)
    firsts = [("ours", 1), ("vllm", 1), ("ours", 16), ("vllm", 16)]
    assert order == firsts + firsts[::-1] + firsts         # untimed round, then two turns
    assert [r["seconds"] for r in runs[16]["vllm"]] == pytest.approx([0.05, 0.12])
    assert all(r["idle_wait"] == 0.25 for n in runs for side in runs[n].values() for r in side)
    assert serving.different_texts(runs[1]["ours"], runs[1]["vllm"], "vllm")[0] == {
        "prompt": "Jack", "ours": ["ours"], "vllm": ["vllm"]}
    assert serving.different_texts(runs[1]["ours"], runs[1]["ours"], "vllm") == []


@pytest.mark.parametrize("bad", [dict(repeats=0), dict(repeats=1, warmup=-1),
                                 dict(repeats=1, number=0)])
def test_time_in_turns_refuses_bad_counts(bad):
    with pytest.raises(ValueError, match="repeats"):
        time_in_turns({"x": lambda: None}, **bad)


def test_time_in_turns_refuses_an_own_clock_with_several_calls():
    with pytest.raises(ValueError, match="number=1"):
        time_in_turns({"x": Candidate(lambda: 1.0, clock=float)}, repeats=1, number=3)


def test_the_figures_of_a_run_of_streams():
    """serving.figures: tokens/s over the run's wall time, TTFT percentiles over the requests,
    and inter-token percentiles over every gap of every stream (TGI's streams only)."""
    from benchmarks.serving import figures, jobs, levels_argument

    streams = [{"tokens": 4, "ttft": 0.1, "gaps": [0.01, 0.03, 0.02]},
               {"tokens": 4, "ttft": 0.3, "gaps": [0.02, 0.02, 0.05]}]
    run = figures(streams, seconds=0.5)
    assert run["tokens"] == 8 and run["tokens_per_second"] == pytest.approx(16)
    assert run["ttft_p50"] == pytest.approx(0.2) and run["itl_p50"] == pytest.approx(0.02)
    assert "itl_p50" not in figures([{"tokens": 2, "ttft": 0.1}], seconds=1.0)
    assert [prompt for prompt, _ in jobs(6, 8)][5] == jobs(1, 8)[0][0]    # the prompts in turn
    assert levels_argument("16, 1,4") == [1, 4, 16]


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


def test_bench_speculative_quick_run(tmp_path):
    """Lesson 09's benchmark in its quick mode: it runs, writes its files, and every way of
    decoding gives the same text (the speed targets are for `make bench`, not asserted here)."""
    import json

    from benchmarks import bench_speculative

    bench_speculative.main(["--quick", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench_speculative.json").read_text())
    assert result["targets_met"]["same text everywhere"]
    assert [row["k"] for row in result["story"]["by_k"]] == list(bench_speculative.DRAFT_KS)
    assert (tmp_path / "bench_speculative.md").exists() and (tmp_path / "speculative.png").exists()


def test_bench_server_quick_run(tmp_path):
    """Lesson 07's benchmark in its quick mode, as `make bench` runs it (its own process, the
    server and transformers serve in theirs): it runs, writes its files, every request is
    answered in full, and greedy decoding gives the same texts through the server, through
    the bare decode loop and through transformers serve. (Speed targets are not asserted.)"""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_server", "--quick", "--out",
                           str(tmp_path)], cwd=BENCHMARKS.parent, timeout=600,
                          capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "bench_server.json").read_text())
    checks = result["targets_met"]
    assert checks["same texts"] and checks["sweep requests all answered in full"]
    compared = result["transformers_serve"]
    assert "error" not in compared, compared.get("error")
    assert [row["clients"] for row in compared["levels"]] == [1, 16]
    assert all(row["tokens"] == row["clients"] * result["new_tokens"]
               for row in compared["levels"])
    assert checks["same texts as transformers serve"], compared["levels"][0]["first_difference"]
    assert result["single_client"]["server_over_bare_loop"] > 0
    if done.returncode == 1:          # only a speed target may be missed, not a check
        assert all(ok for name, ok in checks.items() if "same texts" in name or "answered" in name)
    assert (tmp_path / "bench_server.md").exists() and (tmp_path / "server.png").exists()


def test_transformers_serve_starts_on_the_device_it_is_given():
    from benchmarks.transformers_serve import TransformersServe

    for device in ("cuda", "cpu"):
        theirs = TransformersServe("/models/bundled", threads=1, clients=16, context=256,
                                   device=device)
        try:
            command = theirs.command()
        finally:
            theirs.__exit__()                 # deletes its log; nothing was started
        assert command[command.index("--device") + 1] == device
    assert TransformersServe.__init__.__defaults__[0] == "cpu"


def test_bench_server_puts_transformers_serve_on_its_own_device(monkeypatch):
    """`--device cuda` must reach transformers serve too (it once ran on the CPU beside our
    server on the GPU). The servers are stand-ins: the run stops where theirs is made."""
    from benchmarks import bench_server

    class Made(Exception):
        pass

    def made(*args, **kwargs):
        raise Made(kwargs.get("device"))

    monkeypatch.setattr(bench_server, "serve_in_background", lambda *a, **k: None)
    monkeypatch.setattr(bench_server, "TransformersServe", made)
    monkeypatch.setattr("helpers.models.load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(bench_server, "model_context", lambda model: 256)
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)     # this process keeps its own
    with pytest.raises(Made) as seen:
        bench_server.main(["--quick", "--device", "cuda"])
    assert str(seen.value) == "cuda"


def test_summary_rows_of_the_server_benchmark():
    rows = []
    result = {"clients": 16, "speedup": 4.5, "single_client": {"server_over_bare_loop": 0.8},
              "transformers_serve": {"levels": [{"clients": 1, "ours_over_theirs": 1.2},
                                                {"clients": 16, "ours_over_theirs": 1.4}]}}
    run_all.server_rows(result, lambda *row: rows.append(row))
    assert rows[1] == ("server: one client vs the bare decode loop on the same prompts "
                       "(tokens/s)", "80%", ">= 70%", True)
    assert rows[2][2:] == ("", None) and rows[3][1:] == ("1.40x", ">= 1.5x", False)
    rows.clear()
    run_all.server_rows({**result, "transformers_serve": {"error": "RuntimeError: no command"}},
                        lambda *row: rows.append(row))
    assert rows[2][1] == "not run: RuntimeError: no command" and rows[2][3] is False


def test_the_profiler_sorts_our_stacks_as_it_sorts_vllms():
    """The vLLM profiler's classification (benchmarks/vllm/stacks.py): a stack goes to what
    its innermost telling frame did, the model call wins over the course's code around it,
    and the HTTP process is the API server's but for its pipe."""
    from benchmarks.vllm import report, stacks as ps

    loop = ["_run (helpers/server/engine.py)", "_loop (helpers/server/engine.py)",
            "step (helpers/server/engine.py)", "_generate (helpers/server/engine.py)",
            "forward (helpers/server/kv.py)", "paged_next_token (helpers/paged/batching.py)"]
    decode = loop + ["__call__ (helpers/server/kv.py)"]
    compiled = decode + ["_call (helpers/server/kv.py)",
                         "compile_wrapper (torch/_dynamo/eval_frame.py)",
                         "call (c2ahwwxpymqghmywi66s7isxx35stcz5wuedtp7p2qn4v34q2spw.py)"]
    prefill = loop + ["_forward (helpers/paged/batching.py)",
                      "_wrapped_call_impl (torch/nn/modules/module.py)",
                      "paged_attention (helpers/paged/attention.py)"]
    detok = decode[:-1] + ["_hand_out (helpers/server/engine.py)",
                           "accept (helpers/server/sampling.py)",
                           "add (helpers/server/tokens.py)",
                           "decode (transformers/tokenization_utils_base.py)"]
    pipe = detok[:-2] + ["deliver (helpers/server/engine_process.py)",
                         "send (multiprocessing/connection.py)"]
    engine = {ps.OUR_DECODE: compiled, ps.OUR_PREFILL: prefill, ps.OUR_DETOK: detok,
              ps.IPC: pipe,
              ps.OUR_INPUTS: decode + ["<listcomp> (helpers/server/kv.py)",
                                       "sequence (helpers/paged/batching.py)"],
              ps.OUR_SCHEDULER: decode + ["grow (helpers/paged/blocks.py)"],
              ps.OUR_SAMPLER: decode + ["choose (helpers/server/engine.py)",
                                        "__call__ (helpers/server/sampling.py)"],
              ps.BLOCKED: loop[:2] + ["wait (threading.py)"]}
    for expected, frames in engine.items():
        assert ps.our_category(frames, "engine") == expected, frames
    http = ["run (asyncio/runners.py)", "_run_once (asyncio/base_events.py)",
            "_run (asyncio/events.py)"]
    assert ps.our_category(http, "http") == ps.OUR_EVENT_LOOP
    sse = http + ["stream_response (starlette/responses.py)",
                  "completion_stream (helpers/server/routes_openai.py)",
                  "sse (helpers/server/serving.py)", "dumps (json/__init__.py)"]
    assert ps.our_category(sse, "http") == ps.OUR_ROUTES
    reader = ["_read (helpers/server/engine_process.py)", "recv (multiprocessing/connection.py)"]
    assert ps.our_category(reader, "http") == ps.IPC
    assert report.group("ours", "http", ps.OUR_ROUTES) == "API server"
    assert report.group("ours", "http", ps.IPC) == report.group("vllm", "engine_core",
                                                                ps.HANDING) == "IPC"
    assert report.group("ours", "engine", ps.OUR_DETOK) == report.group(
        "vllm", "api_server", "detokenizing") == "outputs"
    assert ps.vllm_category(["execute_model (vllm/v1/worker/gpu_model_runner.py)",
                             "forward (vllm/model_executor/models/gpt2.py)"]) == "model forward"
