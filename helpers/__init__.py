"""Helpers for the course *Efficiently Serving LLMs*.

Everything the lessons use is importable from here: ``from helpers import load_model``.
Each function's docstring names the lesson that introduces it.
"""

from .batching import (
    Batch,
    Step,
    Trace,
    cache_from_layers,
    cache_layers,
    filter_batch,
    generate_batched,
    generate_continuous,
    generate_next_token,
    generate_sequential,
    generate_static,
    ideal_decode_steps,
    init_batch,
    left_pad,
    merge_batches,
    model_context,
    position_ids_from_mask,
    static_decode_steps,
    transformers_generate_batch,
)
from .generation import (
    Generation,
    cache_nbytes,
    generate_no_cache,
    generate_with_cache,
    kv_cache_bytes,
    kv_cache_bytes_for,
    kv_width,
    next_token_candidates,
)
from .lora import (
    ADAPTERS_DIR,
    NO_ADAPTER,
    TOY_COLOURS,
    LoraLayer,
    MultiLora,
    MultiLoraLayer,
    ToyModel,
    adapter_mismatch,
    ToyMultiLoraModel,
    linear_lora_gathered,
    linear_lora_loop,
    load_adapters,
    random_adapters,
    shipped_adapters,
)
from .models import (
    BUNDLED_MODEL_DIR,
    MODEL_ENV_VAR,
    default_device,
    load_model,
    load_tokenizer,
    resolve_model_name,
)
from .quantization import (
    LLAMA2_70B,
    QuantState,
    conv1d_to_linear,
    dequantize,
    dequantize_model,
    footprint,
    gpu_memory_estimate,
    import_torchao,
    kv_cache_plan,
    perplexity,
    quantization_errors,
    quantize,
    quantize_model,
    quiet_stderr,
    torchao_int8_weight_only,
)
from .plots import durations_figure, finish_times, plot_timeline, timelines_figure
from .server import BackgroundServer, serve_in_background
from .widgets import LivePlot, rerun_controls, show_diagram, show_figure

__all__ = [
    "BUNDLED_MODEL_DIR", "MODEL_ENV_VAR", "Generation", "LivePlot", "cache_nbytes",
    "default_device", "generate_no_cache", "generate_with_cache", "kv_cache_bytes",
    "kv_cache_bytes_for", "kv_width", "load_model", "load_tokenizer", "next_token_candidates",
    "rerun_controls", "resolve_model_name", "seed_everything", "show_diagram", "show_figure",
    # lessons 02-03: batching
    "Batch", "Step", "Trace", "cache_from_layers", "cache_layers", "filter_batch",
    "generate_batched", "generate_continuous", "generate_next_token", "generate_sequential",
    "generate_static", "ideal_decode_steps", "init_batch", "left_pad", "merge_batches",
    "model_context", "plot_timeline", "position_ids_from_mask", "static_decode_steps",
    "transformers_generate_batch", "durations_figure", "finish_times", "timelines_figure",
    # lesson 04: quantization
    "LLAMA2_70B", "QuantState", "conv1d_to_linear", "dequantize", "dequantize_model",
    "footprint", "gpu_memory_estimate", "import_torchao", "kv_cache_plan", "perplexity",
    "quantization_errors", "quantize", "quantize_model", "quiet_stderr",
    "torchao_int8_weight_only",
    # lessons 05-06: LoRA
    "ADAPTERS_DIR", "NO_ADAPTER", "TOY_COLOURS", "LoraLayer", "MultiLora", "MultiLoraLayer",
    "ToyModel", "ToyMultiLoraModel", "adapter_mismatch", "linear_lora_gathered", "linear_lora_loop",
    "load_adapters", "random_adapters", "shipped_adapters",
    # lesson 07: serving (helpers.server holds the rest; FastAPI is imported on first use)
    "BackgroundServer", "serve_in_background",
]


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy (when installed) and torch, so that a lesson runs the same twice."""
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
