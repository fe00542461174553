"""The course's benchmarks: one module a lesson's figures (``bench_*.py``), run from the
repository's root as ``python -m benchmarks.<name>``; ``timing`` times things, ``plots`` draws
and ``results_io`` writes the figures; ``serving`` is the client side of the server
benchmarks; ``run_all`` runs them all and writes the summary. The comparison with vLLM, which
needs an environment of its own, is the sub-package ``benchmarks.vllm``."""

#: The course's prompts, which every benchmark sends in turn.
PROMPTS = ["The quick brown fox jumped over the", "The rain in Spain falls", "What comes up must",
           "Jack and Jill", "Humpty Dumpty sat"]
