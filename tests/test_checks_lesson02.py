"""Lesson 02's checks pass the course's answers, say "not written yet" for a stub, and catch
the mistakes learners make in left padding, position ids and the batched greedy loop, each with
a hint at its symptom."""

import time

import pytest
import torch

from helpers import left_pad, position_ids_from_mask
from helpers.checks import check_batched_greedy, check_left_pad, check_position_ids_from_mask
from helpers.checks.lesson02 import batched_greedy
from tests.answers import Exercise, pick
from tests.checking import assert_caught, assert_not_written, assert_passes

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- left_pad ------------------------------------------------------------------------------

def course_left_pad(token_lists, pad_id):
    """The lesson's solution, as written in its exercise cell."""
    width = max(len(ids) for ids in token_lists)
    input_ids = torch.full((len(token_lists), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(token_lists), width), dtype=torch.long)
    for row, ids in enumerate(token_lists):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    return input_ids, attention_mask


def _pad(token_lists, pad_id, *, side="left", fill=None, flip=False, width=max, dtype=torch.long):
    w = width(len(ids) for ids in token_lists)
    input_ids = torch.full((len(token_lists), w), pad_id if fill is None else fill, dtype=dtype)
    mask = torch.zeros((len(token_lists), w), dtype=torch.long)
    for row, ids in enumerate(token_lists):
        ids = ids[-w:]
        where = slice(w - len(ids), w) if side == "left" else slice(0, len(ids))
        input_ids[row, where] = torch.tensor(ids, dtype=dtype)
        mask[row, where] = 1
    return input_ids, (1 - mask if flip else mask)


def padding_on_the_right(token_lists, pad_id):
    return _pad(token_lists, pad_id, side="right")


def mask_upside_down(token_lists, pad_id):
    return _pad(token_lists, pad_id, flip=True)


def padding_with_zeros(token_lists, pad_id):
    return _pad(token_lists, pad_id, fill=0)


def float_ids(token_lists, pad_id):
    return _pad(token_lists, pad_id, dtype=torch.float32)


def cut_to_the_shortest(token_lists, pad_id):
    return _pad(token_lists, pad_id, width=min)


def only_the_ids(token_lists, pad_id):
    return _pad(token_lists, pad_id)[0]


def a_boolean_mask(token_lists, pad_id):
    ids, mask = _pad(token_lists, pad_id)
    return ids, mask.bool()


def padding_the_lists_in_place(token_lists, pad_id):
    width = max(len(ids) for ids in token_lists)
    masks = []
    for ids in token_lists:
        masks.append([0] * (width - len(ids)) + [1] * len(ids))
        ids[:0] = [pad_id] * (width - len(ids))          # changes the caller's lists
    return torch.tensor(token_lists), torch.tensor(masks)


def left_pad_with_rows_of_lists(token_lists, pad_id):
    """Right, written another way: each row built as a Python list first."""
    width = max(len(ids) for ids in token_lists)
    rows = [[pad_id] * (width - len(ids)) + list(ids) for ids in token_lists]
    masks = [[0] * (width - len(ids)) + [1] * len(ids) for ids in token_lists]
    return torch.tensor(rows), torch.tensor(masks)


LEFT_PAD_MISTAKES = {
    padding_on_the_right: "row 1 ends in padding, so it is padded on the right",
    mask_upside_down: "1 on the padding and 0 on the tokens",
    padding_with_zeros: "expected the pad id 99",
    float_ids: "holds float32",
    cut_to_the_shortest: "pad every row to the LONGEST list",
    only_the_ids: "should return two tensors, (input_ids, attention_mask)",
    a_boolean_mask: "attention_mask holds bool",
    padding_the_lists_in_place: "changed its input token_lists in place",
}


def test_left_pad_check_passes_the_course_solution_quickly(bundled):
    start = time.perf_counter()
    assert_passes(check_left_pad, course_left_pad, bundled[1])
    assert_passes(check_left_pad, left_pad, bundled[1])
    assert_passes(check_left_pad, left_pad_with_rows_of_lists, bundled[1])
    assert time.perf_counter() - start < 5


def test_left_pad_check_says_not_written_for_a_stub(bundled):
    assert_not_written(check_left_pad, bundled[1], fallback=left_pad)


@pytest.mark.parametrize("mistake", LEFT_PAD_MISTAKES, ids=lambda f: f.__name__)
def test_left_pad_check_catches(mistake, bundled):
    assert_caught(check_left_pad, mistake, bundled[1], symptom=LEFT_PAD_MISTAKES[mistake],
                  fallback=left_pad)


# ---- position_ids_from_mask ------------------------------------------------------------------

