"""Lesson 08: the paged KV cache, prefix caching and chunked prefill.

The invariant of lesson 03 holds here too: the paged driver returns exactly the tokens of the
contiguous one (``generate_continuous``), on the bundled GPT-2 model and on a tiny random
Llama (rotary positions, 4 heads sharing 2 kv heads), with prefix caching and chunked prefill
on and off, with LoRA adapters, and with a pool too small for everyone at once. After every
run every block is free (or free and cached) and every reference count is zero. Then the
block manager and the attention function are checked piece by piece, and last the harnesses
that lesson 08's measurements call (what they record, never how fast).
"""

import random

import pytest
import torch

from helpers import (MultiLora, Trace, generate_continuous, generate_sequential, load_adapters,
                     shipped_adapters)
from helpers.corpus import corpus
from helpers.paged import (PAGED_ATTENTION, BlockManager, PagedBatch, PagedForward, PagedKVCache,
                           PoolExhausted, block_hash, filter_paged_batch, generate_paged,
                           init_paged_batch, kv_shape, merge_paged_batches,
                           model_uses_paged_attention, paged_attention, paged_next_token,
                           pool_indices)
from helpers.paged.measure import (fastest_step_times, padded_cache_widths, time_to_first_token,
                                   ttft_one_after_another, worst_inter_token_gap)

from .conftest import COURSE_PROMPTS


pytestmark = pytest.mark.usefixtures("one_thread")   # see tests/conftest.py


# --- queues and references -----------------------------------------------------------------

def course_queue():
    """Lesson 03's queue: 32 requests, every 8th wants 100 tokens, the others 10."""
    return [(COURSE_PROMPTS[i % 5], 100 if i % 8 == 0 else 10) for i in range(32)]


SYSTEM = ("Once upon a time, in a small village by the sea, there lived an old fisherman and "
          "his cat.")


def long_tailed_queue(tokenizer, seed=3, n=16):
    """Prompts of 1-100 tokens cut from the course's stories, half of them after a shared
    system prompt (so prefix caching finds something), and a long tail of max_tokens: most
    requests want a few tokens, a few want many."""
    rng = random.Random(seed)
    docs = corpus(seed=7, n_docs=40)
    requests = []
    for _ in range(n):
        ids = tokenizer(rng.choice(docs))["input_ids"]
        length = rng.randint(1, min(100, len(ids)))
        start = rng.randint(0, len(ids) - length)
        prompt = tokenizer.decode(ids[start:start + length]) or "The"
        if rng.random() < 0.5:
            prompt = SYSTEM + " " + prompt
        max_tokens = min(int(2 * rng.paretovariate(1.0)), 80)
        requests.append((prompt, max(1, max_tokens)))
    return requests


@pytest.fixture(scope="module")
def models(bundled, tiny_llama):
    return {"bundled": bundled, "tiny-llama": tiny_llama}


_REFERENCES = {}


def reference(models, model_name, queue_name, stop_at_eos):
    """The contiguous lesson-03 answers (token ids), computed once per module."""
    key = (model_name, queue_name, stop_at_eos)
    if key not in _REFERENCES:
        model, tokenizer = models[model_name]
        trace = Trace()
        generate_continuous(model, tokenizer, make_queue(queue_name, tokenizer), batch_size=8,
                            progress=False, stop_at_eos=stop_at_eos, trace=trace)
        _REFERENCES[key] = trace.token_ids
    return _REFERENCES[key]


def make_queue(name, tokenizer):
    return course_queue() if name == "course" else long_tailed_queue(tokenizer)


def assert_all_returned(cache: PagedKVCache):
    """No request holds a block: every block is free, every count is zero, nothing is
    reserved, and every cached hash points at a free block that still carries it."""
    manager = cache.manager
    assert manager.tables == {} and manager.reserved == {} and manager.adapters == {}
    assert manager.ref_counts == [0] * manager.num_blocks
    assert sorted(manager.free) == list(range(manager.num_blocks))
    for digest, block in manager.cached.items():
        assert manager.hashes[block] == digest


def assert_consistent(manager: BlockManager):
    """Mid-run: a block's count is the number of tables that hold it, and exactly the blocks
    nobody holds are free."""
    held = {}
    for table in manager.tables.values():
        for block in table:
            held[block] = held.get(block, 0) + 1
    for block in range(manager.num_blocks):
        assert manager.ref_counts[block] == held.get(block, 0)
        assert (block in manager.free) == (block not in held)
    assert manager.available >= 0


