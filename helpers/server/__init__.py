"""A small LoRAX-compatible server built from the course's own helpers. (Lesson 07.)

It puts the course together: continuous batching (lesson 03's ``init_batch``,
``generate_next_token``, ``merge_batches``, ``filter_batch``) with one LoRA adapter per row
(lesson 06: ``MultiLora``), per-request sampling rules and constrained decoding (JSON schemas,
regular expressions), behind the protocols that clients already speak: LoRAX's REST protocol
(also TGI's, which huggingface_hub's ``InferenceClient`` uses) and OpenAI's completions and
chat completions, so the real ``lorax-client``, ``huggingface_hub`` and ``openai`` packages
talk to it.

    python -m helpers.server --port 8080               # from a terminal

    from helpers.server import serve_in_background     # from a notebook
    with serve_in_background() as url:
        from lorax import Client
        print(Client(url).generate("Jack and Jill", max_new_tokens=20).generated_text)

``docs/request-flow.md`` follows one request through the modules and says where a change goes.

Importing this package is cheap: FastAPI, uvicorn and the engine are imported on first use, and
the HTTP process of the server never imports torch or transformers.
"""

from __future__ import annotations

from .background import BackgroundServer, serve_in_background, stop_all

__version__ = "0.1.0"

__all__ = ["ApiError", "BackgroundServer", "Engine", "GenerationParams", "Grammars",
           "create_app", "serve_in_background", "stop_all", "__version__"]

_LAZY = {"Engine": ".engine", "create_app": ".app", "ApiError": ".guards",
         "GenerationParams": ".contract", "Grammars": ".grammar"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
