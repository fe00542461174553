"""Lesson 03's checks: the learner's ``merge_batches`` and ``filter_batch``.

Each case builds real batches with the course's ``init_batch`` and ``generate_next_token`` on
the lesson's model (and on a tiny Llama-style model whose 4 attention heads share 2 kv heads),
runs the learner's function and the course's on copies of the same batches, and compares every
list, every tensor (values, dtype and device) and every layer of the KV cache; the batches it
was given must come back as they were. ``merge_batches`` also meets an empty batch on either
side and two empty ones, as the lesson's loop does.
"""

from __future__ import annotations

import copy
import re

import torch

from ..batching import (Batch, cache_layers, filter_batch, generate_next_token, init_batch,
                        merge_batches)
from .core import Hint, expect_equal, expect_tensor, expect_unchanged, run_check

RUNNING = [("The rain in Spain falls", 2), ("Jack and Jill", 5)]
NEWCOMER = [("Humpty Dumpty sat", 4)]
LONG_NEWCOMER = [("Once upon a time a little fox lived by the river and", 3)]


def _tiny_gqa(tokenizer):
    """A small random Llama-style model (4 attention heads, 2 kv heads), built locally."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(config).eval()


def _prefilled(model, tokenizer, requests, first_id=0):
    batch = init_batch(tokenizer, requests, request_ids=list(range(first_id, first_id + len(requests))))
    return generate_next_token(model, tokenizer, batch, stop_at_eos=False)


def _copy(batch: Batch) -> Batch:
    """A deep copy, so that a function that changes its input cannot change the other run's."""
    return copy.deepcopy(batch)


def _row_order(got: torch.Tensor, expected: torch.Tensor) -> list[int] | None:
    """Where each row of ``expected`` sits in ``got``, when ``got`` holds the same rows in
    another order; else None."""
    order = []
    for want in expected:
        match = [i for i, row in enumerate(got) if i not in order and torch.equal(row, want)]
        if not match:
            return None
        order.append(match[0])
    return order if order != sorted(order) else None


def _expect_batch(got, expected: Batch, what: str) -> None:
    """Compare two batches field by field; the hint names the first field that differs."""
    if not isinstance(got, Batch):
        raise Hint(f"{what} should return a Batch, got {type(got).__name__}")
    expect_equal("the number of rows", len(got), len(expected))
    if len(expected) == 0:
        return
    if sorted(got.request_ids) == sorted(expected.request_ids) and got.request_ids != expected.request_ids:
        raise Hint(f"the rows are in the wrong order: request ids {got.request_ids}, expected "
                   f"{expected.request_ids} (the first batch's rows come first)")
    for field in ("request_ids", "max_tokens", "token_ids", "done"):
        expect_equal(field, getattr(got, field), getattr(expected, field))
    mask = got.attention_mask
    if (isinstance(mask, torch.Tensor) and mask.shape == expected.attention_mask.shape
            and mask.dim() == 2 and not bool(mask[:, -1].all()) and bool(expected.attention_mask[:, -1].all())):
        row = int((mask[:, -1] == 0).nonzero()[0])
        raise Hint(f"row {row} of the attention mask ends in padding, so it is padded on the "
                   f"right: pad on the left, so that every row's newest token stays in the last "
                   f"column")
    expect_tensor("attention_mask", got.attention_mask, expected.attention_mask)
    expect_tensor("input_ids", got.input_ids, expected.input_ids)
    expect_tensor("position_ids", got.position_ids, expected.position_ids)
    try:
        got_layers = cache_layers(got.past_key_values)
    except AttributeError:
        raise Hint(f"past_key_values should be a KV cache (a DynamicCache), "
                   f"got {type(got.past_key_values).__name__}") from None
    want_layers = cache_layers(expected.past_key_values)
    expect_equal("the number of cache layers", len(got_layers), len(want_layers))
    for layer, ((k, v), (ek, ev)) in enumerate(zip(got_layers, want_layers)):
        if isinstance(k, torch.Tensor) and k.shape != ek.shape and k.dim() == 4 and k.shape[:2] == ek.shape[:2]:
            raise Hint(f"layer {layer}'s keys hold {k.shape[2]} tokens, expected {ek.shape[2]} "
                       f"(shape {tuple(k.shape)} vs {tuple(ek.shape)}: rows, kv heads, tokens, "
                       f"head size): the cache must have the same columns as the attention mask, "
                       f"less the newest token")
        for name, got_t, want_t in (("keys", k, ek), ("values", v, ev)):
            if (isinstance(got_t, torch.Tensor) and got_t.shape == want_t.shape
                    and not torch.equal(got_t, want_t) and _row_order(got_t, want_t)):
                raise Hint(f"layer {layer}'s {name} hold the rows in another order than the "
                           f"attention mask: concatenate the caches in the same order as the "
                           f"rows (first batch first)")
            if (isinstance(got_t, torch.Tensor) and got_t.shape == want_t.shape
                    and got_t.dim() == 4 and _padded_on_the_right(got_t, want_t)):
                raise Hint(f"layer {layer}'s {name} end in zeros where the attention mask has "
                           f"the row's tokens: the cache is padded on the right; pad it on the "
                           f"left (dimension 2), as the mask is")
            expect_tensor(f"layer {layer}'s {name}", got_t, want_t, rows="row", cols="kv head")