# --- the invariant -------------------------------------------------------------------------

VARIANTS = [  # (prefix_caching, max_prefill_tokens)
    pytest.param(False, None, id="plain"),
    pytest.param(True, None, id="prefix"),
    pytest.param(False, 8, id="chunked"),
    pytest.param(True, 8, id="prefix+chunked"),
]


@pytest.mark.parametrize("stop_at_eos", [False, True], ids=["ignore-eos", "stop-at-eos"])
@pytest.mark.parametrize("queue_name", ["course", "long-tailed"])
@pytest.mark.parametrize("model_name", ["bundled", "tiny-llama"])
@pytest.mark.parametrize("prefix_caching, max_prefill_tokens", VARIANTS)
def test_paged_gives_the_tokens_of_the_contiguous_cache(models, model_name, queue_name,
                                                        stop_at_eos, prefix_caching,
                                                        max_prefill_tokens):
    model, tokenizer = models[model_name]
    requests = make_queue(queue_name, tokenizer)
    cache = PagedKVCache(model, num_blocks=300, block_size=4, prefix_caching=prefix_caching)
    trace = Trace()
    answers = generate_paged(model, tokenizer, requests, batch_size=8, stop_at_eos=stop_at_eos,
                             trace=trace, cache=cache, max_prefill_tokens=max_prefill_tokens)
    assert trace.token_ids == reference(models, model_name, queue_name, stop_at_eos)
    assert answers == [tokenizer.decode(ids) for ids in trace.token_ids]
    assert_all_returned(cache)
    # The switches did something: cached prompt tokens were skipped, long prompts were chunked.
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p, _ in requests)
    assert cache.prefill_tokens + cache.cached_tokens == prompt_tokens
    assert (cache.cached_tokens > 0) == prefix_caching
    prefills = [rid for step in trace.steps if step.kind == "prefill" for rid in step.rows]
    if max_prefill_tokens is None:        # every prompt read in one forward pass
        assert sorted(prefills) == list(range(len(requests)))
    else:
        # No prefill step read more than the budget, and decode steps ran between chunks.
        assert trace.prefill_steps >= -(-cache.prefill_tokens // max_prefill_tokens)
        assert len(prefills) > len(requests)
        if queue_name == "long-tailed":    # its long prompts take several chunks
            assert _chunks_between_decodes(trace)


def _chunks_between_decodes(trace) -> bool:
    """Some request was prefilled in chunks with a decode step of others in between."""
    steps = trace.steps
    return any(a.kind == "prefill" and b.kind == "decode" and c.kind == "prefill"
               and set(a.rows) & set(c.rows) for a, b, c in zip(steps, steps[1:], steps[2:]))


def test_a_small_pool_makes_requests_wait_and_changes_no_answer(models):
    """With room for one long request and a few short ones at a time, the scheduler admits
    fewer than 8 rows (it waits for blocks), and every answer stays the same."""
    model, tokenizer = models["bundled"]
    requests = course_queue()
    cache = PagedKVCache(model, num_blocks=20, block_size=8)   # a 100-token request needs 14
    trace = Trace()
    generate_paged(model, tokenizer, requests, batch_size=8, stop_at_eos=False, trace=trace,
                   cache=cache)
    assert trace.token_ids == reference(models, "bundled", "course", False)
    assert_all_returned(cache)
    busiest = max(sum(rid is not None for rid in step.slots) for step in trace.steps)
    assert busiest < 8
    assert trace.decode_steps > 126   # the ideal schedule with 8 free slots (lesson 03)


def test_a_request_that_can_never_fit_is_refused_clearly(models):
    model, tokenizer = models["bundled"]
    with pytest.raises(PoolExhausted, match=r"needs \d+ free blocks .* only 4 of 4 are free"):
        generate_paged(model, tokenizer, [("Jack and Jill", 3), ("Humpty Dumpty sat", 60)],
                       num_blocks=4, block_size=8)


def test_block_accounting_holds_at_every_step(models):
    """Drive the lesson-03 loop by hand and check the counts after every forward pass."""
    model, tokenizer = models["tiny-llama"]
    cache = PagedKVCache(model, num_blocks=60, block_size=4)
    requests = [(SYSTEM + " Jack and Jill", 6), (SYSTEM + " Humpty", 3), ("The rain", 5)]
    batch = init_paged_batch(tokenizer, cache, requests[:2], [0, 1])
    assert batch.computed == [0, 0]           # nothing cached yet
    while not batch.prefilled:
        paged_next_token(model, tokenizer, cache, batch, max_prefill_tokens=6)
        assert_consistent(cache.manager)
    # Request 2 (request 0's prompt again) finds the system prompt's full blocks cached;
    # request 3 shares nothing.
    later = init_paged_batch(tokenizer, cache, [requests[0], requests[2]], [2, 3])
    system_blocks = (len(tokenizer(SYSTEM)["input_ids"])) // 4
    assert later.computed[0] >= 4 * system_blocks and later.computed[1] == 0
    assert later.block_tables[0][:system_blocks] == batch.block_tables[0][:system_blocks]
    shared = batch.block_tables[0][0]
    assert cache.manager.ref_counts[shared] == 2     # requests 0 and 2
    paged_next_token(model, tokenizer, cache, later)
    batch = merge_paged_batches(batch, later)
    assert batch.request_ids == [0, 1, 2, 3] and len(batch.block_tables) == 4
    while len(batch):
        paged_next_token(model, tokenizer, cache, batch)
        assert_consistent(cache.manager)
        batch = filter_paged_batch(cache, batch)
        assert_consistent(cache.manager)
    assert_all_returned(cache)
    assert cache.manager.hashes[shared] is not None and shared in cache.manager.free


# --- prefix caching ------------------------------------------------------------------------

def test_a_shared_prefix_is_computed_once(models):
    model, tokenizer = models["bundled"]
    prefix = " ".join([SYSTEM] * 4)
    first, second = (prefix + " The cat said", 8), (prefix + " The old man said", 8)
    ids1, ids2 = (tokenizer(p)["input_ids"] for p, _ in (first, second))
    common = next(i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b)
    assert common >= 64
    cache = PagedKVCache(model, num_blocks=64, block_size=16)
    answers = [generate_paged(model, tokenizer, [request], cache=cache)[0]
               for request in (first, second)]
    assert answers == generate_sequential(model, tokenizer, [first, second])
    hits = common // 16                       # the full blocks inside the shared prefix
    assert cache.manager.hit_blocks == hits
    assert cache.cached_tokens == 16 * hits
    assert cache.prefill_tokens == len(ids1) + len(ids2) - 16 * hits
    assert_all_returned(cache)
    # Without prefix caching the second prompt is read in full.
    plain = PagedKVCache(model, num_blocks=64, block_size=16, prefix_caching=False)
    for request in (first, second):
        generate_paged(model, tokenizer, [request], cache=plain)
    assert plain.manager.hit_blocks == plain.cached_tokens == 0
    assert plain.prefill_tokens == cache.prefill_tokens + cache.cached_tokens


def test_freed_cached_blocks_are_evicted_least_recently_used_first():
    manager = BlockManager(num_blocks=4, block_size=2)
    for rid, prompt in enumerate(([1, 2, 3], [4, 5, 6])):
        manager.allocate(rid, prompt, max_new_tokens=1)       # 2 blocks each
        manager.grow(rid, 3)
        manager.commit(rid, prompt)                           # the first block is full
        manager.free_request(rid)
    assert len(manager.cached) == 2 and manager.available == 4
    # Unhashed blocks are handed out first, then the cached block freed first ([1, 2]).
    manager.allocate(9, [7, 8, 9, 10, 11], max_new_tokens=1)
    manager.grow(9, 5)
    assert len(manager.cached) == 1
    assert manager.cached_prefix([4, 5, 6], None) and not manager.cached_prefix([1, 2, 3], None)
    manager.free_request(9)
    assert manager.ref_counts == [0] * 4


# --- adapters ------------------------------------------------------------------------------

@pytest.fixture
def bundled_with_adapters(bundled):
    model, tokenizer = bundled
    lora = load_adapters(model, shipped_adapters())
    yield model, tokenizer, lora
    lora.remove()


def adapter_reference(model, tokenizer, lora: MultiLora, requests, adapters):
    """Each request alone with its adapter (the lesson-06 way)."""
    answers = []
    for request, adapter in zip(requests, adapters):
        with lora.rows([adapter]):
            answers.append(generate_sequential(model, tokenizer, [request])[0])
    return answers


@pytest.mark.parametrize("prefix_caching, max_prefill_tokens", VARIANTS)
def test_adapters_on_the_paged_cache(bundled_with_adapters, prefix_caching, max_prefill_tokens):
    model, tokenizer, lora = bundled_with_adapters
    prompt = "Tom the fox and Anna the owl found a golden key in the old mill."
    names = lora.names
    adapters = [names[i % len(names)] if i % 5 else None for i in range(10)]
    requests = [(prompt if i % 2 else COURSE_PROMPTS[i % 5], 12) for i in range(10)]
    expected = adapter_reference(model, tokenizer, lora, requests, adapters)
    cache = PagedKVCache(model, num_blocks=80, block_size=4, prefix_caching=prefix_caching)
    got = generate_paged(model, tokenizer, requests, batch_size=4, cache=cache, adapters=adapters,
                         lora=lora, max_prefill_tokens=max_prefill_tokens)
    assert got == expected
    assert lora.current_rows is None               # the rows are put back
    assert_all_returned(cache)


def test_different_adapters_never_share_blocks(bundled_with_adapters):
    model, tokenizer, lora = bundled_with_adapters
    prompt = "Tom the fox and Anna the owl found a golden key in the old mill."
    full = (len(tokenizer(prompt)["input_ids"]) - 1) // 4
    first = [lora.names[0], lora.names[1], None]
    cache = PagedKVCache(model, num_blocks=60, block_size=4)
    generate_paged(model, tokenizer, [(prompt, 4)] * 3, cache=cache, adapters=first, lora=lora)
    # One cached copy of the prompt's blocks per adapter, none shared.
    assert len(cache.manager.cached) >= 3 * full and cache.manager.hit_blocks == 0
    # Each adapter finds its own blocks again; an adapter not seen yet finds none.
    second = [lora.names[1], lora.names[2], None, lora.names[0]]
    requests = [(prompt, 4)] * 4
    got = generate_paged(model, tokenizer, requests, batch_size=1, cache=cache,
                         adapters=second, lora=lora)
    assert cache.manager.hit_blocks == 3 * full
    assert got == adapter_reference(model, tokenizer, lora, requests, second)
    hashes = {block_hash(None, [1, 2], "a"), block_hash(None, [1, 2], "b"),
              block_hash(None, [1, 2])}
    assert len(hashes) == 3


# --- the pieces ----------------------------------------------------------------------------

def test_block_manager_refuses_clearly_and_changes_nothing():
    manager = BlockManager(num_blocks=5, block_size=4)
    manager.allocate("a", list(range(6)), max_new_tokens=6)           # 3 blocks reserved
    assert manager.available == 2 and len(manager.free) == 5        # reserved, not taken
    with pytest.raises(PoolExhausted, match="needs 3 free blocks of 4 tokens .* only 2 of 5"):
        manager.allocate("b", list(range(6)), max_new_tokens=6)
    assert "b" not in manager.tables and manager.available == 2
    assert manager.grow("a", 6) == manager.tables["a"] and len(manager.tables["a"]) == 2
    assert manager.used == 2 and manager.available == 2
    with pytest.raises(PoolExhausted, match="grew past"):
        manager.grow("a", 13)
    with pytest.raises(ValueError, match="already has blocks"):
        manager.allocate("a", [1], 1)
    with pytest.raises(ValueError, match="has no blocks"):
        manager.free_request("zzz")
    with pytest.raises(ValueError, match="prompt is empty"):
        manager.allocate("c", [], 1)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        manager.allocate("c", [1], 0)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            BlockManager(bad, 4)


def test_block_hashes_chain_from_the_start():
    a = block_hash(None, [5, 6])
    assert block_hash(a, [7, 8]) != block_hash(block_hash(None, [1, 2]), [7, 8])
    assert block_hash(a, [7, 8]) == block_hash(block_hash(None, [5, 6]), [7, 8])
    manager = BlockManager(num_blocks=8, block_size=2)
    manager.allocate(0, [1, 2, 3, 4, 5], 1)
    manager.grow(0, 5)
    manager.commit(0, [1, 2, 3, 4, 5])
    # Same second block, different first block: no hit at all.
    assert manager.cached_prefix([9, 9, 3, 4, 5], None) == []
    assert manager.cached_prefix([1, 2, 3, 4, 5], None) == manager.tables[0][:2]
    # The last prompt token is always computed: a prompt of exactly two blocks reuses one.
    assert manager.cached_prefix([1, 2, 3, 4], None) == manager.tables[0][:1]


def test_paged_forward_pool_indices_and_mask():
    class Pool:
        block_size = 4

    # Row 0: 5 tokens in blocks [7, 2], feeding its 6th; row 1: a 3-token prompt in block [5].
    forward = PagedForward.build(Pool(), [[7, 2], [5]], starts=[5, 0], new_counts=[1, 3],
                                 device="cpu")
    # Pool index = block * block_size + offset: position 5 is block 2, offset 1.
    assert forward.write_indices.tolist() == [[-1, -1, 2 * 4 + 1], [20, 21, 22]]
    assert forward.read_indices.tolist() == [[28, 29, 30, 31, 8, 9], [20, 21, 22, 0, 0, 0]]
    assert pool_indices([7, 2], torch.arange(6), 4).tolist() == forward.read_indices[0].tolist()
    mask = forward.mask[:, 0].int().tolist()
    assert mask[0][2] == [1, 1, 1, 1, 1, 1]               # the new token sees all six
    assert mask[1] == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]]


