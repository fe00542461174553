"""LoRA (lessons 05-06): the toy layers, per-row adapters against peft, the shipped adapters."""

import copy
import json
import shutil

import pytest
import torch

from helpers.corpus import task_examples, task_prompt
from helpers.lora import (NO_ADAPTER, TOY_COLOURS, LoraLayer, MultiLora, MultiLoraLayer,
                          ToyModel, ToyMultiLoraModel, linear_lora_gathered, linear_lora_loop,
                          load_adapters, random_adapters, save_random_adapters,
                          shipped_adapters)

from .conftest import random_llama


# --- the toy model and the two linear_lora versions ---------------------------------------

@pytest.mark.parametrize("batch,seq,hidden,rank,n", [(1, 1, 8, 1, 1), (6, 3, 16, 2, 4),
                                                     (17, 5, 32, 8, 3), (64, 1, 64, 4, 64)])
def test_gathered_equals_loop(batch, seq, hidden, rank, n):
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, seq, hidden, generator=gen)
    loras_a, loras_b = random_adapters(n, hidden, rank, seed=n)
    indices = torch.randint(n, (batch,), generator=gen)  # repeats whenever batch > n
    if batch > 1:
        indices[1] = indices[0]  # at least one repeat
    loop = linear_lora_loop(x, loras_a, loras_b, indices)
    gathered = linear_lora_gathered(x, loras_a, loras_b, indices)
    assert gathered.shape == (batch, seq, hidden)
    torch.testing.assert_close(gathered, loop, rtol=1e-5, atol=1e-5)
    for i in range(batch):  # and both are x @ A @ B of the row's adapter
        k = int(indices[i])
        torch.testing.assert_close(loop[i], x[i] @ loras_a[k] @ loras_b[k])


def test_toy_models():
    loras_a, loras_b = random_adapters(5, hidden=1024, rank=2, seed=1)
    ids = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]])
    idx = torch.tensor([4, 0, 4, 2])
    loop = ToyMultiLoraModel(linear_lora_loop)(ids, loras_a, loras_b, idx)
    gathered = ToyMultiLoraModel(linear_lora_gathered)(ids, loras_a, loras_b, idx)
    assert loop.shape == (4, 3, len(TOY_COLOURS)) == (4, 3, 10)
    torch.testing.assert_close(loop, gathered, rtol=1e-4, atol=1e-4)
    base = ToyModel()
    torch.testing.assert_close(base(ids), ToyMultiLoraModel()(ids))  # same seed, same weights
    assert base.encode("red blue").tolist() == [[0, 1]]
    assert base.next_colour(base.encode("red blue"))[0] in TOY_COLOURS
    with pytest.raises(ValueError, match="unknown words"):
        base.encode("red tartan")


def test_lora_layer_changes_output_only_through_xab():
    base = ToyModel().linear
    x = torch.randn(2, 3, 1024)
    fresh = LoraLayer(base, rank=4, seed=0)  # B starts at zero: nothing changes yet
    torch.testing.assert_close(fresh(x), base(x))
    layer = LoraLayer(base, rank=4, alpha=8, zero_b=False, seed=0)
    assert layer.A.shape == (1024, 4) and layer.B.shape == (4, 1024) and layer.scale == 2
    torch.testing.assert_close(layer(x) - base(x), (x @ layer.A @ layer.B) * 2,
                               rtol=1e-4, atol=1e-4)
    assert not any(p.requires_grad for p in layer.base.parameters())
    assert layer.A.requires_grad and layer.B.requires_grad


def test_lora_layer_changes_the_next_colour():
    model = ToyModel()
    ids = model.encode("red green blue")
    before = model.next_colour(ids)
    model.linear = LoraLayer(model.linear, rank=2, zero_b=False, seed=1)
    assert model.next_colour(ids) != before


