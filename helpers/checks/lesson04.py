"""Lesson 04's checks: the learner's ``quantize_tensor``, ``dequantize_tensor`` and
``quantize_channels`` (zero-point 8-bit quantization, per tensor and per channel).

The reference is ``helpers.quantization.quantize`` (the convention of
``torch.quantize_per_tensor``): over the range stretched to contain 0.0,
``scale = (hi - lo) / 255``, an integer ``zero_point = round(-lo / scale)``,
``q = clamp(round(x / scale) + zero_point, 0, 255)`` as uint8, and
``x' = (q - zero_point) * scale``. The cases are the lesson's own weights (a weight matrix of
the model, a LayerNorm gain whose values are all positive) and small edge cases: a tensor of
zeros, a range whose ends fall halfway between two codes (rounding reaches 256 there, so only
the clamp keeps the top code at 255), a vector that holds 0.0 exactly, a 3-D tensor, values
below 0 only. The cases run on the model's device; the per-tensor scale must be a float or a
0-d tensor and the zero point an int, as the lesson formats them and hands them to torch.
"""

from __future__ import annotations

import math

import torch

from ..quantization import quantize
from .core import (Hint, expect_device, expect_like, expect_shape, expect_tensor,
                   expect_unchanged, run_check)

__all__ = ["check_quantize_tensor", "check_dequantize_tensor", "check_quantize_channels",
           "quantize_tensor", "dequantize_tensor", "quantize_channels"]


# ---- the course's versions (the fallbacks), written with the helpers' quantize -------------

def _broadcast_shape(t: torch.Tensor, axis: int) -> list[int]:
    shape = [1] * t.dim()
    shape[axis % t.dim()] = -1
    return shape


def quantize_tensor(t: torch.Tensor):
    """Lesson 04: ``(q, scale, zero_point)`` of ``t``, per tensor: uint8 codes of ``t``'s shape,
    the scale as a 0-d float tensor and the zero point as an int."""
    q, state = quantize(t)
    return q, state.scale[0], int(state.zero_point[0])


def dequantize_tensor(q: torch.Tensor, scale, zero_point) -> torch.Tensor:
    """Lesson 04: ``(q - zero_point) * scale`` in float; scale and zero point may be numbers or
    tensors that broadcast against ``q`` (per channel)."""
    zero_point = torch.as_tensor(zero_point, device=q.device)
    return (q.float() - zero_point) * torch.as_tensor(scale, device=q.device)


def quantize_channels(t: torch.Tensor, axis: int):
    """Lesson 04: ``(q, scale, zero_point)`` with one scale and one zero point per index of
    ``axis``, both shaped to broadcast against ``t`` (1 in every other dimension)."""
    q, state = quantize(t, axis=axis)
    shape = _broadcast_shape(t, axis)
    return q, state.scale.view(shape), state.zero_point.view(shape)


# ---- the cases ------------------------------------------------------------------------------

def _weights(model) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight matrix of the model's blocks (the lesson's ``W`` for the bundled model) and a
    LayerNorm gain (a 1-D parameter whose values are all positive)."""
    named = [(n, p.detach()) for n, p in model.named_parameters() if p.is_floating_point()]
    matrices = [p for n, p in named if p.dim() == 2 and "wte" not in n and "wpe" not in n
                and "embed" not in n and "lm_head" not in n]
    gains = [p for n, p in named if p.dim() == 1 and bool((p > 0).all())]
    lesson_w = [p for n, p in named if n.endswith("h.0.mlp.c_fc.weight")]
    matrix = (lesson_w or [m for m in matrices if m.shape[0] != m.shape[1]] or matrices)[0]
    gain = gains[0] if gains else matrix[0].abs() + 0.5
    return matrix.float(), gain.float()             # on the model's device, as in the lesson


def _tie_matrix() -> torch.Tensor:
    """A small matrix whose range is [-119.5, 135.5] steps of exactly 1/256: both ends sit
    halfway between two codes, round-half-to-even takes both up, and the largest value's code
    comes out as 256 before the clamp."""
    g = torch.Generator().manual_seed(4)
    t = (torch.rand(3, 5, generator=g) * 2 - 1) * 0.4
    t[0, 0], t[2, 4] = -119.5 / 256, 135.5 / 256
    return t


def _small(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _scalar(value, what: str) -> float:
    """The one number in ``value`` (a Python number or a one-element tensor) as a float."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise Hint(f"{what} should be one number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Hint(f"{what} should be a number, got {type(value).__name__}")
    return float(value)


