"""The packed, compiled step of the paged engine (``helpers.server.kv``, lesson 10): the
same tokens as the eager engines, three graphs compiled at start-up and none after, whatever
the batch sizes, prompt lengths, chunks and cached prefixes, its attention the same as lesson
08's, and the rows it cannot take (adapters) going lesson 08's way.

One ``Engine(compile=True)`` (paged, the default layout) serves the module (compiling takes seconds to tens of
seconds; torch keeps compiled kernels on disk, so a second run is faster).
"""

from __future__ import annotations

import pytest

from helpers import load_model
from helpers.lora import ADAPTERS_DIR
import torch

from helpers.paged import KVPool, PagedForward, paged_attention
from helpers.paged.attention import (PackedInputs, in_place_decode_attention,
                                    packed_paged_attention)
from helpers.server.kv import PackedStep
from helpers.server.contract import GenerationParams
from helpers.server.engine_process import build_engine
from helpers.server.engine import Engine

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
    engine = Engine(model, tokenizer, max_batch_size=8, max_queue=64,
                         max_prefill_tokens=16, compile=True).start()
    yield engine
    engine.stop()


def settled(engine) -> dict:
    """The engine's figures once its step is over (the scheduler counts a step after handing
    its events out: the step holds the model lock until then)."""
    with engine._model_lock:
        return {"steps_compiled": 0, "steps_decode": 0, **engine.snapshot()}


def test_warm_up_compiles_three_graphs(compiled):
    """One graph for a single row's decode step, one for every other decode step, one for
    every step that reads prompts."""
    snapshot = compiled.snapshot()
    assert snapshot["compiles"] == 3
    assert snapshot["compile_seconds"] > 0
    assert compiled.info()["compiled"] is True


def test_same_tokens_as_lesson_01_and_no_recompiles(compiled, reference):
    """Greedy answers of varying lengths arrive in waves (batches of 1 to 8 rows, histories
    of a few tokens to a hundred, prompts read in chunks of 16 tokens, a shared prefix found
    in the cache): every token as lesson 01's loop gives it, every step compiled, and not one
    compile after the warm-up."""
    before = settled(compiled)
    prompts = COURSE_PROMPTS + [SHARED, SHARED + " a bone", "A", "The"]
    lengths = [3, 40, 17, 90, 1, 64, 2, 25, 11, 33]
    requests = [(p, GenerationParams(max_new_tokens=n)) for p, n in zip(prompts * 2, lengths)]
    for (prompt, params), events in zip(requests, run(compiled, requests)):
        assert tokens_of(events) == expected_ids(reference, prompt, params.max_new_tokens)
    # one row alone (its prompt, then its decode steps), then two: the warm-up's graphs;
    # then SHARED once more, its first blocks found in the prefix cache
    again = (SHARED, GenerationParams(max_new_tokens=6))
    for batch in ([requests[0]], requests[:2], [again]):
        for (prompt, params), events in zip(batch, run(compiled, batch)):
            assert tokens_of(events) == expected_ids(reference, prompt, params.max_new_tokens)
    after = settled(compiled)
    assert after["compiles"] == before["compiles"] == 3
    steps = {kind: after[f"steps_{kind}"] - before.get(f"steps_{kind}", 0)
             for kind in ("compiled", "decode", "prefill")}
    assert steps["compiled"] == steps["decode"] + steps["prefill"] > 0
    assert after["prefix_cache_hits"] > before.get("prefix_cache_hits", 0)   # SHARED, twice


def test_ignore_eos_and_sampling_rows_take_the_compiled_step(compiled, reference):
    """Rows with their own rules (sampling with a seed, penalties) are chosen as in eager
    decoding: the compiled step only replaces the forward pass."""
    params = GenerationParams(max_new_tokens=20, do_sample=True, temperature=0.8, seed=7,
                              repetition_penalty=1.3)
    first = tokens_of(run(compiled, [(COURSE_PROMPTS[0], params)])[0])
    model, tokenizer = load_model(device="cpu")
    eager = Engine(model, tokenizer, max_batch_size=8, compile=False).start()
    try:
        assert tokens_of(run(eager, [(COURSE_PROMPTS[0], params)])[0]) == first
    finally:
        eager.stop()


