"""Lesson 04's checks pass the course's functions, say "not written yet" for a stub, and catch
the mistakes learners make in zero-point quantization (per tensor and per channel) and in
dequantization, each with a hint at its symptom."""

import time

import pytest
import torch

from helpers.checks import check_dequantize_tensor, check_quantize_channels, check_quantize_tensor
from helpers.checks.lesson04 import dequantize_tensor, quantize_channels, quantize_tensor
from tests.answers import Exercise
from tests.checking import assert_caught, assert_not_written, assert_passes, run

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- quantize_tensor: the right answer, as a learner writes it, and typical mistakes ---------

def _quantize(t, stretch=True, zero_point="round", clamp=True, rounding="round", scale_from="range",
              grid="zero_point", zeros=True):
    lo, hi = (t.min().clamp(max=0), t.max().clamp(min=0)) if stretch else (t.min(), t.max())
    if stretch == "low end only":
        hi = t.max()
    scale = {"range": (hi - lo) / 255, "max": t.abs().max() / 255, "256": (hi - lo) / 256}[scale_from]
    if zeros and scale == 0:
        scale = torch.tensor(1.0)
    z = {"round": int(torch.round(-lo / scale)), "min": float(lo), "unrounded": float(-lo / scale),
         "sign": int(torch.round(lo / scale))}[zero_point]
    steps = (t - lo) / scale if grid == "min" else t / scale
    steps = torch.round(steps) if rounding == "round" else steps
    codes = steps if grid == "min" else steps + z
    if clamp:
        codes = codes.clamp(0, 255)
    return codes.to(torch.uint8), scale, z


def quantize_as_a_learner_writes_it(t):
    return _quantize(t)


def zero_point_is_the_minimum(t):
    return _quantize(t, zero_point="min")


def zero_point_not_rounded(t):
    return _quantize(t, zero_point="unrounded")


def zero_point_with_the_wrong_sign(t):
    return _quantize(t, zero_point="sign")


def codes_not_clamped(t):
    return _quantize(t, clamp=False)


def codes_not_rounded(t):
    return _quantize(t, rounding="none")


def scale_from_the_maximum_only(t):
    return _quantize(t, scale_from="max")


def scale_over_256(t):
    return _quantize(t, scale_from="256")


def range_not_stretched_to_zero(t):
    return _quantize(t, stretch=False)


def codes_from_the_minimum(t):
    return _quantize(t, grid="min")


def zeros_divide_by_zero(t):
    return _quantize(t, zeros=False)


def codes_left_in_float(t):
    q, scale, z = _quantize(t)
    return q.float(), scale, z


def zero_point_left_as_a_float_tensor(t):
    q, scale, z = _quantize(t)
    return q, scale, torch.round(-t.min().clamp(max=0) / scale)     # right value, float dtype


def range_stretched_at_the_low_end_only(t):
    return _quantize(t, stretch="low end only")


def scale_as_a_one_element_tensor(t):
    q, scale, z = _quantize(t)
    return q, scale.reshape(1), z


def zero_point_as_an_integer_tensor(t):
    q, scale, z = _quantize(t)
    return q, scale, torch.tensor(z)


def quantize_dividing_t_in_place(t):
    q, scale, z = _quantize(t)
    t /= scale                                        # the lesson's W would change
    return q, scale, z


def quantize_with_python_numbers(t):
    """Right, written another way: Python floats and ints (double precision, then float32)."""
    lo, hi = min(t.min().item(), 0.0), max(t.max().item(), 0.0)
    scale = (hi - lo) / 255 or 1.0
    zero_point = round(-lo / scale)
    return (t / scale).round().add(zero_point).clamp(0, 255).to(torch.uint8), scale, zero_point


def quantize_ties_the_other_way(t):
    """Right: multiplies by 1 / scale, as torch does on a CPU, so that a value halfway between
    two codes may round the other way."""
    q, scale, z = quantize_tensor(t)
    return (torch.round(t * (1 / scale)) + z).clamp(0, 255).to(torch.uint8), scale, z


def quantize_floor_near_halfway(t):
    q, scale, z = quantize_tensor(t)
    steps = t / scale
    near = ((steps - steps.floor()) - 0.5).abs() < 1e-2            # not only at a tie
    return torch.where(near, (steps.floor() + z).clamp(0, 255).to(torch.uint8), q), scale, z


QUANTIZE_MISTAKES = {
    zero_point_left_as_a_float_tensor: "return it as an int",
    zero_point_is_the_minimum: "is the minimum (-0.",
    zero_point_not_rounded: "not an integer code: round it",
    zero_point_with_the_wrong_sign: "with the minus sign",
    codes_not_clamped: "clamp the codes to [0, 255]",
    codes_not_rounded: "cut down, not rounded",
    scale_from_the_maximum_only: "from the maximum only",
    scale_over_256: "divide by 255",
    range_not_stretched_to_zero: "the range must contain 0.0",
    codes_from_the_minimum: "round((x - min) / scale)",
    zeros_divide_by_zero: "use scale 1 where the range is 0",
    codes_left_in_float: "should be uint8 codes",
    range_stretched_at_the_low_end_only: "the range must contain 0.0",
    scale_as_a_one_element_tensor: "the scale is a tensor of shape (1,)",
    zero_point_as_an_integer_tensor: "held in a tensor (int64): it is a code, so return it as an int",
    quantize_dividing_t_in_place: "changed its input t in place",
    quantize_floor_near_halfway: "differs at",
}


