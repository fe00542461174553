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


CPU_ONLY = ("on the CPU every tensor is on the same device; on a GPU the check compares "
            "devices and flags it")

EXERCISES = [
    Exercise("01", "greedy_with_cache", "check_greedy_with_cache", ("model", "tokenizer"),
             setup="import torch"),
    Exercise("01", "kv_cache_bytes_for", "check_kv_cache_bytes_for", ("model", "tokenizer")),
    Exercise("02", "left_pad", "check_left_pad", ("tokenizer",), setup="import torch"),
    Exercise("02", "position_ids_from_mask", "check_position_ids_from_mask",
             ("tokenizer", "device"), setup="import torch"),
    Exercise("02", "batched_greedy", "check_batched_greedy", ("model", "tokenizer"),
             setup="import torch\nfrom helpers import position_ids_from_mask"),
    Exercise("03", "merge_batches", "check_merge_batches", ("model", "tokenizer"),
             setup="import torch\nfrom helpers import Batch"),
    Exercise("03", "filter_batch", "check_filter_batch", ("model", "tokenizer"),
             setup="import torch\nfrom helpers import Batch, cache_from_layers, cache_layers"),
    Exercise("04", "quantize_tensor", "check_quantize_tensor", ("model",), setup="import torch"),
    Exercise("04", "dequantize_tensor", "check_dequantize_tensor", ("model",),
             setup="import torch"),
    Exercise("04", "quantize_channels", "check_quantize_channels", ("model",),
             setup="import torch"),
    Exercise("05", "LoraLayer", "check_lora_layer", (), setup="import torch"),
    Exercise("05", "merge_lora", "check_merge_lora", ("device",),
             setup="import torch\nfrom torch import nn"),
    Exercise("06", "linear_lora_loop", "check_linear_lora_loop", ("device",),
             setup="import torch"),
    Exercise("06", "linear_lora_gathered", "check_linear_lora_gathered", ("device",),
             setup="import torch"),
    Exercise("07", "time_stream", "check_time_stream", (), setup="import time"),
    Exercise("07", "generate_all", "check_generate_all", (), setup="import asyncio"),
    Exercise("08", "block_hashes", "check_block_hashes", (), setup="import math"),
    Exercise("08", "Blocks", "check_blocks", (), setup="import math", needs=("08:block_hashes",)),
    Exercise("09", "verify", "check_verify", ("model", "tokenizer"), setup="import torch"),
    Exercise("09", "lookup", "check_lookup", ()),
    Exercise("09", "expected_tokens", "check_expected_tokens", ()),
    Exercise("10", "CountingBackend", "check_counting_backend", (), setup="import torch"),
    Exercise("10", "capture_size", "check_capture_size", (), setup="import torch"),
    Exercise("10", "pad_batch", "check_pad_batch", ("device",), setup="import torch"),
    Exercise("10", "break_even_tokens", "check_break_even", ()),
]
