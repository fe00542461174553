"""Counting what a learner's code costs, for the checks that test a claim about cost: the
floating-point operations of its matrix products (in which order A·B and x are multiplied),
and how many torch operations it calls (a loop over the rows calls more of them for more
rows). Counts, not timings: a count is the same on every run and every machine, so a check
that uses one gives the same answer every time.

The products are counted from their operands' shapes as ``torch.utils.flop_counter`` counts
them (2 per multiply-add), inside a ``TorchFunctionMode``: that mode costs nothing to set up,
where ``FlopCounterMode`` imports TorchDynamo, seconds on a laptop, in the middle of a check.
"""

from __future__ import annotations

import math

import torch
from torch.overrides import TorchFunctionMode

#: Matrix products, whatever they are called.
PRODUCTS = {"matmul", "__matmul__", "__rmatmul__", "bmm", "mm", "mv", "einsum", "baddbmm",
            "addmm", "addbmm", "addmv", "linear", "tensordot", "bilinear", "dot", "inner"}


def _shape(t) -> tuple:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else ()


def _matmul_flops(a: tuple, b: tuple) -> int:
    """Of ``a @ b`` for operands of shapes ``a`` and ``b`` (1-D, 2-D or batched)."""
    if not a or not b:
        return 0
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    batch = torch.broadcast_shapes(a2[:-2], b2[:-2]) if len(a2) > 2 or len(b2) > 2 else ()
    return 2 * math.prod(batch) * a2[-2] * a2[-1] * b2[-1]


def _einsum_flops(equation: str, operands) -> int:
    """Of an einsum, contracting its operands from left to right (an estimate of the order
    torch picks, exact for two operands)."""
    inputs, _, output = equation.replace(" ", "").partition("->")
    terms = inputs.split(",")
    if len(terms) != len(operands) or "." in equation:
        return 0
    sizes = {}
    for term, op in zip(terms, operands):
        for letter, size in zip(term, _shape(op)):
            sizes[letter] = size
    total, current = 0, terms[0]
    for i, term in enumerate(terms[1:], 1):
        letters = set(current) | set(term)
        total += 2 * math.prod(sizes.get(c, 1) for c in letters)
        later = set("".join(terms[i + 1:])) | set(output or "")
        current = "".join(c for c in dict.fromkeys(current + term) if c in later)
    return total


def product_flops(name: str, args, kwargs) -> int:
    """The floating-point operations of one call of a matrix product ``name``."""
    shapes = [_shape(a) for a in args]
    if name in ("matmul", "__matmul__", "mm", "bmm", "mv", "dot", "inner"):
        return _matmul_flops(shapes[0], shapes[1]) if len(shapes) >= 2 else 0
    if name == "__rmatmul__":
        return _matmul_flops(shapes[1], shapes[0]) if len(shapes) >= 2 else 0
    if name in ("addmm", "baddbmm", "addbmm", "addmv"):
        return _matmul_flops(shapes[1], shapes[2]) if len(shapes) >= 3 else 0
    if name == "linear":
        weight = shapes[1] if len(shapes) > 1 else _shape(kwargs.get("weight"))
        return 2 * math.prod(shapes[0]) * weight[0] if weight else 0
    if name == "einsum" and args and isinstance(args[0], str):
        operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        return _einsum_flops(args[0], operands)
    return 0


class CountCalls(TorchFunctionMode):
    """Counts, inside ``with CountCalls() as count: ...``, the torch functions and tensor
    methods called (``count.calls``), the matrix products among them (``count.products``) and
    those products' floating-point operations (``count.flops``)."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.products = 0
        self.flops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name not in ("__get__", "__set__"):          # attribute reads (x.shape, x.device)
            self.calls += 1
        if name in PRODUCTS:
            self.products += 1
            self.flops += product_flops(name, args, kwargs)
        return func(*args, **kwargs)


def flops(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), the floating-point operations of its matrix products)``."""
    with CountCalls() as count:
        result = fn(*args, **kwargs)
    return result, count.flops


__all__ = ["CountCalls", "PRODUCTS", "flops", "product_flops"]
