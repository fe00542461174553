"""Eight-bit quantization by hand, what it costs, and how a library does it. (Lesson 04.)

The scheme is zero-point (affine) quantization to unsigned 8-bit integers, written the way
PyTorch (``torch.quantize_per_tensor``) and ONNX (``QuantizeLinear``) write it. For a block of
numbers whose range, stretched to contain 0.0, is [lo, hi] (lo <= 0 <= hi)::

    scale      = (hi - lo) / 255                       # float: the step between two codes
    zero_point = round(-lo / scale)                    # integer: the code that stands for 0.0
    q          = clamp(round(x / scale) + zero_point, 0, 255)     # uint8 codes
    x'         = (q - zero_point) * scale                          # dequantized

so the range spans the codes 0 to 255, 0.0 comes back exactly (as code ``zero_point``), and
every value comes back within half a step (``scale / 2``) of where it was. Writing
``x' = q * scale + offset`` with a float ``offset`` (for instance the minimum itself)
describes the same kind of grid; the integer zero point is the special case
``offset = -zero_point * scale``, which puts 0.0 on the grid and keeps ``q - zero_point`` an
integer (lesson 04 compares the two).

*Per-tensor* quantization uses one ``(scale, zero_point)`` pair for the whole tensor.
*Per-channel* quantization along ``axis`` uses one pair for every index of that axis: for a
weight matrix of shape (rows, cols), ``axis=0`` gives each row its own range and ``axis=1``
each column. A single outlier then only coarsens its own channel, not the whole matrix.

Besides the hand-made path this module has the helpers lesson 04 uses around it: a model's
memory footprint, perplexity on held-out text, torchao's int8 weight-only path; and the
memory-planning arithmetic (GPU memory rule of thumb, KV cache in fp16 versus int8) of the
reading page that goes with the lesson, docs/memory-planning.md.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from .generation import kv_cache_bytes
from .quiet import import_torchao, quiet_stderr


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer from 1 to 8 (codes are stored as uint8), "
                         f"got {bits!r}")
    return 2 ** bits - 1


# --- one tensor ----------------------------------------------------------------------------

@dataclass
class QuantState:
    """What it takes to turn uint8 codes back into floats. (Lesson 04.)

    scale:      float32 tensor, the step between neighbouring codes.
    zero_point: int32 tensor, the code that stands for 0.0 (from 0 to 2**bits - 1).
                Both have one element for per-tensor quantization and one per index of
                ``axis`` for per-channel quantization; ``x' = (q - zero_point) * scale``.
    axis:  None (per-tensor) or the non-negative axis the channels run along.
    dtype: the dtype of the original tensor (``dequantize`` gives it back).
    shape: the shape of the original tensor.
    bits:  how many bits of each code are used (8 unless asked otherwise; codes are uint8).
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    axis: int | None
    dtype: torch.dtype
    shape: torch.Size
    bits: int = 8

    @property
    def nbytes(self) -> int:
        """Bytes of the numbers kept beside the codes: the scales (4 bytes each) and the zero
        points (4 bytes each, stored as int32 for easy arithmetic; a library may keep them in
        one byte, since a zero point is itself a code).

        (The axis, dtype and shape are a few bytes of bookkeeping and are not counted.)
        """
        return _tensor_nbytes(self.scale) + _tensor_nbytes(self.zero_point)

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (scale or zero point) shaped to broadcast against the original tensor."""
        if self.axis is None:
            return t
        view = [1] * len(self.shape)
        view[self.axis] = -1
        return t.view(view)


def _check_tensor(t, what: str = "tensor") -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{what} must be floating point to quantize, got dtype {t.dtype} "
                         f"(it is already made of integers or booleans)")
    if t.numel() == 0:
        raise ValueError(f"{what} is empty (shape {tuple(t.shape)}): there is nothing to quantize")
    if not torch.isfinite(t).all():
        raise ValueError(f"{what} holds NaN or infinity: its range, and so the scale, is undefined")


def _normalize_axis(axis, ndim: int) -> int | None:
    if axis is None:
        return None
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise ValueError(f"axis must be None (per-tensor) or an integer, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for a tensor with {ndim} dimension(s) "
                         f"(valid: {-ndim} to {ndim - 1}, or None for per-tensor)")
    return axis % ndim


def quantize(t: torch.Tensor, axis: int | None = None,
             bits: int = 8) -> tuple[torch.Tensor, QuantState]:
    """Quantize a float tensor to uint8 codes: ``(q, state)``. (Lesson 04.)

    ``q = clamp(round(t / scale) + zero_point, 0, 255)`` with an integer zero point, the
    convention of ``torch.quantize_per_tensor`` / ``torch.quantize_per_channel`` (same codes,
    apart from values within float rounding of a tie: torch multiplies by ``1 / scale``).

    axis: None for one scale and zero point for the whole tensor (per-tensor); an integer
          (negative counts from the end) for one scale and zero point per index of that axis
          (per-channel): ``axis=0`` on a matrix gives every row its own range.
    bits: 8 by default (255 steps). Fewer bits (4 gives 15 steps) make the error, and the
          difference between per-tensor and per-channel, easy to see; the codes are still
          stored one per byte.

    The range of each block is first stretched to contain 0.0 (as PyTorch's observers and
    ONNX do), so 0.0 always has a code: ``zero_point``. Every element comes back from
    ``dequantize(q, state)`` within ``scale / 2`` of its value (plus float rounding), and an
    element equal to 0.0 comes back as exactly 0.0. A block of zeros gets scale 1 and zero
    point 0, with no division by zero. The arithmetic runs in float32 whatever the input
    dtype; ``dequantize`` returns the input dtype.

    Raises ValueError for an empty tensor, a non-floating tensor, a tensor holding NaN or
    infinity, an axis out of range or a number of bits outside 1-8.
    """
    _check_tensor(t)
    levels = _check_bits(bits)
    axis = _normalize_axis(axis, t.dim())
    x = t.detach().float()
    if axis is None:
        lo, hi = x.min().reshape(1), x.max().reshape(1)
    else:
        rows = x.movedim(axis, 0).reshape(x.shape[axis], -1)  # one row per channel
        lo, hi = rows.min(dim=1).values, rows.max(dim=1).values
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)              # the range must contain 0.0
    scale = (hi - lo) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all zeros: any scale works
    # -lo / scale lies in [0, levels]; rounded, it is the code that 0.0 gets.
    zero_point = torch.round(-lo / scale).clamp(0, levels).to(torch.int32)
    state = QuantState(scale=scale, zero_point=zero_point, axis=axis, dtype=t.dtype,
                       shape=t.shape, bits=bits)
    codes = torch.round(x / state._broadcast(scale)) + state._broadcast(zero_point)
    q = codes.clamp(0, levels).to(torch.uint8)
    return q, state


def dequantize(q: torch.Tensor, state: QuantState) -> torch.Tensor:
    """Turn uint8 codes back into floats: ``(q - zero_point) * scale``. (Lesson 04.)"""
    if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8:
        got = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be a uint8 tensor of codes from quantize(), got {got}")
    if q.shape != state.shape:
        raise ValueError(f"q has shape {tuple(q.shape)} but the state was made for "
                         f"shape {tuple(state.shape)}")
    # q.float() first: uint8 minus a zero point would wrap around below 0
    x = (q.float() - state._broadcast(state.zero_point)) * state._broadcast(state.scale)
    return x.to(state.dtype)


# --- a whole model -------------------------------------------------------------------------

def _axis_for(param: torch.Tensor, axis: int | None) -> int | None:
    """The axis a parameter is quantized along: per-channel only for 2-D and larger tensors.

    A 1-D parameter (bias, LayerNorm scale) per channel would need a scale and a zero point
    (8 bytes) for every 1-byte code, so 1-D parameters always fall back to per-tensor.
    """
    return axis if axis is not None and param.dim() >= 2 else None


def quantize_model(model: nn.Module, axis: int | None = None, bits: int = 8,
                   inplace: bool = False,
                   select=None) -> tuple[nn.Module, dict[str, QuantState]]:
    """Quantize the floating-point parameters of ``model`` to uint8: ``(model, states)``.
    (Lesson 04.)

    The returned model really holds uint8 tensors (each quantized parameter's data is replaced
    by its codes), so ``footprint`` measures what 8-bit storage costs. It cannot run until
    ``dequantize_model`` turns the codes back into floats. ``states`` maps each quantized
    parameter's name to its ``QuantState``.

    axis:    None for per-tensor; an integer for per-channel along that axis of every
             parameter with two or more dimensions (1-D parameters stay per-tensor, see
             ``_axis_for``). For GPT-2's ``Conv1D`` weights (in, out) ``axis=-1`` is one
             range per output feature; for ``nn.Linear`` (out, in) that is ``axis=0``.
    bits:    8 by default; see ``quantize``.
    inplace: False (the default) quantizes a deep copy and leaves ``model`` as it was, so a
             notebook cell can be run twice; True changes ``model`` itself.
    select:  None (the default) quantizes every floating-point parameter; a function
             ``select(name, param) -> bool`` quantizes only those it returns True for and
             leaves the rest in float, as libraries leave LayerNorms and embeddings:
             ``select=lambda name, p: p.dim() == 2 and ".h." in name`` takes only the
             weight matrices of GPT-2's blocks.

    Tied parameters (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) are one
    tensor and are quantized once, under the first name ``named_parameters`` gives them
    (``select`` sees GPT-2's output head as ``transformer.wte.weight``). Buffers are left as
    they are.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if select is not None and not callable(select):
        raise ValueError(f"select must be None or a function (name, param) -> bool, "
                         f"got {select!r}")

    def wanted(name, p):
        return p.is_floating_point() and (select is None or bool(select(name, p)))

    targets = [(name, p) for name, p in model.named_parameters() if wanted(name, p)]
    if not targets:
        raise ValueError("model has no floating-point parameters to quantize (was it "
                         "quantized already, or does select return False for all of them?)")
    _check_bits(bits)
    for name, p in targets:  # check everything before changing anything
        _check_tensor(p, f"parameter {name!r}")
        try:
            _normalize_axis(_axis_for(p, axis), p.dim())
        except ValueError as err:
            raise ValueError(f"parameter {name!r} (shape {tuple(p.shape)}): {err}") from None
    if not inplace:
        model = copy.deepcopy(model)
    states = {}
    for name, p in model.named_parameters():
        if not wanted(name, p):
            continue
        q, states[name] = quantize(p.data, _axis_for(p, axis), bits)
        p.requires_grad_(False)  # integer tensors cannot require gradients
        p.data = q
    return model, states


def dequantize_model(model: nn.Module, states: dict[str, QuantState],
                     inplace: bool = False) -> nn.Module:
    """Turn the uint8 codes of a ``quantize_model`` model back into floats. (Lesson 04.)

    Returns a model that runs again, with every quantized parameter carrying its quantization
    error. Those parameters do not require gradients (it is meant for inference). ``inplace``
    as in ``quantize_model``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not states:
        raise ValueError("states is empty: pass the states that quantize_model returned")
    params = dict(model.named_parameters())
    for name, state in states.items():
        p = params.get(name)
        if p is None:
            raise ValueError(f"the model has no parameter {name!r}: were these states made "
                             f"for another model?")
        if p.dtype != torch.uint8:
            raise ValueError(f"parameter {name!r} is {p.dtype}, not uint8 codes: was the model "
                             f"quantized with quantize_model (or dequantized already)?")
        if p.shape != state.shape:
            raise ValueError(f"parameter {name!r} has shape {tuple(p.shape)} but its state was "
                             f"made for shape {tuple(state.shape)}")
    if not inplace:
        model = copy.deepcopy(model)
        params = dict(model.named_parameters())
    for name, state in states.items():
        params[name].data = dequantize(params[name].data, state)
    return model


def quantization_errors(model: nn.Module, axis: int | None = None,
                        bits: int = 8) -> dict[str, float]:
    """Mean absolute round-trip error of every floating parameter, by name. (Lesson 04.)

    Uses the same per-parameter choice of axis as ``quantize_model``; the model is not changed.
    """
    errors = {}
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.numel() > 0:
            q, state = quantize(p.data, _axis_for(p, axis), bits)
            errors[name] = (dequantize(q, state).float() - p.data.float()).abs().mean().item()
    return errors


# --- memory --------------------------------------------------------------------------------

def _tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor's storage really takes.

    Quantized tensors from libraries such as torchao are tensor subclasses that report the
    dtype of the float tensor they stand for; their bytes are those of the plain tensors
    inside them (codes, scales, zero points), which ``__tensor_flatten__`` names.
    """
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def footprint(model: nn.Module, states: dict[str, QuantState] | None = None) -> dict[str, int]:
    """Bytes of a model's parameters and buffers, and of its quantization states. (Lesson 04.)

    Returns ``{"parameters", "buffers", "states", "total"}``, all in bytes. A tied parameter
    counts once. Parameters that ``quantize_model`` turned into codes count one byte each; the
    quantized tensors of torchao count the bytes of their codes, scales and zero points.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = sum(_tensor_nbytes(p) for p in model.parameters())  # parameters() skips tied copies
    buffers = sum(_tensor_nbytes(b) for b in model.buffers())
    state_bytes = sum(s.nbytes for s in (states or {}).values())
    return {"parameters": params, "buffers": buffers, "states": state_bytes,
            "total": params + buffers + state_bytes}


# --- quality: perplexity -------------------------------------------------------------------

@torch.no_grad()
def perplexity(model, tokenizer, texts: list[str], max_length: int | None = None,
               batch_size: int = 16, prepend_bos: bool = True) -> float:
    """Perplexity of ``model`` on ``texts``: exp of the mean negative log-likelihood per
    predicted token, over all texts together (long texts weigh more). (Lesson 04.)

    max_length:  tokens kept per text (default: the model's context length).
    prepend_bos: start every text with the BOS token (EOS when there is none, as GPT-2 does)
                 so that its first token is predicted too, the way the model saw documents
                 in training (each one after an end-of-text token).

    Texts are batched with padding on the right and an attention mask; padded positions do
    not count. Raises ValueError when ``texts`` is empty or has no token to predict, and when
    the model still holds uint8 codes from ``quantize_model``.
    """
    if isinstance(texts, str) or not texts:
        raise ValueError("texts must be a non-empty list of strings")
    if any(p.dtype == torch.uint8 for p in model.parameters()):
        raise ValueError("the model holds uint8 codes: call dequantize_model(model, states) "
                         "before running it")
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if max_length is None:
        max_length = getattr(model.config, "max_position_embeddings", None) or 1024
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sequences = []
    for ids in tokenizer(list(texts), add_special_tokens=False).input_ids:
        if prepend_bos and bos is not None:
            ids = [bos] + ids
        sequences.append(ids[:max_length])

    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, s in enumerate(chunk):
            ids[row, :len(s)] = torch.tensor(s, dtype=torch.long)
            mask[row, :len(s)] = 1
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)  # -100: not counted
        total_nll += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
            ignore_index=-100, reduction="sum").item()
        total_tokens += int((targets != -100).sum())
    if total_tokens == 0:
        raise ValueError("texts contain no token to predict (each needs at least two tokens, "
                         "counting the BOS token)")
    return math.exp(total_nll / total_tokens)


# --- in practice: torchao ------------------------------------------------------------------

def conv1d_to_linear(model: nn.Module) -> int:
    """Replace every transformers ``Conv1D`` in ``model`` by the equivalent ``nn.Linear``, in
    place; return how many were replaced. (Lesson 04.)

    GPT-2 computes its projections with ``Conv1D``, which is a linear layer whose weight is
    stored transposed, (in, out). Library quantizers look for ``nn.Linear`` and pass Conv1D
    by; after this they find it. The outputs are unchanged.
    """
    from transformers.pytorch_utils import Conv1D

    replaced = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                n_in, n_out = child.weight.shape
                linear = nn.Linear(n_in, n_out, bias=child.bias is not None,
                                   device=child.weight.device, dtype=child.weight.dtype)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    if child.bias is not None:
                        linear.bias.copy_(child.bias)
                setattr(parent, child_name, linear)
                replaced += 1
    return replaced


def _tied_weight_ids(model: nn.Module) -> set[int]:
    """ids of parameters that more than one module holds (tied weights)."""
    seen, tied = set(), set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            (tied if id(p) in seen else seen).add(id(p))
    return tied


def torchao_int8_weight_only(model: nn.Module, quantize_tied: bool = False) -> nn.Module:
    """A deep copy of ``model`` with its linear layers quantized by torchao to int8
    weight-only (int8 weights with one scale per output feature; activations stay float).
    (Lesson 04.)

    GPT-2's ``Conv1D`` layers are first turned into ``nn.Linear`` (``conv1d_to_linear``):
    torchao's ``quantize_`` only looks for ``nn.Linear`` and would otherwise quantize
    nothing but the output head.

    quantize_tied: a linear layer whose weight is tied to another module (GPT-2's
        ``lm_head``, tied to the token embedding) is left in float by default. Quantizing it
        would untie it: the embedding would keep its float copy and the int8 copy would come
        on top, so the model would grow.
    """
    import_torchao()
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = copy.deepcopy(model)
    conv1d_to_linear(model)
    tied = set() if quantize_tied else _tied_weight_ids(model)

    def wanted(module, _fqn):
        return isinstance(module, nn.Linear) and id(module.weight) not in tied

    with quiet_stderr():  # the first call may still import (and log from) more of torchao
        quantize_(model, Int8WeightOnlyConfig(), filter_fn=wanted)
    return model


# --- memory planning -----------------------------------------------------------------------

#: Llama-2-70B's shape, for the memory arithmetic: 80 layers of width 8192, 64 attention
#: heads of 128, and grouped-query attention with 8 key/value heads (keys 1024 wide).
LLAMA2_70B = {"n_params": 70e9, "n_layers": 80, "hidden": 8192, "n_heads": 64, "kv_heads": 8}


def gpu_memory_estimate(n_params: float, bytes_per_param: float = 2) -> dict[str, float]:
    """The rule of thumb for serving a model: bytes of weights, and of GPU memory at least
    (weights × 1.25) and recommended (weights × 1.5). (Lesson 04's reading page,
    docs/memory-planning.md.)

    The 25-50 % on top is room for the KV cache, activations and the framework. At 16 bits
    (2 bytes a parameter) a 7B model needs at least 17.5 GB and better 21 GB.
    """
    if n_params <= 0 or bytes_per_param <= 0:
        raise ValueError(f"n_params and bytes_per_param must be positive, got "
                         f"{n_params!r} and {bytes_per_param!r}")
    weights = n_params * bytes_per_param
    return {"weights": weights, "minimum": weights * 1.25, "recommended": weights * 1.5}


def kv_cache_plan(batches=(1, 16, 32, 64), seq_len: int = 1024,
                  model: dict | None = None) -> list[dict[str, float]]:
    """KV-cache bytes in fp16 and int8 for each batch size, with and without grouped-query
    attention (GQA). (Lesson 04's reading page, docs/memory-planning.md; the formula is
    lesson 01's ``kv_cache_bytes``.)

    model: a dict like ``LLAMA2_70B`` (the default) with n_layers, hidden, n_heads, kv_heads.

    Without GQA the keys are ``hidden`` wide; with it only ``hidden × kv_heads / n_heads``
    wide (1024 instead of 8192 for Llama-2-70B), so the real cache is that many times smaller.
    Each row: batch, fp16, int8, fp16_gqa, int8_gqa (bytes).
    """
    m = LLAMA2_70B if model is None else model
    for key in ("n_layers", "hidden", "n_heads", "kv_heads"):
        if key not in m:
            raise ValueError(f"model must give {key!r} (see LLAMA2_70B), got keys {sorted(m)}")
    kv_hidden = m["hidden"] * m["kv_heads"] // m["n_heads"]
    rows = []
    for batch in batches:
        row = {"batch": batch}
        for label, width in (("", m["hidden"]), ("_gqa", kv_hidden)):
            row["fp16" + label] = kv_cache_bytes(m["n_layers"], width, seq_len, batch, 2)
            row["int8" + label] = kv_cache_bytes(m["n_layers"], width, seq_len, batch, 1)
        rows.append(row)
    return rows
