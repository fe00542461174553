"""The machinery the learners' checks share (helpers/checks/core.py, counting.py): comparisons
that name a dtype or a device difference, answers of another type refused, a device error named
as such, and the counts of matrix products (the same as torch's own FlopCounterMode)."""

import re

import pytest
import torch

from helpers.checks.core import (DEVICES_MET, Hint, OnTheGpu, expect_int_list, expect_like,
                                 expect_number, expect_tensor, expect_unchanged, made_on_host,
                                 run_check, snapshot)
from helpers.checks.counting import CountCalls, flops
from tests.checking import run


def test_expect_tensor_names_a_dtype_difference():
    with pytest.raises(Hint, match=r"the mask holds float32 \(torch.float\), expected int64 \(torch.long\)"):
        expect_tensor("the mask", torch.ones(2, 3), torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(Hint, match="holds float64"):
        expect_tensor("x", torch.ones(2, dtype=torch.float64), torch.ones(2))


def test_expect_tensor_names_a_device_difference():
    # A tensor on the meta device stands for one on a GPU: no values, another device.
    with pytest.raises(Hint, match="the ids is on meta, expected cpu"):
        expect_like("the ids", torch.zeros(2, 3, device="meta"), torch.zeros(2, 3))


def test_expect_tensor_still_names_the_first_value_that_differs():
    with pytest.raises(Hint, match="differs at row 1, column 2: got 5, expected 0"):
        expect_tensor("t", torch.tensor([[0, 0, 0], [0, 0, 5]]), torch.zeros(2, 3, dtype=torch.long))
    expect_tensor("t", torch.ones(2), torch.ones(2))


def test_answers_of_another_type_are_refused_not_converted():
    assert expect_number("n", 3) == 3.0 and expect_number("n", 2.5) == 2.5
    for bad, said in (("3", "got str"), (torch.tensor(3.0), "use .item()"), (True, "got bool")):
        with pytest.raises(Hint, match=said):
            expect_number("n", bad)
    assert expect_int_list("ids", [1, 2]) == [1, 2]
    for bad, said in ((torch.tensor([1]), "got a tensor"), ((1, 2), "got tuple"),
                      ([1.0], "holds float values"), ([torch.tensor(1)], "append int")):
        with pytest.raises(Hint, match=said):
            expect_int_list("ids", bad)


def test_an_input_changed_in_place_is_named():
    expect_unchanged("x", torch.ones(2), torch.ones(2))
    with pytest.raises(Hint, match="changed its input x in place"):
        expect_unchanged("x", torch.ones(2), torch.zeros(2))


def test_two_devices_meeting_is_named_as_the_cause():
    def checker(learner, cases):
        with cases("a case"):
            learner()

    def meeting():
        raise RuntimeError("Expected all tensors to be on the same device, but found at least "
                           "two devices, cuda:0 and cpu!")

    line, returned = run(lambda f: run_check("f", f, checker, fallback=None), meeting)
    assert line.startswith("✗") and DEVICES_MET in line and returned is None


def test_products_are_counted_as_flop_counter_mode_counts_them():
    from torch.utils.flop_counter import FlopCounterMode
    from transformers.pytorch_utils import Conv1D

    x, A, B = torch.randn(2, 3, 16), torch.randn(16, 2), torch.randn(2, 48)
    xa, a, b = torch.randn(4, 3, 16), torch.randn(4, 16, 2), torch.randn(4, 2, 48)
    linear, conv = torch.nn.Linear(16, 48), Conv1D(48, 16)
    for fn in (lambda: x @ A @ B, lambda: x @ (A @ B), lambda: linear(x), lambda: conv(x),
               lambda: torch.bmm(torch.bmm(xa, a), b), lambda: torch.matmul(xa, a),
               lambda: torch.einsum("bsi,bir->bsr", xa, a)):
        with FlopCounterMode(display=False) as counter:
            fn()
        assert flops(fn)[1] == counter.get_total_flops() > 0


def test_calls_are_counted_and_grow_with_a_python_loop():
    x = torch.randn(8, 4)
    with CountCalls() as once:
        x.sum(dim=1)
    with CountCalls() as looped:
        torch.stack([x[i].sum() for i in range(8)])
    assert once.calls == 1 and looped.calls == 17 and once.products == 0


def test_a_case_that_stands_for_a_gpu_marks_what_is_made_on_the_cpu():
    x = torch.ones(2, 3)                                # a tensor of the case: "on the GPU"
    with OnTheGpu():
        made = torch.zeros(2, 3)                        # no device=: on the CPU
        moved = torch.zeros(2, 3).to(x.device)
        kept = torch.zeros(2, 3, device=x.device)
        like = torch.zeros_like(x) + x.new_ones(2, 3)
        scalar = x * torch.tensor(2.0)                  # a 0-d CPU tensor may meet a GPU one
        picked = x[torch.tensor([1, 0])]                # and index it
        copied, doubled = x.cpu(), made * 2
        with pytest.raises(Hint, match="a tensor made on the CPU met one on the GPU"):
            torch.cat([x, made])
    assert made_on_host(made) and made_on_host(doubled) and made_on_host(copied)
    assert not any(made_on_host(t) for t in (x, moved, kept, like, scalar, picked))
    with pytest.raises(Hint, match="make every new tensor on the inputs' device"):
        expect_tensor("the result", made, torch.zeros(2, 3))


def test_a_model_fed_a_tensor_made_on_the_cpu_is_named():
    model = torch.nn.Embedding(10, 4)
    with OnTheGpu(model):
        model(torch.tensor([1, 2]).to(model.weight.device))
        with pytest.raises(Hint, match="the model was fed input_ids made on the CPU"):
            model(torch.tensor([1, 2]))


@pytest.mark.parametrize("change, said", [
    (lambda v: v["ids"].append(4), "['ids'] went from 3 to 4 items"),
    (lambda v: v.pop("mask"), "lost the key 'mask'"),
    (lambda v: v["mask"].add_(1), "['mask'] holds other values"),
])
def test_an_input_changed_deep_inside_is_named(change, said):
    given = {"ids": [1, 2, 3], "mask": torch.ones(3)}
    before = snapshot(given)
    expect_unchanged("request", before, given)
    change(given)
    with pytest.raises(Hint, match=re.escape(said)):
        expect_unchanged("request", before, given)