@pytest.mark.parametrize("model_name", ["bundled", "tiny-llama"])
def test_paged_attention_computes_what_sdpa_computes(models, model_name):
    model, tokenizer = models[model_name]
    ids = tokenizer(SYSTEM)["input_ids"]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    cache = PagedKVCache(model, num_blocks=10, block_size=4)
    layers, kv_heads, head_dim = kv_shape(model.config)
    assert cache.pool.keys[0].shape == (40, kv_heads, head_dim) and len(cache.pool.keys) == layers
    cache.manager.allocate(0, ids, 1)
    table = cache.manager.grow(0, len(ids))
    # Two passes, split in the middle of a block: the second reads the first's keys back.
    cut = 10
    logits = []
    for start, new in ((0, cut), (cut, len(ids) - cut)):
        forward = PagedForward.build(cache.pool, [table], [start], [new], model.device)
        with model_uses_paged_attention(model), torch.no_grad():
            out = model(input_ids=torch.tensor([ids[start:start + new]]),
                        position_ids=torch.arange(start, start + new)[None], use_cache=False,
                        paged=forward)
        logits.append(out.logits[0])
    torch.testing.assert_close(torch.cat(logits), expected, atol=1e-4, rtol=1e-4)
    assert model.config._attn_implementation == "sdpa"    # put back


