"""Helpers for the course *Efficiently Serving LLMs*.

Everything the lessons use is importable from here: ``from helpers import load_model``.
Each function's docstring names the lesson that introduces it.

The modules form layers, bottom to top. A module imports only from layers below its own, and
the modules of one layer do not import each other; a sub-package (``server``, ``paged``) counts
as one module, whose files build on one another. tests/test_layering.py reads this list and
checks every import in the package against it, imports inside functions included.

    1. quiet, gpu_run, versions      library noise kept out of a lesson's output; the record of
                                     the course's last run on a GPU; the versions of torch,
                                     transformers, peft, torchao (every lesson's setup cell)
    2. models                        the model and its tokenizer (lesson 01)
    3. generation                    one token at a time, the KV cache (lesson 01)
    4. batching, quantization, lora, costs  what lessons 02-06 teach, and what a decode
                                     step costs on this device (lesson 02)
    5. paged, speculative            the paged KV cache (lesson 08), on top of lesson 03's batches;
                                     speculative decoding (lesson 09)
    6. corpus, plots                 the story world's text, the lessons' figures
    7. compilation, sharding         the compiled decode step and its measurements (lesson 10),
                                     on the static cache of transformers, with its figures;
                                     one model split across ranks (lesson 11)
    8. widgets, checks               notebook display: live plots, controls, diagrams; the
                                     learners' checks of the lessons' exercises
    9. server                        lesson 07's server, built on the layers below
    10. helpers                      this file: the names the lessons import
"""

#: Where each name lives. ``from helpers import load_model`` imports that name's module on
#: first use (PEP 562's module ``__getattr__``), so that importing one sub-package, such as
#: the server's HTTP side (``helpers.server``, which needs no torch), does not import them all.
_EXPORTS = {
    "compilation": ["CAPTURE_SIZES", "CountingBackend", "generate_static_cache",
        "mark_batch_dynamic", "time_decode"],
    "batching": ["Batch", "Step", "Trace", "cache_from_layers", "cache_layers", "filter_batch",
        "generate_batched", "generate_continuous", "generate_next_token", "generate_sequential",
        "generate_static", "ideal_decode_steps", "init_batch", "left_pad", "merge_batches",
        "model_context", "position_ids_from_mask", "static_decode_steps", "time_batch",
        "time_batch_sizes", "time_schedules", "transformers_generate_batch"],
    "generation": ["Generation", "cache_nbytes", "generate_no_cache", "generate_with_cache",
        "kv_cache_bytes", "kv_cache_bytes_for", "next_token_candidates"],
    "lora": ["ADAPTERS_DIR", "NO_ADAPTER", "TOY_COLOURS", "LoraLayer", "MultiLora",
        "MultiLoraLayer", "ToyModel", "adapter_mismatch", "ToyMultiLoraModel",
        "linear_lora_gathered", "linear_lora_loop", "load_adapters", "adapter_folders",
        "random_adapters", "save_random_adapters", "shipped_adapters", "shipped_adapters_fit"],
    "models": ["BUNDLED_MODEL_DIR", "MODEL_ENV_VAR", "Needs", "load_model", "load_tokenizer",
        "resolve_model_name"],
    "quantization": ["LLAMA2_70B", "QuantState", "conv1d_to_linear", "dequantize",
        "dequantize_model", "footprint", "gpu_memory_estimate", "kv_cache_plan", "perplexity",
        "quantization_errors", "quantize", "quantize_model", "torchao_int8_weight_only"],
    "paged": ["BlockManager", "PagedKVCache", "PoolExhausted", "generate_paged"],
    "plots": ["durations_figure", "finish_times", "plot_timeline", "timelines_figure"],
    "quiet": ["import_torchao", "quiet_stderr"],
    "gpu_run": ["gpu_record"],
    "costs": ["DeviceRates", "StepCost", "measure_rates", "step_cost", "step_overhead"],
    "versions": ["LESSON_NEEDS", "show_versions"],
    "speculative": ["DRAFT_MODEL_DIR", "DraftModelProposer", "PromptLookupProposer",
        "course_draft", "speculative_generate"],
    "server": ["serve_in_background"],
    "sharding": ["RankDied", "ShardedMLP", "SimulatedTP", "check_world_size", "load_shard",
        "shard_model", "split_qkv", "start_ranks", "tp_decode_step"],
    "widgets": ["LivePlot", "rerun_controls", "show_diagram", "show_figure"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "BUNDLED_MODEL_DIR", "MODEL_ENV_VAR", "Generation", "Needs", "LivePlot", "cache_nbytes",
    "LESSON_NEEDS", "show_versions",
    "generate_no_cache", "generate_with_cache", "kv_cache_bytes", "kv_cache_bytes_for",
    "load_model", "load_tokenizer", "next_token_candidates", "quiet_stderr", "rerun_controls",
    "resolve_model_name", "seed_everything", "show_diagram", "show_figure", "gpu_record",
    # lessons 02-03: batching
    "Batch", "Step", "Trace", "cache_from_layers", "cache_layers", "filter_batch",
    "generate_batched", "generate_continuous", "generate_next_token", "generate_sequential",
    "generate_static", "ideal_decode_steps", "init_batch", "left_pad", "merge_batches",
    "model_context", "plot_timeline", "position_ids_from_mask", "static_decode_steps",
    "time_batch", "time_batch_sizes", "time_schedules", "transformers_generate_batch",
    "durations_figure", "finish_times", "timelines_figure",
    "DeviceRates", "StepCost", "measure_rates", "step_cost", "step_overhead",
    # lesson 04: quantization
    "LLAMA2_70B", "QuantState", "conv1d_to_linear", "dequantize", "dequantize_model",
    "footprint", "gpu_memory_estimate", "import_torchao", "kv_cache_plan", "perplexity",
    "quantization_errors", "quantize", "quantize_model", "torchao_int8_weight_only",
    # lessons 05-06: LoRA
    "ADAPTERS_DIR", "NO_ADAPTER", "TOY_COLOURS", "LoraLayer", "MultiLora", "MultiLoraLayer",
    "ToyModel", "ToyMultiLoraModel", "adapter_mismatch", "linear_lora_gathered", "linear_lora_loop",
    "adapter_folders", "load_adapters", "random_adapters", "save_random_adapters",
    "shipped_adapters", "shipped_adapters_fit",
    # lesson 07: serving (helpers.server holds the rest; FastAPI is imported on first use)
    "serve_in_background",
    # lesson 08: the paged KV cache (helpers.paged holds the rest)
    "BlockManager", "PagedKVCache", "PoolExhausted", "generate_paged",
    # lesson 09: speculative decoding (helpers.speculative holds the rest)
    "DRAFT_MODEL_DIR", "DraftModelProposer", "PromptLookupProposer", "course_draft",
    "speculative_generate",
    # lesson 10: compilation (helpers.compilation holds the rest)
    "CAPTURE_SIZES", "CountingBackend", "generate_static_cache", "mark_batch_dynamic",
    "time_decode",
    # lesson 11: sharding (helpers.sharding holds the rest)
    "RankDied", "ShardedMLP", "SimulatedTP", "check_world_size", "load_shard", "shard_model",
    "split_qkv", "start_ranks", "tp_decode_step",
]


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy and torch, so that a lesson runs the same twice."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'helpers' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value          # the next access finds it at once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
