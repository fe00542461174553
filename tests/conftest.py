"""Shared fixtures: the bundled model (loaded once) and tiny random models built locally."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

COURSE_PROMPTS = [
    "The quick brown fox jumped over the",
    "The rain in Spain falls",
    "What comes up must",
    "Jack and Jill",
    "Humpty Dumpty sat",
]


@pytest.fixture(scope="session")
def bundled():
    """(model, tokenizer) of the bundled model on CPU."""
    from helpers import load_model

    return load_model(device="cpu")


@pytest.fixture(scope="session")
def tiny_llama():
    """A tiny random Llama-style model (rotary positions, 4 heads sharing 2 kv heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import load_tokenizer

    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(config).eval(), tokenizer
