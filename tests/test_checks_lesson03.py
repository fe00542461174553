"""Lesson 03's checks pass the course's functions, say "not written yet" for a stub, and catch
the mistakes learners make in merge_batches and filter_batch, each with a hint at its symptom."""

import time

import pytest
import torch
import torch.nn.functional as F

from helpers import Batch, cache_from_layers, cache_layers, filter_batch, merge_batches
from helpers.checks import check_filter_batch, check_merge_batches
from tests.answers import Exercise, pick
from tests.checking import assert_caught, assert_not_written, assert_passes

pytestmark = pytest.mark.usefixtures("one_thread")


def _rebuild(batch, **changes):
    fields = dict(request_ids=batch.request_ids, max_tokens=batch.max_tokens,
                  token_ids=batch.token_ids, done=batch.done, input_ids=batch.input_ids,
                  attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                  past_key_values=batch.past_key_values)
    fields.update(changes)
    return Batch(**fields)


# ---- merge_batches: typical mistakes ---------------------------------------------------------

def _merge(batch1, batch2, side="left", cache_order=(0, 1), pad_cache=True, empty=True,
           empty_second=True, cache_side=None):
    if empty and len(batch1) == 0:
        return batch2
    if empty_second and len(batch2) == 0:
        return batch1
    width = max(batch1.attention_mask.shape[1], batch2.attention_mask.shape[1])

    def pad(batch):
        missing = width - batch.attention_mask.shape[1]
        where = (missing, 0) if side == "left" else (0, missing)
        mask = F.pad(batch.attention_mask, where, value=0)
        at = where if (cache_side or side) == side else where[::-1]
        layers = [(F.pad(k, (0, 0) + at), F.pad(v, (0, 0) + at)) if pad_cache else (k, v)
                  for k, v in cache_layers(batch.past_key_values)]
        return mask, layers

    (m1, l1), (m2, l2) = pad(batch1), pad(batch2)
    pairs = [(a, b) if cache_order == (0, 1) else (b, a) for a, b in zip(l1, l2)]
    layers = [(torch.cat([ka, kb]), torch.cat([va, vb])) for (ka, va), (kb, vb) in pairs]
    return Batch(request_ids=batch1.request_ids + batch2.request_ids,
                 max_tokens=batch1.max_tokens + batch2.max_tokens,
                 token_ids=batch1.token_ids + batch2.token_ids, done=batch1.done + batch2.done,
                 input_ids=torch.cat([batch1.input_ids, batch2.input_ids]),
                 attention_mask=torch.cat([m1, m2]),
                 position_ids=torch.cat([batch1.position_ids, batch2.position_ids]),
                 past_key_values=cache_from_layers(layers))


def merge_right_padding(b1, b2):
    return _merge(b1, b2, side="right")


def merge_padding_only_the_cache_on_the_right(b1, b2):
    return _merge(b1, b2, cache_side="right")


def merge_cache_in_wrong_order(b1, b2):
    return _merge(b1, b2, cache_order=(1, 0))


def merge_without_padding_the_cache(b1, b2):
    return _merge(b1, b2, pad_cache=False)


def merge_forgetting_the_empty_batch(b1, b2):
    return _merge(b1, b2, empty=False)


def merge_rows_swapped(b1, b2):
    return _merge(b2, b1) if len(b1) else b2


def merge_forgetting_an_empty_second_batch(b1, b2):
    return _merge(b1, b2, empty_second=False)


