"""Lesson 01's checks pass the course's answers, say "not written yet" for a stub, and catch
the mistakes learners make in the cached greedy loop and the KV-cache size formula, each with
a hint at its symptom."""

import time

import pytest
import torch

from helpers import kv_cache_bytes_for
from helpers.checks import check_greedy_with_cache, check_kv_cache_bytes_for
from helpers.checks.lesson01 import greedy_with_cache
from tests.answers import Exercise
from tests.checking import assert_caught, assert_not_written, assert_passes

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- greedy_with_cache: the lesson's solution and typical mistakes ---------------------------

def _loop(model, tokenizer, prompt, n_tokens, *, pass_past=True, feed="new", position=-1,
          keep_prompt=False, stop_at_eos=False):
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    prompt_ids = ids[0].tolist()
    new, past, step_input = [], None, ids
    with torch.no_grad():
        for _ in range(n_tokens):
            out = model(input_ids=step_input, past_key_values=past if pass_past else None,
                        use_cache=True)
            token = out.logits[0, position].argmax().view(1, 1)
            if stop_at_eos and int(token) == tokenizer.eos_token_id:
                break
            new.append(int(token))
            past, ids = out.past_key_values, torch.cat([ids, token], dim=1)
            step_input = {"new": token, "all": ids, "prompt": ids[:, :len(prompt_ids)]}[feed]
    return prompt_ids + new if keep_prompt else new


def course_greedy_with_cache(model, tokenizer, prompt, n_tokens):
    """The lesson's solution, as written in its exercise cell."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    new, past, step_input = [], None, ids
    with torch.no_grad():
        for _ in range(n_tokens):
            out = model(input_ids=step_input, past_key_values=past, use_cache=True)
            token = out.logits[0, -1].argmax().view(1, 1)
            past, step_input = out.past_key_values, token
            new.append(int(token))
    return new


def forgetting_the_cache(model, tokenizer, prompt, n):
    return _loop(model, tokenizer, prompt, n, pass_past=False)


def feeding_the_whole_sequence_with_the_cache(model, tokenizer, prompt, n):
    return _loop(model, tokenizer, prompt, n, feed="all")


def feeding_the_prompt_every_step(model, tokenizer, prompt, n):
    return _loop(model, tokenizer, prompt, n, feed="prompt")


def reading_the_first_position(model, tokenizer, prompt, n):
    return _loop(model, tokenizer, prompt, n, position=0)


def returning_the_prompt_too(model, tokenizer, prompt, n):
    return _loop(model, tokenizer, prompt, n, keep_prompt=True)


def stopping_at_eos(model, tokenizer, prompt, n):
    return _loop(model, tokenizer, prompt, n, stop_at_eos=True)


def no_cache_at_all(model, tokenizer, prompt, n):
    return _loop(model, tokenizer, prompt, n, pass_past=False, feed="all")


def one_call_too_many(model, tokenizer, prompt, n):
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)          # the prefill, outside the loop
        new = []
        for _ in range(n):
            token = out.logits[0, -1].argmax().view(1, 1)
            new.append(int(token))
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
    return new


def greedy_growing_a_tensor(model, tokenizer, prompt, n_tokens):
    """Right, written another way: the new tokens kept in a tensor, a list at the end."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    new = ids[:, :0]
    past, step_input = None, ids
    with torch.no_grad():
        for _ in range(n_tokens):
            out = model(input_ids=step_input, past_key_values=past, use_cache=True)
            step_input = out.logits[:, -1:].argmax(dim=-1)
            past, new = out.past_key_values, torch.cat([new, step_input], dim=1)
    return new[0].tolist()


def returning_a_tensor(model, tokenizer, prompt, n):
    return torch.tensor(course_greedy_with_cache(model, tokenizer, prompt, n), dtype=torch.long)


def returning_a_tuple(model, tokenizer, prompt, n):
    return tuple(course_greedy_with_cache(model, tokenizer, prompt, n))


def a_list_of_tensors(model, tokenizer, prompt, n):
    return [torch.tensor([[t]]) for t in course_greedy_with_cache(model, tokenizer, prompt, n)]


def a_list_of_floats(model, tokenizer, prompt, n):
    return [float(t) for t in course_greedy_with_cache(model, tokenizer, prompt, n)]


def argmax_over_the_flattened_logits(model, tokenizer, prompt, n_tokens):
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    new, past, step_input = [], None, ids
    with torch.no_grad():
        for _ in range(n_tokens):
            out = model(input_ids=step_input, past_key_values=past, use_cache=True)
            token = out.logits.argmax().view(1, 1)
            past, step_input = out.past_key_values, token
            new.append(int(token))
    return new


def prefill_before_the_loop(model, tokenizer, prompt, n_tokens):
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        token = out.logits[0, -1].argmax().view(1, 1)
        new = [int(token)]
        for _ in range(n_tokens - 1):
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[0, -1].argmax().view(1, 1)
            new.append(int(token))
    return new


