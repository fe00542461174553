"""Lesson 02's checks: the learner's ``left_pad``, ``position_ids_from_mask`` and
``batched_greedy``.

``check_left_pad`` and ``check_position_ids_from_mask`` compare tensors with the course's on
the lesson's prompts and on edge cases (no padding at all, one prompt, a one-token prompt,
another pad id, a row that stopped), and name the usual slip: padding on the right, a mask
upside down, positions counted from 1 or from the first column.

``check_batched_greedy`` runs the learner's loop and the course's on the lesson's model with a
hook that records what every call fed the model (tokens, attention mask, position ids, how much
the cache held), so that a wrong text is traced to the step and the tensor that went wrong; it
also counts the lines it prints, one a step with ``verbose=True`` and none without. The
positions' cases run on the lesson's device; every tensor is compared in dtype and device too.
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import torch

from ..batching import left_pad, position_ids_from_mask
from .core import (Hint, dtype_hint, expect_equal, expect_like, expect_shape, expect_tensor,
                   expect_unchanged, run_check)
from .lesson01 import recording

__all__ = ["check_batched_greedy", "check_left_pad", "check_position_ids_from_mask"]

PROMPTS = ["The quick brown fox jumped over the", "The rain in Spain falls",
           "What comes up must", "Jack and Jill", "Humpty Dumpty sat"]


def _pair(got, what: str) -> tuple:
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise Hint(f"{what} should return two tensors, (input_ids, attention_mask); got "
                   f"{type(got).__name__}" + (f" of {len(got)}" if isinstance(got, (tuple, list)) else ""))
    return got[0], got[1]


def _expect_long(what: str, got) -> None:
    if isinstance(got, torch.Tensor) and got.dtype != torch.long:
        raise Hint(f"{what} holds {str(got.dtype).replace('torch.', '')}; make it integers "
                   f"(torch.long) like the tokenizer's" + (
                       ": the model looks token ids and positions up by index"
                       if "mask" not in what else ""))


# ---- left_pad -------------------------------------------------------------------------------

def _left_pad_cases(tokenizer):
    ids = lambda prompts: [tokenizer(p).input_ids for p in prompts]
    pad = tokenizer.pad_token_id
    scenarios = [
        ("the lesson's five prompts (7 to 3 tokens)", ids(PROMPTS), pad),
        ("prompts of one length: no padding", ids(["Jack and Jill", "Humpty Dumpty sat"]), pad),
        ("a single prompt", ids(["The rain in Spain falls"]), pad),
        ("a one-token prompt beside a long one that holds the pad token <|endoftext|> in its "
         "own text", ids(["Once", "Jack and Jill<|endoftext|>Once upon a time"]), pad),
        ("another pad id (99)", ids(["Jack and Jill went up the hill", "What comes up must"]), 99),
    ]

    def checker(learner, cases):
        for label, token_lists, pad_id in scenarios:
            with cases(label):
                want_ids, want_mask = left_pad(token_lists, pad_id)
                given = [list(t) for t in token_lists]
                got_ids, got_mask = _pair(learner(given, pad_id), "left_pad")
                expect_unchanged("token_lists", [list(t) for t in token_lists], given)
                for name, got, want in (("input_ids", got_ids, want_ids),
                                        ("attention_mask", got_mask, want_mask)):
                    if not isinstance(got, torch.Tensor):
                        raise Hint(f"{name} should be a tensor of shape {tuple(want.shape)}, got "
                                   f"{type(got).__name__}")
                    if got.shape != want.shape:
                        shortest = min(len(t) for t in token_lists)
                        extra = (": pad every row to the LONGEST list, not the shortest"
                                 if got.dim() == 2 and got.shape[1] == shortest else "")
                        raise Hint(f"{name} has shape {tuple(got.shape)}, expected "
                                   f"{tuple(want.shape)} (rows, longest list){extra}")
                    _expect_long(name, got)
                _diagnose_padding(got_ids, got_mask, want_ids, want_mask, pad_id)
                expect_tensor("input_ids", got_ids, want_ids)
                expect_tensor("attention_mask", got_mask, want_mask)
    return checker


def _diagnose_padding(got_ids, got_mask, want_ids, want_mask, pad_id) -> None:
    got_mask, got_ids = got_mask.long().cpu(), got_ids.cpu()
    if torch.equal(got_mask, 1 - want_mask) and not torch.equal(got_mask, want_mask):
        raise Hint("the attention mask is 1 on the padding and 0 on the tokens: 1 marks a real "
                   "token, 0 a pad")
    is_pad = (want_ids == pad_id).long()
    if torch.equal(got_mask, 1 - is_pad) and not torch.equal(got_mask, want_mask):
        raise Hint(f"the attention mask is 0 wherever the id is the pad id {pad_id}, but a prompt "
                   f"can hold that token in its own text (the course pads with <|endoftext|>): "
                   f"mark the padding by position (the columns before each list starts), not by "
                   f"value")
    for row in range(want_mask.shape[0]):
        if bool(want_mask[row, -1]) and not bool(got_mask[row, -1]):
            raise Hint(f"row {row} ends in padding, so it is padded on the right: pad on the "
                       f"left, so that every prompt's last token sits in the last column")
        if not torch.equal(got_mask[row], want_mask[row]):
            continue
        pads = want_mask[row] == 0
        if pads.any() and not torch.equal(got_ids[row][pads], want_ids[row][pads]):
            col = int((got_ids[row] != want_ids[row]).nonzero()[0])
            raise Hint(f"row {row}, column {col} holds {int(got_ids[row, col])}, expected the pad "
                       f"id {pad_id}: fill the padding with the pad_id you are given")


def check_left_pad(learner_left_pad, tokenizer):
    """Lesson 02: check the learner's ``left_pad(token_lists, pad_id)`` against the course's on
    the lesson's prompts, prompts of one length, a single prompt, a one-token prompt beside one
    that holds the pad token in its own text, and another pad id; print one line and return the function the rest of the lesson should use."""
    return run_check("left_pad", learner_left_pad, _left_pad_cases(tokenizer), fallback=left_pad)


# ---- position_ids_from_mask -----------------------------------------------------------------

def _position_cases(tokenizer, device):
    def mask_of(prompts):
        return left_pad([tokenizer(p).input_ids for p in prompts], tokenizer.pad_token_id)[1]

    scenarios = [
        ("the lesson's five prompts", mask_of(PROMPTS)),
        ("no padding", mask_of(["Jack and Jill", "Humpty Dumpty sat"])),
        ("a single row", mask_of(["The rain in Spain falls"])),
        ("a row that stopped: its newest column is padding",
         torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])),
    ]

    def checker(learner, cases):
        for label, mask in scenarios:
            with cases(label):
                mask = mask.to(device)                 # where the lesson's batch is
                expected = position_ids_from_mask(mask)
                given = mask.clone()
                got = learner(given)
                expect_unchanged("attention_mask", mask, given)
                expect_shape("the position ids", got, tuple(expected.shape),
                             ": one position per token, the mask's shape")
                _expect_long("the position ids", got)
                expect_like("the position ids", got, expected)
                _diagnose_positions(got.cpu(), expected.cpu(), mask.cpu())
                expect_tensor("the position ids", got, expected)
    return checker


def _diagnose_positions(got, expected, mask) -> None:
    real = mask == 1
    down = mask.long().cumsum(dim=0) - 1
    if mask.shape[0] > 1 and torch.equal(got[real], down[real]) and not torch.equal(down[real], expected[real]):
        raise Hint("the positions add up the mask down the columns (over the rows, dim=0): each "
                   "row counts its own tokens, so take the cumulative sum along the row, dim=-1")
    for row in range(mask.shape[0]):
        if not real[row].any():
            continue
        first = int(real[row].int().argmax())            # the row's first real token
        g = int(got[row, first])
        if g == 0:
            continue
        if g == 1:
            raise Hint(f"row {row}'s first token is at position 1, expected 0: positions count "
                       f"from 0, so subtract 1 from the cumulative sum")
        if g == first:
            raise Hint(f"row {row}'s first token is at position {g}, its column number, expected "
                       f"0: count real tokens only (the cumulative sum of the mask along the "
                       f"row), not columns")
        raise Hint(f"row {row}'s first token is at position {g}, expected 0 (cumulative sum of the "
                   f"mask along each row, dim=-1, minus 1)")
    if torch.equal(got[real], expected[real]) and not torch.equal(got, expected):
        pads = ~real
        values = sorted(set(got[pads].tolist()))
        if -1 in values:
            raise Hint("the padding's positions are -1, which is no position at all: fill them "
                       "with 1 (masked_fill(mask == 0, 1)); the mask hides them anyway")
        raise Hint(f"the padding's positions are {values[:3]}, expected 1: fill them with 1 "
                   f"(masked_fill(mask == 0, 1)); the mask hides them, but the course's batches "
                   f"(init_batch) use 1 and the lesson compares with them")


def check_position_ids_from_mask(learner_position_ids_from_mask, tokenizer, device="cpu"):
    """Lesson 02: check the learner's ``position_ids_from_mask(attention_mask)`` against the
    course's on left-padded masks, a mask without padding, a single row and a row whose newest
    column is padding, all on ``device`` (the lesson's: ``model.device``); print one line and
    return the function the rest of the lesson should use."""
    return run_check("position_ids_from_mask", learner_position_ids_from_mask,
                     _position_cases(tokenizer, torch.device(device)),
                     fallback=position_ids_from_mask, gpu=True)


# ---- batched_greedy -------------------------------------------------------------------------

@torch.no_grad()
def batched_greedy(model, tokenizer, prompts, n_tokens, verbose=False):
    """The course's answer to lesson 02's exercise: ``n_tokens`` greedy tokens for every prompt,
    generated together with the KV cache (EOS does not stop a row); the new text of each row.
    (Lesson 02.)"""
    token_lists = [tokenizer(p).input_ids for p in prompts]
    ids, mask = left_pad(token_lists, tokenizer.pad_token_id)
    ids, mask = ids.to(model.device), mask.to(model.device)
    positions = position_ids_from_mask(mask)
    past, new = None, []
    for step in range(n_tokens):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                    past_key_values=past, use_cache=True)
        next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        if verbose:
            print(f"step {step}: fed {tuple(ids.shape)}, mask {tuple(mask.shape)}, cache holds "
                  f"{out.past_key_values.get_seq_length()} positions ->",
                  [tokenizer.decode(t) for t in next_ids])
        new.append(next_ids)
        past, ids = out.past_key_values, next_ids
        mask = torch.cat([mask, torch.ones_like(next_ids)], dim=1)
        positions = positions[:, -1:] + 1
    return [tokenizer.decode(row) for row in torch.cat(new, dim=1)]


def _diagnose_calls(calls: list[dict], reference: list[dict], pad_id: int | None = None) -> None:
    """Raise a Hint at the first call whose inputs differ from the course's at the same step."""
    for step, (call, want) in enumerate(zip(calls, reference)):
        at = "the prefill" if step == 0 else f"step {step}"
        ids, want_ids = call["input_ids"], want["input_ids"]
        if isinstance(ids, torch.Tensor) and ids.shape != want_ids.shape:
            if step and ids.shape[0] == want_ids.shape[0] and ids.shape[1] > 1:
                how = "without the cache" if not call["has_past"] else "with a cache that already holds them"
                raise Hint(f"{at} fed {ids.shape[1]} tokens per row {how}: after the prefill feed "
                           f"only the new tokens, one per row, shape ({want_ids.shape[0]}, 1), "
                           f"with past_key_values")
            raise Hint(f"{at} fed input_ids of shape {tuple(ids.shape)}, expected "
                       f"{tuple(want_ids.shape)}")
        if step and not call["has_past"]:
            raise Hint(f"{at} passed no past_key_values: the rows lose everything before their "
                       f"newest token; pass the cache the previous call returned")
        mask, want_mask = call["attention_mask"], want["attention_mask"]
        if mask is None:
            raise Hint(f"{at} passed no attention_mask, so the rows attend to their padding: "
                       f"pass the mask at every call")
        if mask.shape != want_mask.shape:
            if step and mask.shape[0] == want_mask.shape[0] and mask.shape[1] < want_mask.shape[1]:
                raise Hint(f"{at}'s attention_mask has {mask.shape[1]} columns, expected "
                           f"{want_mask.shape[1]}: it must cover the cache AND the new tokens, so "
                           f"add a column of ones at every step")
            raise Hint(f"{at}'s attention_mask has shape {tuple(mask.shape)}, expected "
                       f"{tuple(want_mask.shape)}")
        if mask.is_floating_point() and not want_mask.is_floating_point():
            raise Hint(dtype_hint(f"{at}'s attention_mask", mask.dtype, want_mask.dtype)
                       + " (the tokenizer's mask is int64: keep its dtype when adding columns, "
                         "torch.ones_like(next_ids) or dtype=mask.dtype)")
        mask = mask.long()
        if step == 0:
            for row in range(want_mask.shape[0]):
                if bool(want_mask[row, -1]) and not bool(mask[row, -1]):
                    raise Hint(f"row {row} of the prefill's attention mask ends in padding: the "
                               f"prompts are padded on the right; pad them on the left "
                               f"(tokenizer.padding_side = 'left')")
            by_value = (want["input_ids"] != pad_id).long()
            if torch.equal(mask, by_value) and not torch.equal(mask, want_mask):
                raise Hint(f"the prefill's attention mask is 0 wherever the id is the pad id "
                           f"{pad_id}, but a prompt can hold that token in its own text (the "
                           f"course pads with <|endoftext|>): take the mask from the padding "
                           f"(left_pad's, or the tokenizer's), not from the ids' values")
        expect_tensor(f"{at}'s attention_mask", mask, want_mask)
        positions, want_positions = call["position_ids"], want["position_ids"]
        if positions is None:
            raise Hint(f"{at} passed no position_ids, so a padded row's tokens sit at their column "
                       f"numbers instead of 0, 1, 2 ...: pass position_ids_from_mask(mask) to the "
                       f"prefill, then each row's last position + 1")
        if positions.shape != want_positions.shape:
            raise Hint(f"{at}'s position_ids have shape {tuple(positions.shape)}, expected "
                       f"{tuple(want_positions.shape)}: one position per token fed")
        real = want_mask[:, -want_positions.shape[1]:] == 1    # the columns fed at this step
        if not torch.equal(positions[real], want_positions[real]):
            bad = (positions != want_positions) & real
            row, col = (int(i) for i in bad.nonzero()[0])
            g, e = int(positions[row, col]), int(want_positions[row, col])
            cause = ""
            if step and g == e - 1:
                cause = ": every step moves each row one position further (last position + 1)"
            elif step and g == e - step:
                cause = (": the positions stayed those of the prefill's last token; add 1 at "
                         "every step")
            elif g == col + (want_mask.shape[1] - want_positions.shape[1]):
                cause = ": that is the column number; count only the row's real tokens"
            raise Hint(f"{at}: row {row}'s position id is {g}, expected {e}{cause}")


def _batched_cases(model, tokenizer):
    scenarios = [
        ("the lesson's five prompts, 6 tokens each", PROMPTS, 6, False),
        ("one token each: the prefill alone", PROMPTS[1:4], 1, False),
        ("a single prompt: no padding", ["Jack and Jill"], 5, False),
        ("a long prompt that holds the pad token <|endoftext|> in its own text, and a short "
         "one, 12 tokens", ["Once upon a time<|endoftext|>a little fox lived by the river and",
                            "What comes up must"], 12, False),
        ("verbose=True, as the lesson calls it next (a line a step; what it says is yours)",
         PROMPTS[:2], 3, True),
    ]

    def checker(learner, cases):
        side = tokenizer.padding_side
        for label, prompts, n, verbose in scenarios:
            with cases(label):
                with recording(model) as reference:
                    expected = batched_greedy(model, tokenizer, prompts, n)
                printed = io.StringIO()
                try:
                    with recording(model) as calls, redirect_stdout(printed):
                        try:
                            given = list(prompts)
                            got = (learner(model, tokenizer, given, n, verbose=True)
                                   if verbose else learner(model, tokenizer, given, n))
                        except (NotImplementedError, Hint):
                            raise
                        except Exception:
                            _diagnose_calls(calls, reference, tokenizer.pad_token_id)   # a hint if a call was wrong
                            raise
                finally:
                    tokenizer.padding_side = side
                _diagnose_calls(calls, reference, tokenizer.pad_token_id)
                expect_unchanged("prompts", list(prompts), given)
                lines = [line for line in printed.getvalue().splitlines() if line.strip()]
                if verbose and len(lines) < n:
                    raise Hint(f"with verbose=True it printed {len(lines)} line(s) for {n} "
                               f"steps: print a line at every step, saying what it fed the "
                               f"model (the lesson's next cell shows them)")
                if not verbose and lines:
                    raise Hint(f"it printed {len(lines)} line(s) with verbose=False: print only "
                               f"when verbose is True (the lesson's later cells call it quietly)")
                if not isinstance(got, (list, tuple)) or not all(isinstance(t, str) for t in got):
                    raise Hint(f"batched_greedy should return a list of strings, one new text per "
                               f"prompt, got {type(got).__name__}")
                expect_equal("the number of texts", len(got), len(expected))
                for row, (g, e) in enumerate(zip(got, expected)):
                    if g != e:
                        if e.startswith(g) or g.startswith(e):
                            raise Hint(f"row {row}'s text is {g!r}, expected {e!r}: make exactly "
                                       f"n_tokens tokens per row (EOS does not stop a row here)")
                        raise Hint(f"row {row} ({prompts[row]!r}) generated {g!r}, expected {e!r}")
                if len(calls) > n:
                    raise Hint(f"the right texts, but the model ran {len(calls)} times for {n} "
                               f"token(s) per row: every call gives one token per row")
    return checker


BATCHED_CAUSES = {
    "unexpected keyword argument 'verbose'": "keep the signature, batched_greedy(model, "
                                             "tokenizer, prompts, n_tokens, verbose=False): the "
                                             "lesson calls it with verbose=True",
    "must match the size of tensor": "the attention mask must cover the cache and the new tokens: "
                                     "add a column of ones at every step",
    "index out of range": "a position past the model's longest context: feed one token per row "
                          "after the prefill, with the cache",
}


def check_batched_greedy(learner_batched_greedy, model, tokenizer):
    """Lesson 02: check the learner's ``batched_greedy(model, tokenizer, prompts, n_tokens)``
    against the course's on the lesson's prompts, one token, a single prompt and a long prompt
    that holds the pad token beside a short one, comparing the texts and what every call fed the
    model (tokens, attention mask and its dtype, position ids, cache, none of them made on the
    CPU where the model stands for a GPU's); print one line and return the function the rest of the lesson should
    use."""
    return run_check("batched_greedy", learner_batched_greedy, _batched_cases(model, tokenizer),
                     fallback=batched_greedy, causes=BATCHED_CAUSES, gpu=model)
