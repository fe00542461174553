"""Hints on demand for every lesson's "Your turn" exercises, in three steps.

    from helpers.checks import hint
    hint("replay")      # step 1: the idea
    hint("replay")      # step 2: the tools (which function, which dimension)
    hint("replay")      # step 3: the shape of the answer, with its blanks

A learner who wants help asks for it; one who does not is left to think. The solution itself
stays in the lesson. ``hint("replay", 2)`` shows one step again. Each exercise is listed once in
``HINTS`` with its lesson and its check, so that a new exercise and its check join together.
"""

from __future__ import annotations

import difflib
import re
import textwrap
from typing import NamedTuple

STEPS = ("the idea", "the tools", "the shape of the answer")


class Hints(NamedTuple):
    lesson: str               # "10": the lesson whose "Your turn" cell holds the exercise
    check: str                # the check that follows that cell, in helpers.checks
    steps: tuple[str, str, str]


HINTS: dict[str, Hints] = {
    # ---- 01 ---------------------------------------------------------------------------------
    "greedy_with_cache": Hints("01", "check_greedy_with_cache", (
        "The cache holds the keys and values of every token already read, so only the first "
        "call reads the whole prompt; every call after it reads just the token the call before "
        "chose, and hands back the cache grown by that token.",
        "The model takes the cache as past_key_values= (None at first) with use_cache=True and "
        "returns the grown one as out.past_key_values. The greedy token is the argmax of the "
        "last position's logits, out.logits[0, -1]; fed alone it must be shaped (1, 1) "
        "(.view(1, 1)); int(token) makes it a plain int for the list.",
        "ids = the prompt's ids on model.device; past, step_input = None, ids; then n_tokens "
        "times, under torch.no_grad(): out = model(…); token = …; past, step_input = …, token; "
        "new.append(int(token)). Return new.")),
    "kv_cache_bytes_for": Hints("01", "check_kv_cache_bytes_for", (
        "Every layer keeps a key and a value for every token of every row: count the numbers "
        "and multiply by the bytes of one. The one subtle factor is a key's width: kv heads × "
        "head size, which equals the hidden size only in models like GPT-2.",
        "config.num_hidden_layers, config.num_attention_heads and config.hidden_size are always "
        "there; getattr(config, 'num_key_value_heads', None) and getattr(config, 'head_dim', "
        "None) give None where a config has no such field, and `None or default` falls back.",
        "heads = …; kv_heads = getattr(…) or heads; head_size = getattr(…) or hidden // heads; "
        "return 2 × bytes_per_value × layers × kv_heads × head_size × seq_len × batch.")),
    # ---- 02 ---------------------------------------------------------------------------------
    "left_pad": Hints("02", "check_left_pad", (
        "Every row gets the length of the longest list; a shorter row gets pad ids in front, so "
        "that its own tokens end in the last column. The mask marks each column of a row as "
        "real (1) or padding (0).",
        "torch.full((rows, width), pad_id, dtype=torch.long) makes a rectangle of pad ids and "
        "torch.zeros((rows, width), dtype=torch.long) one of zeros; t[row, width - n:] = … "
        "writes the last n columns of one row.",
        "width = the longest length; make the two rectangles; for each row, its ids into the "
        "last len(ids) columns of input_ids and 1 into the same columns of the mask; return "
        "(input_ids, attention_mask).")),
    "position_ids_from_mask": Hints("02", "check_position_ids_from_mask", (
        "A real token's position is the number of real tokens before it in its row. A running "
        "count of the mask along the row counts them (one too many: it includes the token "
        "itself). Padding is never attended to; the course gives it position 1.",
        "tensor.cumsum(dim=-1) is a running sum along each row (of the mask as integers, "
        ".long()); tensor.masked_fill(condition, value) writes value where condition is True, "
        "here where the mask is 0. Neither changes its input.",
        "positions = (running count of the mask) − 1; return positions with 1 written where "
        "the mask is 0.")),
    "batched_greedy": Hints("02", "check_batched_greedy", (
        "Lesson 1's loop for a whole batch: one prefill of the padded prompts, then one token "
        "per row per step. Three things move with the cache between steps: the input is the "
        "new tokens, the mask gains a column of ones, and each row's position goes one on.",
        "tokenizer(prompts, padding=True, return_tensors='pt').to(model.device) pads on the "
        "left; position_ids_from_mask gives the first positions; the model takes input_ids, "
        "attention_mask, position_ids, past_key_values and use_cache=True; "
        "out.logits[:, -1].argmax(dim=-1, keepdim=True) is (batch, 1); torch.cat(…, dim=1) "
        "adds columns; positions[:, -1:] + 1 is the next position; tokenizer.decode(row).",
        "ids, mask, positions from the tokenizer; past, new = None, []; n_tokens times under "
        "torch.no_grad(): out = model(…); next_ids = …; if verbose: print a line; "
        "new.append(next_ids); past, ids = …; mask = …; positions = …. Return one decoded "
        "string per row of the new tokens joined along dimension 1.")),
    # ---- 03 ---------------------------------------------------------------------------------
    "merge_batches": Hints("03", "check_merge_batches", (
        "Two batches can be stacked once their histories are equally long: the shorter one "
        "gets empty columns on the left (mask 0, zero keys and values), so every row's newest "
        "token stays in the last column. Then each field is the first batch's rows followed by "
        "the second's. An empty batch has no cache: the other batch is the answer.",
        "cache_layers(batch.past_key_values) lists each layer's (keys, values), shaped (rows, "
        "kv heads, tokens, head size); F.pad(t, (left, right)) pads the last dimension and "
        "F.pad(t, (0, 0, missing, 0)) the tokens of a 4-D tensor; torch.cat([a, b]) joins rows "
        "(dimension 0); lists join with +; cache_from_layers(layers) builds the cache.",
        "if one batch is empty, return the other; width = the wider mask; a small function "
        "pads one batch's mask and layers on the left up to width; apply it to both; join the "
        "layers pair by pair; return Batch(request_ids=…, max_tokens=…, token_ids=…, done=…, "
        "input_ids=…, attention_mask=…, position_ids=…, past_key_values=…).")),
    "filter_batch": Hints("03", "check_filter_batch", (
        "Keep the rows that are not done, in every list and tensor. Then the leading columns "
        "that are padding in every kept row are never read again: cut them from the mask and "
        "from every layer's keys and values (the same number from both).",
        "a list of the kept row numbers picks list entries; as a tensor on the batch's device "
        "it picks rows of a tensor (t[rows]); mask.any(dim=0) is True in every column with a "
        "real token, and .int().argmax() finds the first such column; keys[rows, :, first:] "
        "picks rows and cuts columns (tokens are dimension 2). Batch.empty() when no row is "
        "kept.",
        "keep = […]; if not keep: return Batch.empty(); rows = …; mask = …; first = …; layers "
        "= [(keys[…], values[…]) for …]; return Batch(each list picked by keep, done all "
        "False, input_ids and position_ids picked by rows, mask[:, first:], the new cache).")),
    # ---- 04 ---------------------------------------------------------------------------------
    "quantize_tensor": Hints("04", "check_quantize_tensor", (
        "256 codes cover the tensor's range, stretched to contain 0.0 so that 0.0 has a code of "
        "its own (the zero point). The scale is the width of one step; a value's code is the "
        "value in steps, shifted by the zero point, rounded and kept within 0 … 255.",
        "t.min().clamp(max=0) and t.max().clamp(min=0) stretch the range; a range of width 0 "
        "(a tensor of zeros) needs scale 1; torch.round; int(…) makes the zero point a plain "
        "int; .clamp(0, 255) before .to(torch.uint8), which wraps 256 around to 0.",
        "lo, hi = …; scale = (hi − lo) / 255, or 1 when that is 0; zero_point = int(round(−lo "
        "/ scale)); q = (round(t / scale) + zero_point) clamped, as uint8; return q, scale, "
        "zero_point.")),
    "dequantize_tensor": Hints("04", "check_dequantize_tensor", (
        "Undo the mapping: the code minus the zero point is the number of steps from 0.0, and "
        "the steps times the scale is the value. Mind the type the arithmetic happens in.",
        "q holds uint8, and uint8 arithmetic wraps below 0 (3 − 120 gives 139): .float() "
        "first. Broadcasting takes care of a scale and zero point with one entry per channel.",
        "return (q as floats − zero_point) × scale: one line.")),
    "quantize_channels": Hints("04", "check_quantize_channels", (
        "quantize_tensor's recipe with one range per channel: the minimum and maximum over "
        "every dimension except the channel's, kept as dimensions of size 1 so that the scale "
        "and zero point broadcast against t.",
        "axis % t.dim() turns −1 into the last dimension; t.amin(dim=[…], keepdim=True) and "
        "t.amax(…) take a list of dimensions; torch.where(scale > 0, scale, "
        "torch.ones_like(scale)) gives a channel of zeros scale 1; .to(torch.int32) makes the "
        "zero points integers.",
        "axis = …; others = every dimension but axis; lo, hi = amin and amax over others, "
        "clamped as before; scale = …, fixed where 0; zero_point = round(−lo / scale) as "
        "int32; q = quantize_tensor's line; return q, scale, zero_point.")),
    # ---- 05 ---------------------------------------------------------------------------------
    "LoraLayer": Hints("05", "check_lora_layer", (
        "The output is the frozen layer's plus a low-rank detour: x shrinks to r numbers "
        "through A, grows back through B, and the detour is scaled. With B at zero the layer "
        "computes exactly what its base did.",
        "self.base(x) runs the frozen layer, bias included; @ multiplies with any leading "
        "dimensions; the order sets the cost: (x @ A) @ B keeps r numbers per token in the "
        "middle, while A @ B first builds a d_in × d_out matrix.",
        "return self.base(x) + (x through A, then B) × self.scale.")),
    "merge_lora": Hints("05", "check_merge_lora", (
        "Products distribute: x·W + (x·A·B) × scale is x times one matrix, which can be made "
        "once. Mind which way round each layer stores its weight: Conv1D (in × out), "
        "nn.Linear (out × in). The layer itself stays as it is.",
        "isinstance(base, nn.Linear) tells the two layouts apart; .T turns a matrix; "
        "base.weight + delta makes a new tensor, where += would change the layer.",
        "delta = A·B × scale; turn it for an nn.Linear; return the weight plus delta.")),
    # ---- 06 ---------------------------------------------------------------------------------
    "linear_lora_loop": Hints("06", "check_linear_lora_loop", (
        "Each row has its own adapter: look it up by the row's index, send that row alone "
        "through its A and B, and put the rows back together as a batch.",
        "lora_indices.tolist() gives plain ints; loras_a[k] is (in, r) and loras_b[k] is (r, "
        "out); x[i] is (seq, in); torch.stack(list) adds the batch dimension back.",
        "rows = []; for i, k in enumerate(…): rows.append(row i through adapter k's A, then "
        "B); return the rows stacked.")),
    "linear_lora_gathered": Hints("06", "check_linear_lora_gathered", (
        "Instead of a loop, gather every row's A and B into tensors that line up with the rows "
        "of x, then do all rows' products at once: the number of operations no longer grows "
        "with the batch.",
        "stack.index_select(0, lora_indices) picks one adapter per row (an adapter used twice "
        "comes twice): (batch, in, r) and (batch, r, out); torch.bmm multiplies batch by batch, "
        "(b, n, m) @ (b, m, p) → (b, n, p).",
        "a = the gathered A's; b = the gathered B's; return x times a, then times b, each a "
        "batched product.")),
    # ---- 07 ---------------------------------------------------------------------------------
    "time_stream": Hints("07", "check_time_stream", (
        "A stopwatch around the stream: one stamp before sending, one when each event "
        "arrives. TTFT is the first stamp minus the start; the gaps are the differences of "
        "neighbouring stamps. Every token is stamped; only the non-special ones add text.",
        "start = clock() before send(); in `for event in send():` read clock() first thing; "
        "event.token.special and event.token.text; zip(stamps, stamps[1:]) pairs neighbours.",
        "start = …; stamps, text = [], ''; for each event: stamp, then add its text unless "
        "special; ttft = …; gaps = […]; return ttft, gaps, text.")),
    "generate_all": Hints("07", "check_generate_all", (
        "Awaiting one request, then the next, sends them one after another. Start them all, "
        "then wait for all of them together, and hand back the texts in the order they were "
        "asked for, whatever order they finish in.",
        "aclient.generate(**request) makes a coroutine without running it; "
        "asyncio.gather(*coroutines) runs them together and returns their results in the order "
        "given; reply.generated_text is the text.",
        "replies = await asyncio.gather(*(one coroutine per request)); return their texts in "
        "that order.")),
    # ---- 08 ---------------------------------------------------------------------------------
    "block_hashes": Hints("08", "check_block_hashes", (
        "A full block's name comes from its tokens and its parent's name, so two blocks share a "
        "name only when everything before them is the same too. A last block that is not full "
        "has no name.",
        "len(token_ids) // block_size counts the full blocks; token_ids[i * block_size:(i + 1) "
        "* block_size] is block i; chain_hash(parent, tokens, adapter), with parent None for "
        "block 0 and the name just made after that.",
        "names, parent = [], None; for each full block: parent = chain_hash(…); "
        "names.append(parent); return names.")),
    "Blocks": Hints("08", "check_blocks", (
        "allocate promises a request every block it may ever need (prompt + max_new_tokens, "
        "less the cached ones it takes) or refuses it whole, so a running request can always "
        "grow; grow turns promises into real blocks as tokens arrive; free_request hands "
        "references back, and a block nobody uses goes on the free list: last if its name "
        "still finds it (kept cached longest), first otherwise.",
        "math.ceil(tokens / block_size) counts whole blocks; blocks free for a new promise: "
        "len(self.free) − sum(self.reserved.values()); a cached block at 0 references is on "
        "the free list and leaves it when taken, so it counts as needed; next(iter(self.free)) "
        "is the front; self.free[block] = None puts a block at the back and "
        "self.free.move_to_end(block, last=False) at the front; self.cached.get(name) == block "
        "says whether its name still finds it.",
        "allocate: hits = …; needed = …; if needed + free hits > available: raise "
        "PoolExhausted before changing anything; the table = hits taken; reserved[rid] = "
        "needed; hit_blocks += …; return the tokens the hits hold. grow: while the table is "
        "too small: one reservation less, the front block evicted and taken. free_request: "
        "for each block of the popped table, one reference less, and at 0 back on the free "
        "list: at its end if its name still finds it, else at its front; then forget the "
        "reservation.")),
    # ---- 09 ---------------------------------------------------------------------------------
    "verify": Hints("09", "check_verify", (
        "One pass reads the unread tokens and every guess; the logits at a position say what "
        "greedy decoding writes next, so each guess is checked by the position before it. Keep "
        "guesses while they match, then add the model's own choice; the cache must end up "
        "holding the accepted tokens only.",
        "One model call with past_key_values=cache and use_cache=True, under torch.no_grad(), "
        "on a (1, tokens) tensor on the model's device; argmax over the vocabulary gives "
        "greedy's choice at every position (which position judges guess 1?); "
        "cache.crop(-r) forgets the last r positions.",
        "choices = …; n = how many leading guesses equal their choice; if some were rejected, "
        "crop them from the cache; return the kept guesses + [choices[n]].")),
    "lookup": Hints("09", "check_lookup", (
        "Text that repeats itself predicts itself: find where the last few tokens appeared "
        "before and propose what followed them there. Longer tails first (they predict "
        "better), and for each, the latest earlier place first.",
        "n runs from min(max_ngram, len(ids) − 1) down to 1; tail = ids[-n:]; a match is a "
        "start before the tail's own, from len(ids) − n − 1 down to 0, with ids[start:start + "
        "n] == tail; the proposal is the slice after it, at most k long.",
        "for n …: tail = …; for start …: if match: return the (at most k) tokens after it. "
        "After both loops: return [].")),
    "expected_tokens": Hints("09", "check_expected_tokens", (
        "A pass always writes the model's own token; it writes guess i as well only when "
        "guesses 1 … i all pass, with probability α^i. The average is the sum of these chances, "
        "one per token the pass may write.",
        "1 + α + α² + … + α^k is a geometric series, (1 − alpha ** (k + 1)) / (1 − alpha); that "
        "divides by 1 − α, which is 0 at alpha = 1, where every guess passes.",
        "return the closed form when alpha < 1, else ___ (the tokens a pass writes when every "
        "guess passes).")),
    # ---- 10 ---------------------------------------------------------------------------------
    "CountingBackend": Hints("10", "check_counting_backend", (
        "torch.compile calls its backend once per compilation, with the graph it traced, and "
        "runs whatever the backend returns. Keep each graph you are given: the list's length "
        "is then the number of compilations.",
        "list.append(gm); gm.forward runs the graph's operations as they were recorded (what "
        "backend='eager' does); example_inputs is not needed.",
        "In __call__: keep gm in self.graphs, then return what runs it: two lines.")),
    "capture_size": Hints("10", "check_capture_size", (
        "Of the sizes that hold the batch (size ≥ batch), the smallest wastes the fewest rows. "
        "When none holds it, there is no graph to use: None.",
        "a comprehension keeps the sizes that fit; min() of them, whatever the order; do not "
        "sort or change `sizes` (a tuple, and not yours); keep the default sizes=CAPTURE_SIZES.",
        "fitting = [sizes that hold batch]; return the smallest of them, or None when there "
        "are none.")),
    "pad_batch": Hints("10", "check_pad_batch", (
        "The batch gets rows of pad ids below it until it has `size` rows. The real rows stay "
        "first and unchanged, so the step's output for them is its first rows.",
        "input_ids.new_full((rows, columns), value) makes a tensor of input_ids' dtype and "
        "device; torch.cat([a, b]) puts b's rows below a's.",
        "padding = size − batch new rows of pad_token_id, as wide as input_ids; return "
        "input_ids with the padding below.")),
    "break_even_tokens": Hints("10", "check_break_even", (
        "Each compiled step saves (eager − compiled) seconds, so the compile is paid back "
        "after compile_seconds / saving steps, counted in whole steps, and each step writes "
        "batch tokens. No saving: it never pays.",
        "math.ceil rounds the steps up (round the steps, not the tokens); math.inf when the "
        "saving is 0 or less.",
        "saving = …; if saving <= 0: return math.inf; return the steps rounded up × batch.")),
    "replay": Hints("10", "check_replay", (
        "A captured graph takes no arguments: it reruns its recorded operations on the memory "
        "it recorded. So a replay is: choose the graph big enough for the batch, write this "
        "step's inputs into that graph's buffers (pad ids in the rows the batch does not "
        "fill), replay it once, and keep the batch's rows of its output.",
        "capture_size(batch, list(graphs)) gives the key of the graph; pad_batch(token, "
        "graph.size, pad_token_id) makes a full-size input; buffer.copy_(source) writes into "
        "the memory the graph reads (graph.token = … would put a new tensor there, which the "
        "graph never reads); slicing [:batch] keeps the real rows.",
        "graph = graphs[…]; copy the padded tokens into graph.token; copy position into "
        "graph.position; return the first batch rows of graph.replay().")),
    # ---- 11 ---------------------------------------------------------------------------------
    "split_qkv": Hints("11", "check_split_qkv", (
        "c_attn's output columns are three blocks side by side: queries, keys, values. A rank "
        "needs the same heads' columns in all three, so cut each block on its own and put this "
        "rank's three pieces side by side again. GPT-2's Conv1D stores its weight as (in, "
        "out): the output columns are dimension 1, not dimension 0 as in nn.Linear.",
        "hidden = weight.shape[1] // 3 and part = hidden // world_size; in the block that "
        "starts at column s, rank r's piece is columns s + r·part up to s + (r + 1)·part; "
        "weight[:, columns]; torch.cat(…, dim=1); the bias (one dimension) the same way with "
        "torch.cat; num_heads % world_size != 0 is the case to refuse with ValueError.",
        "refuse first; hidden, part = …; columns = [the slice of this rank in each of the three "
        "blocks]; return (the weight's three pieces side by side, the bias's three pieces "
        "joined).")),
    "ShardedMLP": Hints("11", "check_sharded_mlp", (
        "c_fc is split by columns and c_proj by the same rows, so a rank computes the "
        "activation of its own columns without talking, then a partial product with its rows: "
        "a share of every output number. The shares add up to the whole output, so one "
        "all-reduce; the bias once, after the sum, or W ranks would add it W times.",
        "x @ self.fc_weight + self.fc_bias; self.act(…); h @ self.proj_weight; "
        "self.comm.all_reduce(t) sums t over the ranks in place; + self.proj_bias after it.",
        "h = act(x through this rank's c_fc); partial = h through its rows of c_proj; one "
        "all-reduce of partial; return partial plus the bias.")),
    "embed_vocab_shard": Hints("11", "check_embed_vocab_shard", (
        "Each rank holds a range of rows. For the ids in its range it looks up its rows (at id "
        "− start); for the others it gives zeros; adding every rank's piece gives each id its "
        "row from exactly one rank. The lookup must stay in range even for ids it then zeroes, "
        "and the ids given must not change.",
        "a boolean mask, (ids >= start) & (ids < start + rows held); torch.where(mask, ids − "
        "start, 0) is a valid index everywhere; weight_shard[index] has shape ids.shape + "
        "(hidden,); the mask needs a last dimension (.unsqueeze(-1)) and the weights' dtype "
        "(.to(weight_shard.dtype)) to multiply the rows; comm.all_reduce once.",
        "mine = …; rows = weight_shard[…]; rows = rows × the mask as weights; all-reduce rows; "
        "return rows.")),
}

