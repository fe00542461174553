"""The course server beside real vLLM (its CPU build), apart from ``make bench``: vLLM needs an
environment of its own (``.venv-vllm``, which ``make bench-vllm`` and ``make test-vllm``
build) and takes 60-100 s to start. ``compare`` measures (``python -m benchmarks.vllm.compare``);
``serve`` starts vLLM's OpenAI server (``tests/vllm`` uses it too). The package builds on
``benchmarks.serving`` and never the other way round."""