def _expect_scale_type(scale) -> None:
    """The lesson formats the per-tensor scale (f"{scale:.6f}") and passes float(scale) on: a
    Python float or a 0-d tensor does both; a tensor of shape (1,) cannot be formatted."""
    if isinstance(scale, torch.Tensor) and scale.dim() > 0:
        raise Hint(f"the scale is a tensor of shape {tuple(scale.shape)}; per tensor it is one "
                   f"number: a float or a 0-d tensor (t.min() and t.max() without dim= give "
                   f"0-d tensors; scale[0] or .item() makes one), which the lesson prints "
                   f"with a format")


def _triple(got, name: str):
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        size = f" of {len(got)}" if isinstance(got, (tuple, list)) else ""
        kind = f"a {type(got).__name__}{size}"
        raise Hint(f"{name} should return three things, (q, scale, zero_point); got {kind}")
    return got


def _range(t: torch.Tensor, dims=None):
    """(lo, hi): the range of ``t`` (over ``dims``, kept as size 1), stretched to contain 0."""
    if dims is None:
        return t.min().clamp(max=0), t.max().clamp(min=0)
    return t.amin(dim=dims, keepdim=True).clamp(max=0), t.amax(dim=dims, keepdim=True).clamp(min=0)


def _scale_hint(got: torch.Tensor, expected: torch.Tensor, t: torch.Tensor, dims) -> None:
    """Raise a Hint naming the usual cause at the first channel (the only one, per tensor)
    whose scale is wrong. ``got`` and ``expected`` have the same shape."""
    got, expected = got.detach().cpu().double().flatten(), expected.double().flatten()
    bad = ~torch.isclose(got, expected, rtol=1e-5, atol=0)
    if not bad.any():
        return
    i = int(bad.nonzero()[0])
    g, e = got[i].item(), expected[i].item()
    where = "" if dims is None else f" of channel {i}"
    shown = f"scale{where}: got {g:.6g}, expected {e:.6g}"

    def stat(reduce):
        value = reduce(t) if dims is None else reduce(t, dims)
        return value.double().flatten()[i].item()

    tmin = stat(lambda x, *d: x.amin(dim=d[0]) if d else x.min())
    tmax = stat(lambda x, *d: x.amax(dim=d[0]) if d else x.max())
    absmax = max(abs(tmin), abs(tmax))
    lo, hi = min(tmin, 0.0), max(tmax, 0.0)

    def like(value):
        return math.isclose(g, value, rel_tol=1e-5, abs_tol=0)

    if not math.isfinite(g) or (g == 0 and hi == lo):
        raise Hint(f"{shown}: where max = min = 0 (all zeros), (max - min) / 255 is 0 and "
                   f"x / 0 is not a number; use scale 1 where the range is 0")
    if like((tmax - tmin) / 255):
        raise Hint(f"{shown}: the range must contain 0.0: lo = min(min, 0) and "
                   f"hi = max(max, 0) (these values all lie on one side of 0), so that 0.0 has "
                   f"a code")
    if any(like(v) for v in (hi / 255, absmax / 255, tmax / 255, hi / 127.5, absmax / 127.5)):
        raise Hint(f"{shown}: the scale comes from the maximum only; it spans the whole range, "
                   f"(max - min) / 255")
    if like((hi - lo) / 256):
        raise Hint(f"{shown}: divide by 255, the number of steps between 256 codes, not 256")
    raise Hint(f"{shown} = (max - min) / 255 over the range stretched to contain 0.0")