def test_the_attention_function_is_registered_and_says_what_it_needs(models):
    from transformers import AttentionInterface

    model, tokenizer = models["tiny-llama"]
    with model_uses_paged_attention(model):
        assert AttentionInterface()[PAGED_ATTENTION] is paged_attention
        with pytest.raises(ValueError, match="paged=PagedForward"):
            model(torch.tensor([[1, 2, 3]]), use_cache=False)


def test_bad_input_is_refused(models):
    model, tokenizer = models["tiny-llama"]
    cache = PagedKVCache(model, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="1 requests, 2 request_ids"):
        init_paged_batch(tokenizer, cache, [("Jack", 3)], [0, 1])
    with pytest.raises(ValueError, match="prompt is empty"):
        init_paged_batch(tokenizer, cache, [("Jack", 3), ("", 3)])
    assert cache.manager.tables == {}                  # all or nothing
    batch = init_paged_batch(tokenizer, cache, [("Jack", 3)])
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        paged_next_token(model, tokenizer, cache, batch, max_prefill_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        paged_next_token(model, tokenizer, cache, PagedBatch.empty())
    with pytest.raises(ValueError, match="lora is None"):
        generate_paged(model, tokenizer, [("Jack", 3)], adapters=["rhymes"])
    with pytest.raises(ValueError, match="2 adapters for 1 requests"):
        generate_paged(model, tokenizer, [("Jack", 3)], adapters=[None, None])
    with pytest.raises(ValueError, match="either cache or num_blocks"):
        generate_paged(model, tokenizer, [("Jack", 3)], cache=cache, num_blocks=8)


# --- lesson 08's measurements (helpers.paged.measure): what they record, not how fast -------

def test_padded_cache_widths_records_lesson_03s_run(models):
    model, tokenizer = models["bundled"]
    queue = [(COURSE_PROMPTS[i % 5], 12 if i % 4 == 0 else 3) for i in range(8)]
    token_ids, widths = padded_cache_widths(model, tokenizer, queue, batch_size=3)
    trace = Trace()
    generate_continuous(model, tokenizer, queue, batch_size=3, progress=False,
                        stop_at_eos=False, trace=trace)
    assert token_ids == trace.token_ids
    assert len(widths) == trace.decode_steps
    for width, real in widths:
        assert 1 <= len(real) <= 3 and max(real) <= width
    assert any(min(real) < width for _, real in widths)          # padding was carried
    with pytest.raises(ValueError, match="batch_size"):
        padded_cache_widths(model, tokenizer, queue, batch_size=0)


def test_ttft_one_after_another_finds_the_shared_prefix(models):
    model, tokenizer = models["bundled"]
    prefix = " ".join([SYSTEM] * 3)
    requests = [(prefix + " " + prompt, 2) for prompt in COURSE_PROMPTS[:3]]
    cached, seconds, token_ids = ttft_one_after_another(model, tokenizer, requests, runs=2)
    plain, plain_seconds, plain_ids = ttft_one_after_another(model, tokenizer, requests, runs=1,
                                                             prefix_caching=False)
    assert token_ids == plain_ids
    assert len(seconds) == len(plain_seconds) == 3 and min(seconds + plain_seconds) > 0
    assert plain.cached_tokens == 0 and cached.cached_tokens > 0   # requests 1 and 2 found it
    assert cached.cached_tokens + cached.prefill_tokens == plain.prefill_tokens
    assert_all_returned(cached)
    with pytest.raises(ValueError, match="runs must be a positive integer"):
        ttft_one_after_another(model, tokenizer, requests, runs=0)
    with pytest.raises(ValueError, match="requests is empty"):
        ttft_one_after_another(model, tokenizer, [])


def test_fastest_step_times_keeps_each_steps_shortest_time(models):
    model, tokenizer = models["tiny-llama"]
    arrivals = [("Jack and Jill", 6), ("Humpty Dumpty sat", 6), ("What comes up must", 1),
                (" ".join([SYSTEM] * 2), 2)]
    trace, seconds = fastest_step_times(model, tokenizer, arrivals, runs=2, batch_size=2,
                                        stop_at_eos=False, max_prefill_tokens=8)
    assert len(seconds) == len(trace.steps)
    assert all(0 < fastest <= step.seconds for fastest, step in zip(seconds, trace.steps))
    whole = Trace()
    generate_paged(model, tokenizer, arrivals, batch_size=2, stop_at_eos=False, trace=whole,
                   progress=False)
    assert trace.token_ids == whole.token_ids and trace.prefill_steps > whole.prefill_steps
    with pytest.raises(ValueError, match="runs must be a positive integer"):
        fastest_step_times(model, tokenizer, arrivals, runs=0)
    with pytest.raises(ValueError, match="leave trace out"):
        fastest_step_times(model, tokenizer, arrivals, trace=Trace())


def test_worst_gap_and_time_to_first_token_on_a_trace_made_by_hand():
    from helpers import Step

    # Rows 0 and 1 stream; request 2's prompt is read in two chunks between their tokens.
    steps = [Step("prefill", [0, 1], [0, 1], 1.0, 2), Step("decode", [0, 1], [0, 1], 0.5, 2),
             Step("prefill", [2], [0, 1], 2.0, 0), Step("decode", [0, 1], [0, 1], 0.5, 2),
             Step("prefill", [2], [0, 1], 1.0, 1), Step("decode", [0, 1, 2], [0, 1], 0.5, 3)]
    trace = Trace(steps=steps)
    # Tokens of rows 0 and 1 at 1.5, 4.0 and 5.5 s: the chunk of 2 s made the worst pause.
    assert worst_inter_token_gap(trace, [0, 1]) == pytest.approx(2.5)
    assert worst_inter_token_gap(trace, [0], seconds=[1] * 6) == pytest.approx(2.0)
    # Request 2's prompt is read from 1.5 s to 5.0 s; request 0's from 0 to 1 s.
    assert time_to_first_token(trace, 2) == pytest.approx(3.5)
    assert time_to_first_token(trace, 0, seconds=[2] * 6) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="2 step times for a trace of 6 steps"):
        worst_inter_token_gap(trace, [0], seconds=[1, 1])
    with pytest.raises(ValueError, match="request_ids is empty"):
        worst_inter_token_gap(trace, [])
    with pytest.raises(ValueError, match="no gap to measure"):
        worst_inter_token_gap(trace, [2])                  # one token only
    with pytest.raises(ValueError, match="request 9 has no prefill pass"):
        time_to_first_token(trace, 9)