def test_linear_lora_errors():
    x = torch.randn(3, 2, 8)
    a, b = random_adapters(4, hidden=8, rank=2)
    with pytest.raises(ValueError, match="out of range: 4"):
        linear_lora_gathered(x, a, b, torch.tensor([0, 4, 1]))
    with pytest.raises(ValueError, match="out of range: -1"):
        linear_lora_loop(x, a, b, torch.tensor([0, -1, 1]))
    with pytest.raises(ValueError, match="rank mismatch"):
        linear_lora_gathered(x, a, b[:, :1], torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="shape mismatch"):
        linear_lora_gathered(torch.randn(3, 2, 9), a, b, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="one index per row"):
        linear_lora_gathered(x, a, b, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="rank must be"):
        LoraLayer(torch.nn.Linear(4, 4), rank=0)
    with pytest.raises(ValueError, match="wrap nn.Linear, transformers' Conv1D, not Embedding"):
        LoraLayer(torch.nn.Embedding(4, 4), rank=2)


# --- per-row adapters against peft on tiny random models ----------------------------------

def _save_random_adapter(model, folder, rank, targets, seed, **config):
    """A peft adapter with random (non-zero) A and B, saved with save_pretrained."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    conv1d = model.config.model_type == "gpt2"  # GPT-2's Conv1D stores weights as (in, out)
    config = LoraConfig(r=rank, lora_alpha=3 * rank, target_modules=targets,
                        init_lora_weights=False, lora_dropout=0.0, fan_in_fan_out=conv1d,
                        **config)
    peft_model = get_peft_model(copy.deepcopy(model), config)
    with torch.no_grad():  # make the adapter's effect large enough to change greedy tokens
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(20)
    peft_model.save_pretrained(folder, save_embedding_layers=False)
    return folder


def _compare_with_peft(model, tokenizer, folders, rows, prompts):
    from peft import PeftModel

    names = list(folders)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(model), folders[names[0]],
                                           adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(folders[name], adapter_name=name)
    peft_model.eval()
    ours = copy.deepcopy(model)
    lora = load_adapters(ours, folders)
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    peft_rows = [NO_ADAPTER if r is None else r for r in rows]
    with torch.no_grad():
        want = peft_model(**batch, adapter_names=peft_rows).logits
        lora.set_rows(rows)
        got = ours(**batch).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got[0], got[1], atol=1e-3)  # the adapters do something
    # generation with the KV cache: prefill (batch, seq) then decode steps (batch, 1)
    gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    want_tokens = peft_model.generate(**batch, adapter_names=peft_rows, **gen)
    lora.set_rows(None)
    with lora.rows(rows):
        got_tokens = ours.generate(**batch, **gen)
    assert lora.current_rows is None  # the context manager restored "no adapters"
    assert got_tokens.tolist() == want_tokens.tolist()
    return lora, ours


def test_per_row_layers_equal_peft_on_llama_style_model(tiny_llama, tmp_path):
    model, tokenizer = tiny_llama
    folders = {
        "qv": _save_random_adapter(model, tmp_path / "qv", 4, ["q_proj", "v_proj"], seed=1),
        "mlp": _save_random_adapter(model, tmp_path / "mlp", 6,
                                    ["gate_proj", "up_proj", "down_proj", "o_proj"], seed=2,
                                    rank_pattern={"down_proj": 2}, alpha_pattern={"o_proj": 5}),
    }
    rows = ["qv", "mlp", None, "qv", NO_ADAPTER]
    prompts = ["Jack and Jill", "The rain in Spain falls", "Humpty", "What comes up must",
               "The quick brown fox jumped over the"]
    lora, ours = _compare_with_peft(model, tokenizer, folders, rows, prompts)
    layer = ours.model.layers[0].self_attn.q_proj
    assert isinstance(layer, MultiLoraLayer) and layer.rank == 4
    assert ours.model.layers[0].mlp.up_proj.rank == 6  # ranks differ per layer
    # indices work like names; -1 is the base model
    batch = tokenizer(prompts[:3], return_tensors="pt", padding=True)
    with torch.no_grad():
        lora.set_rows(["qv", "mlp", None])
        by_name = ours(**batch).logits
        lora.set_rows([0, 1, -1])
        by_index = ours(**batch).logits
    torch.testing.assert_close(by_name, by_index)
    lora.remove()
    assert type(ours.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def _tiny_gpt2():
    """A random GPT-2 of width 32 and 2 layers for the course's tokenizer (seeded), and the
    tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from helpers import load_tokenizer

    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2,
                        n_positions=64, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval(), tokenizer