def _expect_scale(got, expected: torch.Tensor, t: torch.Tensor, dims=None) -> None:
    expected, t = expected.cpu(), t.cpu()             # the hints read them on the CPU
    if dims is None:
        value = torch.tensor([_scalar(got, "the scale")], dtype=torch.float64)
        _scale_hint(value, expected.reshape(1), t.double(), None)
        return
    if not isinstance(got, torch.Tensor):
        raise Hint(f"the scale should be a tensor of shape {tuple(expected.shape)}, "
                   f"got {type(got).__name__}")
    _scale_hint(got, expected, t.double(), dims)


def _zero_point_hint(value: float, expected: float, lo: float, scale: float, where: str = "") -> None:
    if not math.isfinite(value):
        raise Hint(f"the zero point{where} is {value}: look at the scale first (a range of 0 "
                   f"needs scale 1)")
    if value != round(value):
        if math.isclose(value, lo, rel_tol=1e-5, abs_tol=1e-12):
            raise Hint(f"the zero point{where} is the minimum ({value:.5g}) itself: it is a code "
                       f"(an integer from 0 to 255), the one that stands for 0.0, "
                       f"round(-min / scale) = {expected:.0f}")
        raise Hint(f"the zero point{where} is {value:.5g}, not an integer code: round it, "
                   f"round(-min / scale) = {expected:.0f}")
    if value != expected:
        if value == -expected or (scale and value == round(lo / scale)):
            raise Hint(f"the zero point{where} is {value:.0f}, expected {expected:.0f}: it is "
                       f"round(-min / scale), with the minus sign (min <= 0, so it lies in 0..255)")
        raise Hint(f"the zero point{where}: got {value:.0f}, expected {expected:.0f} = "
                   f"round(-min / scale)")


def _expect_codes(got, expected: torch.Tensor, t: torch.Tensor, scale: torch.Tensor,
                  zero_point: torch.Tensor, lo: torch.Tensor) -> None:
    """Compare the learner's codes with ours; ties (a value halfway between two codes, where
    the last bit of x / scale decides) may go either way."""
    expect_shape("q (uint8 codes)", got, tuple(expected.shape), " (one code per value of t)")
    expect_device("q", got, t.device)
    got, expected, t = got.detach().cpu(), expected.cpu(), t.cpu()
    scale, zero_point, lo = (torch.as_tensor(v).cpu() for v in (scale, zero_point, lo))
    if got.dtype != torch.uint8:
        if got.is_floating_point() and bool((got != got.round()).any()):
            raise Hint(f"q holds {got.dtype} values that are not whole numbers: round x / scale "
                       f"(torch.round), add the zero point, clamp to [0, 255], then "
                       f".to(torch.uint8)")
        raise Hint(f"q should be uint8 codes, got dtype {got.dtype}: end with .to(torch.uint8) "
                   f"(after the clamp)")
    steps = t / scale
    tie = ((steps - steps.floor()) - 0.5).abs() < 1e-4     # halfway, to float32's rounding
    diff = (got.int() - expected.int()).abs()
    bad = (diff > 1) | ((diff == 1) & ~tie)
    if not bad.any():
        return
    wrapped = ((expected == 255) & (got == 0)) | ((expected == 0) & (got == 255))
    if bool((wrapped & bad).any()):
        index = tuple(int(i) for i in (wrapped & bad).nonzero()[0])
        raise Hint(f"the value {t[index].item():.6g} got code {int(got[index])} instead of "
                   f"{int(expected[index])}: rounding took it just past the end of 0..255 and "
                   f"uint8 wrapped it around; clamp the codes to [0, 255] before .to(torch.uint8)")

    def same(candidate):
        return torch.equal(got, candidate.clamp(0, 255).to(torch.uint8))

    if same((steps + zero_point).floor()) or same(steps.trunc() + zero_point):
        raise Hint("the codes are cut down, not rounded (.to(torch.uint8) drops the fraction): "
                   "round x / scale with torch.round first")
    if same(((t - lo) / scale).round()):
        raise Hint("the codes are round((x - min) / scale), the grid of a float offset; with the "
                   "integer zero point they are round(x / scale) + zero_point, so that 0.0 gets "
                   "exactly the code zero_point")
    expect_tensor("q", got, expected)


