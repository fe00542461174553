"""Lesson 05's checks pass the course's LoraLayer and merge, say "not written yet" for a stub,
and catch the mistakes learners make in LoRA's forward and in merging an adapter into a
weight, each with a hint at its symptom."""

import time

import pytest
import torch
from torch import nn

import helpers.lora
from helpers.checks import check_lora_layer, check_merge_lora
from helpers.checks.lesson05 import merge_lora
from tests.answers import Exercise
from tests.checking import assert_caught, assert_not_written, assert_passes, run

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- LoraLayer: the lesson's class with one forward or another -------------------------------

def _lora_class(forward):
    return type(forward.__name__, (helpers.lora.LoraLayer,), {"forward": forward})


def forward_as_a_learner_writes_it(self, x):
    detour = (x @ self.A) @ self.B
    return self.base(x) + self.scale * detour


def forward_without_the_base(self, x):
    return (x @ self.A @ self.B) * self.scale


def forward_without_the_scale(self, x):
    return self.base(x) + x @ self.A @ self.B


def forward_scaling_everything(self, x):
    return (self.base(x) + x @ self.A @ self.B) * self.scale


def forward_with_a_and_b_transposed(self, x):
    return self.base(x) + (x @ self.B.T @ self.A.T) * self.scale


def forward_without_the_detour(self, x):
    return self.base(x)


def forward_with_the_weight_by_hand(self, x):
    return x @ self.base.weight.T + (x @ self.A @ self.B) * self.scale


def forward_detaching_the_adapter(self, x):
    return self.base(x) + (x @ self.A.detach() @ self.B.detach()) * self.scale


def forward_dividing_by_the_scale(self, x):
    return self.base(x) + (x @ self.A @ self.B) / self.scale


def forward_b_before_a(self, x):
    return self.base(x) + (x @ self.B @ self.A) * self.scale


def forward_forming_a_times_b_first(self, x):
    return self.base(x) + x @ (self.A @ self.B) * self.scale


def forward_in_double_precision(self, x):
    return (self.base(x) + (x @ self.A @ self.B) * self.scale).double()


def forward_scaling_x_in_place(self, x):
    out = self.base(x)
    x *= self.scale                                    # the caller's x changes
    return out + x @ self.A @ self.B


def forward_with_matmul_and_a_scaled_b(self, x):
    """Right, written another way: the scale folded into B, x multiplied by A first."""
    return self.base(x) + torch.matmul(torch.matmul(x, self.A), self.B * self.scale)


def forward_stub(self, x):
    raise NotImplementedError()


LORA_MISTAKES = {
    forward_without_the_base: "base layer's output is missing",
    forward_without_the_scale: "the detour is not scaled",
    forward_scaling_everything: "the base output is scaled too",
    forward_with_a_and_b_transposed: "A and B are used transposed",
    forward_without_the_detour: "the detour is missing",
    forward_with_the_weight_by_hand: "the bias is missing",
    forward_detaching_the_adapter: "A and B get no gradient",
    forward_dividing_by_the_scale: "divided by the scale",
    forward_b_before_a: "x @ self.A @ self.B in that order",
    forward_forming_a_times_b_first: "right numbers, but A·B was formed first",
    forward_in_double_precision: "holds float64 (torch.double), expected float32",
    forward_scaling_x_in_place: "changed its input x in place",
}


# ---- merge_lora ------------------------------------------------------------------------------

def merge_as_a_learner_writes_it(base, A, B, scale):
    delta = A @ B * scale
    if isinstance(base, nn.Linear):
        return base.weight + delta.T
    return base.weight + delta


def merge_never_transposing(base, A, B, scale):
    return base.weight + A @ B * scale


def merge_always_transposing(base, A, B, scale):
    return base.weight + (A @ B * scale).T


def merge_without_the_scale(base, A, B, scale):
    return merge_as_a_learner_writes_it(base, A, B, 1.0)


def merge_in_place(base, A, B, scale):
    with torch.no_grad():
        base.weight += merge_as_a_learner_writes_it(base, A, B, scale) - base.weight
    return base.weight