GREEDY_MISTAKES = {
    forgetting_the_cache: "fed one token without past_key_values",
    feeding_the_whole_sequence_with_the_cache: "fed 6 tokens (the whole sequence) together with a cache",
    feeding_the_prompt_every_step: "fed 5 tokens (the prompt again)",
    reading_the_first_position: "read the next token at the last position",
    returning_the_prompt_too: "return only the new tokens",
    stopping_at_eos: "does not stop at EOS",
    no_cache_at_all: "re-read the whole sequence (6 tokens) without the cache",
    one_call_too_many: "the model ran 21 time(s) for 20 token(s)",
    returning_a_tensor: "should be a list of ints, got a tensor: return .tolist()",
    returning_a_tuple: "should be a list of ints, got tuple",
    a_list_of_tensors: "holds Tensor values: append int(token)",
    a_list_of_floats: "holds float values",
    argmax_over_the_flattened_logits: "the argmax ran over the flattened logits",
    prefill_before_the_loop: "returned 1 token(s) for n_tokens=0: asked for no token, return []",
}


def test_greedy_check_passes_the_course_solution_quickly(bundled):
    start = time.perf_counter()
    assert_passes(check_greedy_with_cache, course_greedy_with_cache, *bundled)
    assert time.perf_counter() - start < 10   # about 0.5 s on a quiet 2-core machine


def test_greedy_reference_gives_the_solution_tokens(bundled):
    for prompt, n in (("The rain in Spain falls", 20), ("Once", 3)):
        assert greedy_with_cache(*bundled, prompt, n) == course_greedy_with_cache(*bundled, prompt, n)


def test_greedy_check_says_not_written_for_a_stub(bundled):
    assert_not_written(check_greedy_with_cache, *bundled, fallback=greedy_with_cache)


@pytest.mark.parametrize("mistake", GREEDY_MISTAKES, ids=lambda f: f.__name__)
def test_greedy_check_catches(mistake, bundled):
    assert_caught(check_greedy_with_cache, mistake, *bundled, symptom=GREEDY_MISTAKES[mistake],
                  fallback=greedy_with_cache)


def test_greedy_check_passes_right_answers_written_otherwise(bundled):
    for right in EXERCISES[0].right:
        assert_passes(check_greedy_with_cache, right, *bundled)


# ---- kv_cache_bytes_for: the lesson's solution and typical mistakes --------------------------

