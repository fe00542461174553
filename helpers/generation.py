"""One request, one token at a time: the greedy loop with and without the KV cache.

Introduced in lesson 01. The two loops return the same tokens; what differs is how much work
each step does. Without the cache every step runs the whole sequence through the model again;
with it, a step feeds only the newest token and the keys and values kept from earlier steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

#: Called after every generated token as ``on_token(step, token_text, seconds)``.
TokenCallback = Callable[[int, str, float], None]


@dataclass
class Generation:
    """What a generation loop produced, and how long each token took. (Lesson 01.)

    ``step_seconds[0]`` is the time to first token (it includes reading the whole prompt);
    the rest are the times of the following tokens.
    """

    prompt: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    step_seconds: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        """Time to first token, seconds."""
        return self.step_seconds[0] if self.step_seconds else float("nan")

    @property
    def tpot(self) -> float:
        """Time per output token after the first, seconds (mean)."""
        rest = self.step_seconds[1:]
        return sum(rest) / len(rest) if rest else float("nan")

    @property
    def latency(self) -> float:
        """Total seconds for the whole answer: TTFT + TPOT × (tokens − 1)."""
        return sum(self.step_seconds)

    @property
    def throughput(self) -> float:
        """Generated tokens per second over the whole request."""
        return len(self.token_ids) / self.latency if self.step_seconds else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check(tokenizer, prompt, max_new_tokens):
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise ValueError("prompt is empty: give the model at least one token to continue")
    return ids


def next_token_candidates(model, tokenizer, prompt: str, k: int = 10) -> list[tuple[str, float]]:
    """The ``k`` most likely next tokens after ``prompt`` with their probabilities. (Lesson 01.)"""
    ids = _check(tokenizer, prompt, 1).to(model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1]
    probs = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(probs, k)
    return [(tokenizer.decode([int(i)]), float(p)) for p, i in zip(top.values, top.indices)]


@torch.no_grad()
def generate_no_cache(model, tokenizer, prompt: str, max_new_tokens: int = 20,
                      stop_at_eos: bool = True, on_token: TokenCallback | None = None) -> Generation:
    """Greedy decoding that re-reads the whole sequence at every step. (Lesson 01.)"""
    ids = _check(tokenizer, prompt, max_new_tokens).to(model.device)
    out = Generation(prompt)
    for step in range(max_new_tokens):
        start = time.perf_counter()
        logits = model(input_ids=ids).logits
        token = logits[0, -1].argmax()
        _sync(ids.device)
        out.step_seconds.append(time.perf_counter() - start)
        if stop_at_eos and int(token) == tokenizer.eos_token_id:
            out.step_seconds.pop()
            break
        out.token_ids.append(int(token))
        ids = torch.cat([ids, token.view(1, 1)], dim=1)
        if on_token:
            on_token(step, tokenizer.decode([int(token)]), out.step_seconds[-1])
    out.text = tokenizer.decode(out.token_ids)
    return out


@torch.no_grad()
def generate_with_cache(model, tokenizer, prompt: str, max_new_tokens: int = 20,
                        stop_at_eos: bool = True, on_token: TokenCallback | None = None) -> Generation:
    """Greedy decoding with the KV cache: after the prompt, feed one token a step. (Lesson 01.)"""
    ids = _check(tokenizer, prompt, max_new_tokens).to(model.device)
    out = Generation(prompt)
    past, next_input = None, ids
    for step in range(max_new_tokens):
        start = time.perf_counter()
        result = model(input_ids=next_input, past_key_values=past, use_cache=True)
        token = result.logits[0, -1].argmax()
        _sync(ids.device)
        out.step_seconds.append(time.perf_counter() - start)
        if stop_at_eos and int(token) == tokenizer.eos_token_id:
            out.step_seconds.pop()
            break
        past, next_input = result.past_key_values, token.view(1, 1)
        out.token_ids.append(int(token))
        if on_token:
            on_token(step, tokenizer.decode([int(token)]), out.step_seconds[-1])
    out.text = tokenizer.decode(out.token_ids)
    return out


# --- the size of the KV cache ------------------------------------------------------------

def kv_cache_bytes(n_layers: int, hidden: int, seq_len: int, batch: int = 1,
                   bytes_per_value: float = 2) -> float:
    """Bytes of a KV cache: 2 (keys and values) × bytes × layers × hidden × seq_len × batch.

    ``hidden`` is the width of the keys (``kv_heads × head_dim``; equal to the model's hidden
    size unless the model uses grouped-query attention). (Lesson 01; used again in lesson 04.)
    """
    for name, value in (("n_layers", n_layers), ("hidden", hidden), ("seq_len", seq_len),
                        ("batch", batch), ("bytes_per_value", bytes_per_value)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    return 2 * bytes_per_value * n_layers * hidden * seq_len * batch


def kv_width(config) -> int:
    """Width of one layer's keys for a transformers config: kv_heads × head_dim. (Lesson 01.)"""
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return kv_heads * head_dim


def kv_cache_bytes_for(config, seq_len: int, batch: int = 1, bytes_per_value: float = 2) -> float:
    """``kv_cache_bytes`` for a transformers model config. (Lesson 01.)"""
    n_layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    return kv_cache_bytes(n_layers, kv_width(config), seq_len, batch, bytes_per_value)


def cache_nbytes(cache) -> int:
    """Bytes actually held by a transformers cache (keys and values of every layer). (Lesson 01.)"""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