# ---- dequantize_tensor -----------------------------------------------------------------------

def dequantize_as_a_learner_writes_it(q, scale, zero_point):
    return (q.float() - zero_point) * scale


def dequantize_without_the_zero_point(q, scale, zero_point):
    return q.float() * scale


def dequantize_in_uint8(q, scale, zero_point):
    return (q - zero_point) * scale          # uint8 - int stays uint8: wraps below 0


def dequantize_adding_the_zero_point(q, scale, zero_point):
    return (q.float() + zero_point) * scale


def dequantize_dividing_by_the_scale(q, scale, zero_point):
    return (q.float() - zero_point) / scale


def dequantize_per_tensor_only(q, scale, zero_point):
    return (q.float() - int(zero_point)) * float(scale)


def dequantize_in_double_precision(q, scale, zero_point):
    return (q.double() - zero_point) * scale


def dequantize_through_int32(q, scale, zero_point):
    """Right, written another way: integers first, floats when the scale multiplies."""
    return (q.to(torch.int32) - zero_point) * scale


DEQUANTIZE_MISTAKES = {
    dequantize_without_the_zero_point: "subtract the zero point",
    dequantize_in_uint8: "wraps around below 0",
    dequantize_adding_the_zero_point: "the zero point is added",
    dequantize_dividing_by_the_scale: "divided by the scale",
    dequantize_per_tensor_only: "keep them as tensors",
    dequantize_in_double_precision: "holds float64 (torch.double), expected float32",
}


# ---- quantize_channels -----------------------------------------------------------------------

def _channels(t, axis, over="others", keepdim=True, stretch=True, round_zero_point=True,
              zeros=True, zero_point_dtype=torch.int32):
    a = axis % t.dim()
    dims = [d for d in range(t.dim()) if d != a] if over == "others" else [a]
    lo, hi = t.amin(dim=dims, keepdim=True), t.amax(dim=dims, keepdim=True)
    if stretch:
        lo = lo.clamp(max=0)
        hi = hi if stretch == "low end only" else hi.clamp(min=0)
    scale = (hi - lo) / 255
    if zeros:
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    z = torch.round(-lo / scale) if round_zero_point else lo
    q = (torch.round(t / scale) + z).clamp(0, 255).to(torch.uint8)
    if not keepdim:
        scale, z = scale.flatten(), z.flatten()
    return q, scale, z.to(zero_point_dtype) if round_zero_point else z


def channels_as_a_learner_writes_it(t, axis):
    return _channels(t, axis)


def channels_along_the_wrong_axis(t, axis):
    return _channels(t, axis, over="axis")


def channels_without_keepdim(t, axis):
    return _channels(t, axis, keepdim=False)


def channels_not_stretched_to_zero(t, axis):
    return _channels(t, axis, stretch=False)


def channels_zero_point_is_the_minimum(t, axis):
    return _channels(t, axis, round_zero_point=False)


def channels_of_zeros_divide_by_zero(t, axis):
    return _channels(t, axis, zeros=False)


def channels_one_scale_for_all(t, axis):
    q, scale, z = quantize_tensor(t)
    return q, scale, z


def channels_stretched_at_the_low_end_only(t, axis):
    return _channels(t, axis, stretch="low end only")


def channels_zero_points_in_float(t, axis):
    return _channels(t, axis, zero_point_dtype=torch.float32)


def channels_zero_points_in_int64(t, axis):
    """Right, written another way: int64 zero points work as well as int32."""
    return _channels(t, axis, zero_point_dtype=torch.int64)


def channels_one_row_per_channel(t, axis):
    """Right, written another way: each channel flattened into one row."""
    a = axis % t.dim()
    rows = t.movedim(a, 0).reshape(t.shape[a], -1)
    lo, hi = rows.min(1).values.clamp(max=0), rows.max(1).values.clamp(min=0)
    scale = (hi - lo) / 255
    scale[scale == 0] = 1
    shape = [1] * t.dim()
    shape[a] = -1
    scale, zero_point = scale.view(shape), torch.round(-lo / scale.flatten()).int().view(shape)
    return (torch.round(t / scale) + zero_point).clamp(0, 255).to(torch.uint8), scale, zero_point