def merge_the_change_only(base, A, B, scale):
    return merge_as_a_learner_writes_it(base, A, B, scale) - base.weight


def merge_b_times_a(base, A, B, scale):
    return base.weight + B @ A * scale


def merge_in_double_precision(base, A, B, scale):
    return merge_as_a_learner_writes_it(base, A, B, scale).double()


def merge_with_torch_add(base, A, B, scale):
    """Right, written another way: torch.add with alpha."""
    delta = A @ B
    if isinstance(base, nn.Linear):
        delta = delta.T
    return torch.add(base.weight, delta, alpha=scale)


MERGE_MISTAKES = {
    merge_never_transposing: "nn.Linear stores its weight as (out x in)",
    merge_always_transposing: "Conv1D keeps (in x out)",
    merge_without_the_scale: "the adapter is not scaled",
    merge_in_place: "changed the layer's own weight",
    merge_the_change_only: "this is the change alone",
    merge_b_times_a: "(in x r) @ (r x out)",
    merge_in_double_precision: "holds float64 (torch.double), expected float32",
}


# ---- the tests -------------------------------------------------------------------------------

def test_lora_check_passes_the_course_class_quickly():
    start = time.perf_counter()
    assert_passes(check_lora_layer, helpers.lora.LoraLayer)
    assert time.perf_counter() - start < 10   # ≤ 2 s on a quiet 2-core machine
    for right in EXERCISES[0].right:
        assert_passes(check_lora_layer, right)


def test_lora_check_says_not_written_for_a_stub():
    line, returned = run(check_lora_layer, _lora_class(forward_stub))
    assert "not written yet" in line and returned is helpers.lora.LoraLayer


@pytest.mark.parametrize("mistake", LORA_MISTAKES, ids=lambda f: f.__name__)
def test_lora_check_catches(mistake):
    assert_caught(check_lora_layer, _lora_class(mistake), symptom=LORA_MISTAKES[mistake],
                  fallback=helpers.lora.LoraLayer)


def test_lora_check_wants_a_class():
    line, returned = run(check_lora_layer, None)
    assert "expected a class" in line and returned is helpers.lora.LoraLayer


def test_merge_check_passes_the_course_function():
    assert_passes(check_merge_lora, merge_lora)
    for right in EXERCISES[1].right:
        assert_passes(check_merge_lora, right)


def test_merge_check_says_not_written_for_a_stub():
    assert_not_written(check_merge_lora, fallback=merge_lora)


@pytest.mark.parametrize("mistake", MERGE_MISTAKES, ids=lambda f: f.__name__)
def test_merge_check_catches(mistake):
    assert_caught(check_merge_lora, mistake, symptom=MERGE_MISTAKES[mistake], fallback=merge_lora)


def test_the_merged_weight_computes_what_the_lora_layer_does():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    for base, d_in in ((nn.Linear(16, 48), 16), (Conv1D(48, 16), 16)):
        layer = helpers.lora.LoraLayer(base, rank=4, alpha=8, zero_b=False, seed=1)
        x = torch.randn(3, d_in)
        with torch.no_grad():
            merged = merge_lora(base, layer.A, layer.B, layer.scale)
            out = x @ merged.T + base.bias if isinstance(base, nn.Linear) else x @ merged + base.bias
            assert torch.allclose(out, layer(x), atol=1e-5)


def merge_on_the_cpu(base, A, B, scale):
    return merge_as_a_learner_writes_it(base, A, B, scale).cpu()


EXERCISES = [
    Exercise("LoraLayer", check_lora_layer, (), helpers.lora.LoraLayer,
             right=[_lora_class(forward_as_a_learner_writes_it),
                    _lora_class(forward_with_matmul_and_a_scaled_b)],
             wrong={_lora_class(f): symptom for f, symptom in LORA_MISTAKES.items()}),
    Exercise("merge_lora", check_merge_lora, ("device",), merge_lora,
             right=[merge_as_a_learner_writes_it, merge_with_torch_add],
             wrong={**MERGE_MISTAKES,
                    merge_on_the_cpu: "make every new tensor on the inputs' device"}),
]
