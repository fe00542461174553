"""The compiled decode step of the paged engine (``helpers.server.compiled``, lesson 10): the
same tokens as the eager engines, two graphs compiled at start-up and none after, whatever the
batch sizes and lengths, and the rows it cannot take (adapters, prompts being read) going the
eager way.

One ``PagedEngine(compile=True)`` serves the module (compiling takes seconds to tens of
seconds; torch keeps compiled kernels on disk, so a second run is faster).
"""

from __future__ import annotations

import pytest

from helpers import load_model
from helpers.lora import ADAPTERS_DIR
from helpers.server.compiled import MAX_COMPILES, DecodeStep
from helpers.server.contract import GenerationParams
from helpers.server.engine_process import build_engine
from helpers.server.paged_engine import PagedEngine

from .conftest import COURSE_PROMPTS
from .test_engine import SHARED, expected_ids, run, tokens_of

pytestmark = pytest.mark.usefixtures("one_thread")   # see tests/conftest.py

HAVE_ADAPTERS = (ADAPTERS_DIR / "entities" / "adapter_model.safetensors").is_file()


@pytest.fixture(scope="module")
def reference():
    return load_model(device="cpu")


@pytest.fixture(scope="module")
def compiled():
    model, tokenizer = load_model(device="cpu")
    engine = PagedEngine(model, tokenizer, max_batch_size=8, max_queue=64,
                         max_prefill_tokens=16, compile=True).start()
    yield engine
    engine.stop()


def settled(engine) -> dict:
    """The engine's figures once its step is over (the scheduler counts a step after handing
    its events out: the step holds the model lock until then)."""
    with engine._model_lock:
        return {"steps_compiled": 0, "steps_decode": 0, **engine.snapshot()}


def test_warm_up_compiles_two_graphs(compiled):
    """One graph for a single row, one for every batch of two rows or more."""
    snapshot = compiled.snapshot()
    assert snapshot["compiles"] == 2
    assert snapshot["compile_seconds"] > 0
    assert compiled.info()["compiled"] is True


def test_same_tokens_as_lesson_01_and_no_recompiles(compiled, reference):
    """Greedy answers of varying lengths arrive in waves (batches of 1 to 8 rows, histories
    of a few tokens to a hundred): every token as lesson 01's loop gives it, every decode step
    compiled, and not one compile after the warm-up."""
    before = settled(compiled)
    prompts = COURSE_PROMPTS + [SHARED, SHARED + " a bone", "A", "The"]
    lengths = [3, 40, 17, 90, 1, 64, 2, 25, 11, 33]
    requests = [(p, GenerationParams(max_new_tokens=n)) for p, n in zip(prompts * 2, lengths)]
    for (prompt, params), events in zip(requests, run(compiled, requests)):
        assert tokens_of(events) == expected_ids(reference, prompt, params.max_new_tokens)
    # one row alone, then two: the two graphs of the warm-up
    for batch in ([requests[0]], requests[:2]):
        run(compiled, batch)
    after = settled(compiled)
    assert after["compiles"] == before["compiles"] == 2
    assert after["steps_compiled"] - before["steps_compiled"] > 0
    assert after["steps_compiled"] - before["steps_compiled"] == (
        after["steps_decode"] - before["steps_decode"])


def test_ignore_eos_and_sampling_rows_take_the_compiled_step(compiled, reference):
    """Rows with their own rules (sampling with a seed, penalties) are chosen as in eager
    decoding: the compiled step only replaces the forward pass."""
    params = GenerationParams(max_new_tokens=20, do_sample=True, temperature=0.8, seed=7,
                              repetition_penalty=1.3)
    first = tokens_of(run(compiled, [(COURSE_PROMPTS[0], params)])[0])
    model, tokenizer = load_model(device="cpu")
    eager = PagedEngine(model, tokenizer, max_batch_size=8, compile=False).start()
    try:
        assert tokens_of(run(eager, [(COURSE_PROMPTS[0], params)])[0]) == first
    finally:
        eager.stop()


@pytest.mark.skipif(not HAVE_ADAPTERS, reason="the course's adapters are not trained here")
def test_adapter_rows_run_eager_beside_compiled_ones(compiled, reference):
    """A batch with a LoRA row is not compiled (eager, lesson 08's step); its answers are the
    eager engine's, and the base rows of later batches are compiled again (the wrapped layers
    cost one more trace of a graph, not one per step)."""
    model, tokenizer = load_model(device="cpu")
    eager = PagedEngine(model, tokenizer, max_batch_size=8, compile=False).start()
    requests = [(COURSE_PROMPTS[0], GenerationParams(max_new_tokens=12, adapter_id="entities")),
                (COURSE_PROMPTS[1], GenerationParams(max_new_tokens=12))]
    try:
        expected = [tokens_of(events) for events in run(eager, requests)]
    finally:
        eager.stop()
    before = settled(compiled)["steps_compiled"]
    assert [tokens_of(events) for events in run(compiled, requests)] == expected
    assert settled(compiled)["steps_compiled"] == before      # the adapter row: eager
    run(compiled, requests[1:])
    assert settled(compiled)["steps_compiled"] > before
    # The first adapter wraps the model's layers (lesson 06): each graph is traced once more.
    assert compiled.snapshot()["compiles"] <= 4


def test_too_many_compiles_fall_back_to_eager(reference):
    """Past MAX_COMPILES the step stops calling the compiled model (no recompile storm)."""
    model, tokenizer = reference
    engine = PagedEngine(model, tokenizer, max_batch_size=2, compile=False)
    step = DecodeStep(model, engine.cache.pool, engine.cache.manager.num_blocks,
                      engine.pad_id, compile=True)
    step.compiles = MAX_COMPILES + 1        # as if the step had been traced again and again
    assert step.usable(engine._batch) is False            # an empty batch: nothing to run
    assert step.compiled is False and step._forward == step._run_model


def test_compile_on_needs_the_paged_cache():
    settings = dict(model=None, device="cpu", dtype=None, threads=1, kv_cache="contiguous",
                    compile="on", adapters_dir=None, model_id="bundled")
    with pytest.raises(ValueError, match="--compile on needs --kv-cache paged"):
        build_engine(settings)


def test_auto_runs_eager_where_compiling_fails(reference, monkeypatch, caplog):
    """No C++ compiler on a laptop (torch's CPU compiler needs one): "auto" serves eager and
    says why in the log; "on" refuses to start."""
    model, tokenizer = reference

    def fail(self):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(DecodeStep, "warm_up", fail)
    engine = PagedEngine(model, tokenizer, max_batch_size=2, compile="auto")
    assert engine.info()["compiled"] is False
    assert "compiling failed (RuntimeError: no C++ compiler found)" in caplog.text
    with pytest.raises(RuntimeError, match="no C"):
        PagedEngine(model, tokenizer, max_batch_size=2, compile="on")
    with pytest.raises(ValueError, match="compile must be 'auto', 'on' or 'off', got 'yes'"):
        PagedEngine(model, tokenizer, max_batch_size=2, compile="yes")
