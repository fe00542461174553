"""CUDA graphs for the paged engine's decode steps (``helpers.server.graphs``, lesson 10), as
far as a machine without a GPU can test them: the capture sizes and the padding, the staging
buffer's layout, the scratch block, the fallback reasons, the counts, "auto" meaning off
without CUDA, and that nothing is compiled or captured after start-up, with tokens as lesson
01 gives them. A CPU has no CUDA graph: ``rerun_each_replay`` stands in for the capture (each
replay runs the captured function again on the same buffers), so everything around the
graphs runs as it would on a GPU. The capture itself is checked on a GPU
(``benchmarks/gpu_server.py``, part of ``make test-gpu``).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import pytest
import torch

from helpers import load_model
from helpers.lora import ADAPTERS_DIR
from helpers.server.background import BackgroundServer
from helpers.server.contract import GenerationParams
from helpers.server.engine_process import build_engine
from helpers.compilation import rerun_each_replay
from helpers.server.graphs import ID, LENGTH, POSITION, READ, WRITE
from helpers.server.options import check
from helpers.server.metrics import Metrics
from helpers.server.engine import Engine

from .conftest import COURSE_PROMPTS
from .test_engine import SHARED, expected_ids, run, tokens_of

pytestmark = pytest.mark.usefixtures("one_thread")
HAVE_ADAPTERS = (ADAPTERS_DIR / "entities" / "adapter_model.safetensors").is_file()


@pytest.fixture(scope="module")
def reference():
    return load_model(device="cpu")


@pytest.fixture(scope="module")
def graphed():
    """Compiled, with graphs of 1, 2 and 4 rows (the stand-in capture) and room for 8 rows:
    batches of 5 to 8 rows run without a graph."""
    model, tokenizer = load_model(device="cpu")
    engine = Engine(model, tokenizer, max_batch_size=8, max_queue=64, compile=True,
                    cuda_graphs="on", graph_sizes=(4, 1, 2, 64), capture=rerun_each_replay)
    engine.start()
    yield engine
    engine.stop()


def settled(engine) -> dict:
    with engine._model_lock:
        return engine.snapshot()


def sizes(value, max_batch_size=8):
    return check({"cuda_graph_sizes": value, "max_batch_size": max_batch_size})["cuda_graph_sizes"]


def test_sizes_are_checked_sorted_and_capped_by_the_batch():
    assert sizes((8, 1, 4, 2, 64)) == (1, 2, 4, 8)
    assert sizes("1, 2,4") == (1, 2, 4)
    with pytest.raises(ValueError, match="'two' is not one"):
        sizes("1,two")
    with pytest.raises(ValueError, match="0 is not one"):
        sizes((0, 1))
    with pytest.raises(ValueError, match="no capture size in \\(16, 32\\) is at most the "
                                         "largest batch, 8 \\(--max-batch-size\\)"):
        sizes((16, 32))
    for text in ("0", "-1", "", "1,,2", "+2", "1.5", "\u0663"):       # the last: an Arabic 3
        with pytest.raises(ValueError, match="--cuda-graph-sizes takes positive whole numbers"):
            sizes(text)


def _server_settings(**changes) -> dict:
    values = dict(model=None, device="cpu", dtype=None, threads=1, kv_cache="paged",
                  compile="off", cuda_graphs="auto", adapters_dir=None, model_id="bundled",
                  max_batch_size=8, max_input_tokens=None, max_total_tokens=None, max_queue=4,
                  default_max_new_tokens=4)
    return {**values, **changes}


@pytest.mark.parametrize("changes, error", [
    ({"cuda_graph_sizes": "100000"}, "at most the largest batch, 8"),
    ({"cuda_graph_sizes": "0"}, "'0' is not one"),
    ({"cuda_graph_sizes": ""}, "'' is not one"),
    ({"cuda_graphs": "on"}, "--cuda-graphs on needs a CUDA device; the model is on cpu"),
    ({"device": "foo"}, "--device 'foo' is not a device torch knows"),
    ({"threads": 0}, "--threads 0: must be between 1 and"),
] + ([({"device": "cuda"}, "--device cuda: .* has no such device")] if not torch.cuda.is_available() else []))
def test_the_server_refuses_bad_settings_before_it_loads_the_model(changes, error, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr("helpers.models.load_model", no_loading)
    with pytest.raises(ValueError, match=error):
        build_engine(_server_settings(**changes))


def test_a_list_of_sizes_becomes_the_flag():
    from helpers.server.options import command_line

    assert command_line({"cuda_graph_sizes": [1, 2, 4]}) == ["--cuda-graph-sizes", "1,2,4"]


def test_start_up_captures_one_graph_per_size_on_the_compiled_step(graphed):
    snapshot = graphed.snapshot()
    assert graphed.info()["cuda_graph_sizes"] == [1, 2, 4]        # 64 > max_batch_size
    assert snapshot["cuda_graph_captures"] == 3 and snapshot["cuda_graph_replays"] == 0
    assert snapshot["compiles"] == 3          # the captures reuse the warm-up's graphs


def test_auto_is_off_without_cuda_and_on_needs_it(reference):
    model, tokenizer = reference
    engine = Engine(model, tokenizer, max_batch_size=2, cuda_graphs="auto")
    assert engine.kv.runner.graphs is None and engine.info()["cuda_graph_sizes"] == []
    assert "cuda_graph_captures" not in engine.snapshot()
    with pytest.raises(ValueError, match="--cuda-graphs on needs a CUDA device; the model is "
                                         "on cpu"):
        Engine(model, tokenizer, max_batch_size=2, cuda_graphs="on")
    with pytest.raises(ValueError, match="cuda_graphs must be one of auto, on, off"):
        Engine(model, tokenizer, max_batch_size=2, cuda_graphs="yes")
    settings = dict(model=None, device="cpu", dtype=None, threads=1, kv_cache="contiguous",
                    compile="off", cuda_graphs="on", adapters_dir=None, model_id="bundled",
                    max_batch_size=2, max_input_tokens=None, max_total_tokens=None,
                    max_queue=4, default_max_new_tokens=4)
    with pytest.raises(ValueError, match="--cuda-graphs on needs --kv-cache paged"):
        build_engine(settings)


def test_the_staging_buffer_holds_each_row_then_padding(graphed):
    """Three rows replay the graph of 4: row r's token, position, write index (its block's
    pool entry), history length and read indices (its entries, then the scratch entry); the
    fourth row is padding, which reads and writes the scratch entry only."""
    graphs, pool = graphed.kv.runner.graphs, graphed.kv.cache.pool
    size, scratch = pool.block_size, graphed.kv.runner.packed.scratch
    tables, starts, ids = [[3], [5, 7], [2]], [4, 17, 0], [11, 12, 13]
    with graphed._model_lock, torch.inference_mode():
        graphs._stage(starts, tables, ids, 4)
        staged = graphs.inputs[:4].cpu()
    assert staged[:, ID].tolist() == [11, 12, 13, graphed.pad_id]
    assert staged[:, POSITION].tolist() == [4, 17, 0, 0]
    assert staged[:, WRITE].tolist() == [3 * size + 4, 7 * size + 1, 2 * size, scratch]
    assert staged[:, LENGTH].tolist() == [5, 18, 1, 1]
    read = staged[:, READ:]
    assert read.shape[1] == graphed.max_total_tokens
    assert read[0, :5].tolist() == [3 * size + i for i in range(5)]
    assert read[1, :18].tolist() == ([5 * size + i for i in range(16)]
                                     + [7 * size, 7 * size + 1])
    assert read[2, 0] == 2 * size
    assert (read[0, 5:] == scratch).all() and (read[3] == scratch).all()


def test_same_tokens_as_lesson_01_with_padding_and_fallbacks(graphed, reference):
    """Waves of 1, 3 (padded to 4) and 8 rows (above the largest size: no graph), arrivals
    in between, prompts of every length: lesson 01's tokens, every decode step of at most 4
    rows replayed, the others counted by reason."""
    before = settled(graphed)
    one = [(COURSE_PROMPTS[0], GenerationParams(max_new_tokens=9))]
    three = [(p, GenerationParams(max_new_tokens=n)) for p, n in zip(COURSE_PROMPTS, [6, 6, 6])]
    eight = [(p, GenerationParams(max_new_tokens=n))
             for p, n in zip(COURSE_PROMPTS + [SHARED, "A", "The"], [3, 20, 7, 12, 5, 9, 2, 16])]
    for wave in (one, three, eight):
        for (prompt, params), events in zip(wave, run(graphed, wave)):
            assert tokens_of(events) == expected_ids(reference, prompt, params.max_new_tokens)
    after = settled(graphed)
    # one row alone: 8 decode steps after its prompt, each a replay
    assert after["cuda_graph_replays"] - before["cuda_graph_replays"] >= 8
    assert after["cuda_graph_padded_rows"] > before["cuda_graph_padded_rows"]
    fallbacks = {reason: count - before["cuda_graph_fallbacks"].get(reason, 0)
                 for reason, count in after["cuda_graph_fallbacks"].items()}
    assert fallbacks["prompt"] >= 3 and fallbacks["rows"] >= 1
    assert after["cuda_graph_captures"] == 3 and after["compiles"] == 3


def test_a_replay_pads_to_the_next_size_and_gives_the_steps_logits(graphed):
    """Three rows in a block of their own replay the graph of 4: one padding row (which writes
    to the scratch block, not theirs), one replay, and the logits of the compiled step run
    without a graph."""
    runner, manager = graphed.kv.runner, graphed.kv.cache.manager
    graphs, packed = runner.graphs, runner.packed
    starts, ids = [0, 1, 2], [11, 12, 13]
    with graphed._model_lock, torch.inference_mode():
        manager.allocate("probe", [0, 1, 2], 1)
        tables = [manager.grow("probe", 3)] * 3
        try:
            before = (graphs.replays, graphs.padded_rows)
            logits = graphs.run(starts, tables, ids).clone()
            assert (graphs.replays, graphs.padded_rows) == (before[0] + 1, before[1] + 1)
            assert logits.shape == (3, 1, graphed.model.config.vocab_size)
            torch.testing.assert_close(logits, packed._run(starts, [1, 1, 1], tables, ids),
                                       rtol=1e-5, atol=1e-5)
        finally:
            manager.free_request("probe")


@pytest.mark.skipif(not HAVE_ADAPTERS, reason="the course's adapters are not trained here")
def test_no_compile_and_no_capture_after_start_up_whatever_comes(graphed, reference):
    """Adapter and base requests in every order, alone and together, after start-up: the
    compile and capture counts never move, no step runs eager instead, base answers are lesson
    01's, and no step takes long (a compile takes seconds; a step here takes milliseconds)."""
    durations = []
    real_step = graphed.step

    def timed_step():
        start = time.perf_counter()
        real_step()
        durations.append(time.perf_counter() - start)

    before = settled(graphed)
    graphed.step = timed_step
    try:
        base = (COURSE_PROMPTS[1], GenerationParams(max_new_tokens=8))
        want = expected_ids(reference, base[0], 8)
        orders = [["sad"], [None, "entities"], ["rhymes", None, "sad"], [None], ["title", None],
                  [None, None, "entities", "rhymes"], ["sad", "title"], [None]]
        for adapters in orders:
            requests = [(COURSE_PROMPTS[i % 3], GenerationParams(max_new_tokens=8,
                                                                 adapter_id=a))
                        if a else base for i, a in enumerate(adapters)]
            for (prompt, params), events in zip(requests, run(graphed, requests)):
                if params.adapter_id is None:
                    assert tokens_of(events) == want
    finally:
        del graphed.step
    after = settled(graphed)
    assert after["compiles"] == before["compiles"] == 3
    assert after["cuda_graph_captures"] == before["cuda_graph_captures"] == 3
    assert after["steps_eager_instead"] == 0
    assert after["cuda_graph_fallbacks"]["adapter"] > before["cuda_graph_fallbacks"].get(
        "adapter", 0)
    assert max(durations) < max(50 * statistics.median(durations), 1.0), durations