def _quantize_cases(model):
    W, gain = _weights(model)
    return [
        (f"a weight matrix of the model {tuple(W.shape)}", W),
        (f"a LayerNorm gain {tuple(gain.shape)}, every value above 0", gain),
        ("a range whose ends fall halfway between two codes", _tie_matrix()),
        ("a tensor of zeros", torch.zeros(4, 3)),
        ("a tensor of values below 0 only", -_tie_matrix().abs() - 0.01),
    ]


# ---- quantize_tensor ------------------------------------------------------------------------

def _quantize_tensor_checker(model):
    cases_list = _quantize_cases(model)

    def checker(learner, cases):
        for label, t in cases_list:
            with cases(label):
                t = t.to(model.device)
                q_ref, state = quantize(t)
                scale, zp = state.scale[0], float(state.zero_point[0])
                given = t.clone()
                q, got_scale, got_zp = _triple(learner(given), "quantize_tensor")
                expect_unchanged("t", t, given)
                lo = t.min().clamp(max=0)
                _expect_scale_type(got_scale)
                _expect_scale(got_scale, scale, t)
                value = _scalar(got_zp, "the zero point")
                _zero_point_hint(value, zp, lo.item(), scale.item())
                if isinstance(got_zp, bool) or not isinstance(got_zp, int):
                    kind = (f"tensor ({str(got_zp.dtype).replace('torch.', '')})"
                            if isinstance(got_zp, torch.Tensor) else type(got_zp).__name__)
                    raise Hint(f"the zero point is {value:g} held in a {kind}: it is a code, "
                               f"so return it as an int (int(...) of the rounded value), as the "
                               f"stub says; the lesson prints it and hands it to "
                               f"torch.quantize_per_tensor")
                _expect_codes(q, q_ref, t, scale, torch.tensor(zp), lo)
    return checker


QUANTIZE_CAUSES = {
    "cannot convert float NaN to integer": "with max = min = 0 (all zeros) the scale is 0 and "
                                           "-min / scale is not a number; use scale 1 where the "
                                           "range is 0",
}


def check_quantize_tensor(learner_quantize_tensor, model):
    """Lesson 04: check the learner's ``quantize_tensor(t) -> (q, scale, zero_point)`` against
    the course's on a weight matrix of ``model``, a LayerNorm gain (all positive), a range that
    rounds past 255 and a tensor of zeros; print one line and return the function the rest of
    the lesson should use."""
    return run_check("quantize_tensor", learner_quantize_tensor,
                     _quantize_tensor_checker(model), fallback=quantize_tensor,
                     causes=QUANTIZE_CAUSES, gpu=True)


# ---- dequantize_tensor ----------------------------------------------------------------------