def course_position_ids_from_mask(attention_mask):
    """The lesson's solution, as written in its exercise cell."""
    positions = attention_mask.long().cumsum(dim=-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def counting_from_one(mask):
    return mask.long().cumsum(dim=-1).masked_fill(mask == 0, 1)


def column_numbers(mask):
    return torch.arange(mask.shape[1]).expand(mask.shape).clone()


def padding_left_at_minus_one(mask):
    return mask.long().cumsum(dim=-1) - 1


def padding_at_zero(mask):
    return (mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def summing_down_the_columns(mask):
    return (mask.long().cumsum(dim=0) - 1).masked_fill(mask == 0, 1)


def positions_in_float(mask):
    return (mask.float().cumsum(dim=-1) - 1).masked_fill(mask == 0, 1)


def positions_in_the_mask_itself(mask):
    positions = mask.cumsum_(dim=-1)                     # the lesson's mask is changed
    return (positions - 1).masked_fill(positions == 0, 1)


def positions_with_where(mask):
    """Right, written another way."""
    return torch.where(mask.bool(), mask.long().cumsum(dim=-1) - 1, torch.ones_like(mask))


POSITION_MISTAKES = {
    counting_from_one: "first token is at position 1, expected 0",
    column_numbers: "its column number, expected 0: count real tokens only",
    padding_left_at_minus_one: "the padding's positions are -1",
    padding_at_zero: "the padding's positions are [0], expected 1",
    summing_down_the_columns: "down the columns (over the rows, dim=0)",
    positions_in_float: "the position ids holds float32",
    positions_in_the_mask_itself: "changed its input attention_mask in place",
}


def test_position_check_passes_the_course_solution(bundled):
    assert_passes(check_position_ids_from_mask, course_position_ids_from_mask, bundled[1])
    assert_passes(check_position_ids_from_mask, position_ids_from_mask, bundled[1])
    assert_passes(check_position_ids_from_mask, positions_with_where, bundled[1], "cpu")


def test_position_check_says_not_written_for_a_stub(bundled):
    assert_not_written(check_position_ids_from_mask, bundled[1], fallback=position_ids_from_mask)


@pytest.mark.parametrize("mistake", POSITION_MISTAKES, ids=lambda f: f.__name__)
def test_position_check_catches(mistake, bundled):
    assert_caught(check_position_ids_from_mask, mistake, bundled[1],
                  symptom=POSITION_MISTAKES[mistake], fallback=position_ids_from_mask)


# ---- batched_greedy --------------------------------------------------------------------------

def course_batched_greedy(model, tokenizer, prompts, n_tokens, verbose=False):
    """The lesson's solution, as written in its exercise cell (the tokenizer pads on the left)."""
    batch = tokenizer(prompts, padding=True, return_tensors="pt").to(model.device)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = position_ids_from_mask(mask)
    past, new = None, []
    with torch.no_grad():
        for step in range(n_tokens):
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                        past_key_values=past, use_cache=True)
            next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            if verbose:
                print(f"step {step}: fed {tuple(ids.shape)}, mask {tuple(mask.shape)}, "
                      f"cache holds {out.past_key_values.get_seq_length()} positions ->",
                      [tokenizer.decode(t) for t in next_ids])
            new.append(next_ids)
            past, ids = out.past_key_values, next_ids
            mask = torch.cat([mask, torch.ones_like(next_ids)], dim=1)
            positions = positions[:, -1:] + 1
    return [tokenizer.decode(row) for row in torch.cat(new, dim=1)]


def _batched(model, tokenizer, prompts, n_tokens, verbose=False, *, side="left",
             pass_positions=True, pass_mask=True, grow_mask=True, step_positions=1,
             use_cache=True, mask_by_value=False, ones=torch.ones_like):
    before = tokenizer.padding_side
    tokenizer.padding_side = side
    try:
        batch = tokenizer(prompts, padding=True, return_tensors="pt").to(model.device)
    finally:
        tokenizer.padding_side = before
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if mask_by_value:
        mask = (ids != tokenizer.pad_token_id).long()
    positions = position_ids_from_mask(mask)
    past, new = None, []
    with torch.no_grad():
        for _ in range(n_tokens):
            out = model(input_ids=ids, attention_mask=mask if pass_mask else None,
                        position_ids=positions if pass_positions else None,
                        past_key_values=past if use_cache else None, use_cache=True)
            next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            if verbose:
                print("step:", [tokenizer.decode(t) for t in next_ids])
            new.append(next_ids)
            if grow_mask or not use_cache:
                mask = torch.cat([mask, ones(next_ids)], dim=1)
            if use_cache:
                past, ids = out.past_key_values, next_ids
                positions = positions[:, -1:] + step_positions
            else:
                ids = torch.cat([ids, next_ids], dim=1)
                positions = position_ids_from_mask(mask)
    return [tokenizer.decode(row) for row in torch.cat(new, dim=1)]


def padding_prompts_on_the_right(model, tokenizer, prompts, n, verbose=False):
    return _batched(model, tokenizer, prompts, n, verbose, side="right")


def without_position_ids(model, tokenizer, prompts, n, verbose=False):
    return _batched(model, tokenizer, prompts, n, verbose, pass_positions=False)


def without_the_attention_mask(model, tokenizer, prompts, n, verbose=False):
    return _batched(model, tokenizer, prompts, n, verbose, pass_mask=False)


def mask_that_does_not_grow(model, tokenizer, prompts, n, verbose=False):
    return _batched(model, tokenizer, prompts, n, verbose, grow_mask=False)


def positions_that_stand_still(model, tokenizer, prompts, n, verbose=False):
    return _batched(model, tokenizer, prompts, n, verbose, step_positions=0)


def without_the_cache(model, tokenizer, prompts, n, verbose=False):
    return _batched(model, tokenizer, prompts, n, verbose, use_cache=False)


def batched_with_lists_of_ints(model, tokenizer, prompts, n_tokens, verbose=False):
    """Right, written another way: each row's tokens kept as a list of ints, the cache's
    length read from the mask."""
    batch = tokenizer(prompts, padding=True, return_tensors="pt").to(model.device)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = position_ids_from_mask(mask)
    past, rows = None, [[] for _ in prompts]
    with torch.no_grad():
        for step in range(n_tokens):
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                        past_key_values=past, use_cache=True)
            if verbose:                               # the lesson's words, as its next cell shows
                print(f"step {step}: fed {tuple(ids.shape)}, mask {tuple(mask.shape)}, cache "
                      f"holds {out.past_key_values.get_seq_length()} positions ->",
                      [tokenizer.decode(t) for t in out.logits[:, -1:].argmax(dim=-1)])
            ids = out.logits[:, -1:].argmax(dim=-1)
            for row, token in zip(rows, ids.flatten().tolist()):
                row.append(token)
            past = out.past_key_values
            mask = torch.cat([mask, mask.new_ones((len(prompts), 1))], dim=1)
            positions = positions[:, -1:] + 1
    return [tokenizer.decode(row) for row in rows]