def _zeros_merge(batch1, batch2, mask_dtype=torch.long, heads=None, on_cpu=False):
    """merge_batches that pads by concatenating zeros made by hand."""
    if len(batch1) == 0:
        return batch2
    if len(batch2) == 0:
        return batch1
    width = max(batch1.attention_mask.shape[1], batch2.attention_mask.shape[1])

    def pad(batch):
        missing = width - batch.attention_mask.shape[1]
        rows = len(batch)
        zeros = (torch.zeros(rows, missing, dtype=mask_dtype) if on_cpu
                 else batch.attention_mask.new_zeros((rows, missing), dtype=mask_dtype))
        mask = torch.cat([zeros, batch.attention_mask], dim=1)
        layers = []
        for keys, values in cache_layers(batch.past_key_values):
            shape = (rows, heads or keys.shape[1], missing, keys.shape[3])
            layers.append((torch.cat([keys.new_zeros(shape), keys], dim=2),
                           torch.cat([values.new_zeros(shape), values], dim=2)))
        return mask, layers

    (m1, l1), (m2, l2) = pad(batch1), pad(batch2)
    layers = [(torch.cat([k1, k2]), torch.cat([v1, v2])) for (k1, v1), (k2, v2) in zip(l1, l2)]
    return Batch(request_ids=batch1.request_ids + batch2.request_ids,
                 max_tokens=batch1.max_tokens + batch2.max_tokens,
                 token_ids=batch1.token_ids + batch2.token_ids, done=batch1.done + batch2.done,
                 input_ids=torch.cat([batch1.input_ids, batch2.input_ids]),
                 attention_mask=torch.cat([m1, m2]),
                 position_ids=torch.cat([batch1.position_ids, batch2.position_ids]),
                 past_key_values=cache_from_layers(layers))


def merge_with_zeros_made_by_hand(b1, b2):
    """Right, written another way: the padding concatenated as zeros."""
    return _zeros_merge(b1, b2)


def merge_with_a_float_mask(b1, b2):
    return _zeros_merge(b1, b2, mask_dtype=torch.float32)


def merge_padding_with_the_attention_heads(b1, b2):
    return _zeros_merge(b1, b2, heads=4)          # the models here have 4 attention heads


def merge_with_a_mask_made_on_the_cpu(b1, b2):
    return _zeros_merge(b1, b2, on_cpu=True)


MERGE_MISTAKES = {
    merge_right_padding: "row 2 of the attention mask ends in padding",
    merge_padding_only_the_cache_on_the_right: "padded on the right",
    merge_cache_in_wrong_order: "in another order than the attention mask",
    merge_without_padding_the_cache: "pad the shorter one's keys and values on the left",
    merge_forgetting_the_empty_batch: "an empty batch has no cache yet",
    merge_rows_swapped: "rows are in the wrong order",
    merge_forgetting_an_empty_second_batch: "an empty batch has no cache yet: return the other",
    merge_with_a_float_mask: "attention_mask holds float32 (torch.float), expected int64 (torch.long)",
    merge_padding_with_the_attention_heads: "this model's cache has 2 kv heads, fewer than its 4 attention heads",
}


# ---- filter_batch: typical mistakes ----------------------------------------------------------

def _filter(batch, trim="both", offset=0, drop_finished=True):
    keep = [r for r, d in enumerate(batch.done) if not d or not drop_finished]
    if not keep or all(batch.done):
        return Batch.empty()
    rows = torch.tensor(keep)
    mask = batch.attention_mask[rows]
    first = int(mask.any(dim=0).int().argmax()) + offset if trim != "none" else 0
    cache_first = first if trim == "both" else 0
    layers = [(k[rows, :, cache_first:], v[rows, :, cache_first:])
              for k, v in cache_layers(batch.past_key_values)]
    return _rebuild(batch, request_ids=[batch.request_ids[r] for r in keep],
                    max_tokens=[batch.max_tokens[r] for r in keep],
                    token_ids=[batch.token_ids[r] for r in keep], done=[False] * len(keep),
                    input_ids=batch.input_ids[rows], attention_mask=mask[:, first:],
                    position_ids=batch.position_ids[rows], past_key_values=cache_from_layers(layers))


def filter_without_trimming(batch):
    return _filter(batch, trim="none")


def filter_trimming_the_mask_only(batch):
    return _filter(batch, trim="mask")


def filter_one_column_too_many(batch):
    return _filter(batch, offset=1)


def filter_keeping_finished_rows(batch):
    return _filter(batch, drop_finished=False)


def filter_with_a_boolean_index(batch):
    """Right, written another way: rows picked with a boolean mask."""
    keep = torch.tensor([not done for done in batch.done])
    if not keep.any():
        return Batch.empty()
    mask = batch.attention_mask[keep.to(batch.attention_mask.device)]
    first = int(mask.any(dim=0).int().argmax())
    rows = keep.nonzero().flatten().tolist()
    layers = [(k[keep.to(k.device)][:, :, first:], v[keep.to(v.device)][:, :, first:])
              for k, v in cache_layers(batch.past_key_values)]
    return _rebuild(batch, request_ids=[batch.request_ids[r] for r in rows],
                    max_tokens=[batch.max_tokens[r] for r in rows],
                    token_ids=[batch.token_ids[r] for r in rows], done=[False] * len(rows),
                    input_ids=batch.input_ids[keep.to(batch.input_ids.device)],
                    attention_mask=mask[:, first:],
                    position_ids=batch.position_ids[keep.to(batch.position_ids.device)],
                    past_key_values=cache_from_layers(layers))