def _dequantize_checker(model):
    W, _ = _weights(model)
    vector = _small([-1.0, -0.5, 0.0, 0.25, 2.0]).to(W.device)
    q_vec, scale_vec, zp_vec = quantize_tensor(vector)

    cases_list = [
        (f"the codes of a weight matrix {tuple(W.shape)}, scale and zero point of the whole tensor",
         quantize_tensor(W)),
        ("a vector that holds 0.0 exactly", (q_vec, scale_vec, zp_vec)),
        ("the scale as a Python float, the zero point as an int", (q_vec, float(scale_vec), zp_vec)),
        (f"per-channel codes (axis=-1): scale and zero point of shape (1, {W.shape[1]})",
         quantize_channels(W, axis=-1)),
    ]

    def checker(learner, cases):
        for label, (q, scale, zp) in cases_list:
            with cases(label):
                expected = dequantize_tensor(q, scale, zp)
                given = q.clone()
                got = learner(given, scale, zp)
                expect_unchanged("q", q, given)
                expect_shape("the result", got, tuple(expected.shape), " (the shape of q)")
                if not got.is_floating_point():
                    raise Hint(f"the result is {got.dtype}: dequantized values are floats, "
                               f"(q - zero_point) * scale with q.float()")
                expect_like("the dequantized tensor", got, expected)
                got = got.detach().cpu().float()
                expected = expected.cpu()
                s = torch.as_tensor(scale).float().cpu()
                z = torch.as_tensor(zp).float().cpu()
                qc = q.cpu()
                qf = qc.float()

                def like(candidate):
                    return bool(torch.allclose(got, candidate.expand_as(got), rtol=1e-5, atol=1e-7))

                if not like(expected):
                    below = qf < z.expand_as(qf)
                    if bool(below.any()) and like(torch.where(below, expected + 256 * s, expected)):
                        raise Hint("values below 0.0 came back 256 steps too high: q is uint8, "
                                   "so q - zero_point wraps around below 0 (3 - 120 gives 139); "
                                   "turn q into floats first, (q.float() - zero_point) * scale")
                    if like(qf * s):
                        raise Hint("every value is zero_point x scale too high: subtract the zero "
                                   "point from the codes before multiplying, "
                                   "(q - zero_point) * scale")
                    if like((qf + z) * s):
                        raise Hint("the zero point is added: subtract it, (q - zero_point) * scale")
                    if like((qf - z) / s):
                        raise Hint("the codes are divided by the scale: multiply, "
                                   "(q - zero_point) * scale")
                    if like(qf * s - z):
                        raise Hint("the zero point is a code, not a float offset: subtract it "
                                   "from q before multiplying by the scale, (q - zero_point) * scale")
                zero = (qc == torch.as_tensor(zp).cpu().expand_as(qc))
                if bool(zero.any()) and bool((got[zero] != 0).any()):
                    raise Hint(f"the code zero_point stands for 0.0 but came back as "
                               f"{got[zero][got[zero] != 0][0].item():.3g}: compute "
                               f"(q - zero_point) * scale")
                expect_tensor("the dequantized tensor", got, expected, atol=1e-7)
    return checker


DEQUANTIZE_CAUSES = {
    "only one element tensors": "scale and zero_point can be tensors (one per channel): keep them "
                                "as tensors, broadcasting lines them up with q",
    "must match the size": "scale and zero_point broadcast against q as they are: no reshaping",
}


def check_dequantize_tensor(learner_dequantize_tensor, model):
    """Lesson 04: check the learner's ``dequantize_tensor(q, scale, zero_point)`` against
    ``(q - zero_point) * scale`` on a weight matrix's codes, a vector holding 0.0 and
    per-channel scales; print one line and return the function the rest of the lesson should
    use."""
    return run_check("dequantize_tensor", learner_dequantize_tensor, _dequantize_checker(model),
                     fallback=dequantize_tensor, causes=DEQUANTIZE_CAUSES, gpu=True)


# ---- quantize_channels ----------------------------------------------------------------------

def _channel_cases(model):
    W, _ = _weights(model)
    g = torch.Generator().manual_seed(5)
    mixed = torch.randn(4, 6, generator=g) * 0.1
    mixed[1] = 0.0                                 # a channel of zeros (a pruned row)
    mixed[2] = mixed[2].abs() + 0.05               # a channel of positive values only
    mixed[3] = -mixed[3].abs() - 0.05              # a channel of negative values only
    stack = torch.randn(3, 4, 5, generator=g)
    ties = _tie_matrix()
    ties[1, 0], ties[1, 4] = -119.5 / 256, 135.5 / 256     # row 1's top code rounds to 256
    mixed, stack, ties = mixed.to(W.device), stack.to(W.device), ties.to(W.device)
    return [
        (f"a weight matrix {tuple(W.shape)}, one range per column (axis=-1)", W, -1),
        (f"the same matrix, one range per row (axis=0)", W, 0),
        ("a matrix with a row of zeros, one above 0 and one below 0 (axis=0)", mixed, 0),
        ("a row whose range ends fall halfway between two codes (axis=0)", ties, 0),
        ("a 3-D tensor (3, 4, 5), one range per index of axis 1", stack, 1),
        ("a 3-D tensor (3, 4, 5), axis=-1", stack, -1),
    ]


