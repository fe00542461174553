"""The server benchmark's side-by-side run against ``transformers serve --continuous-batching``
(transformers' OpenAI-compatible server on its own continuous batching and paged KV cache).

Both servers get the same requests on OpenAI's streaming ``/v1/completions``: the same prompts
and lengths, EOS ignored (theirs: a per-request generation config with ``eos_token_id`` -1),
greedy, on the same device and torch threads. Their server loads the same local folder
offline and builds its batching on the first request: warm-up requests come first.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import sys

import httpx

from benchmarks.results_io import markdown_table
from benchmarks.serving import OURS_EXTRA, Server, ServerProcess, level_row, side_by_side

#: Tokens one step of their server may read: the course prompts of 64 clients at once (8
#: tokens each at most) and their decode tokens fit several times over.
MAX_BATCH_TOKENS = 1024


def transformers_command() -> list[str] | None:
    """The ``transformers`` command of this environment, or None if it has none."""
    beside = pathlib.Path(sys.executable).parent / "transformers"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("transformers")
    return [found] if found else None


class TransformersServe(ServerProcess):
    """``transformers serve --continuous-batching`` on one local model folder, on ``device``
    (the device our server uses in the same comparison: "cpu", "cuda", "cuda:1"), with
    ``threads`` torch threads; ``with TransformersServe(path, threads, clients, context,
    device) as url:`` starts it."""

    name = "transformers serve"

    def __init__(self, model_path: str, threads: int, clients: int, context: int,
                 device: str = "cpu", timeout: float = 300.0):
        super().__init__(timeout)
        self.model_path, self.threads, self.device = model_path, threads, device
        # Their cache would take 90% of the device's free memory (14 GB on a laptop's CPU):
        # give it room for ``clients`` requests of the model's whole context instead, in
        # blocks of 256 tokens (their page size). A step reads at most MAX_BATCH_TOKENS
        # tokens (their attention masks are sized by it: 2.7 GB at 16384).
        self.num_blocks = math.ceil(clients * context / 256) + 1
        self.max_batch_tokens = MAX_BATCH_TOKENS

    def command(self) -> list[str]:
        command = transformers_command()
        if command is None:
            raise RuntimeError("this environment has no `transformers` command")
        return command + [
            "serve", "--continuous-batching", "--device", self.device, "--host", "127.0.0.1",
            "--port", str(self.port), "--log-level", "warning",
            "--cb-num-blocks", str(self.num_blocks),
            "--cb-max-batch-tokens", str(self.max_batch_tokens), self.model_path]

    def environment(self) -> dict:
        return {**os.environ, "OMP_NUM_THREADS": str(self.threads), "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"}

    def extra(self) -> dict:
        """The model their server serves, and the end token switched off in a per-request
        generation config."""
        return {"model": self.model_path, "generation_config": json.dumps(
            {"eos_token_id": -1, "do_sample": False})}


def against_transformers(url, theirs: TransformersServe, levels, new_tokens, reps):
    """Each level's requests at once on our server and on ``transformers serve
    --continuous-batching`` (``theirs``, maybe started already), both through OpenAI's
    streaming /v1/completions, taking turns (``serving.side_by_side``). Returns one entry per
    level, or {"error": why} if their server could not run."""
    print("waiting for transformers serve --continuous-batching ...", flush=True)
    try:
        with theirs as their_url:
            runs = side_by_side({"ours": Server(url, OURS_EXTRA),
                                 "theirs": Server(their_url, theirs.extra())},
                                levels, new_tokens, reps)
    except (RuntimeError, OSError, httpx.HTTPError) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    return {"levels": [level_row(n, runs[n], "theirs") for n in levels]}


def side_by_side_markdown(result, target: float, target_clients: int) -> list[str]:
    compared = result["transformers_serve"]
    lines = ["## Side by side with `transformers serve --continuous-batching`", ""]
    if "error" in compared:
        return lines + [f"Not run: {compared['error']}", ""]

    def cell(figure):
        return f"{figure['median']:.0f} ({figure['min']:.0f}-{figure['max']:.0f})"

    rows = [[row["clients"], row["tokens"], cell(row["ours"]["tokens_per_second"]),
             cell(row["theirs"]["tokens_per_second"]), f"**{row['ours_over_theirs']:.2f}x**",
             row["same_texts"]] for row in compared["levels"]]
    return lines + [
        f"transformers {result['transformers']}: `transformers serve --continuous-batching "
        f"--device {result.get('device', 'cpu')}` on the same model folder and device as ours, "
        f"{result['threads']} torch thread(s) "
        f"(OMP_NUM_THREADS). Each level: that many streaming requests at once on OpenAI's "
        f"`/v1/completions` of each server, the course prompts, {result['new_tokens']} new "
        f"tokens each with EOS ignored, greedy; tokens counted from each stream's usage. The "
        f"servers take turns; median over {result['reps']} repetition(s) (min-max).", "",
        *markdown_table(["clients", "tokens", "ours (tokens/s)", "transformers serve "
                         "(tokens/s)", "ours / theirs", "same texts"], rows, "rrrrrl"), "",
        f"Target: >= {target}x at {target_clients} clients.", ""]