CHANNEL_MISTAKES = {
    channels_along_the_wrong_axis: "over the other dimensions, not along axis -1",
    channels_without_keepdim: "keepdim=True",
    channels_not_stretched_to_zero: "the range must contain 0.0",
    channels_zero_point_is_the_minimum: "is the minimum (-0.",
    channels_of_zeros_divide_by_zero: "use scale 1 where the range is 0",
    channels_one_scale_for_all: "one scale for the whole tensor",
    channels_stretched_at_the_low_end_only: "the range must contain 0.0",
    channels_zero_points_in_float: "the zero points hold torch.float32: they are codes",
}


# ---- the tests -------------------------------------------------------------------------------

def test_quantize_check_passes_the_course_function_quickly(bundled):
    start = time.perf_counter()
    assert_passes(check_quantize_tensor, quantize_tensor, bundled[0])
    assert time.perf_counter() - start < 10   # ≤ 2 s on a quiet 2-core machine


def test_quantize_check_passes_right_answers_written_otherwise(bundled):
    for right in EXERCISES[0].right:
        assert_passes(check_quantize_tensor, right, bundled[0])


def test_quantize_check_says_not_written_for_a_stub(bundled):
    assert_not_written(check_quantize_tensor, bundled[0], fallback=quantize_tensor)


@pytest.mark.parametrize("mistake", QUANTIZE_MISTAKES, ids=lambda f: f.__name__)
def test_quantize_check_catches(mistake, bundled):
    assert_caught(check_quantize_tensor, mistake, bundled[0], symptom=QUANTIZE_MISTAKES[mistake],
                  fallback=quantize_tensor)


def test_dequantize_check_passes_the_course_function(bundled):
    assert_passes(check_dequantize_tensor, dequantize_tensor, bundled[0])
    for right in EXERCISES[1].right:
        assert_passes(check_dequantize_tensor, right, bundled[0])


def test_dequantize_check_says_not_written_for_a_stub(bundled):
    assert_not_written(check_dequantize_tensor, bundled[0], fallback=dequantize_tensor)


@pytest.mark.parametrize("mistake", DEQUANTIZE_MISTAKES, ids=lambda f: f.__name__)
def test_dequantize_check_catches(mistake, bundled):
    assert_caught(check_dequantize_tensor, mistake, bundled[0],
                  symptom=DEQUANTIZE_MISTAKES[mistake], fallback=dequantize_tensor)


def test_channels_check_passes_the_course_function(bundled):
    assert_passes(check_quantize_channels, quantize_channels, bundled[0])
    assert_passes(check_quantize_channels, channels_as_a_learner_writes_it, bundled[0])


def test_channels_check_passes_right_answers_written_otherwise(bundled):
    for right in EXERCISES[2].right:
        assert_passes(check_quantize_channels, right, bundled[0])


def test_channels_check_says_not_written_for_a_stub(bundled):
    assert_not_written(check_quantize_channels, bundled[0], fallback=quantize_channels)


@pytest.mark.parametrize("mistake", CHANNEL_MISTAKES, ids=lambda f: f.__name__)
def test_channels_check_catches(mistake, bundled):
    assert_caught(check_quantize_channels, mistake, bundled[0], symptom=CHANNEL_MISTAKES[mistake],
                  fallback=quantize_channels)


def test_the_fallbacks_agree_with_the_helpers(bundled):
    from helpers import dequantize, quantize

    W = bundled[0].transformer.h[0].mlp.c_fc.weight.detach()
    q, scale, z = quantize_tensor(W)
    q_ref, state = quantize(W)
    assert torch.equal(q, q_ref) and isinstance(z, int)
    assert torch.equal(dequantize_tensor(q, scale, z), dequantize(q_ref, state))
    q, scale, z = quantize_channels(W, axis=-1)
    q_ref, state = quantize(W, axis=-1)
    assert scale.shape == z.shape == (1, W.shape[1])
    assert torch.equal(dequantize_tensor(q, scale, z), dequantize(q_ref, state))


def test_a_wrong_return_is_one_line_without_a_traceback(bundled):
    line, returned = run(check_quantize_tensor, lambda t: t, bundled[0])
    assert "three things" in line and returned is quantize_tensor


def quantize_codes_on_the_cpu(t):
    q, scale, z = _quantize(t)
    return q.cpu(), scale, z


EXERCISES = [
    Exercise("quantize_tensor", check_quantize_tensor, ("model",), quantize_tensor,
             right=[quantize_as_a_learner_writes_it, quantize_with_python_numbers,
                    quantize_ties_the_other_way],
             wrong={**QUANTIZE_MISTAKES,
                    quantize_codes_on_the_cpu: "make every new tensor on the inputs' device"}),
    Exercise("dequantize_tensor", check_dequantize_tensor, ("model",), dequantize_tensor,
             right=[dequantize_as_a_learner_writes_it, dequantize_through_int32],
             wrong=DEQUANTIZE_MISTAKES),
    Exercise("quantize_channels", check_quantize_channels, ("model",), quantize_channels,
             right=[channels_as_a_learner_writes_it, channels_zero_points_in_int64,
                    channels_one_row_per_channel],
             wrong=CHANNEL_MISTAKES),
]