def test_per_row_layers_equal_peft_on_gpt2_conv1d(tmp_path):
    model, tokenizer = _tiny_gpt2()
    folders = {"attn": _save_random_adapter(model, tmp_path / "a", 4, ["c_attn", "c_proj"], 1),
               "fc": _save_random_adapter(model, tmp_path / "b", 2, ["c_fc"], 2),
               # the embedding and the (tied) output layer too, as the entities adapter does
               "ends": _save_random_adapter(model, tmp_path / "c", 3, ["wte", "lm_head"], 3)}
    _compare_with_peft(model, tokenizer, folders, ["fc", None, "attn", "ends", "attn"],
                       ["Jack and Jill", "Humpty Dumpty sat", "The rain", "Once upon a time",
                        "What comes up"])


def test_layers_wrapped_before_any_adapter_keep_their_objects_and_answers(tmp_path):
    """wrap_all (what a compiled server does before compiling) wraps every Linear, Conv1D and
    Embedding at once; adapters loaded later fill the stacks without replacing a module, and
    answer as adapters loaded the usual way. An empty wrapper can be taken over by another
    MultiLora; one that holds adapters cannot."""
    from transformers.pytorch_utils import Conv1D

    from helpers.lora import MultiLora

    model, tokenizer = _tiny_gpt2()
    folders = {"attn": _save_random_adapter(model, tmp_path / "a", 4, ["c_attn", "c_proj"], 1),
               "ends": _save_random_adapter(model, tmp_path / "c", 3, ["wte", "lm_head"], 3)}
    adaptable = [path for path, m in model.named_modules()
                 if isinstance(m, (torch.nn.Linear, Conv1D, torch.nn.Embedding))]
    batch = tokenizer(["Jack and Jill", "Humpty Dumpty sat"], return_tensors="pt", padding=True)

    wrapped = copy.deepcopy(model)
    lora = MultiLora(wrapped)
    assert sorted(lora.wrap_all()) == sorted(adaptable)      # wte, wpe, lm_head, 4 per block
    assert wrapped.get_input_embeddings().num_embeddings == len(tokenizer)  # from the base
    modules = dict(wrapped.named_modules())
    with torch.no_grad():
        torch.testing.assert_close(wrapped(**batch).logits, model(**batch).logits)
        for name, folder in folders.items():
            lora.add(name, folder)
        assert all(modules[path] is wrapped.get_submodule(path) for path in adaptable)
        usual = copy.deepcopy(model)
        usual_lora = load_adapters(usual, folders)
        for rows in (["attn", "ends"], [None, "attn"], None):
            lora.set_rows(rows)
            usual_lora.set_rows(rows)
            torch.testing.assert_close(wrapped(**batch).logits, usual(**batch).logits)

    empty = copy.deepcopy(model)
    MultiLora(empty).wrap_all()
    second = load_adapters(empty, {"attn": folders["attn"]})   # takes the empty wrappers over
    assert set(second.layers) == {p for p in adaptable if p.endswith(("c_attn", "c_proj"))}
    with pytest.raises(ValueError, match="already carries adapters from another MultiLora"):
        MultiLora(empty).wrap_all()


