"""Tests against real vLLM (its CPU build), run only when asked for by path.

`pytest tests` (make test, make unit, make test-pythons) leaves this folder out, as it does
tests/browser: vLLM needs an environment of its own (.venv-vllm, 3.4 GB, about 4 minutes to
build) and takes 60-100 s to start. Run it with

    make test-vllm         # builds .venv-vllm first; or, with VLLM_PYTHON=.venv-vllm/bin/python:
    .venv/bin/python -m pytest tests/vllm -q

Any path at or below this folder on the command line enables it. vLLM is started once for
the session (``benchmarks.vllm.serve.VllmServe``), the course's server once beside it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ..apart import ignore_unless_asked

HERE = Path(__file__).resolve().parent


pytest_ignore_collect = ignore_unless_asked(HERE)   # tests/apart.py


@pytest.fixture(scope="session")
def vllm_url():
    """The URL of vLLM's OpenAI server on the bundled model (served as ``bundled``), warmed
    up; a missing vLLM environment fails the test with how to build it."""
    from benchmarks.vllm.serve import VllmServe

    try:
        server = VllmServe()
    except RuntimeError as err:
        pytest.fail(str(err))
    with server as url:
        yield url


@pytest.fixture(scope="session")
def ours_url():
    """The URL of the course's server with its defaults (one torch thread, as vLLM's)."""
    from helpers.server import serve_in_background

    with serve_in_background(threads=1, name="test-vllm") as url:
        yield url
