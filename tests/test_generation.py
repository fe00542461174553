"""The lesson-01 loops, the KV-cache size formula and the bundled model's quality."""

import re

import pytest
import torch

from helpers import (cache_nbytes, generate_no_cache, generate_with_cache, kv_cache_bytes,
                     kv_cache_bytes_for, next_token_candidates)

from .conftest import COURSE_PROMPTS


@pytest.mark.parametrize("prompt", COURSE_PROMPTS)
def test_cache_and_no_cache_give_identical_tokens(bundled, prompt):
    model, tokenizer = bundled
    a = generate_no_cache(model, tokenizer, prompt, max_new_tokens=40, stop_at_eos=False)
    b = generate_with_cache(model, tokenizer, prompt, max_new_tokens=40, stop_at_eos=False)
    assert a.token_ids == b.token_ids
    assert len(a.token_ids) == 40 and len(b.step_seconds) == 40
    assert b.latency == pytest.approx(sum(b.step_seconds))
    assert b.ttft == b.step_seconds[0] and b.throughput > 0


def test_loops_agree_with_transformers_generate(bundled):
    model, tokenizer = bundled
    prompt = COURSE_PROMPTS[0]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=25, do_sample=False)[0, ids.shape[1]:].tolist()
    if tokenizer.eos_token_id in ref:  # generate stops at EOS and keeps it; ours drops it
        ref = ref[:ref.index(tokenizer.eos_token_id)]
    ours = generate_with_cache(model, tokenizer, prompt, max_new_tokens=25)
    assert ref == ours.token_ids and len(ours.token_ids) >= 5


def test_llama_style_loops_agree(tiny_llama):
    model, tokenizer = tiny_llama
    a = generate_no_cache(model, tokenizer, "Jack and Jill", max_new_tokens=15, stop_at_eos=False)
    b = generate_with_cache(model, tokenizer, "Jack and Jill", max_new_tokens=15, stop_at_eos=False)
    assert a.token_ids == b.token_ids


def test_stop_at_eos(bundled):
    model, tokenizer = bundled
    # A finished rhyme is followed by the end of the document in the corpus.
    out = generate_with_cache(model, tokenizer, "Slow and steady wins the race. That is what",
                              max_new_tokens=60)
    assert tokenizer.eos_token_id not in out.token_ids
    assert len(out.token_ids) < 60, "expected the model to end this document with EOS"


@pytest.mark.parametrize("prompt", COURSE_PROMPTS)
def test_bundled_model_continues_course_prompts_fluently(bundled, prompt):
    model, tokenizer = bundled
    out = generate_with_cache(model, tokenizer, prompt, max_new_tokens=20, stop_at_eos=False)
    ids = out.token_ids
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    assert len(grams) == len(set(grams)), f"repeated 4-gram in {out.text!r}"
    # A finished rhyme may be followed by the end-of-text token and a new document.
    words = out.text.replace(tokenizer.eos_token, " ").split()
    assert len(words) >= 12
    assert all(re.fullmatch(r"[\"']?[A-Za-z][A-Za-z']*[.,!?:;\"']*", w) for w in words), out.text


def test_top_candidates(bundled):
    model, tokenizer = bundled
    top = next_token_candidates(model, tokenizer, "The rain in Spain falls", k=10)
    assert len(top) == 10
    probs = [p for _, p in top]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0001
    assert top[0][0] == " mainly"


def test_kv_formula_equals_real_cache_bytes(bundled, tiny_llama):
    for model, tokenizer in (bundled, tiny_llama):
        ids = tokenizer(["Jack and Jill went up the hill"] * 3, return_tensors="pt").input_ids
        with torch.no_grad():
            cache = model(input_ids=ids, use_cache=True).past_key_values
        expected = kv_cache_bytes_for(model.config, seq_len=ids.shape[1], batch=3, bytes_per_value=4)
        assert cache_nbytes(cache) == expected


def test_kv_formula_known_values():
    # Llama-2-7B: 32 layers, hidden 4096, fp16, 4096 tokens -> 2 GiB per sequence.
    assert kv_cache_bytes(32, 4096, 4096, 1, 2) == 2 * 2**30
    with pytest.raises(ValueError, match="seq_len"):
        kv_cache_bytes(32, 4096, 0)


def test_kv_formula_figures_quoted_in_lesson_01():
    from transformers import GPT2Config, LlamaConfig

    # Grouped-query attention: Llama-2-70B's 64 query heads share 8 key/value heads of 128.
    llama_70b = LlamaConfig(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                            num_key_value_heads=8)
    assert kv_cache_bytes_for(llama_70b, seq_len=1) == 320 * 2**10
    # Exercise 2: GPT-2 small, full 1,024-token context, batch 64, fp32.
    gpt2 = GPT2Config()
    assert gpt2.max_position_embeddings == 1024
    cache = kv_cache_bytes_for(gpt2, seq_len=1024, batch=64, bytes_per_value=4)
    assert cache == 4_831_838_208 and cache / 2**30 == 4.5
    weights = 124_439_808 * 4   # GPT-2 small's parameters (lm_head tied to the embedding), fp32
    assert round(cache / weights, 1) == 9.7


def test_bad_input_is_named(bundled):
    model, tokenizer = bundled
    with pytest.raises(ValueError, match="prompt must be a string"):
        generate_with_cache(model, tokenizer, 42)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_no_cache(model, tokenizer, "Jack", max_new_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        generate_with_cache(model, tokenizer, "")