def _padded_on_the_right(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether a (rows, kv heads, tokens, head size) cache has its rows' padding (all-zero
    positions) at the end, where the expected one has it at the start."""
    got_pad, want_pad = (got == 0).all(dim=3).all(dim=1), (want == 0).all(dim=3).all(dim=1)
    return bool((got_pad[:, -1] & ~want_pad[:, -1]).any()) and bool(
        (got_pad.sum(dim=1) == want_pad.sum(dim=1)).all())


# ---- merge_batches ------------------------------------------------------------------------

def _heads_hint(error: Exception, mdl) -> None:
    """A Hint when a concatenation failed because zeros were made with the number of attention
    heads where the cache has fewer kv heads (grouped-query attention)."""
    found = re.search(r"Expected size (\d+) but got size (\d+)", str(error))
    heads = mdl.config.num_attention_heads
    kv_heads = getattr(mdl.config, "num_key_value_heads", None) or heads
    if found and kv_heads != heads and {int(found[1]), int(found[2])} == {heads, kv_heads}:
        raise Hint(f"this model's cache has {kv_heads} kv heads, fewer than its {heads} "
                   f"attention heads (grouped-query attention), and the padding was made with "
                   f"{heads}: make it from the keys themselves, F.pad(keys, (0, 0, missing, 0)) "
                   f"or keys.new_zeros with keys.shape[1], not config.num_attention_heads") from None


def _merge_cases(model, tokenizer):
    def checker(learner, cases):
        gqa = _tiny_gqa(tokenizer)
        for label, mdl, first, second in (
            ("2 running rows (5 tokens seen) and a newcomer (3 tokens)",
             model, RUNNING, NEWCOMER),
            ("a newcomer with a longer history", model, NEWCOMER, LONG_NEWCOMER),
            ("a GQA model (4 heads share 2 kv heads)", gqa, RUNNING, NEWCOMER),
        ):
            with cases(label):
                b1 = _prefilled(mdl, tokenizer, first)
                b2 = _prefilled(mdl, tokenizer, second, first_id=len(first))
                expected = merge_batches(_copy(b1), _copy(b2))
                given1, given2 = _copy(b1), _copy(b2)
                try:
                    got = learner(given1, given2)
                except RuntimeError as error:
                    _heads_hint(error, mdl)
                    raise
                expect_unchanged("batch1", b1, given1)
                expect_unchanged("batch2", b2, given2)
                _expect_batch(got, expected, "merge_batches")
        with cases("an empty running batch"):
            b2 = _prefilled(model, tokenizer, NEWCOMER)
            got = learner(Batch.empty(), _copy(b2))
            if isinstance(got, Batch) and len(got) != len(b2):
                raise Hint(f"merging into an empty batch should give the newcomers' "
                           f"{len(b2)} row(s), got {len(got)}")
            _expect_batch(got, b2, "merge_batches")
        with cases("no newcomers: an empty second batch"):
            b1 = _prefilled(model, tokenizer, RUNNING)
            got = learner(_copy(b1), Batch.empty())
            if isinstance(got, Batch) and len(got) != len(b1):
                raise Hint(f"merging an empty batch in should leave the running "
                           f"{len(b1)} row(s), got {len(got)}: when either batch is empty, "
                           f"return the other one")
            _expect_batch(got, b1, "merge_batches")
        with cases("two empty batches"):
            got = learner(Batch.empty(), Batch.empty())
            if not isinstance(got, Batch) or len(got) != 0:
                raise Hint("merging two empty batches should give an empty batch (return "
                           "either one)")
    return checker


MERGE_CAUSES = {
    "Sizes of tensors must match": "the two caches hold histories of different lengths: pad the "
                                   "shorter one's keys and values on the left (dimension 2) first",
    "'NoneType' object has no attribute": "an empty batch has no cache yet: return the other "
                                          "batch when one of them is empty",
}


def check_merge_batches(learner_merge_batches, model, tokenizer):
    """Lesson 03: check the learner's ``merge_batches(batch1, batch2)`` against the course's on
    rows of different history lengths, a GQA model, an empty batch on either side and two
    empty ones; print one line and return the function the rest of the lesson should use."""
    return run_check("merge_batches", learner_merge_batches, _merge_cases(model, tokenizer),
                     fallback=merge_batches, causes=MERGE_CAUSES, gpu=True)


# ---- filter_batch -------------------------------------------------------------------------

def _three_rows(model, tokenizer, steps: int):
    """The lesson's scenario: two rows, a newcomer merged in, then ``steps`` decode steps."""
    batch = merge_batches(_prefilled(model, tokenizer, RUNNING),
                          _prefilled(model, tokenizer, NEWCOMER, first_id=2))
    for _ in range(steps):
        batch = generate_next_token(model, tokenizer, batch, stop_at_eos=False)
    return batch


