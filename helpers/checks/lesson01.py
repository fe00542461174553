"""Lesson 01's checks: the learner's ``greedy_with_cache`` and ``kv_cache_bytes_for``.

``check_greedy_with_cache`` runs the learner's loop and the course's on the lesson's model and
compares the tokens; while they run, a hook on the model records what every call was fed (how
many tokens, how many the cache already held), so that a wrong answer is traced to the step
that went wrong: a step without the cache, a step that re-feeds the whole sequence, a prefill
that did not read the whole prompt.

``check_kv_cache_bytes_for`` compares the learner's formula with the course's on the bundled
model (against the bytes of a real cache), GPT-2, Llama-2-7B, Llama-2-70B and two configs that
set ``head_dim`` apart from hidden size / heads (Qwen3's and Gemma's sizes), and names the
usual slip from the ratio of the two answers (keys *and* values, grouped-query attention, the
head size, the batch, the bytes per value).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..generation import cache_nbytes, generate_with_cache, kv_cache_bytes_for
from .core import Hint, expect_int_list, expect_number, expect_unchanged, run_check, snapshot

__all__ = ["check_greedy_with_cache", "check_kv_cache_bytes_for"]


# ---- what the model was fed: a hook that records every call ---------------------------------

def _seen(past) -> int:
    """How many tokens a cache held when it was passed in (0 for none)."""
    if past is None:
        return 0
    if hasattr(past, "get_seq_length"):
        return int(past.get_seq_length())
    try:                                   # a legacy tuple of (keys, values) per layer
        return int(past[0][0].shape[2])
    except (TypeError, IndexError, AttributeError):
        return 0


def _cpu(tensor):
    return tensor.detach().to("cpu").clone() if isinstance(tensor, torch.Tensor) else tensor


@contextmanager
def recording(model):
    """Record every forward call of ``model`` while the block runs: a list of dicts with the
    ``input_ids``, ``attention_mask`` and ``position_ids`` it was given (copies on the CPU, or
    None) and ``past``, the number of tokens the cache held. (Lessons 01 and 02's checks.)"""
    calls: list[dict] = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        calls.append({
            "input_ids": _cpu(ids),
            "attention_mask": _cpu(kwargs.get("attention_mask")),
            "position_ids": _cpu(kwargs.get("position_ids")),
            "has_past": kwargs.get("past_key_values") is not None,
            "past": _seen(kwargs.get("past_key_values")),
        })

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


# ---- greedy_with_cache ----------------------------------------------------------------------

def greedy_with_cache(model, tokenizer, prompt: str, n_tokens: int) -> list[int]:
    """The course's answer to lesson 01's exercise: ``n_tokens`` greedy token ids after
    ``prompt``, with the KV cache, not stopping at EOS. (Lesson 01.)"""
    if n_tokens == 0:
        return []
    return generate_with_cache(model, tokenizer, prompt, max_new_tokens=n_tokens,
                               stop_at_eos=False).token_ids


def _diagnose_steps(calls: list[dict], prompt_len: int, n_tokens: int, vocab: int) -> None:
    """Raise a Hint at the first call that was not fed what a cached loop feeds it: token ids
    of the vocabulary, the whole prompt first, then one token with a cache that holds
    everything before it."""
    for step, call in enumerate(calls):
        ids = call["input_ids"]
        if isinstance(ids, torch.Tensor) and ids.numel() and int(ids.max()) >= vocab:
            raise Hint(f"step {step} fed token id {int(ids.max())}, but the vocabulary has "
                       f"{vocab} ids: the argmax ran over the flattened logits (positions x "
                       f"vocabulary); take it over the vocabulary at the last position, "
                       f"out.logits[0, -1].argmax()")
    for step, call in enumerate(calls[:n_tokens]):
        ids = call["input_ids"]
        fed = ids.shape[-1] if isinstance(ids, torch.Tensor) else None
        if step == 0:
            if fed is not None and fed != prompt_len:
                raise Hint(f"the first call fed {fed} token(s); it should read the whole prompt "
                           f"({prompt_len} tokens): that prefill fills the cache and gives the "
                           f"first new token")
            continue
        before = prompt_len + step - 1          # tokens the cache should hold at this step
        if call["past"] == 0:
            if fed == 1:
                raise Hint(f"step {step} fed one token without past_key_values, so the model saw "
                           f"only that token and none of the text before it: pass the cache the "
                           f"previous call returned (out.past_key_values)")
            if fed == before + 1:
                raise Hint(f"step {step} re-read the whole sequence ({fed} tokens) without the "
                           f"cache, as the loop of section 3 does: feed only the newest token, "
                           f"together with past_key_values")
        elif call["past"] != before:
            raise Hint(f"at step {step} the cache held {call['past']} tokens, expected {before} "
                       f"(the prompt and every token so far but the newest): pass the cache the "
                       f"previous call returned")
        if fed is not None and fed != 1:
            extra = (" (the whole sequence)" if fed == before + 1 else
                     " (the prompt again)" if fed == prompt_len else "")
            raise Hint(f"step {step} fed {fed} tokens{extra} together with a cache that already "
                       f"holds them: feed only the newest token, input_ids of shape (1, 1)")


def _greedy_cases(model, tokenizer):
    eos = tokenizer.eos_token_id
    vocab = model.get_input_embeddings().num_embeddings
    word = lambda t: repr(tokenizer.decode([t]))
    scenarios = [
        ("20 tokens after 'The rain in Spain falls' (past an <|endoftext|>)",
         "The rain in Spain falls", 20),
        ("one token only: the prefill alone", "Jack and Jill", 1),
        ("a prompt of one token", "Once", 8),
        ("40 tokens after 'Humpty Dumpty sat'", "Humpty Dumpty sat", 40),
        ("no new tokens at all (n_tokens=0)", "Jack and Jill", 0),
    ]

    def checker(learner, cases):
        for label, prompt, n in scenarios:
            with cases(label):
                prompt_ids = tokenizer(prompt).input_ids
                expected = greedy_with_cache(model, tokenizer, prompt, n)
                with recording(model) as calls:
                    try:
                        got = learner(model, tokenizer, prompt, n)
                    except (NotImplementedError, Hint):
                        raise
                    except Exception:
                        _diagnose_steps(calls, len(prompt_ids), n, vocab)   # a hint if a step was wrong
                        raise
                _diagnose_steps(calls, len(prompt_ids), n, vocab)
                if isinstance(got, str):
                    raise Hint("greedy_with_cache returned a string; return the new token ids (a "
                               "list of ints) and decode them afterwards")
                # The lesson decodes the answer and compares it with lists of ints: that is
                # what is checked, as it is (no conversion here).
                got = expect_int_list("greedy_with_cache's answer", got)
                if got == expected:
                    if len(calls) > max(n, 1):      # n_tokens=0 may run the prefill or not
                        raise Hint(f"the right tokens, but the model ran {len(calls)} time(s) for "
                                   f"{n} token(s): every call gives one token (the prefill gives "
                                   f"the first), so {n} call(s) are enough")
                    continue
                if n == 0:
                    raise Hint(f"returned {len(got)} token(s) for n_tokens=0: asked for no "
                               f"token, return [] (every token, the first included, comes "
                               f"from a step of the loop over range(n_tokens))")
                if len(got) == len(prompt_ids) + n and got[len(prompt_ids):] == expected:
                    raise Hint(f"returned {len(got)} ids: the prompt's {len(prompt_ids)} and the "
                               f"{n} new ones; return only the new tokens")
                if len(got) < n and got == expected[:len(got)] and expected[len(got)] == eos:
                    raise Hint(f"stopped after {len(got)} tokens, at <|endoftext|>; this loop "
                               f"makes exactly n_tokens tokens and does not stop at EOS")
                for i, (g, e) in enumerate(zip(got, expected)):
                    if g != e:
                        cause = ""
                        if i == 0:
                            first = _logits_at(model, prompt_ids, 0)
                            if first == g and len(prompt_ids) > 1:
                                cause = ("; that is the prediction after the prompt's FIRST "
                                         "token: read the next token at the last position, "
                                         "logits[0, -1]")
                        raise Hint(f"new token {i} is {word(g)} (id {g}), expected {word(e)} "
                                   f"(id {e}){cause}")
                raise Hint(f"returned {len(got)} tokens, expected {n}")
    return checker


def _logits_at(model, prompt_ids, position: int) -> int:
    with torch.no_grad():
        ids = torch.tensor([prompt_ids], device=model.device)
        return int(model(input_ids=ids).logits[0, position].argmax())


GREEDY_CAUSES = {
    "index out of range": "a position past the model's longest context: after the prefill "
                          "feed one token a step, with the cache, not the whole sequence again",
    "must match the size of tensor": "the new token and the cache do not fit together: feed "
                                     "one token of shape (1, 1) with the cache of the call before",
}


def check_greedy_with_cache(learner_greedy_with_cache, model, tokenizer):
    """Lesson 01: check the learner's ``greedy_with_cache(model, tokenizer, prompt, n_tokens)``
    against the course's on five cases (one new token, none, a one-token prompt, a run past
    EOS, 40 tokens), that it returns a list of ints, and what each model call was fed; print
    one line and return the function the rest of the lesson should use."""
    return run_check("greedy_with_cache", learner_greedy_with_cache,
                     _greedy_cases(model, tokenizer), fallback=greedy_with_cache,
                     causes=GREEDY_CAUSES, gpu=model)


# ---- kv_cache_bytes_for ---------------------------------------------------------------------

def _configs():
    from transformers import GPT2Config, LlamaConfig

    return {
        "gpt2": GPT2Config(),
        "7b": LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                          max_position_embeddings=4096),
        "70b": LlamaConfig(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                           num_key_value_heads=8, max_position_embeddings=4096),
        # Qwen3-0.6B's sizes: head_dim 128 is set apart from hidden_size // heads = 64, and
        # 16 heads share 8 kv heads
        "qwen3": LlamaConfig(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=128, max_position_embeddings=40960),
        # Gemma-7B's sizes: head_dim 256, not 3072 // 16 = 192; no grouped-query attention
        "gemma": LlamaConfig(hidden_size=3072, num_hidden_layers=28, num_attention_heads=16,
                             num_key_value_heads=16, head_dim=256, max_position_embeddings=8192),
    }


