"""``/metrics``: the server's counters, gauges and latency histograms in Prometheus' text
format. (Lesson 07.)

The histograms are the latencies clients saw (``serving.Run`` observes each token); the
counters and gauges come from the engine's ``snapshot()``; ``guards.AnswerGuard`` counts the
answers by status. From two scrapes a dashboard gets rates and latency percentiles.
"""

from __future__ import annotations

import operator
from collections import Counter

import prometheus_client

# Each histogram's own series only (not a "_created" time beside each).
prometheus_client.disable_created_metrics()

PREFIX = "helpers_server_"

#: Bucket edges in seconds: from a GPU with an empty queue to a CPU behind a full batch.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)

#: Each key of ``Engine.snapshot()``: (type, help); a key not listed is "untyped".
ENGINE_METRICS = {
    "requests": ("counter", "Requests the engine accepted into its queue."),
    "tokens": ("counter", "Tokens generated, all rows together."),
    "finished": ("counter", "Requests that finished (end of text, stop sequence or length)."),
    "cancelled": ("counter", "Requests dropped because their client went away."),
    "failed": ("counter", "Accepted requests that failed, by reason: error (in the engine) or "
                          "engine_crash (the engine's process died under them)."),
    "rejected_overloaded": ("counter", "Requests refused because the queue was full (429)."),
    "steps_prefill": ("counter", "Forward passes that read new prompts (on the paged cache, "
                                 "with the running rows' next tokens)."),
    "steps_decode": ("counter", "Forward passes that generated one token per running row."),
    "busy_seconds": ("counter", "Seconds the scheduler spent in forward passes."),
    "waiting": ("gauge", "Requests waiting for a slot in the batch (the queue's length)."),
    "running": ("gauge", "Rows in the running batch."),
    "rows_max": ("gauge", "Most rows the batch has held at once since the server started."),
    "prefix_cache_queries": ("counter", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("counter", "Prompt tokens found in the prefix cache (not recomputed)."),
    "kv_blocks_used": ("gauge", "KV blocks held by running requests (free blocks may still "
                                "hold cached prefixes)."),
    "kv_blocks_total": ("gauge", "KV blocks in the pool (0 without the paged KV cache)."),
    "steps_compiled": ("counter", "Steps run by the compiled model (--compile; lesson 10)."),
    "compiles": ("counter", "Graphs torch.compile made of the model's step, all at start-up."),
    "compile_seconds": ("counter", "Seconds inductor spent generating code for the step (the "
                                   "start-up lines give the whole compile)."),
    "submissions_held": ("gauge", "Submissions the engine's process keeps to their last event."),
    "steps_eager_instead": ("counter", "Steps that needed a compile after start-up and ran "
                                       "eager instead (0 unless something unexpected came)."),
    "cuda_graph_captures": ("counter", "CUDA graphs captured at start-up (one per capture size)."),
    "cuda_graph_replays": ("counter", "Decode steps that replayed a CUDA graph."),
    "cuda_graph_padded_rows": ("counter", "Padding rows replayed with them, for nothing."),
    "cuda_graph_fallbacks": ("counter", "Steps run without a CUDA graph, by reason: prompt, "
                                        "adapter, rows (more than the largest capture size)."),
    "cuda_graph_memory_bytes": ("gauge", "GPU memory the graphs reserved when captured."),
    "cuda_graph_capture_seconds": ("counter", "Seconds spent capturing the graphs."),
}

# Figures counted by a label: every label has a sample from the start, so that a dashboard's
# query finds the series. A plain number counts under the first label.
LABELS = {"cuda_graph_fallbacks": ("adapter", "prompt", "rows"),
          "failed": ("error", "engine_crash")}


def combine(first: dict, second: dict, how=operator.add) -> dict:
    """``second`` (a ``snapshot()``) with its counters combined with ``first``'s (added: what
    engine processes that died had counted; or the larger taken). Gauges are ``second``'s."""
    out = dict(second)
    for key, mine in first.items():
        if ENGINE_METRICS.get(key, ("counter",))[0] != "counter":
            continue
        theirs = out.get(key, {} if isinstance(mine, dict) else 0)
        if isinstance(mine, dict):
            out[key] = {label: how(mine.get(label, 0), theirs.get(label, 0))
                        for label in {**mine, **theirs}}
        else:
            out[key] = how(mine, theirs)
    return out


def _number(value: float) -> str:
    """A sample value as Prometheus writes it: integers without ".0"."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _family(key: str, kind: str, help: str, value, label: str = "reason") -> list[str]:
    """One metric's HELP, TYPE and samples (``value``, or ``{label value: value}``)."""
    name = PREFIX + key
    lines = [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
    if isinstance(value, dict):
        return lines + [f'{name}{{{label}="{k}"}} {_number(v)}' for k, v in sorted(value.items())]
    return lines + [f"{name} {_number(value)}"]


class Metrics:
    """The latency histograms and the answer counts of the HTTP side (what clients saw)."""

    def __init__(self):
        # prometheus_client writes the histograms; not the other figures, as it would rename
        # each counter <name>_total and write 528 as 528.0.
        self.histograms = prometheus_client.CollectorRegistry()
        self.ttft = prometheus_client.Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Seconds from the moment a request was read to its first generated token "
            "(admission, queueing and prefill included).", buckets=TTFT_BUCKETS,
            registry=self.histograms)
        self.per_token = prometheus_client.Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Seconds between two consecutive generated tokens of one request.",
            buckets=TOKEN_BUCKETS, registry=self.histograms)
        self.responses: Counter = Counter()      # by status code (``guards.AnswerGuard``)

    def render(self, snapshot: dict | None, restarts: int = 0) -> str:
        """The whole page; ``snapshot`` None: the engine does not answer (``up`` says so)."""
        lines = _family("up", "gauge", "1 while the engine answers; 0 when it does not (its "
                        "own figures are then left out).", 0 if snapshot is None else 1)
        lines += _family("engine_restarts", "counter", "Engine processes started again after "
                         "the one before crashed (the engine in a process of its own).", restarts)
        for key in sorted(set(ENGINE_METRICS) | set(snapshot)) if snapshot is not None else []:
            kind, help = ENGINE_METRICS.get(key, ("untyped", f"The engine's {key!r} figure."))
            value = snapshot.get(key, 0)
            if key in LABELS:
                value = {**dict.fromkeys(LABELS[key], 0),
                         **(value if isinstance(value, dict) else {LABELS[key][0]: value})}
            lines += _family(key, kind, help, value)
        responses = dict(self.responses)
        lines += _family("responses", "counter", "HTTP answers by status code.", responses, "code")
        # 499 is not a refusal: it marks a client that hung up (see ``cancelled``).
        rejected = sum(n for code, n in responses.items() if 400 <= code < 500 and code != 499)
        lines += _family("rejected", "counter", "Requests answered with a 4xx status (refused "
                         "at the door, not found, or the queue was full).", rejected)
        return "\n".join(lines) + "\n" + prometheus_client.generate_latest(
            self.histograms).decode()


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
