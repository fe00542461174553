"""The course's benchmarks: one module a lesson's figures (``bench_*.py``), run from the
repository's root as ``python -m benchmarks.<name>``; ``timing`` times things and
``results_io`` writes the figures; ``run_all`` runs them all and writes the summary."""
