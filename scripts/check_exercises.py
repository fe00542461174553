"""The lessons' exercises, as the mutation test of the checks knows them
(``scripts/mutate_checks.py``).

A new exercise joins with one entry: the lesson's number, the name its cell defines (the
function or class the learner writes, between ``### BEGIN SOLUTION`` and ``### END SOLUTION``),
the check's name in ``helpers.checks``, what the check takes after the answer (``"model"``,
``"tokenizer"``, ``"device"``: the bundled model on the CPU), the code the cell needs from the
lesson's earlier cells (``setup``), the other exercises whose cells must run first (``needs``),
and, once the mutation test has run, the mutants it passes that change nothing the lesson relies
on, each with its reason (``harmless``)::

    Exercise("11", "my_function", "check_my_function", ("model", "tokenizer"),
             setup="import torch", harmless={...}),
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Exercise:
    lesson: str
    name: str
    check: str
    args: tuple[str, ...] = ()
    setup: str = ""
    needs: tuple[str, ...] = ()
    harmless: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.lesson}:{self.name}"

    def check_module(self) -> str:
        return f"lesson{self.lesson}"


INDEPENDENT = "independent statements: neither reads or changes what the other writes"
USE_CACHE = ("use_cache defaults to True in the model's config, so the call returns (and fills) "
             "the cache all the same")
ONE_ROW = "the batch dimension has one row here: index -1 is index 0"
LAST_DIM = "the tensor has two dimensions here, so dim=1 is dim=-1"

EXERCISES = [
    Exercise("01", "greedy_with_cache", "check_greedy_with_cache", ("model", "tokenizer"),
             setup="import torch", harmless={
                 "keyword dropped: `model(input_ids=step_input, past_key_values=past, use_cache…` "
                 "-> `model(input_ids=step_input, past_key_values=past)`": USE_CACHE,
                 "off by one: `0` -> `-1`": ONE_ROW,
                 "statements swapped: `past, step_input = (out.past_key_values, token) / new.appen…` "
                 "-> `new.append(int(token)) / past, step_input = (out.past_key_v…`": INDEPENDENT,
             }),
    Exercise("01", "kv_cache_bytes_for", "check_kv_cache_bytes_for", ("model", "tokenizer"),
             harmless={
                 "arithmetic: `config.hidden_size // heads` -> `config.hidden_size / heads`":
                     "every model's hidden size is a multiple of its heads, so the float "
                     "quotient is the integer one; the size comes back as a float, which the "
                     "lesson formats the same",
                 "statements swapped: `kv_heads = getattr(config, 'num_key_value_heads', None) or …` "
                 "-> `head_size = getattr(config, 'head_dim', None) or config.hid…`": INDEPENDENT,
             }),
    Exercise("02", "left_pad", "check_left_pad", ("tokenizer",), setup="import torch", harmless={
        "keyword dropped: `torch.full((len(token_lists), width), pad_id, dtype=torch.l…` -> "
        "`torch.full((len(token_lists), width), pad_id)`":
            "torch.full takes int64 from an int fill value: the same dtype as dtype=torch.long",
        "statements swapped: `input_ids = torch.full((len(token_lists), width), pad_id, d…` -> "
        "`attention_mask = torch.zeros((len(token_lists), width), dty…`": INDEPENDENT,
        "statements swapped: `input_ids[row, width - len(ids):] = torch.tensor(ids) / att…` -> "
        "`attention_mask[row, width - len(ids):] = 1 / input_ids[row,…`": INDEPENDENT,
    }),
    Exercise("02", "position_ids_from_mask", "check_position_ids_from_mask",
             ("tokenizer", "device"), setup="import torch", harmless={
                 "call dropped: `attention_mask.long()` -> `attention_mask`":
                     "cumsum of an integer or boolean tensor gives int64 all the same",
                 "sign or not dropped: `-1` -> `1`": LAST_DIM + " (an attention mask is 2-D)",
             }),
    Exercise("02", "batched_greedy", "check_batched_greedy", ("model", "tokenizer"),
             setup="import torch\nfrom helpers import position_ids_from_mask", harmless={
                 "keyword dropped: `model(input_ids=ids, attention_mask=mask, position_ids=posi…` -> "
                 "`model(input_ids=ids, attention_mask=mask, position_ids=posi…` (#2)": USE_CACHE,
                 "sign or not dropped: `-1` -> `1` (#2)": LAST_DIM + " (the last position's "
                 "logits, batch x vocabulary)",
                 "arguments swapped: `print(f'step {step}: fed {tuple(ids.shape)}, mask {tuple(ma…` "
                 "-> `print([tokenizer.decode(t) for t in next_ids], f'step {step…`":
                     "what the verbose line says is the learner's own; the check counts the lines",
                 "statements swapped: `positions = position_ids_from_mask(mask) / past, new = (Non…` "
                 "-> `past, new = (None, []) / positions = position_ids_from_mask…`": INDEPENDENT,
                 "statements swapped: `if verbose: / new.append(next_ids)` -> "
                 "`new.append(next_ids) / if verbose:`": INDEPENDENT,
                 "statements swapped: `new.append(next_ids) / past, ids = (out.past_key_values, ne…` "
                 "-> `past, ids = (out.past_key_values, next_ids) / new.append(ne…`": INDEPENDENT,
                 "statements swapped: `past, ids = (out.past_key_values, next_ids) / mask = torch.…` "
                 "-> `mask = torch.cat([mask, torch.ones_like(next_ids)], dim=1) …`": INDEPENDENT,
                 "statements swapped: `mask = torch.cat([mask, torch.ones_like(next_ids)], dim=1) …` "
                 "-> `positions = positions[:, -1:] + 1 / mask = torch.cat([mask,…`": INDEPENDENT,
             }),
    Exercise("03", "merge_batches", "check_merge_batches", ("model", "tokenizer"),
             setup="import torch\nfrom helpers import Batch", harmless={
                 "arguments swapped: `max(batch1.attention_mask.shape[1], batch2.attention_mask.s…` "
                 "-> `max(batch2.attention_mask.shape[1], batch1.attention_mask.s…`":
                     "max is symmetric",
                 "keyword dropped: `F.pad(batch.attention_mask, (missing, 0), value=0)` -> "
                 "`F.pad(batch.attention_mask, (missing, 0))`": "F.pad pads with 0 by default",
                 "statements swapped: `if len(batch1) == 0: / if len(batch2) == 0:` -> "
                 "`if len(batch2) == 0: / if len(batch1) == 0:`":
                     "when both are empty either one is the empty result",
                 "statements swapped: `if len(batch2) == 0: / width = max(batch1.attention_mask.sh…` "
                 "-> `width = max(batch1.attention_mask.shape[1], batch2.attentio…`":
                     "the width of an empty batch's mask is 0, so computing it first changes "
                     "nothing",
                 "statements swapped: `width = max(batch1.attention_mask.shape[1], batch2.attentio…` "
                 "-> `def pad_on_the_left(batch): / width = max(batch1.attention_…`":
                     "the inner function reads width when it is called, after both lines ran",
                 "statements swapped: `mask1, layers1 = pad_on_the_left(batch1) / mask2, layers2 =…` "
                 "-> `mask2, layers2 = pad_on_the_left(batch2) / mask1, layers1 =…`": INDEPENDENT,
                 "statements swapped: `mask = F.pad(batch.attention_mask, (missing, 0), value=0) /…` "
                 "-> `layers = [(F.pad(keys, (0, 0, missing, 0)), F.pad(values, (…`": INDEPENDENT,
             }),
    Exercise("03", "filter_batch", "check_filter_batch", ("model", "tokenizer"),
             setup="import torch\nfrom helpers import Batch, cache_from_layers, cache_layers",
             harmless={
                 "keyword dropped: `torch.tensor(keep, device=batch.attention_mask.device)` -> "
                 "`torch.tensor(keep)`": "a CPU tensor of row numbers indexes a tensor on any "
                 "device (PyTorch moves the index), on a GPU too",
                 "function swapped: `mask.any(dim=0).int()` -> `mask.any(dim=0).long()`":
                     "argmax of the same 0s and 1s, in another integer type",
                 "statements swapped: `if not keep: / rows = torch.tensor(keep, device=batch.atten…` "
                 "-> `rows = torch.tensor(keep, device=batch.attention_mask.devic…`":
                     "torch.tensor([]) is made and dropped when every row is done",
             }),
    Exercise("04", "quantize_tensor", "check_quantize_tensor", ("model",), setup="import torch",
             harmless={
                 "off by one: `0` -> `-1` (#4)": "the codes are never below 0 (t >= min gives "
                 "round(t / scale) >= -zero_point, rounding being symmetric), so the clamp's "
                 "lower end never acts",
                 "made without the input's device: `torch.ones_like(scale)` -> "
                 "`torch.ones(scale.shape)`": "the scale is a 0-d tensor, and a 0-d tensor on "
                 "the CPU meets tensors on a GPU as a number does (PyTorch allows it): the codes "
                 "and the dequantization come out the same on any device",
             }),
    Exercise("04", "dequantize_tensor", "check_dequantize_tensor", ("model",),
             setup="import torch"),
    Exercise("04", "quantize_channels", "check_quantize_channels", ("model",),
             setup="import torch", harmless={
                 "dtype: `torch.int32` -> `torch.int64`": "int64 zero points are integers too "
                 "and dequantize the same; the text asks for a tensor of integers",
                 "off by one: `0` -> `-1` (#4)": "the codes are never below 0 (t >= min gives "
                 "round(t / scale) >= -zero_point), so the clamp's lower end never acts",
                 "statements swapped: `lo = t.amin(dim=others, keepdim=True).clamp(max=0) / hi = t…` "
                 "-> `hi = t.amax(dim=others, keepdim=True).clamp(min=0) / lo = t…`": INDEPENDENT,
             }),
    Exercise("05", "LoraLayer", "check_lora_layer", (), setup="import torch"),
    Exercise("05", "merge_lora", "check_merge_lora", ("device",),
             setup="import torch\nfrom torch import nn"),
    Exercise("06", "linear_lora_loop", "check_linear_lora_loop", ("device",),
             setup="import torch", harmless={
                 "call dropped: `lora_indices.tolist()` -> `lora_indices`":
                     "a 0-d tensor indexes the stacks as the int does (on any device); only "
                     "slower, and this is the slow version",
             }),
    Exercise("06", "linear_lora_gathered", "check_linear_lora_gathered", ("device",),
             setup="import torch", harmless={
                 "statements swapped: `a = loras_a.index_select(0, lora_indices) / b = loras_b.ind…` "
                 "-> `b = loras_b.index_select(0, lora_indices) / a = loras_a.ind…`": INDEPENDENT,
             }),
    Exercise("07", "time_stream", "check_time_stream", (), setup="import time", harmless={
        "statements swapped: `start = clock() / stamps, text = ([], '')` -> "
        "`stamps, text = ([], '') / start = clock()`":
            "the clock is still read before send(); two empty containers take no time worth "
            "a stamp",
        "statements swapped: `ttft = stamps[0] - start / gaps = [now - before for before,…` -> "
        "`gaps = [now - before for before, now in zip(stamps, stamps[…`": INDEPENDENT,
    }),
    Exercise("07", "generate_all", "check_generate_all", (), setup="import asyncio"),
    Exercise("08", "block_hashes", "check_block_hashes", (), setup="import math"),
    Exercise("08", "Blocks", "check_blocks", (), setup="import math", needs=("08:block_hashes",),
             harmless={
                 "statements swapped: `needed = math.ceil((len(prompt_ids) + max_new_tokens) / sel…` "
                 "-> `free_hits = sum((self.ref_counts[b] == 0 for b in hits)) / …`": INDEPENDENT,
                 "statements swapped: `self.tables[rid] = [self.take(b) for b in hits] / self.rese…` "
                 "-> `self.reserved[rid] = needed / self.tables[rid] = [self.take…`": INDEPENDENT,
                 "statements swapped: `self.reserved[rid] = needed / self.hit_blocks += len(hits)` "
                 "-> `self.hit_blocks += len(hits) / self.reserved[rid] = needed`": INDEPENDENT,
                 "statements swapped: `self.reserved[rid] -= 1 / block = next(iter(self.free))` -> "
                 "`block = next(iter(self.free)) / self.reserved[rid] -= 1`": INDEPENDENT,
                 "statements swapped: `self.evict(block) / table.append(self.take(block))` -> "
                 "`table.append(self.take(block)) / self.evict(block)`":
                     "take() changes the reference count and the free list, evict() the names: "
                     "neither reads what the other changes",
                 "statements swapped: `for block in self.tables.pop(rid): / del self.reserved[rid]` "
                 "-> `del self.reserved[rid] / for block in self.tables.pop(rid):`": INDEPENDENT,
             }),
    Exercise("09", "verify", "check_verify", ("model", "tokenizer"), setup="import torch",
             harmless={
                 "keyword dropped: `model(input_ids=ids, past_key_values=cache, use_cache=True)` -> "
                 "`model(input_ids=ids, past_key_values=cache)`": USE_CACHE,
                 "boolean: `True` -> `False`": "transformers fills the DynamicCache it is given "
                 "in place whatever use_cache says; the cache ends the same",
                 "off by one: `0` -> `-1` (#1)": ONE_ROW,
                 "sign or not dropped: `-1` -> `1`": LAST_DIM + " (positions x vocabulary)",
                 "compare: `n < len(guesses)` -> `n <= len(guesses)` (#2)":
                     "with every guess kept the crop is cache.crop(-0), which removes nothing",
                 "statements swapped: `choices = logits[len(unread) - 1:].argmax(dim=-1).tolist() …` "
                 "-> `n = 0 / choices = logits[len(unread) - 1:].argmax(dim=-1).t…`": INDEPENDENT,
             }),
    Exercise("09", "lookup", "check_lookup", (), harmless={
        "arguments swapped: `min(max_ngram, len(ids) - 1)` -> `min(len(ids) - 1, max_ngram)`":
            "min is symmetric",
        "arithmetic: `len(ids) - 1` -> `len(ids) + 1`":
            "an n-gram as long as ids or longer has no earlier occurrence: the search finds "
            "nothing for it and goes on to shorter ones",
        "off by one: `1` -> `0` (#1)": "an n-gram as long as ids has no earlier occurrence: the "
        "search finds nothing for it and goes on to shorter ones",
        "off by one: `0` -> `-1`": "n = 0 compares an empty slice with the whole list, which "
        "never matches: the result is still []",
        "off by one: `1` -> `2` (#4)": "start = -1 gives an empty slice, ids[-1:n - 1], which "
        "never matches the tail",
    }),
    Exercise("09", "expected_tokens", "check_expected_tokens", ()),
    Exercise("10", "CountingBackend", "check_counting_backend", (), setup="import torch"),
    Exercise("10", "capture_size", "check_capture_size", (), setup="import torch"),
    Exercise("10", "pad_batch", "check_pad_batch", ("device",), setup="import torch"),
    Exercise("10", "break_even_tokens", "check_break_even", ()),
    Exercise("10", "replay", "check_replay", (),
             setup="import torch\nfrom helpers.compilation import capture_size, pad_batch",
             harmless={
                 "statements swapped: `graph.token.copy_(pad_batch(token, graph.size, pad_token_id…` "
                 "-> `graph.position.copy_(position) / graph.token.copy_(pad_batc…`":
                     INDEPENDENT + " (both copies land before the replay)",
                 "copy dropped: `list(graphs)` -> `graphs`": "capture_size only iterates over the "
                 "sizes it is given, and a dict iterates over its keys, the graphs' sizes; "
                 "nothing changes the dict",
             }),
    Exercise("11", "split_qkv", "check_split_qkv", ("model",), setup="import torch", harmless={
        "statements swapped: `if num_heads % world_size: / hidden = weight.shape[1] // 3` -> "
        "`hidden = weight.shape[1] // 3 / if num_heads % world_size:`": INDEPENDENT + " (the "
        "ValueError still comes before anything is cut)",
    }),
    Exercise("11", "ShardedMLP", "check_sharded_mlp", ("model",), setup="import torch"),
    Exercise("11", "embed_vocab_shard", "check_embed_vocab_shard", ("model",),
             setup="import torch", harmless={
                 "operands swapped: `(ids >= start) & (ids < start + weight_shard.shape[0])` -> "
                 "`(ids < start + weight_shard.shape[0]) & (ids >= start)`": "& is symmetric: "
                 "the same mask",
                 "off by one: `0` -> `-1` (#2)": "an id held by another rank looks up the "
                 "shard's last row instead of its first, and the mask makes it zero all the same "
                 "(the text asks for any valid index there)",
                 "call dropped: `mine.unsqueeze(-1).to(weight_shard.dtype)` -> "
                 "`mine.unsqueeze(-1)`": "rows times a boolean mask keep the rows' dtype "
                 "(PyTorch promotes bool to the float type it meets, float16 and bfloat16 "
                 "included), with the same values",
             }),
]