def _layers(config) -> int:
    return getattr(config, "num_hidden_layers", None) or config.n_layer


def _ratio_hint(got: float, expected: float, config, seq_len: int, batch: int, nbytes) -> str:
    """The usual slip behind a wrong size, read from got / expected ('' if none fits)."""
    ratio = got / expected if expected else float("nan")
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    near = lambda r: abs(ratio - r) <= 1e-6 * r
    if head_dim != hidden // heads:
        for wrong_heads in {kv_heads, heads}:
            if near(wrong_heads * (hidden // heads) / (kv_heads * head_dim)):
                return (f"this config sets head_dim = {head_dim}, not hidden_size // "
                        f"num_attention_heads = {hidden // heads}: use config.head_dim when it "
                        f"is set (getattr(config, 'head_dim', None) or hidden_size // heads)"
                        + (f", and the {kv_heads} kv heads" if wrong_heads != kv_heads else ""))
    if kv_heads != heads and near(heads / kv_heads):
        return (f"{heads // kv_heads}x the expected: this model shares each kv head among "
                f"{heads // kv_heads} query heads ({kv_heads} kv heads for {heads}), so its keys "
                f"are kv heads x head size = {kv_heads * head_dim} wide, "
                f"not hidden_size = {config.hidden_size}")
    if nbytes != 2 and near(2 / nbytes):
        return f"as if every value took 2 bytes: use bytes_per_value, here {nbytes}"
    if near(0.5):
        return "half the expected: the cache keeps keys AND values, hence the factor 2"
    if batch > 1 and near(1 / batch):
        return f"{batch}x too small: every one of the batch's {batch} rows has its own cache"
    if _layers(config) > 1 and near(1 / _layers(config)):
        return f"{_layers(config)}x too small: each of the {_layers(config)} layers keeps its own keys and values"
    if near(8):
        return "8x the expected: the size is in bytes (bytes_per_value), not bits"
    if near(2 ** -30) or near(2 ** -20) or near(1e-9) or near(1e-6):
        return "return the size in bytes, not in GiB, MiB, GB or MB"
    return ""


def _bytes_cases(model, tokenizer):
    def formula_case(learner, cases, label, config, seq_len, batch, nbytes):
        with cases(label):
            expected = kv_cache_bytes_for(config, seq_len=seq_len, batch=batch,
                                          bytes_per_value=nbytes)
            before = snapshot(config)
            got = learner(config, seq_len=seq_len, batch=batch, bytes_per_value=nbytes)
            expect_unchanged("config", before, config)     # the model reads it too
            _expect_size(got, expected, config, seq_len, batch, nbytes,
                         f"expected {expected:,.0f} bytes")

    def checker(learner, cases):
        # Ordered so that each usual slip shows first where its ratio names it alone.
        configs = _configs()
        formula_case(learner, cases, "GPT-2 small (12 layers, hidden 768), 1,024 tokens in fp16",
                     configs["gpt2"], 1024, 1, 2)
        formula_case(learner, cases, "Llama-2-7B, 32 rows of 4,096 tokens in fp16",
                     configs["7b"], 4096, 32, 2)
        formula_case(learner, cases, "Llama-2-70B: grouped-query attention (64 heads share 8 "
                     "kv heads)", configs["70b"], 4096, 1, 2)
        formula_case(learner, cases, "Llama-2-7B, one token in fp32", configs["7b"], 1, 1, 4)
        with cases("the bundled model, 4 rows of 7 tokens, against a real cache"):
            batch = tokenizer(["Jack and Jill went up the hill"] * 4, return_tensors="pt").to(model.device)
            with torch.no_grad():
                cache = model(**batch, use_cache=True).past_key_values
            seq_len, nbytes = batch["input_ids"].shape[1], model.dtype.itemsize
            real = cache_nbytes(cache)
            before = snapshot(model.config)
            got = learner(model.config, seq_len=seq_len, batch=4, bytes_per_value=nbytes)
            expect_unchanged("config", before, model.config)
            _expect_size(got, real, model.config, seq_len, 4, nbytes,
                         f"the real cache holds {real:,} bytes")
        with cases("the defaults: batch=1, bytes_per_value=2"):
            config = configs["gpt2"]
            expected = kv_cache_bytes_for(config, seq_len=100)
            got = learner(config, seq_len=100)
            explicit = learner(config, seq_len=100, batch=1, bytes_per_value=2)
            if explicit == expected and got != expected:
                raise Hint(f"right with batch=1, bytes_per_value=2 given, wrong without them: "
                           f"make those the defaults")
            _expect_size(got, expected, config, 100, 1, 2,
                         f"with only (config, seq_len=100) expected {expected:,.0f} bytes")
        formula_case(learner, cases, "Qwen3-0.6B: head_dim 128 set apart from hidden_size / "
                     "heads = 64, 16 heads share 8 kv heads", configs["qwen3"], 2048, 1, 2)
        formula_case(learner, cases, "Gemma-7B: head_dim 256 set apart from hidden_size / "
                     "heads = 192", configs["gemma"], 8192, 2, 2)
    return checker


def _expect_size(got, expected, config, seq_len, batch, nbytes, saying: str) -> None:
    value = expect_number("the size in bytes", got)      # the lesson formats and divides it
    if abs(value - expected) <= 1e-6 * expected:
        return
    cause = _ratio_hint(value, expected, config, seq_len, batch, nbytes)
    shown = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    raise Hint(f"got {shown} bytes, {saying}" + (f": {cause}" if cause else ""))


BYTES_CAUSES = {
    "has no attribute": "read the sizes from the config: config.num_hidden_layers, "
                        "config.hidden_size, config.num_attention_heads, and "
                        "getattr(config, 'num_key_value_heads', None) (GPT-2 has none)",
    "unexpected keyword argument": "keep the signature: kv_cache_bytes_for(config, seq_len, "
                                   "batch=1, bytes_per_value=2)",
}


def check_kv_cache_bytes_for(learner_kv_cache_bytes_for, model, tokenizer):
    """Lesson 01: check the learner's ``kv_cache_bytes_for(config, seq_len, batch=1,
    bytes_per_value=2)`` against a real cache of the bundled model and against the course's
    formula for GPT-2, Llama-2-7B, Llama-2-70B (grouped-query attention), and Qwen3's and
    Gemma's sizes (``config.head_dim`` set apart from hidden size / heads); print one line and
    return the function the rest of the lesson should use."""
    return run_check("kv_cache_bytes_for", learner_kv_cache_bytes_for,
                     _bytes_cases(model, tokenizer), fallback=kv_cache_bytes_for,
                     causes=BYTES_CAUSES)