def _filter_cases(model, tokenizer):
    def checker(learner, cases):
        gqa = _tiny_gqa(tokenizer)
        scenarios = [
            ("1 of 3 rows finished; 2 columns of shared padding",
             lambda m: _three_rows(m, tokenizer, 1)),
            ("no row finished, no shared padding",
             lambda m: _prefilled(m, tokenizer, [("The rain in Spain falls", 9), ("Jack and Jill went", 9)])),
            ("a row that finished at its prefill",
             lambda m: _prefilled(m, tokenizer, [("Once upon a time a little fox lived by the", 1),
                                                 ("Jack and Jill", 5)])),
            ("every row finished", lambda m: _prefilled(m, tokenizer, [("Jack and Jill", 1),
                                                                       ("Humpty Dumpty sat", 1)])),
            ("1 of 3 rows finished, on a GQA model",
             lambda m: _three_rows(m, tokenizer, 1)),
        ]
        for label, build in scenarios:
            with cases(label):
                batch = build(gqa if "GQA" in label else model)
                finished = [rid for rid, done in zip(batch.request_ids, batch.done) if done]
                expected = filter_batch(_copy(batch))
                given = _copy(batch)
                got = learner(given)
                expect_unchanged("batch", batch, given)
                if isinstance(got, Batch):
                    left = [rid for rid in finished if rid in got.request_ids]
                    if left:
                        raise Hint(f"request {left[0]} is done and should have left the batch")
                    if (len(got) == len(expected) and len(expected) and isinstance(got.attention_mask, torch.Tensor)
                            and got.attention_mask.shape[1] > expected.attention_mask.shape[1]):
                        extra = got.attention_mask.shape[1] - expected.attention_mask.shape[1]
                        raise Hint(f"the attention mask keeps {extra} column(s) on the left that "
                                   f"are padding in every remaining row: cut them, from the mask "
                                   f"and from every layer's keys and values")
                _expect_batch(got, expected, "filter_batch")
    return checker


def check_filter_batch(learner_filter_batch, model, tokenizer):
    """Lesson 03: check the learner's ``filter_batch(batch)`` against the course's (finished
    rows leave, shared padding is cut from the mask and the cache); print one line and return
    the function the rest of the lesson should use."""
    return run_check("filter_batch", learner_filter_batch, _filter_cases(model, tokenizer),
                     fallback=filter_batch, gpu=True)
