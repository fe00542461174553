"""load_model: the bundled model offline, another model by name or by $COURSE_MODEL."""

import os

import pytest
import torch

import helpers
from helpers import MODEL_ENV_VAR, load_model, load_tokenizer, resolve_model_name


def test_bundled_model_loads_offline(bundled, monkeypatch):
    model, tokenizer = bundled
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert model.config.model_type == "gpt2"
    assert not model.training
    assert model.device.type == "cpu"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"


def test_no_name_means_bundled_unless_env_var(monkeypatch, tmp_path):
    monkeypatch.delenv(MODEL_ENV_VAR, raising=False)
    assert resolve_model_name() == str(helpers.BUNDLED_MODEL_DIR)
    assert resolve_model_name("bundled") == str(helpers.BUNDLED_MODEL_DIR)
    monkeypatch.setenv(MODEL_ENV_VAR, str(tmp_path))
    assert resolve_model_name() == str(tmp_path)
    assert resolve_model_name("gpt2") == "gpt2"  # an explicit name wins over the variable


def test_env_var_switches_to_a_local_model(tiny_llama, tmp_path, monkeypatch):
    model, tokenizer = tiny_llama
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setenv(MODEL_ENV_VAR, str(tmp_path))
    loaded, tok = load_model(device="cpu")
    assert loaded.config.model_type == "llama"
    assert tok.padding_side == "left" and tok.pad_token_id == tok.eos_token_id
    ids = tok("Jack and Jill", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-5)


def test_hub_name_offline_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError) as err:
        load_tokenizer("some-org/model-that-is-not-cached")
    message = str(err.value)
    assert "no network" in message and "load_model() with no name" in message


def test_dtype_choices(bundled):
    model, _ = load_model(device="cpu", dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    model, _ = load_model(device="cpu", dtype="auto")
    assert model.dtype == torch.float32  # auto is float16 only on CUDA
    with pytest.raises(ValueError, match="dtype"):
        load_model(device="cpu", dtype="int3")


def test_bundled_assets_are_small_and_safe():
    folder = helpers.BUNDLED_MODEL_DIR.parent
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 25 * 2**20
    assert (helpers.BUNDLED_MODEL_DIR / "model.safetensors").exists()
    assert (helpers.BUNDLED_MODEL_DIR / "README.md").exists(), "the model card is missing"
    pickles = [p.name for p in files if p.suffix in {".bin", ".pt", ".pth", ".pkl", ".ckpt"}]
    assert not pickles, f"weights must be safetensors, found {pickles}"


def test_tokenizer_script_reproduces_the_bundled_tokenizer():
    """The corpus generator and the tokenizer script still give the shipped vocabulary, so
    the model card's recipe holds (a change to helpers/corpus.py that alters seed 0 fails)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "train_tokenizer", helpers.BUNDLED_MODEL_DIR.parents[2] / "scripts" / "train_tokenizer.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    fresh = script.train_tokenizer(vocab_size=4096)
    assert fresh.get_vocab() == load_tokenizer().get_vocab()
