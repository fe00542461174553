"""A small LoRAX-compatible server built from the course's own helpers. (Lesson 07.)

Continuous batching (lesson 03) with one LoRA adapter per row (lesson 06), per-request sampling
and constrained decoding, behind LoRAX's (and TGI's) REST protocol and OpenAI's completions
and chat completions: the real ``lorax-client``, ``huggingface_hub`` and ``openai`` talk to it.

    python -m helpers.server --port 8080               # from a terminal

    from helpers.server import serve_in_background     # from a notebook
    with serve_in_background() as url:
        from lorax import Client
        print(Client(url).generate("Jack and Jill", max_new_tokens=20).generated_text)

``docs/request-flow.md`` follows one request through the modules. Importing this package is
cheap: FastAPI, uvicorn and the engine are imported on first use.
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
