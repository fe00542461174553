"""A small LoRAX-compatible server built from the course's own helpers. (Lesson 07.)

It puts the course together: continuous batching (lesson 03: ``init_batch``-style prefill,
``merge_batches``, ``filter_batch``) with one LoRA adapter per row (lesson 06: ``MultiLora``),
per-request sampling rules and JSON mode (outlines-core), behind LoRAX's REST protocol and
OpenAI's completions protocol, so the real ``lorax-client`` and ``openai`` packages talk to it.

    python -m helpers.server --port 8080               # from a terminal

    from helpers.server import serve_in_background     # from a notebook
    with serve_in_background() as url:
        from lorax import Client
        print(Client(url).generate("Jack and Jill", max_new_tokens=20).generated_text)

Modules: ``engine`` (the scheduler that owns the model), ``app`` (the routes), ``protocol``
(request bodies and errors), ``json_mode`` (schemas to token masks), ``adapters`` (adapter
names to loaded adapters), ``background`` (start/stop from Python), ``__main__`` (the command).

Importing this package is cheap: FastAPI, uvicorn and the engine are imported on first use.
"""

from __future__ import annotations

from .background import BackgroundServer, serve_in_background, stop_all

__version__ = "0.1.0"

__all__ = ["ApiError", "BackgroundServer", "Engine", "GenerationParams", "JsonMode",
           "create_app", "serve_in_background", "stop_all", "__version__"]

_LAZY = {"Engine": ".engine", "create_app": ".app", "ApiError": ".protocol",
         "GenerationParams": ".protocol", "JsonMode": ".json_mode"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