def test_multi_lora_errors(tiny_llama, tmp_path):
    model, tokenizer = tiny_llama
    model = copy.deepcopy(model)
    good = _save_random_adapter(model, tmp_path / "good", 4, ["q_proj"], seed=1)
    lora = load_adapters(model, {"good": good})
    with pytest.raises(ValueError, match="unknown adapter name 'nope'"):
        lora.set_rows(["good", "nope"])
    with pytest.raises(ValueError, match="adapter index 1 is out of range"):
        lora.set_rows([0, 1])
    with pytest.raises(ValueError, match="adapter index -2 is out of range"):
        lora.set_rows([-2])
    with pytest.raises(ValueError, match="already loaded"):
        lora.add("good", good)
    with pytest.raises(ValueError, match="name must be"):
        lora.add(NO_ADAPTER, good)
    lora.set_rows(["good", None])  # two rows named, three in the batch
    with pytest.raises(ValueError, match="3 rows but set_rows named 2"):
        model(**tokenizer(["a", "b", "c"], return_tensors="pt"))
    lora.set_rows(None)

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "adapter_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="'empty'.*no adapter_model.safetensors.*pickles"):
        lora.add("empty", empty)
    with pytest.raises(ValueError, match="unknown adapter 'no-such-adapter'"):
        load_adapters(model, ["no-such-adapter"])

    wrong_rank = tmp_path / "wrong_rank"
    shutil.copytree(good, wrong_rank)
    config = json.loads((wrong_rank / "adapter_config.json").read_text())
    config["r"] = 2
    (wrong_rank / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'wrong_rank'.*rank mismatch.*r=2"):
        lora.add("wrong_rank", wrong_rank)

    wide = random_llama(tokenizer, hidden=32)  # the same layers, narrower
    other = _save_random_adapter(wide, tmp_path / "other", 4, ["q_proj"], seed=2)
    with pytest.raises(ValueError, match="'other'.*shape mismatch.*q_proj"):
        lora.add("other", other)
    deep = random_llama(tokenizer, layers=3)  # one layer more
    deeper = _save_random_adapter(deep, tmp_path / "deeper", 4, ["q_proj"], seed=3)
    with pytest.raises(ValueError, match="'deeper' adapts 'model.layers.2.self_attn.q_proj'"):
        lora.add("deeper", deeper)
    assert lora.names == ["good"]  # failed loads changed nothing
    with pytest.raises(ValueError, match="another MultiLora"):
        load_adapters(model, {"again": good})

    layer = MultiLoraLayer(torch.nn.Linear(8, 4))
    with pytest.raises(ValueError, match="rank mismatch"):
        layer.add_adapter(torch.zeros(8, 2), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.add_adapter(torch.zeros(9, 2), torch.zeros(2, 4))


# --- the bundled model and the shipped adapters -------------------------------------------

@pytest.fixture(scope="module")
def shipped():
    """The bundled model with every shipped adapter installed for per-row use."""
    from helpers import load_model

    names = shipped_adapters()
    assert len(names) >= 3, "expected the shipped adapters; run scripts/train_adapters.py"
    model, tokenizer = load_model(device="cpu")
    lora = load_adapters(model)
    assert lora.names == names
    return model, tokenizer, lora


@pytest.fixture(scope="module")
def peft_reference():
    """The bundled model with every shipped adapter loaded into peft."""
    from peft import PeftModel

    from helpers import load_model
    from helpers.lora import ADAPTERS_DIR

    model, _ = load_model(device="cpu")
    names = shipped_adapters()
    peft_model = PeftModel.from_pretrained(model, ADAPTERS_DIR / names[0], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(ADAPTERS_DIR / name, adapter_name=name)
    return peft_model.eval()


def test_mixed_batch_equals_each_row_alone_through_peft(shipped, peft_reference):
    model, tokenizer, lora = shipped
    sentences = [s for s, _ in task_examples("entities", 7, 4)]
    names = lora.names
    rows = [names[0], None, *names[1:], names[0]]
    prompts = [task_prompt(sentences[i % len(sentences)]) for i in range(len(rows))]
    prompts[1] = "Jack and Jill"  # a short prompt: the others get left padding
    prompts[-1] = task_prompt("Ben the cat found a tiny bell at the lake and showed it to "
                              "Ruby the duck.")
    gen = dict(max_new_tokens=30, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert len(set(batch.attention_mask.sum(1).tolist())) > 1  # prompts of different lengths
    with lora.rows(rows):
        mixed = model.generate(**batch, **gen)[:, batch.input_ids.shape[1]:]
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        alone = tokenizer(prompt, return_tensors="pt")
        if row is None:
            with peft_reference.disable_adapter():
                want = peft_reference.generate(**alone, **gen)
        else:
            peft_reference.set_adapter(row)
            want = peft_reference.generate(**alone, **gen)
        want = want[0, alone.input_ids.shape[1]:].tolist()
        got = mixed[i].tolist()
        got = got[:len(want)]  # peft stops at EOS alone; the batch pads with EOS after it
        assert got == want, f"row {i} ({row}): {tokenizer.decode(got)!r} != {tokenizer.decode(want)!r}"


def test_merged_equals_unmerged(shipped, peft_reference, tmp_path):
    """Merging an adapter into the weights changes nothing, and our per-row layer agrees.

    An adapter on the tied embedding (wte and lm_head share one tensor in GPT-2) cannot be
    merged: both deltas would land in the same tensor. The shipped adapters that adapt them
    are checked unmerged only; merging is checked on every other shipped adapter and, always,
    on a random adapter of the bundled model's blocks (the kind lesson 05 trains and merges).
    """
    import json

    from peft import PeftModel

    from helpers import load_model
    from helpers.lora import ADAPTERS_DIR

    model, tokenizer, lora = shipped
    batch = tokenizer([task_prompt("Tom the fox met Lily the owl at the river and found a red "
                                   "ball."), "Jack and Jill"], return_tensors="pt", padding=True)
    for name in lora.names:
        targets = set(json.loads((ADAPTERS_DIR / name / "adapter_config.json").read_text())
                      ["target_modules"])
        peft_reference.set_adapter(name)
        with torch.no_grad():
            unmerged = peft_reference(**batch).logits
            with lora.rows([name, name]):
                ours = model(**batch).logits
            torch.testing.assert_close(ours, unmerged, rtol=1e-4, atol=1e-4)
            if targets & {"wte", "lm_head"}:
                continue
            merged_model = copy.deepcopy(peft_reference)
            merged_model.set_adapter(name)
            merged = merged_model.merge_and_unload()(**batch).logits
            torch.testing.assert_close(merged, unmerged, rtol=1e-4, atol=1e-4)

    base, _ = load_model(device="cpu")
    folder = _save_random_adapter(base, tmp_path / "blocks", 4, ["c_attn", "c_proj", "c_fc"], 5)
    blocks = PeftModel.from_pretrained(base, folder).eval()
    with torch.no_grad():
        unmerged = blocks(**batch).logits
        merged = blocks.merge_and_unload()(**batch).logits
    assert not torch.allclose(unmerged, load_model(device="cpu")[0](**batch).logits, atol=1e-1)
    # this adapter is large (B × 20), so are the logits it moves: rounding grows with them
    torch.testing.assert_close(merged, unmerged, rtol=1e-3, atol=1e-3)


def test_shipped_adapters_answer_differently(shipped):
    model, tokenizer, lora = shipped
    sentence = "Tom the fox met Lily the owl at the river and found a red ball."
    names = [None, *lora.names]
    batch = tokenizer([task_prompt(sentence)] * len(names), return_tensors="pt", padding=True)
    with lora.rows(names):
        out = model.generate(**batch, max_new_tokens=80, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    answers = {n: tokenizer.decode(row[batch.input_ids.shape[1]:],
                                   skip_special_tokens=True).strip()
               for n, row in zip(names, out)}
    assert len(set(answers.values())) == len(names), answers
    # The entities adapter answers with a JSON object (how accurate its values are is the
    # adapter's quality, measured by scripts/train_adapters.py and listed in its README).
    assert isinstance(json.loads(answers["entities"]), dict), answers["entities"]
    assert isinstance(lora, MultiLora)


def test_entities_adapter_copies_names_place_and_object(shipped):
    """The entities adapter's answers for sentences it never trained on, through our per-row
    layer: JSON whose characters ("Tom the fox"), place and object are the sentence's own."""
    model, tokenizer, lora = shipped
    pairs = task_examples("entities", 4242, 12)
    batch = tokenizer([task_prompt(s) for s, _ in pairs], return_tensors="pt", padding=True)
    with lora.rows(["entities"] * len(pairs)):
        out = model.generate(**batch, max_new_tokens=60, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    right = {"names": 0, "characters": 0, "place": 0, "object": 0}
    for (sentence, want), row in zip(pairs, out):
        got = json.loads(tokenizer.decode(row[batch.input_ids.shape[1]:],
                                          skip_special_tokens=True))
        want = json.loads(want)
        right["names"] += [c.split(" the ")[0] for c in got["characters"]] == \
            [c.split(" the ")[0] for c in want["characters"]]
        right["characters"] += got["characters"] == want["characters"]
        right["place"] += got["place"] == want["place"]
        right["object"] += got["object"] == want["object"]
    assert all(count >= 0.9 * len(pairs) for count in right.values()), right


def test_rows_can_change_between_steps(tiny_llama, tmp_path):
    """Continuous batching: after the prefill a row leaves, and the next step names the rest."""
    model, tokenizer = tiny_llama
    model = copy.deepcopy(model)
    folders = {"a": _save_random_adapter(model, tmp_path / "a", 4, ["q_proj", "down_proj"], 1),
               "b": _save_random_adapter(model, tmp_path / "b", 2, ["v_proj"], 2)}
    lora = load_adapters(model, folders)
    batch = tokenizer(["Jack and Jill", "Humpty Dumpty sat on", "The rain"], return_tensors="pt",
                      padding=True)
    with torch.no_grad():
        lora.set_rows(["a", "b", None])
        prefill = model(**batch, position_ids=(batch.attention_mask.cumsum(-1) - 1).clamp(min=0),
                        use_cache=True)
        token = prefill.logits[:, -1].argmax(-1, keepdim=True)
        keep = torch.tensor([0, 2])  # row 1 finished
        cache = prefill.past_key_values
        cache.batch_select_indices(keep)
        mask = torch.cat([batch.attention_mask[keep], torch.ones(2, 1, dtype=torch.long)], 1)
        positions = (mask.cumsum(-1) - 1)[:, -1:]
        lora.set_rows(["a", None])
        step = model(input_ids=token[keep], attention_mask=mask, past_key_values=cache,
                     position_ids=positions).logits[:, -1]
        # the same rows from scratch, without a cache
        ids = torch.cat([batch.input_ids[keep], token[keep]], 1)
        full_positions = (mask.cumsum(-1) - 1).clamp(min=0)
        full = model(input_ids=ids, attention_mask=mask, position_ids=full_positions).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-4)


def test_remove_resets_the_rows_that_used_the_adapters(tiny_llama, tmp_path):
    """After remove() no row names an adapter that is gone: the rows are reset, the model
    answers as the base model does, and adding an adapter again starts clean."""
    model, tokenizer = tiny_llama
    model = copy.deepcopy(model)
    folder = _save_random_adapter(model, tmp_path / "a", 4, ["q_proj", "v_proj"], seed=3)
    batch = tokenizer(["Jack and Jill", "The rain"], return_tensors="pt", padding=True)
    with torch.no_grad():
        base = model(**batch).logits
        lora = load_adapters(model, {"a": folder})
        lora.set_rows(["a", None])
        adapted = model(**batch).logits
        assert not torch.allclose(adapted[0], base[0], atol=1e-3)
        assert lora.remove() is model
        assert lora.current_rows is None and lora.names == []
        torch.testing.assert_close(model(**batch).logits, base)
        with pytest.raises(ValueError, match="unknown adapter name 'a'"):
            lora.set_rows(["a", None])
        lora.add("a", folder)
        assert lora.current_rows is None  # a fresh adapter is off until a row names it
        torch.testing.assert_close(model(**batch).logits, base)
        lora.set_rows(["a", None])
        torch.testing.assert_close(model(**batch).logits, adapted)


def test_adapter_mismatch_names_the_layer_that_does_not_fit(shipped, tiny_llama):
    """The shipped adapters fit the bundled model; on another model the reason names a layer."""
    from helpers import adapter_mismatch, load_model

    model, _ = load_model(device="cpu")
    assert all(adapter_mismatch(model, name) is None for name in ("entities", "rhymes"))
    other, _ = tiny_llama
    reason = adapter_mismatch(other, "entities")
    assert reason is not None and "'entities'" in reason
    assert "lacks" in reason or "shape mismatch" in reason
    with pytest.raises(ValueError, match="unknown adapter"):
        adapter_mismatch(model, "no-such-adapter")


def test_shipped_adapters_fit_says_why_and_skips(bundled, tiny_llama, capsys):
    """The bundled model needs nothing; on another model the Needs names the layer and a part
    that needs the adapters prints one line and skips."""
    from helpers import shipped_adapters_fit

    fits = shipped_adapters_fit(bundled[0])
    assert fits.ok and not fits.missing("Section 6")
    assert capsys.readouterr().out == ""
    other = shipped_adapters_fit(tiny_llama[0])
    assert not other.ok and "do not fit this model" in other.problem
    assert other.missing("Section 6")
    line = capsys.readouterr().out.strip()
    assert line.startswith("Section 6: skipped, the shipped adapters do not fit this model (")
    assert "\n" not in line


def test_adapter_folders_stand_in_random_adapters_of_the_right_shapes(bundled, tiny_llama):
    """The shipped folders on the bundled model; on another model random peft adapters that
    fit it, as many as ship, different from each other."""
    from helpers import adapter_folders, adapter_mismatch

    folders, needs = adapter_folders(bundled[0])
    assert needs.ok and list(folders) == shipped_adapters()
    other = tiny_llama[0]
    folders, needs = adapter_folders(other)
    assert not needs.ok and len(folders) == len(shipped_adapters())
    assert all(adapter_mismatch(other, folder) is None for folder in folders.values())
    first, second = (open(f / "adapter_model.safetensors", "rb").read()
                     for f in list(folders.values())[:2])
    assert first != second
    with pytest.raises(ValueError, match="n and rank must be positive"):
        save_random_adapters(other, n=0)


def test_held_out_parts_of_free_text_answers():
    """scripts/train_adapters.py grades the adapters' free-text answers part by part (the
    numbers on the adapters' card): the right template, then each name, animal, place and
    object the answer copies from its sentence, in order."""
    from scripts.train_adapters import answer_part_rates

    want = ("The wind was blowing, and Oscar never saw the jar of honey again. Sam was sad for "
            "a long time. The end.")
    wrong_name = want.replace("Oscar", "Rosa")
    wrong_template = "The jar of honey broke, and Oscar walked home in the rain, tired and sad. The end."
    rates = answer_part_rates([want, wrong_name, wrong_template], [want] * 3)
    assert rates == pytest.approx({"format": 2 / 3, "names": 1 / 3, "object": 1.0})
    title = "The owl, the mouse and the jar of honey"
    rates = answer_part_rates(["The hen, the hen and the jar of honey", title], [title] * 2)
    assert rates == {"format": 1.0, "animals": 0.5, "object": 1.0}


# --- lesson 05: the adapter the lesson trains in seconds --------------------------------------

def lesson_05_recipe() -> dict:
    """The ``recipe = dict(...)`` lesson 05 trains with, read from the notebook's own source, so
    that the test below trains exactly what the lesson shows."""
    import ast
    from pathlib import Path

    import nbformat

    notebook = Path(__file__).resolve().parents[1] / "lessons" / "05_lora.ipynb"
    for cell in nbformat.read(notebook, as_version=4).cells:
        if cell.cell_type != "code" or "recipe = dict(" not in cell.source:
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id == "recipe"):
                return {kw.arg: ast.literal_eval(kw.value) for kw in node.value.keywords}
    raise AssertionError("lesson 05 has no `recipe = dict(...)` cell")


def test_lesson_05_recipe_answers_most_held_out_sentences(one_thread):
    """Lesson 05's recipe, trained on the bundled model as the lesson trains it (on one thread,
    as there), answers at least 80 % of the lesson's held-out sentences exactly (none of them
    in the training set)."""
    from helpers import load_model
    from helpers.corpus import found_examples
    from helpers.lora import count_right_answers, train_lora_adapter

    recipe = lesson_05_recipe()
    assert set(recipe) == {"rank", "lora_alpha", "target_modules", "steps", "batch", "lr",
                           "seed"}
    model, tokenizer = load_model("bundled", device="cpu")   # trained in place: a fresh copy
    train = found_examples(seed=1, n=recipe["steps"] * recipe["batch"])   # as in the lesson
    held_out = found_examples(seed=7, n=20)
    assert not {s for s, _ in held_out} & {s for s, _ in train}
    peft_model, losses = train_lora_adapter(
        model, tokenizer, [(task_prompt(s), a) for s, a in train], **recipe)
    assert len(losses) == recipe["steps"] and losses[-1] < 0.1 * losses[0]
    right = count_right_answers(peft_model, tokenizer,
                                [(task_prompt(s), a) for s, a in held_out])
    assert right >= 0.8 * len(held_out), f"{right}/{len(held_out)} held-out sentences right"


def test_found_examples_share_the_tasks_sentences():
    from helpers.corpus import found_examples

    pairs = found_examples(seed=7, n=5)
    assert [s for s, _ in pairs] == [s for s, _ in task_examples("title", seed=7, n=5)]
    for sentence, found in pairs:
        assert found[0].isupper() and f"found {found[0].lower()}{found[1:]}" in sentence
    assert found_examples(seed=7, n=5) == pairs and found_examples(seed=8, n=5) != pairs
    with pytest.raises(ValueError, match="n must be a non-negative integer"):
        found_examples(seed=0, n=-1)


def test_train_lora_adapter_and_count_right_answers_reject_bad_input(tiny_llama):
    from helpers.lora import count_right_answers, train_lora_adapter

    model, tokenizer = tiny_llama
    recipe = dict(rank=2, lora_alpha=4, target_modules=["c_attn"], steps=2, batch=2, lr=1e-3)
    with pytest.raises(ValueError, match="2 steps of 2 need 4 examples, got 1"):
        train_lora_adapter(copy.deepcopy(model), tokenizer, [("Input: a\nOutput:", "b")], **recipe)
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        train_lora_adapter(copy.deepcopy(model), tokenizer, [], **(recipe | {"rank": 0}))
    with pytest.raises(ValueError, match="lr must be positive"):
        train_lora_adapter(copy.deepcopy(model), tokenizer, [], **(recipe | {"lr": 0}))
    with pytest.raises(ValueError, match="examples is empty"):
        count_right_answers(model, tokenizer, [])
    # on a non-GPT-2 model the recipe's modules become "all-linear", as in the lesson
    pairs = [("Input: Tom the fox.\nOutput:", "A red ball")] * 4
    peft_model, losses = train_lora_adapter(copy.deepcopy(model), tokenizer, pairs, **recipe)
    assert len(losses) == 2 and peft_model.peft_config["default"].target_modules
    assert 0 <= count_right_answers(peft_model, tokenizer, pairs[:1], max_new_tokens=3) <= 1
