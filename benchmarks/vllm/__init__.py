"""The course server beside real vLLM (its CPU build), apart from ``make bench``: vLLM needs an
environment of its own (``.venv-vllm``, which ``make bench-vllm`` and ``make test-vllm``
build) and takes 60-100 s to start.

    python -m benchmarks.vllm.compare     # tokens/s and TTFT at 1, 16 and 64 clients
    python -m benchmarks.vllm.profile     # where each server's time goes (py-spy)

``serve`` starts vLLM's OpenAI server (``tests/vllm`` uses it too); ``stacks`` sorts the
profiler's samples into what each server was doing, and ``report`` writes the profile's
tables. The package builds on ``benchmarks.serving`` and never the other way round.
"""
