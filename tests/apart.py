"""Folders of tests that `pytest tests` leaves out: they run only when asked for by path.

``tests/browser`` (a real JupyterLab in Chromium) and ``tests/vllm`` (real vLLM, in an
environment of its own) take minutes and need what `make test` does not install. Their
``conftest.py`` sets ``pytest_ignore_collect = ignore_unless_asked(HERE)``: any path at or
below the folder on the command line (``tests/vllm``, ``tests/vllm/test_x.py::test_y``)
enables it.
"""

from __future__ import annotations

from pathlib import Path


def ignore_unless_asked(folder: Path):
    """A ``pytest_ignore_collect`` hook that skips ``folder`` unless a command-line path
    names it or something inside it."""

    def asked_for(config) -> bool:
        base = Path(config.invocation_params.dir)
        for arg in config.args:
            path = (base / arg.split("::", 1)[0]).resolve()
            if path == folder or folder in path.parents:
                return True
        return False

    def pytest_ignore_collect(collection_path, config):
        if collection_path.resolve() != folder and not asked_for(config):
            return True
        return None

    return pytest_ignore_collect
