"""The one place where a benchmark builds the course's engine in its own process (most of them
start the server instead: ``helpers.server.serve_in_background``). ``gpu_server.py`` needs the
engine itself, to hand it requests and read its counters without HTTP in between."""


def make_engine(model, tokenizer, **options):
    """The server's default engine (lesson 08's paged KV cache) on ``model``, with the
    server's ``options`` (``max_batch_size``, ``compile``, ``cuda_graphs``, ...), started."""
    from helpers.server.engine import Engine

    return Engine(model, tokenizer, **options).start()


def stand_in_capture():
    """What ``make_engine(..., capture=)`` takes to run its CUDA-graph code on a CPU: each
    replay runs the step again (the course's tests use the same stand-in)."""
    from helpers.compilation import rerun_each_replay

    return rerun_each_replay
