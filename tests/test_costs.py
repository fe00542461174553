"""Lesson 02's cost model (``helpers.costs``): the three costs of a decode step, the shrunk copy
that measures the fixed overhead, and the device's rates. Timings are measured, never compared
with a figure: the tests check what the functions compute from them and what they refuse."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.costs import (DeviceRates, StepCost, measure_rates, shrunk_copy, step_cost,
                           step_overhead, weight_bytes)

pytestmark = pytest.mark.usefixtures("one_thread")


class CountOps(TorchDispatchMode):
    """Counts the aten operations a piece of code runs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def decode_ops(model) -> list[str]:
    token = torch.zeros(1, 4, dtype=torch.long)
    with torch.no_grad():
        past = model(input_ids=token, use_cache=True).past_key_values
        with CountOps() as counter:
            model(input_ids=token[:, -1:], past_key_values=past, use_cache=True)
    return counter.ops


@pytest.mark.parametrize("which", ["bundled", "tiny_llama"])
def test_the_shrunk_copy_runs_the_same_operations_on_almost_no_data(which, request):
    """Same layers, heads and vocabulary, a width of 4 numbers a head: the same operations in
    a decode step (what the overhead is), a small share of the weights."""
    model, _ = request.getfixturevalue(which)
    tiny = shrunk_copy(model)
    config, small = model.config, tiny.config
    assert small.num_hidden_layers == config.num_hidden_layers
    assert small.num_attention_heads == config.num_attention_heads
    assert small.hidden_size == 4 * config.num_attention_heads
    assert type(tiny) is type(model) and tiny.device == model.device
    assert decode_ops(tiny) == decode_ops(model)
    assert weight_bytes(tiny) < weight_bytes(model) / 3


def test_weight_bytes_count_a_shared_matrix_once(bundled):
    model, _ = bundled
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    assert weight_bytes(model) == sum(unique.values())


def test_the_step_is_its_largest_cost_and_names_it(bundled):
    model, _ = bundled
    rates = DeviceRates("a device", torch.float32, bandwidth=1e10, compute=1e11)
    small = step_cost(model, 1, rates, overhead=5e-3)
    assert small.read == pytest.approx(weight_bytes(model) / 1e10)
    params = weight_bytes(model) // 4
    assert small.arithmetic == pytest.approx(2 * params / 1e11)
    assert small.bound == "overhead" and small.step == 5e-3
    big = step_cost(model, 4096, rates, overhead=5e-3)
    assert big.arithmetic == pytest.approx(4096 * small.arithmetic)
    assert big.bound == "arithmetic" and big.step == big.arithmetic
    reading = StepCost(1, read=2.0, arithmetic=1.0, overhead=0.5)
    assert reading.bound == "reading weights" and reading.step == 2.0
    for bad in (0, -3, 1.5, True, "8"):
        with pytest.raises(ValueError, match="batch must be a positive integer"):
            step_cost(model, bad, rates, 1e-3)


def test_the_device_rates_and_the_overhead_are_measured(bundled):
    model, _ = bundled
    rates = measure_rates("cpu", torch.float32, repeats=2)
    assert rates.device == "cpu" and rates.dtype == torch.float32
    assert rates.bandwidth > 1e8 and rates.compute > 1e8        # bytes/s and FLOP/s, not ms
    overhead = step_overhead(model, steps=5)
    assert 0 < overhead < 1.0
