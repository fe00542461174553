"""Lesson 10: the compiled decode step's plumbing (helpers.compilation).

The decode step on a static cache gives exactly lesson 1's greedy tokens (bundled GPT-2 and a
tiny random Llama with grouped-query attention), eager and traced by TorchDynamo; with the
batch dimension marked dynamic one graph serves every batch size, and a padded batch gives its
real rows the tokens of the unpadded one. Compilations are counted with ``CountingBackend``
(tracing only: inductor's compile takes far too long for a unit test; the lesson runs it). The
timing harness, the profiler summary, the break-even formula and the figures are checked on
their shapes and edge cases.
"""

import math

import pytest
import torch
from matplotlib.figure import Figure

from helpers import generate_with_cache
from helpers.compilation import (CAPTURE_SIZES, CountingBackend, DecodeTiming,
                                 break_even_figure, break_even_tokens, capture_size,
                                 course_prompts, decode_speed_figure, generate_static_cache,
                                 graph_ops, graphs_compiled, guard_failure_reasons,
                                 batch_marker, mark_batch_dynamic, pad_batch, static_decode_step,
                                 static_prefill, step_profile, time_decode)

from .conftest import COURSE_PROMPTS

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test starts and ends with no compiled graph."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---- capture sizes and padding ----------------------------------------------------------------

def test_capture_size_takes_the_smallest_size_that_holds_the_batch():
    batches = (1, 2, 3, 4, 5, 8, 9, 33, 64)
    assert [capture_size(b) for b in batches] == [1, 2, 4, 4, 8, 8, 16, 64, 64]
    assert capture_size(65) is None
    assert capture_size(3, (8, 1, 4, 2)) == 4                     # any order
    assert capture_size(17, [1, 2, 4, 8, 16, 24, 32]) == 24
    assert CAPTURE_SIZES == (1, 2, 4, 8, 16, 32, 64)


@pytest.mark.parametrize("batch, sizes", [(0, CAPTURE_SIZES), (2.0, CAPTURE_SIZES),
                                          (True, CAPTURE_SIZES), (3, ()), (3, (4, 0))])
def test_capture_size_refuses_what_is_not_a_batch_or_a_size_list(batch, sizes):
    with pytest.raises(ValueError):
        capture_size(batch, sizes)


def test_pad_batch_adds_rows_of_the_pad_id_below_the_real_ones():
    ids = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    padded = pad_batch(ids, 4, 99)
    assert padded.tolist() == [[5, 6, 7], [8, 9, 10], [11, 12, 13], [99, 99, 99]]
    assert padded.dtype == ids.dtype and padded.device == ids.device
    assert torch.equal(pad_batch(ids, 3, 0), ids)
    with pytest.raises(ValueError, match="cannot pad 3 rows down to 2"):
        pad_batch(ids, 2, 0)
    with pytest.raises(ValueError):
        pad_batch(ids[0], 4, 0)


# ---- the backend that counts ------------------------------------------------------------------

def test_counting_backend_counts_compilations_not_calls():
    backend = CountingBackend()
    compiled = torch.compile(lambda x: torch.relu(x) * 3, backend=backend, dynamic=False)
    x = torch.tensor([[-1.0, 2.0]])
    assert torch.equal(compiled(x), torch.tensor([[0.0, 6.0]]))
    compiled(x + 1)                                       # same shape: the graph is reused
    assert len(backend.graphs) == 1
    compiled(torch.ones(3, 2))                            # a new shape: a recompilation
    assert len(backend.graphs) == 2
    assert isinstance(backend.graphs[0], torch.fx.GraphModule)
    assert graph_ops(backend.graphs[0]) == 2              # relu and the multiplication
    assert CountingBackend().graphs == []                 # a list of its own
    reasons = guard_failure_reasons()
    assert len(reasons) == 1 and "size mismatch at index 0. expected 1, actual 3" in reasons[0]


def test_guard_failure_reasons_can_be_kept_to_one_function():
    def first(x):
        return x + 1

    def second(x):
        return x * 2

    for fn in (first, second):
        compiled = torch.compile(fn, backend=CountingBackend(), dynamic=False)
        compiled(torch.ones(2))
        compiled(torch.ones(3))
    assert len(guard_failure_reasons()) == 2
    assert len(guard_failure_reasons(first)) == 1 and len(guard_failure_reasons(second)) == 1


# ---- the decode step on a static cache --------------------------------------------------------

def _ids(model, tokenizer, prompt):
    return tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)