def batched_without_verbose(model, tokenizer, prompts, n_tokens):
    return course_batched_greedy(model, tokenizer, prompts, n_tokens)


def batched_ignoring_verbose(model, tokenizer, prompts, n_tokens, verbose=False):
    return course_batched_greedy(model, tokenizer, prompts, n_tokens)


def batched_always_printing(model, tokenizer, prompts, n_tokens, verbose=False):
    print("batch of", len(prompts))
    return course_batched_greedy(model, tokenizer, prompts, n_tokens)


BATCHED_MISTAKES = {
    padding_prompts_on_the_right: "row 1 of the prefill's attention mask ends in padding",
    without_position_ids: "the prefill passed no position_ids",
    without_the_attention_mask: "the prefill passed no attention_mask",
    mask_that_does_not_grow: "add a column of ones at every step",
    positions_that_stand_still: "every step moves each row one position further",
    without_the_cache: "step 1 fed 8 tokens per row without the cache",
    batched_without_verbose: "the lesson calls it with verbose=True",
    batched_ignoring_verbose: "with verbose=True it printed 0 line(s) for 3 steps",
    batched_always_printing: "it printed 1 line(s) with verbose=False",
}


def test_batched_check_passes_the_course_solution_quickly(bundled):
    start = time.perf_counter()
    assert_passes(check_batched_greedy, course_batched_greedy, *bundled)
    assert_passes(check_batched_greedy, batched_with_lists_of_ints, *bundled)
    assert time.perf_counter() - start < 10   # about 0.5 s on a quiet 2-core machine


def test_batched_reference_gives_the_texts_of_one_prompt_at_a_time(bundled):
    from helpers import generate_with_cache

    model, tokenizer = bundled
    texts = batched_greedy(model, tokenizer, ["Jack and Jill", "What comes up must"], 12)
    assert texts == [generate_with_cache(model, tokenizer, p, 12, stop_at_eos=False).text
                     for p in ["Jack and Jill", "What comes up must"]]


def test_batched_check_says_not_written_for_a_stub(bundled):
    assert_not_written(check_batched_greedy, *bundled, fallback=batched_greedy)


@pytest.mark.parametrize("mistake", BATCHED_MISTAKES, ids=lambda f: f.__name__)
def test_batched_check_catches(mistake, bundled):
    assert_caught(check_batched_greedy, mistake, *bundled, symptom=BATCHED_MISTAKES[mistake],
                  fallback=batched_greedy)
    assert bundled[1].padding_side == "left"     # the check leaves the tokenizer as it was