_given: dict[str, int] = {}         # the hint steps each exercise has been given so far


def _key(name) -> str:
    return re.sub(r"[^a-z0-9]", "", str(name).lower())


def _find(name) -> str | None:
    """The exercise ``name`` stands for: its own name in any case, its check's name, or the
    function or class the learner wrote."""
    if callable(name) and hasattr(name, "__name__"):
        name = name.__name__
    wanted = _key(name)
    for exercise, entry in HINTS.items():
        if wanted in (_key(exercise), _key(entry.check), _key(entry.check[len("check_"):])):
            return exercise
    return None


def hint(name, step: int | None = None) -> None:
    """Print the next hint step (1, 2, then 3) for the exercise ``name``, or step ``step``."""
    exercise = _find(name)
    if exercise is None:
        near = difflib.get_close_matches(str(name), list(HINTS), n=1)
        maybe = f" (did you mean {near[0]!r}?)" if near else ""
        print(f"✗ hint: no exercise is called {name!r}{maybe}; the exercises are: "
              f"{', '.join(HINTS)}")
        return
    entry = HINTS[exercise]
    if step is None:
        step = min(_given.get(exercise, 0) + 1, len(STEPS))
    if step not in range(1, len(STEPS) + 1):
        print(f"✗ hint: step {step!r} of {exercise!r}? The steps are 1, 2 and 3.")
        return
    _given[exercise] = max(_given.get(exercise, 0), step)
    after = (f"hint({exercise!r}) again gives step {step + 1}." if step < len(STEPS) else
             f"That was the last step; the complete answer is in lesson {entry.lesson}.")
    print(textwrap.fill(f"hint {step} of {len(STEPS)} for {exercise} ({STEPS[step - 1]}): "
                        f"{entry.steps[step - 1]}", width=96))
    print(after)
