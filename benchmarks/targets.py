"""The targets the lessons set: each benchmark checks its own, and ``run_all``'s summary sets
the measured figures beside them."""

BATCHING = {"speedup": 3.0, "steps_over_ideal": 1.15, "ours_over_generate": 1.2}
QUANTIZATION = {"per_tensor_footprint": 0.27}
LORA = {"gathered_at_64": 5.0, "peft_over_ours": 2.0}
SERVER = {"speedup": 4.0, "single_client": 0.70, "transformers": 1.5}
PAGED = {"concurrency": 2.0, "ttft": 3.0}
SPECULATIVE = {"lookup": 1.5, "ours_vs_transformers": 1.0}