def positions_filled_in_on_the_cpu(mask):
    positions = torch.ones(mask.shape, dtype=torch.long)            # on the CPU
    real = mask == 1
    positions[real] = (mask.long().cumsum(dim=-1) - 1)[real]
    return positions


def batched_with_the_batch_left_on_the_cpu(model, tokenizer, prompts, n_tokens, verbose=False):
    batch = tokenizer(prompts, padding=True, return_tensors="pt")   # not moved to model.device
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = position_ids_from_mask(mask)
    past, new = None, []
    with torch.no_grad():
        for step in range(n_tokens):
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                        past_key_values=past, use_cache=True)
            next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            if verbose:
                print(f"step {step}")
            new.append(next_ids)
            past, ids = out.past_key_values, next_ids
            mask = torch.cat([mask, torch.ones_like(next_ids)], dim=1)
            positions = positions[:, -1:] + 1
    return [tokenizer.decode(row) for row in torch.cat(new, dim=1)]


# ---- what a GPU refuses, the pad token inside a prompt (the checks catch them on any device) --

def positions_built_in_python(mask):
    rows = []
    for row in mask.tolist():
        seen, positions = 0, []
        for m in row:
            positions.append(seen if m else 1)
            seen += m
        rows.append(positions)
    return torch.tensor(rows)                  # on the CPU, wherever the mask is


def batched_growing_the_mask_with_cpu_ones(model, tokenizer, prompts, n, verbose=False):
    return _batched(model, tokenizer, prompts, n, verbose,
                    ones=lambda t: torch.ones(t.shape[0], 1, dtype=torch.long))


def batched_with_a_float_mask(model, tokenizer, prompts, n, verbose=False):
    return _batched(model, tokenizer, prompts, n, verbose,
                    ones=lambda t: torch.ones(t.shape, device=t.device))   # float32: the cat too


def batched_masking_by_value(model, tokenizer, prompts, n, verbose=False):
    return _batched(model, tokenizer, prompts, n, verbose, mask_by_value=True)


def left_pad_masking_by_value(token_lists, pad_id):
    ids = _pad(token_lists, pad_id)[0]
    return ids, (ids != pad_id).long()


def batched_with_the_encoding_moved(model, tokenizer, prompts, n_tokens, verbose=False):
    """Right: BatchEncoding.to moves every tensor of the encoding."""
    batch = tokenizer(prompts, padding=True, return_tensors="pt").to(model.device)
    ids, mask = batch.input_ids, batch.attention_mask
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    past, new = None, []
    with torch.no_grad():
        for _ in range(n_tokens):
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                        past_key_values=past)
            ids = out.logits[:, -1:].argmax(-1)
            new.append(ids)
            past = out.past_key_values
            mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=-1)
            positions = positions[:, -1:] + 1
            if verbose:
                print("step", len(new))
    return tokenizer.batch_decode(torch.cat(new, dim=-1))


ON_A_GPU = {
    positions_built_in_python: "make every new tensor on the inputs' device",
    batched_growing_the_mask_with_cpu_ones: "a tensor made on the CPU met one on the GPU",
    batched_with_a_float_mask: "attention_mask holds float32 (torch.float), expected int64",
}
NAMED_CASES = {
    left_pad_masking_by_value: "a prompt can hold that token in its own text",
    batched_masking_by_value: "a prompt can hold that token in its own text",
}


EXERCISES = [
    Exercise("left_pad", check_left_pad, ("tokenizer",), left_pad,
             right=[course_left_pad, left_pad_with_rows_of_lists],
             wrong={**LEFT_PAD_MISTAKES, **pick(NAMED_CASES, left_pad_masking_by_value)}),
    Exercise("position_ids_from_mask", check_position_ids_from_mask, ("tokenizer", "device"),
             position_ids_from_mask, right=[course_position_ids_from_mask, positions_with_where],
             wrong={**POSITION_MISTAKES,
                    positions_filled_in_on_the_cpu: "make every new tensor on the inputs' device",
                    **pick(ON_A_GPU, positions_built_in_python)}),
    Exercise("batched_greedy", check_batched_greedy, ("model", "tokenizer"), batched_greedy,
             right=[course_batched_greedy, batched_with_the_encoding_moved,
                    batched_with_lists_of_ints],
             wrong={**BATCHED_MISTAKES,
                    batched_with_the_batch_left_on_the_cpu: "a tensor made on the CPU met one on the GPU",
                    **pick(ON_A_GPU, batched_growing_the_mask_with_cpu_ones,
                          batched_with_a_float_mask),
                    **pick(NAMED_CASES, batched_masking_by_value)}),
]