@pytest.mark.skipif(not HAVE_ADAPTERS, reason="the course's adapters are not trained here")
def test_adapter_rows_run_eager_beside_compiled_ones(compiled, reference):
    """A batch with a LoRA row is not compiled (eager, lesson 08's step); its answers are the
    eager engine's, and the base rows of later batches take the compiled step again, with the
    graphs of the warm-up."""
    model, tokenizer = load_model(device="cpu")
    eager = Engine(model, tokenizer, max_batch_size=8, compile=False).start()
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
    # Every adaptable layer was wrapped before compiling: loading the adapter changed no
    # module the graphs were traced from, so nothing is compiled again.
    assert compiled.snapshot()["compiles"] == 3


@pytest.mark.skipif(not HAVE_ADAPTERS, reason="the course's adapters are not trained here")
def test_an_adapter_scored_alone_leaves_no_adapter_behind(compiled, reference):
    """A request with an adapter that asks for its prompt's log probabilities is scored by a
    pass of its own: afterwards no adapter is left set for the base rows that follow (the
    packed step sees one sequence, so a stale adapter would apply to every row)."""
    base = (COURSE_PROMPTS[0], GenerationParams(max_new_tokens=12))
    want = expected_ids(reference, *base[:1], 12)
    assert tokens_of(run(compiled, [base])[0]) == want
    run(compiled, [(COURSE_PROMPTS[1], GenerationParams(max_new_tokens=3, adapter_id="entities",
                                                        prompt_logprobs=True))])
    assert compiled.adapters.lora.current_rows is None
    assert tokens_of(run(compiled, [base])[0]) == want


def test_a_pool_too_small_for_one_request_is_refused(reference):
    """A request the pool could never hold would wait for blocks forever: refused up front."""
    model, tokenizer = reference
    with pytest.raises(ValueError, match=r"num_blocks=2 blocks of 16 tokens cannot hold one "
                                         r"request of max_total_tokens=256: give at least 16"):
        Engine(model, tokenizer, num_blocks=2)
    assert Engine(model, tokenizer, num_blocks=16).kv.cache.manager.num_blocks == 16


def test_after_start_up_a_step_that_needs_a_new_graph_runs_eager(compiled, reference):
    """Nothing compiles after start-up: a step whose inputs the warm-up's graphs do not cover
    (here, token ids of another dtype) runs eager, is counted, and gives the same logits."""
    step = compiled.kv.runner.packed
    assert step.sealed
    before = settled(compiled)
    block = step.scratch // step.pool.block_size
    with compiled._model_lock, torch.inference_mode():   # as the engine's steps run
        paged = PackedInputs.build(step.pool, step.scratch, [[block]], [2], [1], "cpu")
        ids = torch.tensor([[5]])
        want = step._call(ids, paged)
        got = step._call(ids.to(torch.int32), paged)          # a new dtype: a guard fails
    torch.testing.assert_close(got, want)
    after = settled(compiled)
    assert after["compiles"] == before["compiles"] == 3
    assert after["steps_eager_instead"] == before["steps_eager_instead"] + 1


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

    monkeypatch.setattr(PackedStep, "warm_up", fail)
    engine = Engine(model, tokenizer, max_batch_size=2, compile="auto")
    assert engine.info()["compiled"] is False
    assert "compiling failed (RuntimeError: no C++ compiler found)" in caplog.text
    with pytest.raises(RuntimeError, match=r"compiling the step failed \(RuntimeError: no C\+\+ "
                                           r"compiler found\); --compile auto would serve"):
        Engine(model, tokenizer, max_batch_size=2, compile="on")
    with pytest.raises(ValueError, match="compile must be one of auto, on, off, got 'yes'"):
        Engine(model, tokenizer, max_batch_size=2, compile="yes")


