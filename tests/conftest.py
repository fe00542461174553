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


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests: the models are tiny, and a second thread only adds
    waiting (a lot of it when another process keeps the other core busy). A module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def bundled():
    """(model, tokenizer) of the bundled model on CPU."""
    from helpers import load_model

    return load_model(device="cpu")


def random_llama(tokenizer, hidden: int = 64, layers: int = 2, positions: int = 256):
    """A random Llama-style model for ``tokenizer`` (rotary positions, 4 attention heads sharing
    2 kv heads, MLP twice as wide), in eval mode. Seed torch first for the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden,
                         intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=positions, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_llama():
    """A tiny random Llama-style model (rotary positions, 4 heads sharing 2 kv heads)."""
    from helpers import load_tokenizer

    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    return random_llama(tokenizer), tokenizer


def process_gone(pid: int, timeout: float = 30.0) -> bool:
    """True once process ``pid`` has exited (reaped, or a zombie waiting to be) within
    ``timeout`` seconds: what the tests of lessons 07 and 11 ask of a server or a rank whose
    kernel went away."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
