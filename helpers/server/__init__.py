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

Modules, in the order a request travels (``docs/request-flow.md`` draws it): ``app`` (the
application: error mapping, /health, /info, /metrics), ``guards`` (the HTTP door: body size,
content type, JSON, slow or vanished clients), ``routes_lorax`` and ``routes_openai`` (the two
families of routes), ``protocol`` (request bodies, parsed into a ``Call``), ``serving`` (the
request path the routes share: submit, collect or stream, cancel), ``contract`` (what the HTTP
side and the engine share: ``GenerationParams`` and its one check, ``Submission``, ``Handle``,
the events, ``deliver``, the ``EngineClient`` interface), ``engine_process`` (the engine in a
process of its own, supervised: the default); on the engine's side ``engine`` (one
``Sequence`` per generated sequence and the scheduler's one turn), ``admission`` (tokens,
limits, adapter and grammar for each submission), ``tokens`` (client text never becomes a
special token; chat templates; tokens back to text as they come), ``scheduling`` (the
admission policy), ``kv`` (the KV layouts the turn is given: lesson 03's padded batch or lesson
08's paged cache), ``runner`` and ``graphs`` (how a paged pass runs: eager, compiled, CUDA
graphs), ``sampling`` (how each row's next token is chosen), ``grammar`` (grammars to token
masks), ``adapters`` (adapter names to loaded adapters), ``errors`` (the engine's own errors);
and ``metrics`` (Prometheus' text format), ``background`` (start/stop from Python),
``options`` (the server's options, declared once), ``__main__`` (the command).

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
