"""Lesson 05's checks: the learner's ``LoraLayer`` (its ``forward``) and ``merge_lora``.

The reference is ``helpers.lora.LoraLayer``: ``base(x) + (x @ A @ B) * scale`` with ``A``
(in × r), ``B`` (r × out) and scale = alpha / rank. Merging folds the detour into the frozen
weight: ``W + A @ B * scale`` for GPT-2's ``Conv1D``, which stores ``W`` as (in × out), and
``W + (A @ B * scale)ᵀ`` for ``nn.Linear``, which stores it as (out × in). The cases wrap a
square ``nn.Linear`` (where a transposed product still has the right shape, so only the values
tell), a non-square one, and GPT-2's ``Conv1D``, with scale 1 and scale 2, inputs of two and
three dimensions, and a fresh adapter (B = 0). The floating-point operations of forward's
products are counted (``counting.flops``): ``x @ (A @ B)`` gives the same numbers at the cost
of an in × out matrix, and is flagged.
"""

from __future__ import annotations

import torch
from torch import nn

from ..lora import LoraLayer
from .core import (Hint, expect_device, expect_like, expect_shape, expect_tensor, expect_unchanged,
                   run_check)
from .counting import flops

__all__ = ["check_lora_layer", "check_merge_lora", "merge_lora"]