def gqa_pool(heads=4, kv_heads=2, head_dim=8, blocks=8, block_size=4):
    """A pool of random keys and values for a model with grouped-query attention (two query
    heads a kv head), which the bundled GPT-2 does not exercise."""
    from types import SimpleNamespace

    config = SimpleNamespace(num_hidden_layers=1, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, hidden_size=heads * head_dim)
    pool = KVPool(SimpleNamespace(config=config, dtype=torch.float32, device="cpu"),
                  blocks, block_size)
    generator = torch.Generator().manual_seed(0)
    for tensor in pool.keys + pool.values:
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return pool


@pytest.mark.parametrize("counts", [[1, 1, 1], [3, 1, 2]], ids=["decode", "prompts"])
def test_packed_attention_equals_lesson_08s(counts):
    """The same rows (histories of 5, 9 and 2 tokens, in scattered blocks) through lesson 08's
    padded ``paged_attention`` and through the packed one: the same outputs token for token,
    the same pool after the writes; and the in-place decode attention, eager, gives them too."""
    from types import SimpleNamespace

    starts, tables = [5, 9, 2], [[6, 1], [0, 3, 5], [2]]
    heads, kv_heads, head_dim = 4, 2, 8
    generator = torch.Generator().manual_seed(1)
    new = [torch.randn(n, heads + 2 * kv_heads, head_dim, generator=generator)
           for n in counts]
    module = SimpleNamespace(layer_idx=0)
    # lesson 08: new tokens padded on the left, (rows, heads, new, head_dim)
    padded = gqa_pool()
    width = max(counts)

    def left(part):
        return torch.stack([torch.cat([torch.zeros(width - x.shape[0], *x.shape[1:]), x])
                            for x in part]).transpose(1, 2)

    q, k, v = (left([x[:, s] for x in new]) for s in (slice(0, heads),
                                                        slice(heads, heads + kv_heads),
                                                        slice(heads + kv_heads, None)))
    forward = PagedForward.build(padded, tables, starts, counts, "cpu")
    expected, _ = paged_attention(module, q, k, v, None, paged=forward)
    expected = torch.cat([expected[r, width - n:] for r, n in enumerate(counts)])   # (T, h, d)
    # packed: the same tokens one after another, (1, heads, T, head_dim)
    packed_pool = gqa_pool()
    flat = torch.cat(new).transpose(0, 1)[None]
    inputs = PackedInputs.build(packed_pool, 7 * 4, tables, starts, counts, "cpu")
    output, _ = packed_paged_attention(module, flat[:, :heads], flat[:, heads:heads + kv_heads],
                                       flat[:, heads + kv_heads:], None, paged=inputs)
    assert torch.allclose(output[0], expected, atol=1e-5)
    assert torch.equal(packed_pool.keys[0], padded.keys[0])
    assert torch.equal(packed_pool.values[0], padded.values[0])
    if max(counts) == 1:
        in_place = in_place_decode_attention(flat[0, :heads].transpose(0, 1),
                                             packed_pool.keys[0], packed_pool.values[0], inputs)
        assert torch.allclose(in_place, expected, atol=1e-5)
        assert not torch.allclose(in_place[1:], expected[:-1], atol=1e-3)    # rows differ


def test_packed_inputs_of_a_step():
    """Two rows of a pool of blocks of 4: one reads 3 prompt tokens from position 2 (blocks 2
    and 3), one generates at position 2 (block 0); block 4 is the scratch block. Where each
    token is written and read, and which positions each query sees."""
    pool = gqa_pool(blocks=5, block_size=4)
    inputs = PackedInputs.build(pool, 16, [[2, 3], [0]], [2, 2], [3, 1], "cpu")
    assert inputs.positions.tolist() == [[2, 3, 4, 2]]
    assert inputs.write_indices.tolist() == [10, 11, 12, 2]
    assert inputs.read_indices.tolist() == [[8, 9, 10, 11, 12], [0, 1, 2, 16, 16]]
    assert inputs.query_indices.tolist() == [[0, 1, 2], [3, 3, 3]]
    assert inputs.output_indices.tolist() == [0, 1, 2, 3]
    assert inputs.last.tolist() == [2, 3]
    assert inputs.mask[0, 0].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0],
                                                [1, 1, 1, 1, 1]]
    assert inputs.mask[1, 0].int().tolist() == [[1, 1, 1, 0, 0]] * 3