@pytest.mark.parametrize("which", ["bundled", "tiny_llama"])
def test_static_cache_gives_lesson_1s_tokens(which, request):
    model, tokenizer = request.getfixturevalue(which)
    for prompt in COURSE_PROMPTS[:3]:
        ours = generate_static_cache(model, _ids(model, tokenizer, prompt), 10)[0].tolist()
        lesson_1 = generate_with_cache(model, tokenizer, prompt, 10, stop_at_eos=False)
        assert ours == lesson_1.token_ids


def test_static_prefill_and_step_keep_the_cache_shape(bundled):
    model, tokenizer = bundled
    ids = _ids(model, tokenizer, "Jack and Jill")
    cache, token = static_prefill(model, ids, 24)
    assert token.shape == (1, 1)
    shape = cache.layers[0].keys.shape
    assert shape[2] == 24
    step = static_decode_step(model)
    with torch.no_grad():
        for i in range(3):
            token = step(token, cache, torch.tensor([ids.shape[1] + i], device=model.device))
            assert cache.layers[0].keys.shape == shape and token.shape == (1, 1)
    with pytest.raises(ValueError, match="must hold the prompt"):
        static_prefill(model, ids, 2)
    with pytest.raises(ValueError, match="must hold the prompt and every new token"):
        generate_static_cache(model, ids, 10, max_cache_len=5)


def test_a_traced_step_gives_the_eager_tokens_with_one_graph(bundled):
    model, tokenizer = bundled
    prompts = course_prompts(tokenizer, n=4).to(model.device)
    backend = CountingBackend()
    step = torch.compile(static_decode_step(model), backend=backend, dynamic=False)
    traced = generate_static_cache(model, prompts, 8, step=step, max_cache_len=32)
    assert torch.equal(traced, generate_static_cache(model, prompts, 8, max_cache_len=32))
    assert len(backend.graphs) == 1                       # 7 decode steps, the same shapes


def test_a_dynamic_batch_dimension_serves_every_size_with_one_graph(bundled):
    model, tokenizer = bundled
    prompts = course_prompts(tokenizer, n=8).to(model.device)
    backend = CountingBackend()
    step = torch.compile(static_decode_step(model), backend=backend, dynamic=False)
    before = graphs_compiled()
    for batch in (3, 1, 8):
        ours = generate_static_cache(model, prompts[:batch], 3, step=step,
                                     prepare=mark_batch_dynamic, max_cache_len=32)
        assert torch.equal(ours, generate_static_cache(model, prompts[:batch], 3, max_cache_len=32))
    # mark_dynamic (torch before 2.13) compiles a batch of 1 apart: one graph more
    graphs = 1 if batch_marker()[0] is not torch._dynamo.mark_dynamic else 2
    assert len(backend.graphs) == graphs and graphs_compiled() - before == graphs


def test_the_batch_marker_follows_the_torch_version():
    from torch._dynamo.decorators import mark_unbacked

    for version, mark, name in [("2.11.0+cu130", torch._dynamo.mark_dynamic, "mark_dynamic"),
                                ("2.12.1", torch._dynamo.mark_dynamic, "mark_dynamic"),
                                ("2.13.0", mark_unbacked, "mark_unbacked"),
                                ("2.14.1+cpu", mark_unbacked, "mark_unbacked")]:
        got, line = batch_marker(version)
        assert got is mark and f"marked with {name}" in line
        assert line.startswith(f"torch {version.split('+')[0]}: ")
        assert "\n" not in line
    assert "a batch of 1 gets a graph of its own" in batch_marker("2.11.0")[1]


def test_padding_leaves_the_real_rows_their_tokens(bundled):
    model, tokenizer = bundled
    prompts = course_prompts(tokenizer, n=5).to(model.device)
    padded = pad_batch(prompts, capture_size(5), tokenizer.pad_token_id)
    assert padded.shape[0] == 8
    assert torch.equal(generate_static_cache(model, padded, 6)[:5],
                       generate_static_cache(model, prompts, 6))


def test_course_prompts_are_equal_length_held_out_text(bundled):
    _, tokenizer = bundled
    prompts = course_prompts(tokenizer, n=64, length=16)
    assert prompts.shape == (64, 16) and prompts.dtype == torch.long
    assert torch.equal(prompts, course_prompts(tokenizer, n=64, length=16))    # seeded
    assert len({tuple(row) for row in prompts.tolist()}) > 32                   # not all alike
    with pytest.raises(ValueError):
        course_prompts(tokenizer, n=0)


# ---- measurements -----------------------------------------------------------------------------