def course_kv_cache_bytes_for(config, seq_len, batch=1, bytes_per_value=2):
    """The lesson's solution, as written in its exercise cell."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
    key_width = kv_heads * head_size
    return 2 * bytes_per_value * config.num_hidden_layers * key_width * seq_len * batch


def _bytes(config, seq_len, batch=1, bytes_per_value=2, *, factor=2, gqa=True, use_batch=True,
           nbytes=None, layers=True, unit=1):
    heads = config.num_attention_heads
    kv_heads = (getattr(config, "num_key_value_heads", None) or heads) if gqa else heads
    width = kv_heads * (config.hidden_size // heads)
    return (factor * (nbytes or bytes_per_value) * (config.num_hidden_layers if layers else 1)
            * width * seq_len * (batch if use_batch else 1)) / unit


def forgetting_keys_and_values(config, seq_len, batch=1, bytes_per_value=2):
    return _bytes(config, seq_len, batch, bytes_per_value, factor=1)


def ignoring_grouped_query_attention(config, seq_len, batch=1, bytes_per_value=2):
    return _bytes(config, seq_len, batch, bytes_per_value, gqa=False)


def ignoring_the_batch(config, seq_len, batch=1, bytes_per_value=2):
    return _bytes(config, seq_len, batch, bytes_per_value, use_batch=False)


def always_two_bytes(config, seq_len, batch=1, bytes_per_value=2):
    return _bytes(config, seq_len, batch, bytes_per_value, nbytes=2)


def one_layer_only(config, seq_len, batch=1, bytes_per_value=2):
    return _bytes(config, seq_len, batch, bytes_per_value, layers=False)


def in_gib(config, seq_len, batch=1, bytes_per_value=2):
    return _bytes(config, seq_len, batch, bytes_per_value, unit=2 ** 30)


def fp32_by_default(config, seq_len, batch=1, bytes_per_value=4):
    return _bytes(config, seq_len, batch, bytes_per_value)


def ignoring_head_dim(config, seq_len, batch=1, bytes_per_value=2):
    return _bytes(config, seq_len, batch, bytes_per_value)        # hidden_size // heads always


def as_a_string(config, seq_len, batch=1, bytes_per_value=2):
    return f"{course_kv_cache_bytes_for(config, seq_len, batch, bytes_per_value):.0f}"


def as_a_tensor(config, seq_len, batch=1, bytes_per_value=2):
    return torch.tensor(course_kv_cache_bytes_for(config, seq_len, batch, bytes_per_value))


def bytes_with_head_dim_and_floats(config, seq_len, batch=1, bytes_per_value=2):
    """Right, written another way: the head size read from head_dim, in float arithmetic."""
    heads = config.num_attention_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size / heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2.0 * bytes_per_value * config.num_hidden_layers * kv_heads * head_size * seq_len * batch


BYTES_MISTAKES = {
    forgetting_keys_and_values: "keys AND values, hence the factor 2",
    ignoring_grouped_query_attention: "8x the expected: this model shares each kv head among 8",
    ignoring_the_batch: "32x too small: every one of the batch's 32 rows",
    always_two_bytes: "as if every value took 2 bytes",
    one_layer_only: "each of the 12 layers keeps its own",
    in_gib: "not in GiB",
    fp32_by_default: "make those the defaults",
    ignoring_head_dim: "this config sets head_dim = 128, not hidden_size // num_attention_heads = 64",
    as_a_string: "should be a number (an int or a float), got str",
    as_a_tensor: "got Tensor: use .item()",
}


def test_bytes_check_passes_the_course_solution_and_helpers(bundled):
    assert_passes(check_kv_cache_bytes_for, course_kv_cache_bytes_for, *bundled)
    assert_passes(check_kv_cache_bytes_for, kv_cache_bytes_for, *bundled)
    for right in EXERCISES[1].right:
        assert_passes(check_kv_cache_bytes_for, right, *bundled)


def test_bytes_check_says_not_written_for_a_stub(bundled):
    assert_not_written(check_kv_cache_bytes_for, *bundled, fallback=kv_cache_bytes_for)


@pytest.mark.parametrize("mistake", BYTES_MISTAKES, ids=lambda f: f.__name__)
def test_bytes_check_catches(mistake, bundled):
    assert_caught(check_kv_cache_bytes_for, mistake, *bundled, symptom=BYTES_MISTAKES[mistake],
                  fallback=kv_cache_bytes_for)


def greedy_with_the_ids_left_on_the_cpu(model, tokenizer, prompt, n_tokens):
    ids = tokenizer(prompt, return_tensors="pt").input_ids          # not moved to model.device
    new, past, step_input = [], None, ids
    with torch.no_grad():
        for _ in range(n_tokens):
            out = model(input_ids=step_input, past_key_values=past, use_cache=True)
            token = out.logits[0, -1].argmax().view(1, 1)
            past, step_input = out.past_key_values, token
            new.append(int(token))
    return new


def prefill_then_the_loop(model, tokenizer, prompt, n_tokens):
    """Right: the prefill runs before the loop, even for n_tokens=0 (the text asks for the
    tokens, not for no call at all there)."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    new = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(n_tokens):
            token = out.logits[0, -1].argmax().view(1, 1)
            new.append(int(token))
            if len(new) < n_tokens:
                out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
    return new


def greedy_feeding_a_new_tensor_each_step(model, tokenizer, prompt, n_tokens):
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    new, past, step_input = [], None, ids
    with torch.no_grad():
        for _ in range(n_tokens):
            out = model(input_ids=step_input, past_key_values=past, use_cache=True)
            new.append(int(out.logits[0, -1].argmax()))
            past, step_input = out.past_key_values, torch.tensor([[new[-1]]])   # on the CPU
    return new


def bytes_filling_in_the_config(config, seq_len, batch=1, bytes_per_value=2):
    if getattr(config, "num_key_value_heads", None) is None:      # GPT-2 has none: set it
        config.num_key_value_heads = config.num_attention_heads   # on the model's own config
    if getattr(config, "head_dim", None) is None:
        config.head_dim = config.hidden_size // config.num_attention_heads
    width = config.num_key_value_heads * config.head_dim
    return 2 * bytes_per_value * config.num_hidden_layers * width * seq_len * batch


ON_A_GPU = {greedy_feeding_a_new_tensor_each_step: "a tensor made on the CPU met one on the GPU"}
IN_PLACE = {bytes_filling_in_the_config: "changed its input config in place"}


EXERCISES = [
    Exercise("greedy_with_cache", check_greedy_with_cache, ("model", "tokenizer"),
             greedy_with_cache,
             right=[course_greedy_with_cache, prefill_then_the_loop, greedy_growing_a_tensor],
             wrong={**GREEDY_MISTAKES, **ON_A_GPU,
                    greedy_with_the_ids_left_on_the_cpu: "a tensor made on the CPU met one on the GPU"}),
    Exercise("kv_cache_bytes_for", check_kv_cache_bytes_for, ("model", "tokenizer"),
             kv_cache_bytes_for, right=[course_kv_cache_bytes_for, bytes_with_head_dim_and_floats],
             wrong={**BYTES_MISTAKES, **IN_PLACE}),
]