FILTER_MISTAKES = {
    filter_without_trimming: "padding in every remaining row",
    filter_trimming_the_mask_only: "keys hold 6 tokens, expected 4",
    filter_one_column_too_many: "attention_mask has shape",
    filter_keeping_finished_rows: "is done and should have left",
}


# ---- inputs changed in place: right results, but the caller's batches changed --------------

def merge_extending_the_first_batchs_lists(b1, b2):
    if len(b1) == 0 or len(b2) == 0:
        return merge_batches(b1, b2)
    lists = {}
    for name in ("request_ids", "max_tokens", "token_ids", "done"):
        mine = getattr(b1, name)
        mine += getattr(b2, name)                 # += extends batch1's own list
        lists[name] = mine
    merged = merge_batches(_rebuild(b1, **{k: v[:len(b1.input_ids)] for k, v in lists.items()}),
                           b2)
    return _rebuild(merged, **lists)


def filter_dropping_rows_from_the_input(batch):
    result = filter_batch(_rebuild(batch, **{name: list(getattr(batch, name)) for name in
                                             ("request_ids", "max_tokens", "token_ids", "done")}))
    for row in reversed(range(len(batch.done))):
        if batch.done[row]:                       # the caller's lists lose the finished rows
            for name in ("request_ids", "max_tokens", "token_ids", "done"):
                del getattr(batch, name)[row]
    return result


IN_PLACE = {
    merge_extending_the_first_batchs_lists: "changed its input batch1 in place",
    filter_dropping_rows_from_the_input: "changed its input batch in place",
}


# ---- the tests -------------------------------------------------------------------------------

def test_merge_check_passes_the_course_function_quickly(bundled):
    start = time.perf_counter()
    assert_passes(check_merge_batches, merge_batches, *bundled)
    assert_passes(check_merge_batches, merge_with_zeros_made_by_hand, *bundled)
    assert time.perf_counter() - start < 10   # ≤ 2 s on a quiet 2-core machine


def test_merge_check_says_not_written_for_a_stub(bundled):
    assert_not_written(check_merge_batches, *bundled, fallback=merge_batches)


@pytest.mark.parametrize("mistake", MERGE_MISTAKES, ids=lambda f: f.__name__)
def test_merge_check_catches(mistake, bundled):
    assert_caught(check_merge_batches, mistake, *bundled, symptom=MERGE_MISTAKES[mistake],
                  fallback=merge_batches)


def test_filter_check_passes_the_course_function(bundled):
    assert_passes(check_filter_batch, filter_batch, *bundled)
    assert_passes(check_filter_batch, filter_with_a_boolean_index, *bundled)


def test_filter_check_says_not_written_for_a_stub(bundled):
    assert_not_written(check_filter_batch, *bundled, fallback=filter_batch)


@pytest.mark.parametrize("mistake", FILTER_MISTAKES, ids=lambda f: f.__name__)
def test_filter_check_catches(mistake, bundled):
    assert_caught(check_filter_batch, mistake, *bundled, symptom=FILTER_MISTAKES[mistake],
                  fallback=filter_batch)


EXERCISES = [
    Exercise("merge_batches", check_merge_batches, ("model", "tokenizer"), merge_batches,
             right=[merge_batches, merge_with_zeros_made_by_hand],
             wrong={**MERGE_MISTAKES, **pick(IN_PLACE, merge_extending_the_first_batchs_lists),
                    merge_with_a_mask_made_on_the_cpu: "a tensor made on the CPU met one on the GPU"}),
    Exercise("filter_batch", check_filter_batch, ("model", "tokenizer"), filter_batch,
             right=[filter_batch, filter_with_a_boolean_index],
             wrong={**FILTER_MISTAKES, **pick(IN_PLACE, filter_dropping_rows_from_the_input)}),
]
