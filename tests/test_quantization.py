"""Lesson 04: zero-point quantization by hand (checked against torch's own quantizer), whole
models, footprint, perplexity, torchao."""

import os

import pytest
import torch

from helpers.quantization import (LLAMA2_70B, conv1d_to_linear, dequantize,
                                  dequantize_model, footprint, gpu_memory_estimate,
                                  kv_cache_plan, perplexity, quantization_errors, quantize,
                                  quantize_model)
from helpers.quiet import quiet_stderr


@pytest.fixture(scope="module")
def tiny_gpt2():
    """A tiny random GPT-2 (Conv1D projections, lm_head tied to wte) with the course tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from helpers import load_tokenizer

    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=128, n_layer=2,
                        n_head=2, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    return GPT2LMHeadModel(config).eval(), tokenizer


def _bound(t, q, state):
    """Per-element allowed error: half a step, plus float rounding of the values involved."""
    scale = state._broadcast(state.scale)
    return scale / 2 * (1 + 1e-5) + 1e-6 * t.float().abs().max()


def _assert_close_logits(got, ref):
    """8-bit weights move the logits of a random model by a few percent of their spread."""
    diff = (got - ref).abs()
    assert diff.mean() < 0.03 * ref.std() and diff.max() < 0.15 * ref.std()
    assert torch.corrcoef(torch.stack([got.flatten(), ref.flatten()]))[0, 1] > 0.999


# --- one tensor ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,axis", [
    ((1000,), None), ((7,), 0), ((13, 17), None), ((13, 17), 0), ((13, 17), 1), ((13, 17), -1),
    ((3, 5, 7), None), ((3, 5, 7), 1), ((3, 5, 7), -1), ((3, 5, 7), -3), ((2, 3, 4, 5), 2)])
def test_round_trip_error_within_half_a_step(shape, axis):
    gen = torch.Generator().manual_seed(100 * len(shape) + sum(shape) + (axis or 0))
    t = torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-3, 3, (1,), generator=gen)
    q, state = quantize(t, axis=axis)
    assert q.dtype == torch.uint8 and q.shape == t.shape
    assert state.shape == t.shape and state.dtype == t.dtype
    n_channels = 1 if axis is None else shape[axis]
    assert state.scale.shape == (n_channels,) and state.zero_point.shape == (n_channels,)
    assert state.axis == (None if axis is None else axis % len(shape))
    assert state.nbytes == 8 * n_channels
    back = dequantize(q, state)
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.all((back - t).abs() <= _bound(t, q, state))
    if t.numel() > n_channels:  # every channel's range is used end to end
        assert int(q.min()) == 0 and int(q.max()) == 255


def _near_a_tie(t, state):
    """Where t / scale is within float rounding of k + 0.5: there torch, which multiplies by
    1 / scale instead of dividing, may round to the other neighbour."""
    steps = t.float() / state._broadcast(state.scale)
    return ((steps - steps.floor()) - 0.5).abs() < 2e-5


def test_same_codes_and_values_as_torch_quantize_per_tensor():
    import warnings

    gen = torch.Generator().manual_seed(3)
    t = torch.randn(300, 200, generator=gen) * 0.05 + 0.01     # a weight-like matrix
    t[0, 0] = 0.0
    q, state = quantize(t)
    scale, zero_point = float(state.scale), int(state.zero_point)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.13 deprecates its quantized dtypes
        ref = torch.quantize_per_tensor(t, scale, zero_point, torch.quint8)
    assert 0 < zero_point < 255 and state.zero_point.dtype == torch.int32
    tie = _near_a_tie(t, state)
    assert tie.float().mean() < 1e-3                             # a handful at most
    assert torch.equal(q[~tie], ref.int_repr()[~tie])
    assert torch.all((q[tie].int() - ref.int_repr()[tie].int()).abs() <= 1)
    # same codes, same values back (up to float rounding of (q - z) * scale)
    assert torch.allclose(dequantize(q, state)[~tie], ref.dequantize()[~tie],
                          rtol=0, atol=1e-6 * scale)
    # the convention really is the library's: 0.0 is code zero_point, and comes back exactly
    assert int(q[0, 0]) == int(ref.int_repr()[0, 0]) == zero_point
    assert float(dequantize(q, state)[0, 0]) == float(ref.dequantize()[0, 0]) == 0.0


def test_same_codes_as_torch_quantize_per_channel():
    import warnings

    gen = torch.Generator().manual_seed(4)
    t = torch.randn(64, 48, generator=gen) * torch.logspace(-2, 0, 48)  # columns of all sizes
    q, state = quantize(t, axis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = torch.quantize_per_channel(t, state.scale.double(), state.zero_point.long(), 1,
                                         torch.quint8)
    assert torch.equal(state.zero_point.long(), ref.q_per_channel_zero_points())
    tie = _near_a_tie(t, state)
    assert tie.float().mean() < 1e-3
    assert torch.equal(q[~tie], ref.int_repr()[~tie])
    assert torch.allclose(dequantize(q, state)[~tie], ref.dequantize()[~tie],
                          rtol=0, atol=1e-6 * float(state.scale.max()))


def test_zero_is_exact_and_the_range_contains_it():
    t = torch.tensor([[-0.3, 0.0, 0.7, 0.25], [0.0, 0.11, -0.05, 0.0]])
    q, state = quantize(t)
    back = dequantize(q, state)
    assert torch.all(back[t == 0] == 0.0)                        # exactly, not approximately
    assert torch.all(q[t == 0] == state.zero_point)
    # all-positive and all-negative blocks: the range is stretched to 0, so the zero point
    # is code 0 or code 255, and 0.0 still has a code
    pos, s_pos = quantize(torch.tensor([0.9, 1.0, 1.2]))
    neg, s_neg = quantize(torch.tensor([-0.9, -1.0, -1.2]))
    assert int(s_pos.zero_point) == 0 and int(s_neg.zero_point) == 255
    assert float(s_pos.scale) == pytest.approx(1.2 / 255) and int(pos.max()) == 255
    assert int(neg.min()) == 0
    # per channel: one integer zero point per row
    _, rows = quantize(torch.tensor([[1.0, 2.0], [-1.0, 3.0], [-2.0, -1.0]]), axis=0)
    assert rows.zero_point.tolist() == [0, 64, 255]  # round(1 / (4 / 255))


def test_a_float_offset_is_the_same_grid_written_differently():
    """x' = (q - z) * scale is x' = q * scale + offset with offset = -z * scale."""
    t = torch.randn(40, 30, generator=torch.Generator().manual_seed(5))
    q, state = quantize(t, axis=0)
    offset = -state.zero_point.float() * state.scale
    assert torch.allclose(q.float() * state.scale[:, None] + offset[:, None], dequantize(q, state),
                          atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes_come_back_in_their_dtype(dtype):
    t = torch.linspace(-3, 5, 301).to(dtype)
    q, state = quantize(t)
    back = dequantize(q, state)
    assert back.dtype == dtype
    rounding = torch.finfo(dtype).eps * t.double().abs()
    assert torch.all((back.double() - t.double()).abs() <= state.scale.double() / 2 * 1.001 + rounding)


@pytest.mark.parametrize("axis", [None, 0, 1])
def test_constant_tensor_round_trips_without_nan(axis):
    t = torch.full((4, 6), 0.731)
    q, state = quantize(t, axis=axis)
    back = dequantize(q, state)
    assert not torch.isnan(back).any() and torch.equal(back, t)
    assert torch.all(state.scale > 0)


def test_constant_row_beside_varying_rows():
    t = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.5, 1.0]])
    q, state = quantize(t, axis=0)
    assert torch.allclose(dequantize(q, state), t, atol=1 / 510 + 1e-7)


def test_empty_tensor_is_refused():
    with pytest.raises(ValueError, match="empty"):
        quantize(torch.empty(0, 4))


@pytest.mark.parametrize("t", [torch.arange(10), torch.ones(3, dtype=torch.uint8),
                               torch.tensor([True, False])])
def test_non_floating_tensor_is_refused(t):
    with pytest.raises(ValueError, match="floating point"):
        quantize(t)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_refused(bad):
    with pytest.raises(ValueError, match="NaN or infinity"):
        quantize(torch.tensor([0.0, bad, 1.0]))


def test_bad_axis_and_bits_are_refused():
    with pytest.raises(ValueError, match="out of range"):
        quantize(torch.randn(3, 4), axis=2)
    with pytest.raises(ValueError, match="out of range"):
        quantize(torch.randn(3, 4), axis=-3)
    with pytest.raises(ValueError, match="axis must be"):
        quantize(torch.randn(3, 4), axis="rows")
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.randn(3, 4), bits=9)
    with pytest.raises(ValueError, match="must be a torch.Tensor"):
        quantize([1.0, 2.0])


def test_dequantize_checks_its_input():
    q, state = quantize(torch.randn(3, 4))
    with pytest.raises(ValueError, match="uint8"):
        dequantize(q.float(), state)
    with pytest.raises(ValueError, match="shape"):
        dequantize(q.reshape(4, 3), state)


def test_fewer_bits_mean_coarser_steps():
    t = torch.randn(50, 20, generator=torch.Generator().manual_seed(1))
    q4, s4 = quantize(t, bits=4)
    assert int(q4.max()) == 15 and s4.bits == 4
    assert torch.all((dequantize(q4, s4) - t).abs() <= _bound(t, q4, s4))
    q8, s8 = quantize(t)
    err4 = (dequantize(q4, s4) - t).abs().mean()
    err8 = (dequantize(q8, s8) - t).abs().mean()
    assert err8 < err4 / 10


def test_per_channel_beats_per_tensor_when_rows_differ_in_scale():
    gen = torch.Generator().manual_seed(2)
    row_scales = torch.tensor([1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0]).unsqueeze(1)
    t = torch.randn(6, 64, generator=gen) * row_scales
    per_tensor = (dequantize(*quantize(t)) - t).abs()
    per_row = (dequantize(*quantize(t, axis=0)) - t).abs()
    assert per_row.mean() <= per_tensor.mean()
    # The small rows are where it matters: per-tensor rounds them all to one step.
    assert per_row[0].mean() < per_tensor[0].mean() / 100


# --- a whole model ---------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [None, 0, -1])
def test_quantized_model_takes_about_a_quarter_of_the_memory(tiny_gpt2, axis):
    model, _ = tiny_gpt2
    before = footprint(model)
    qmodel, states = quantize_model(model, axis=axis)
    after = footprint(qmodel, states)
    assert after["states"] == sum(s.nbytes for s in states.values()) > 0
    assert after["total"] == after["parameters"] + after["buffers"] + after["states"]
    assert all(p.dtype == torch.uint8 for p in qmodel.parameters())
    assert after["total"] / before["total"] <= 0.27
    # the original is untouched
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_tied_weights_are_quantized_once_and_stay_tied(tiny_gpt2):
    model, _ = tiny_gpt2
    assert model.lm_head.weight is model.transformer.wte.weight
    n_unique = sum(p.numel() for p in model.parameters())
    assert footprint(model)["parameters"] == 4 * n_unique
    qmodel, states = quantize_model(model, axis=0)
    assert "transformer.wte.weight" in states and "lm_head.weight" not in states
    assert qmodel.lm_head.weight is qmodel.transformer.wte.weight
    assert footprint(qmodel, states)["parameters"] == n_unique
    restored = dequantize_model(qmodel, states)
    assert restored.lm_head.weight is restored.transformer.wte.weight


def test_one_dimensional_parameters_fall_back_to_per_tensor(tiny_gpt2):
    model, _ = tiny_gpt2
    _, states = quantize_model(model, axis=0)
    assert states["transformer.h.0.ln_1.weight"].axis is None
    assert states["transformer.h.0.attn.c_attn.bias"].axis is None
    assert states["transformer.h.0.attn.c_attn.weight"].axis == 0
    _, states = quantize_model(model, axis=-1)
    assert states["transformer.h.0.attn.c_attn.weight"].axis == 1


@pytest.mark.parametrize("axis", [None, -1])
def test_dequantized_model_generates_close_to_the_original(tiny_gpt2, axis):
    model, tokenizer = tiny_gpt2
    qmodel, states = quantize_model(model, axis=axis)
    with pytest.raises(ValueError, match="dequantize_model"):
        perplexity(qmodel, tokenizer, ["Jack and Jill"])
    restored = dequantize_model(qmodel, states)
    assert all(p.dtype == torch.float32 for p in restored.parameters())
    assert all(p.dtype == torch.uint8 for p in qmodel.parameters())  # not in place by default
    ids = tokenizer("Jack and Jill went up the hill", return_tensors="pt").input_ids
    with torch.no_grad():
        ref, got = model(ids).logits, restored(ids).logits
    _assert_close_logits(got, ref)
    out = restored.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape == (1, ids.shape[1] + 5)


def test_in_place_round_trip(tiny_gpt2):
    model, _ = tiny_gpt2
    import copy

    work = copy.deepcopy(model)
    same, states = quantize_model(work, inplace=True)
    assert same is work and work.transformer.h[0].mlp.c_fc.weight.dtype == torch.uint8
    assert dequantize_model(work, states, inplace=True) is work
    for (name, a), b in zip(model.named_parameters(), work.parameters()):
        assert torch.all((a - b).abs() <= states[name].scale.max() / 2 * 1.001 + 1e-7), name


def test_select_quantizes_only_what_it_picks(tiny_gpt2):
    model, _ = tiny_gpt2

    def block_matrices(name, p):
        return p.dim() == 2 and ".h." in name

    qmodel, states = quantize_model(model, select=block_matrices)
    picked = {n for n, p in model.named_parameters() if block_matrices(n, p)}
    assert set(states) == picked and len(picked) == 4 * model.config.n_layer
    for name, p in qmodel.named_parameters():
        assert p.dtype == (torch.uint8 if name in picked else torch.float32), name
    # what is left in float costs 4 bytes a parameter, the rest 1
    n_picked = sum(p.numel() for n, p in model.named_parameters() if n in picked)
    n_all = sum(p.numel() for p in model.parameters())
    assert footprint(qmodel, states)["parameters"] == n_picked + 4 * (n_all - n_picked)
    restored = dequantize_model(qmodel, states)
    assert all(p.dtype == torch.float32 for p in restored.parameters())
    for name, p in restored.named_parameters():
        if name not in picked:  # untouched, bit for bit
            assert torch.equal(p, dict(model.named_parameters())[name]), name
    with pytest.raises(ValueError, match="select must be"):
        quantize_model(model, select="ln_")
    with pytest.raises(ValueError, match="select return False"):
        quantize_model(model, select=lambda name, p: False)


def test_model_errors_are_clear(tiny_gpt2):
    model, _ = tiny_gpt2
    qmodel, states = quantize_model(model)
    with pytest.raises(ValueError, match="already"):
        quantize_model(qmodel)
    with pytest.raises(ValueError, match="not uint8"):
        dequantize_model(model, states)
    with pytest.raises(ValueError, match="no parameter"):
        dequantize_model(qmodel, {"nope.weight": states["transformer.wte.weight"]})
    with pytest.raises(ValueError, match="out of range"):
        quantize_model(model, axis=2)


def test_quantization_errors_per_layer(tiny_gpt2):
    model, _ = tiny_gpt2
    per_tensor, per_channel = quantization_errors(model), quantization_errors(model, axis=-1)
    assert set(per_tensor) == {n for n, _ in model.named_parameters()}
    weights = [n for n, p in model.named_parameters() if p.dim() == 2]
    assert all(per_channel[n] <= per_tensor[n] * 1.05 for n in weights)


# --- perplexity ------------------------------------------------------------------------------

def test_perplexity_of_a_random_model_is_about_the_vocabulary(tiny_gpt2):
    from helpers.corpus import corpus

    model, tokenizer = tiny_gpt2
    texts = corpus(seed=1, n_docs=6)
    ppl = perplexity(model, tokenizer, texts, batch_size=4)
    assert len(tokenizer) / 2 < ppl < len(tokenizer) * 2
    # padding must not change anything: one text at a time gives the same number
    assert perplexity(model, tokenizer, texts, batch_size=1) == pytest.approx(ppl, rel=1e-4)


def test_perplexity_refuses_bad_input(tiny_gpt2):
    model, tokenizer = tiny_gpt2
    for bad in ([], "Jack and Jill"):
        with pytest.raises(ValueError, match="non-empty list"):
            perplexity(model, tokenizer, bad)
    with pytest.raises(ValueError, match="no token to predict"):
        perplexity(model, tokenizer, ["a"], prepend_bos=False)


# --- memory planning -------------------------------------------------------------------------

def test_gpu_memory_rule_of_thumb():
    est = gpu_memory_estimate(7e9)
    assert est == {"weights": 14e9, "minimum": 17.5e9, "recommended": 21e9}
    assert gpu_memory_estimate(70e9, bytes_per_param=1)["minimum"] == 87.5e9
    with pytest.raises(ValueError, match="positive"):
        gpu_memory_estimate(0)


def test_kv_cache_plan_for_a_70b_model():
    rows = kv_cache_plan()
    assert [r["batch"] for r in rows] == [1, 16, 32, 64]
    one = rows[0]
    assert one["fp16"] == 2 * 2 * 80 * 8192 * 1024  # 2.5 GiB
    assert one["int8"] == one["fp16"] / 2
    assert one["fp16_gqa"] == one["fp16"] / 8 and one["int8_gqa"] == one["int8"] / 8
    assert rows[-1]["fp16"] == 64 * one["fp16"]
    assert LLAMA2_70B["n_layers"] == 80
    with pytest.raises(ValueError, match="kv_heads"):
        kv_cache_plan(model={"n_layers": 2, "hidden": 8, "n_heads": 2})


# --- in practice: torchao --------------------------------------------------------------------

def test_conv1d_to_linear_keeps_the_outputs(tiny_gpt2):
    import copy

    model, tokenizer = tiny_gpt2
    linear = copy.deepcopy(model)
    assert conv1d_to_linear(linear) == 4 * model.config.n_layer
    ids = tokenizer("Humpty Dumpty sat", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, linear(ids).logits, atol=1e-5)


def test_quiet_stderr_hides_python_and_native_output(capfd):
    import sys
    import warnings

    with quiet_stderr():
        print("python noise", file=sys.stderr)
        os.write(2, b"native noise\n")
        warnings.warn("warning noise")
    print("after", file=sys.stderr)
    err = capfd.readouterr().err
    assert "noise" not in err and "after" in err


def test_torchao_int8_weight_only(tiny_gpt2):
    pytest.importorskip("torchao")  # optional: the lesson says how to install it
    from helpers.quantization import torchao_int8_weight_only

    model, tokenizer = tiny_gpt2
    small = torchao_int8_weight_only(model)
    linears = [m for m in small.modules() if isinstance(m, torch.nn.Linear)]
    quantized = [m for m in linears if type(m.weight) is not torch.nn.Parameter]
    assert len(quantized) == 4 * model.config.n_layer  # every projection, not the tied head
    assert small.lm_head.weight is small.transformer.wte.weight
    assert footprint(small)["total"] < 0.6 * footprint(model)["total"]
    ids = tokenizer("The rain in Spain falls", return_tensors="pt").input_ids
    with torch.no_grad():
        ref, got = model(ids).logits, small(ids).logits
    _assert_close_logits(got, ref)


def test_import_torchao_says_how_to_install(monkeypatch):
    import sys

    from helpers.quiet import import_torchao

    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao` fail
    with pytest.raises(ImportError, match="pip install torchao"):
        import_torchao()
    assert import_torchao(missing_ok=True) is None
