"""Counting what a learner's code costs, for the checks that test a claim about cost: the
floating-point operations of its matrix products (in which order A·B and x are multiplied),
and how many torch operations it calls (a loop over the rows calls more of them for more
rows). Counts, not timings: a count is the same on every run and every machine, so a check
that uses one gives the same answer every time.
"""

from __future__ import annotations

from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

#: Matrix products, whatever they are called.
PRODUCTS = {"matmul", "__matmul__", "__rmatmul__", "bmm", "mm", "mv", "einsum", "baddbmm",
            "addmm", "addbmm", "linear", "tensordot", "bilinear"}


class CountCalls(TorchFunctionMode):
    """Counts the torch functions and tensor methods called inside
    ``with CountCalls() as count: ...``: ``count.calls`` all of them, ``count.products`` the
    matrix products."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.products = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name not in ("__get__", "__set__"):          # attribute reads (x.shape, x.device)
            self.calls += 1
        if name in PRODUCTS:
            self.products += 1
        return func(*args, **(kwargs or {}))


def flops(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), the floating-point operations of its matrix products)``, as
    ``torch.utils.flop_counter.FlopCounterMode`` counts them (2 per multiply-add)."""
    with FlopCounterMode(display=False) as counter:
        result = fn(*args, **kwargs)
    return result, counter.get_total_flops()