def _quantize_channels_checker(model):
    cases_list = _channel_cases(model)

    def checker(learner, cases):
        for label, t, axis in cases_list:
            with cases(label):
                q_ref, scale, zp = quantize_channels(t, axis)
                a = axis % t.dim()
                dims = [d for d in range(t.dim()) if d != a]
                given = t.clone()
                q, got_scale, got_zp = _triple(learner(given, axis), "quantize_channels")
                expect_unchanged("t", t, given)
                if isinstance(got_scale, torch.Tensor) and got_scale.shape != scale.shape:
                    shape, want = tuple(got_scale.shape), tuple(scale.shape)
                    along = [1 if d == a else n for d, n in enumerate(t.shape)]
                    if got_scale.numel() == 1:
                        raise Hint(f"one scale for the whole tensor: per channel there is one per "
                                   f"index of axis {axis}, shape {want}")
                    if list(shape) == along or (got_scale.numel() == math.prod(along) != scale.numel()):
                        raise Hint(f"the scale has shape {shape}, expected {want}: take min and "
                                   f"max over the other dimensions, not along axis {axis}")
                    if got_scale.numel() == scale.numel():
                        raise Hint(f"the scale has shape {shape}, expected {want}: keep the reduced "
                                   f"dimensions as size 1 (keepdim=True), so that the scale "
                                   f"broadcasts against t")
                    raise Hint(f"the scale has shape {shape}, expected {want}")
                lo, _ = _range(t, dims)
                _expect_scale(got_scale, scale, t, dims)
                expect_like("the scale", got_scale, scale)
                expect_shape("the zero point", got_zp, tuple(zp.shape), ", the shape of the scale")
                expect_device("the zero point", got_zp, zp.device)
                got_z, want_z = got_zp.detach().cpu().double(), zp.cpu().double()
                if not torch.equal(got_z, want_z):
                    i = int((got_z != want_z).flatten().nonzero()[0])
                    _zero_point_hint(got_z.flatten()[i].item(), want_z.flatten()[i].item(),
                                     lo.flatten()[i].item(), scale.flatten()[i].item(),
                                     where=f" of channel {i}")
                if got_zp.is_floating_point() or got_zp.dtype == torch.bool:
                    raise Hint(f"the zero points hold {got_zp.dtype}: they are codes, a tensor "
                               f"of integers, .to(torch.int32)")
                _expect_codes(q, q_ref, t, scale, zp.float(), lo)
    return checker


CHANNEL_CAUSES = {
    "must match the size": "scale and zero point need t's number of dimensions, with 1 in every "
                           "dimension but axis (keepdim=True), to broadcast against t",
    "Dimension out of range": "a negative axis counts from the end: axis % t.dim() gives its "
                              "non-negative index",
}


def check_quantize_channels(learner_quantize_channels, model):
    """Lesson 04: check the learner's ``quantize_channels(t, axis) -> (q, scale, zero_point)``
    against the course's on a weight matrix along both axes, a matrix with a channel of zeros
    and an all-positive channel, and a 3-D tensor; print one line and return the function the
    rest of the lesson should use."""
    return run_check("quantize_channels", learner_quantize_channels,
                     _quantize_channels_checker(model), fallback=quantize_channels,
                     causes=CHANNEL_CAUSES, gpu=True)