def merge_lora(base: nn.Module, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """Lesson 05: the weight of ``base`` (an ``nn.Linear`` or GPT-2's ``Conv1D``) with the
    adapter ``A @ B * scale`` folded in, in ``base``'s own layout; ``base`` is not changed."""
    delta = (A @ B) * scale                  # (in × out)
    if isinstance(base, nn.Linear):
        delta = delta.T                      # nn.Linear keeps its weight as (out × in)
    return base.weight + delta


def _layers():
    """(description, layer, its input size): a square nn.Linear, a non-square one, GPT-2's
    Conv1D, seeded."""
    from transformers.pytorch_utils import Conv1D

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        square = nn.Linear(32, 32)
        wide = nn.Linear(16, 48)
        conv = Conv1D(48, 16)                # GPT-2's layout: weight (in=16, out=48)
        nn.init.normal_(conv.bias, std=0.02)
        conv_square = Conv1D(32, 32)
        nn.init.normal_(conv_square.bias, std=0.02)
    return [("a square nn.Linear (32 -> 32)", square, 32),
            ("an nn.Linear 16 -> 48", wide, 16),
            ("GPT-2's Conv1D 16 -> 48 (weight stored as in x out)", conv, 16),
            ("a square Conv1D (32 -> 32)", conv_square, 32)]


def _close(got: torch.Tensor, candidate: torch.Tensor) -> bool:
    return got.shape == candidate.shape and bool(torch.allclose(got, candidate, rtol=1e-4, atol=1e-5))


# ---- LoraLayer.forward ----------------------------------------------------------------------

SETTINGS = [dict(rank=2, zero_b=False, seed=0), dict(rank=4, alpha=8, zero_b=False, seed=1)]


def _lora_cases():
    layers = _layers()
    cases = []
    for label, layer, d_in in layers[:3]:
        for kwargs in SETTINGS:
            scale = kwargs.get("alpha", kwargs["rank"]) / kwargs["rank"]
            cases.append((f"{label}, rank {kwargs['rank']}, scale {scale:g}", layer, d_in, kwargs))
    cases.append(("a fresh adapter (B = 0) on " + layers[1][0], layers[1][1], layers[1][2],
                  dict(rank=4, seed=2)))
    return cases


def _expect_output(got, expected, x, ours: LoraLayer) -> None:
    expect_shape("the output of forward", got, tuple(expected.shape),
                 " (the base layer's output shape)")
    expect_like("the output of forward", got, expected)
    got = got.detach()
    if _close(got, expected):
        return
    with torch.no_grad():
        base = ours.base(x)
        detour = x @ ours.A @ ours.B
        s = ours.scale
        hints = [
            (detour * s, "the base layer's output is missing: return self.base(x) + the detour"),
            (base, "the detour is missing: add (x @ self.A @ self.B) * self.scale to self.base(x)"),
            (base + detour, f"the detour is not scaled: multiply x @ A @ B by self.scale "
                            f"(alpha / rank = {s:g} here)"),
            ((base + detour) * s, "the base output is scaled too: only the detour is, "
                                  "self.base(x) + (x @ self.A @ self.B) * self.scale"),
            (base + detour / s, f"the detour is divided by the scale: multiply by self.scale "
                                f"({s:g} here)"),
        ]
        if ours.A.shape[0] == ours.B.shape[1]:       # a transposed product fits a square layer
            hints.append((base + (x @ ours.B.T @ ours.A.T) * s,
                          "A and B are used transposed: A is (in x r) and B is (r x out), so "
                          "the detour is x @ self.A @ self.B, in that order"))
        weight = ours.base.weight
        for w in (weight, weight.T):
            if w.shape[0] == x.shape[-1]:
                hints.append((x @ w + detour * s, "the bias is missing: call self.base(x) for "
                                                  "the frozen path; it adds the bias and knows "
                                                  "its own weight layout"))
    for candidate, hint in hints:
        if _close(got, candidate):
            raise Hint(hint)
    expect_tensor("the output", got, expected, atol=1e-5, rows="row", cols="token")


def _lora_checker(learner_class, cases):
    inputs = torch.Generator().manual_seed(3)
    for label, layer, d_in, kwargs in _lora_cases():
        with cases(label):
            ours = LoraLayer(layer, **kwargs)
            theirs = learner_class(layer, **kwargs)
            for name in ("A", "B"):
                mine, yours = getattr(ours, name), getattr(theirs, name, None)
                if not isinstance(yours, torch.Tensor) or yours.shape != mine.shape:
                    raise Hint(f"the layer's {name} should be a parameter of shape "
                               f"{tuple(mine.shape)}, got "
                               f"{tuple(yours.shape) if isinstance(yours, torch.Tensor) else yours!r}: "
                               f"keep the lesson's __init__ as it is")
                with torch.no_grad():
                    yours.copy_(mine)        # the same adapter in both: only forward differs
            theirs.scale = ours.scale
            for shape in ((2, 3, d_in), (5, d_in)):
                x = torch.randn(*shape, generator=inputs)
                with torch.no_grad():
                    expected, cost = flops(ours, x)
                given = x.clone()
                got = theirs(given)
                expect_unchanged("x", x, given)
                _expect_output(got, expected, x, ours)
                with torch.no_grad():
                    _, their_cost = flops(theirs, x)
                _expect_cost(their_cost, cost, x, ours)
            if kwargs.get("zero_b") is False and isinstance(got, torch.Tensor):
                if got.requires_grad:
                    got.sum().backward()
                if not got.requires_grad or theirs.A.grad is None or theirs.B.grad is None:
                    raise Hint("A and B get no gradient, so training would not move them: use "
                               "self.A and self.B as they are in forward (no .detach(), .data "
                               "or torch.no_grad())")


def _expect_cost(got: int, expected: int, x, ours: LoraLayer) -> None:
    """The text's claim about cost: (x·A)·B shrinks every token to r numbers first. Counted,
    not timed: the multiply-adds of the matrix products, as FlopCounterMode counts them."""
    if got <= expected:
        return
    d_in, rank = ours.A.shape
    d_out = ours.B.shape[1]
    tokens = x.numel() // d_in
    a_times_b = 2 * d_in * rank * d_out + 2 * tokens * d_in * d_out - 2 * tokens * rank * (d_in + d_out)
    if got == expected + a_times_b:
        raise Hint(f"right numbers, but A·B was formed first: a {d_in} x {d_out} matrix "
                   f"({got:,} floating-point operations here instead of {expected:,}); "
                   f"multiply x by A first, (x @ self.A) @ self.B, so that every token shrinks "
                   f"to r = {rank} numbers before it grows back")
    raise Hint(f"right numbers, but {got:,} floating-point operations in the matrix products "
               f"where base(x) + (x @ A) @ B needs {expected:,}: compute only those products")


LORA_CAUSES = {
    "shapes cannot be multiplied": "the detour is x @ self.A @ self.B in that order (A is in x r, "
                                   "B is r x out); for the frozen path call self.base(x), which "
                                   "knows its own weight layout",
    "must match the size": "the detour has the base output's shape only as x @ self.A @ self.B "
                           "(A is in x r, B is r x out)",
}


def check_lora_layer(learner_class):
    """Lesson 05: check the learner's ``LoraLayer`` class (its forward, ``base(x) + (x @ A @ B)
    * scale``) against ``helpers.lora.LoraLayer`` on square and non-square ``nn.Linear`` layers
    and GPT-2's ``Conv1D``, scales 1 and 2, inputs of 2 and 3 dimensions, and a fresh adapter,
    and that it multiplies x by A first (the floating-point operations of its products are
    counted); print one line and return the class the rest of the lesson should use."""
    return run_check("LoraLayer", learner_class, _lora_checker, fallback=LoraLayer, kind="class",
                     causes=LORA_CAUSES)


# ---- merge_lora -----------------------------------------------------------------------------

def _merge_checker(learner, cases, device):
    for label, layer, _ in _layers():
        layer = layer.to(device)
        for kwargs in SETTINGS:
            scale = kwargs.get("alpha", kwargs["rank"]) / kwargs["rank"]
            if kwargs["rank"] == 4 and "square" in label:
                continue                             # scale 2 is tried on the non-square layers
            with cases(f"{label}, rank {kwargs['rank']}, scale {scale:g}"):
                adapter = LoraLayer(layer, **kwargs)
                A, B = adapter.A.detach().clone(), adapter.B.detach().clone()
                before = layer.weight.detach().clone()
                with torch.no_grad():
                    expected = merge_lora(layer, A, B, adapter.scale)
                given_a, given_b = A.clone(), B.clone()
                got = learner(layer, given_a, given_b, adapter.scale)
                expect_unchanged("A", A, given_a)
                expect_unchanged("B", B, given_b)
                if not torch.equal(layer.weight.detach(), before):
                    with torch.no_grad():
                        layer.weight.copy_(before)   # put it back for the next cases
                    raise Hint("merge_lora changed the layer's own weight: return a new tensor, "
                               "W + ..., and leave base as it is (the lesson still uses it)")
                if not isinstance(got, torch.Tensor):
                    raise Hint(f"merge_lora should return the merged weight, a tensor of shape "
                               f"{tuple(expected.shape)}, got {type(got).__name__}")
                expect_device("the merged weight", got, expected.device)
                got = got.detach()
                if got.shape == expected.shape:
                    expect_like("the merged weight", got, expected)
                if _close(got, expected):
                    continue
                W, delta = before, A @ B
                linear = isinstance(layer, nn.Linear)
                kind = ("nn.Linear stores its weight as (out x in), so add the transpose, "
                        "(A @ B * scale).T" if linear else
                        "Conv1D stores its weight as (in x out), the shape of A @ B: no transpose")
                right = (lambda m: m.T) if linear else (lambda m: m)
                wrong = (lambda m: m) if linear else (lambda m: m.T)
                hints = [
                    (lambda: W + right(delta), f"the adapter is not scaled: W + A @ B * scale "
                                               f"(scale {scale:g} here)"),
                    (lambda: W + wrong(delta * scale),
                     f"the product has the wrong orientation for this layer: {kind}"),
                    (lambda: right(delta * scale),
                     "this is the change alone: return the merged weight, W + the change"),
                    (lambda: W, "the weight came back unchanged: add the adapter, "
                                "W + A @ B * scale"),
                ]
                for candidate, hint in hints:
                    try:
                        value = candidate()
                    except RuntimeError:             # that mistake cannot give this shape
                        continue
                    if _close(got, value):
                        raise Hint(hint)
                if got.shape != expected.shape:
                    raise Hint(f"the merged weight has shape {tuple(got.shape)}, expected "
                               f"{tuple(expected.shape)}, the shape of base.weight ({kind})")
                expect_tensor("the merged weight", got, expected, atol=1e-5)


MERGE_CAUSES = {
    "must match the size": "the change is A @ B, (in x r) @ (r x out) = (in x out); nn.Linear "
                           "keeps its weight as (out x in), so add the transpose there, and "
                           "Conv1D keeps (in x out), so add it as it is",
    "shapes cannot be multiplied": "the change is A @ B, (in x r) @ (r x out), in that order",
}


def check_merge_lora(learner_merge_lora, device="cpu"):
    """Lesson 05: check the learner's ``merge_lora(base, A, B, scale)`` against the course's on a
    square and a non-square ``nn.Linear`` and on GPT-2's ``Conv1D`` (square and not), scales 1
    and 2, with layers on ``device`` (the lesson's: ``model.device``); print one line and
    return the function the rest of the lesson should use."""
    device = torch.device(device)
    return run_check("merge_lora", learner_merge_lora,
                     lambda learner, cases: _merge_checker(learner, cases, device),
                     fallback=merge_lora, causes=MERGE_CAUSES, gpu=True)