def test_metrics_show_the_fallbacks_by_reason():
    page = Metrics().render({"cuda_graph_fallbacks": {"prompt": 3, "adapter": 1},
                             "cuda_graph_replays": 7})
    assert 'helpers_server_cuda_graph_fallbacks{reason="adapter"} 1' in page
    assert 'helpers_server_cuda_graph_fallbacks{reason="prompt"} 3' in page
    assert "# TYPE helpers_server_cuda_graph_replays counter" in page
    assert "helpers_server_cuda_graph_replays 7" in page
    assert 'helpers_server_cuda_graph_fallbacks{reason="rows"} 0' in page
    for snapshot in ({}, {"cuda_graph_fallbacks": {}}):     # graphs off, or none fell back yet
        page = Metrics().render(snapshot)
        for reason in ("adapter", "prompt", "rows"):
            assert f'helpers_server_cuda_graph_fallbacks{{reason="{reason}"}} 0' in page


def _slow_starter(tmp_path, script: str) -> BackgroundServer:
    """A process that prints start-up lines as the server does, and never listens."""
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                   stdout=out, stderr=subprocess.STDOUT)
    return BackgroundServer("slow", process, "127.0.0.1", tmp_path)


def test_the_start_up_wait_follows_the_stages_and_names_the_one_it_stuck_in(tmp_path):
    """Stages keep coming for longer than the timeout: the wait goes on; then one stage lasts
    longer than the timeout: the error names it."""
    script = ("import time\n"
              "from helpers.server.startup import report\n"
              "for i in range(6):\n"
              "    report('compiling graph %d of 6', i + 1)\n"
              "    time.sleep(0.4)\n"
              "time.sleep(60)\n")
    server = _slow_starter(tmp_path, script)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="it stayed at 'compiling graph 6 of 6' for 1 s"):
        server.wait(timeout=1.0)
    assert time.monotonic() - start > 2.0        # past the timeout, while stages came
    assert server.process.poll() is not None     # and it was stopped