def test_time_decode_times_each_batch_and_keeps_its_tokens(bundled):
    model, tokenizer = bundled
    prompts = course_prompts(tokenizer, n=4).to(model.device)
    timings = time_decode(model, prompts, [1, 4], steps=3, repeats=2, progress=False)
    assert list(timings) == [1, 4]
    for batch, timing in timings.items():
        assert isinstance(timing, DecodeTiming) and timing.seconds_per_step > 0
        assert timing.tokens_per_second == pytest.approx(batch / timing.seconds_per_step)
        assert torch.equal(timing.token_ids, generate_static_cache(model, prompts[:batch], 4).cpu())
    with pytest.raises(ValueError, match="needs 5 prompts"):
        time_decode(model, prompts, [5], progress=False)
    with pytest.raises(ValueError, match="must hold the prompt and the steps"):
        time_decode(model, prompts, [1], steps=3, max_cache_len=8, progress=False)
    with pytest.raises(ValueError):
        time_decode(model, prompts, [], progress=False)


def test_step_profile_counts_the_operations_of_one_step(bundled):
    model, tokenizer = bundled
    ids = _ids(model, tokenizer, "Jack and Jill")
    cache, token = static_prefill(model, ids, 16)
    view = step_profile(static_decode_step(model), token, cache,
                        torch.tensor([ids.shape[1]], device=model.device))
    layers = model.config.num_hidden_layers
    assert view.matmuls == 4 * layers + 1                 # 4 linear layers a block, the output
    assert view.ops > 5 * view.matmuls                    # many small operations around them
    assert 0 < view.matmul_seconds < view.seconds
    assert "aten::addmm" in view.table


def test_break_even_tokens():
    assert break_even_tokens(30.0, 0.006, 0.0031) == math.ceil(30.0 / (0.006 - 0.0031))
    assert break_even_tokens(12.5, 0.0093, 0.0061, 8) == math.ceil(12.5 / 0.0032) * 8
    assert break_even_tokens(10.0, 0.004, 0.004) == math.inf
    assert break_even_tokens(10.0, 0.004, 0.005, 4) == math.inf


def test_figures():
    eager = {1: 0.006, 8: 0.009, 64: 0.03}
    compiled = {b: DecodeTiming(b, s / 1.5, torch.zeros(b, 1)) for b, s in eager.items()}
    fig = decode_speed_figure(eager, compiled)
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    with pytest.raises(ValueError, match="the same batch sizes"):
        decode_speed_figure(eager, {1: 0.003})
    fig = break_even_figure(30.0, 0.006, 0.003, batch=1)
    assert isinstance(fig, Figure)
    assert isinstance(break_even_figure(30.0, 0.003, 0.006), Figure)   # never pays: no crossing


def test_graphed_generation_gives_the_eager_tokens_on_the_cpu_stand_in(bundled):
    from helpers.compilation import capture_steps, generate_graphed

    model, tokenizer = bundled
    prompts = course_prompts(tokenizer, n=3, length=6)
    step = static_decode_step(model)
    graphs = capture_steps(step, model, (1, 4), max_cache_len=24)
    assert list(graphs) == [1, 4] and all(g.pool is None for g in graphs.values())   # no CUDA
    graphed = generate_graphed(model, graphs, prompts, 5, tokenizer.pad_token_id)
    assert torch.equal(graphed, generate_static_cache(model, prompts, 5, step=step))


def test_a_capture_warms_up_on_a_side_stream_then_records_once(bundled, monkeypatch):
    """The order torch.cuda.graph asks for, with stand-ins for CUDA's pieces: the side stream
    waits for the current one, the step runs twice on it, the current stream waits for it, and
    the step runs once more inside the capture, with the pool it was given; a replay is the
    graph's."""
    from contextlib import contextmanager

    from helpers.compilation import StepGraph, record

    model, tokenizer = bundled
    events = []

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name} waits for {other.name}")

    class Graph:
        def replay(self):
            events.append("replay")

        def pool(self):
            return "its pool"

    @contextmanager
    def on(stream):
        events.append(f"on {stream.name}")
        yield
        events.append(f"off {stream.name}")

    @contextmanager
    def recording(graph, pool=None):
        events.append(f"record, pool {pool}")
        yield
        events.append("recorded")

    graph = StepGraph(static_decode_step(model), model, 2, max_cache_len=8)
    monkeypatch.setattr(graph, "step", lambda *args: events.append("step") or args[0])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("current"))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", recording)
    replay, output, pool = record(graph.run, torch.device("cuda"), pool="the pool")
    assert output is graph.token and pool == "its pool"
    replay()
    assert events == ["side waits for current", "on side", "step", "step", "off side",
                      "current waits for side", "record, pool the pool", "step", "recorded",
                      "replay"]
