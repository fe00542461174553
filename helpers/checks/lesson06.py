"""Lesson 06's checks: the learner's ``linear_lora_loop`` and ``linear_lora_gathered``.

Both compute the adapter part of a multi-LoRA layer, ``x[i] @ A[k] @ B[k]`` with
``k = lora_indices[i]`` for every row ``i``. Each case draws random adapters (seeded) with
``helpers.lora.random_adapters`` or by hand, runs the learner's function and the course's on the
same tensors, and compares the outputs row by row. The layers here map ``in`` features to a
different number of ``out`` features, so that A and B swapped or transposed cannot slip
through; a case with the lesson's own sizes (1024 → 1024, rank 2, 64 adapters) comes last.
When a row is wrong, the hint says what that row got instead: another adapter's result (its
row number used as the index, or an off-by-one), another row's, zeros, or the sum of all rows.

The text's claims about cost are counted, not timed: the floating-point operations of the
matrix products (x·A first, then ·B; forming A·B first costs in × out per row), and, for the
gathered version, the torch operations it calls at two batch sizes (a loop over the rows or
over the adapters calls more of them for more rows).
"""

from __future__ import annotations

import torch

from ..lora import linear_lora_gathered, linear_lora_loop, random_adapters
from .core import Hint, device_hint, dtype_hint, expect_device, expect_unchanged, run_check, shape_of
from .counting import CountCalls, flops

__all__ = ["check_linear_lora_loop", "check_linear_lora_gathered"]

IN, OUT, RANK, N_ADAPTERS = 16, 12, 3, 6


def _stacks(n, in_features, out_features, rank, seed):
    g = torch.Generator().manual_seed(seed)
    loras_a = torch.randn(n, in_features, rank, generator=g) / in_features ** 0.5
    loras_b = torch.randn(n, rank, out_features, generator=g) / rank ** 0.5
    return loras_a, loras_b


def _case(indices, seq=1, seed=0, in_features=IN, out_features=OUT, rank=RANK, n=N_ADAPTERS):
    """(x, loras_a, loras_b, lora_indices) on the CPU."""
    if (in_features, out_features) == (1024, 1024):
        loras_a, loras_b = random_adapters(n, hidden=1024, rank=rank, seed=seed)
    else:
        loras_a, loras_b = _stacks(n, in_features, out_features, rank, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(len(indices), seq, in_features, generator=g)
    return x, loras_a, loras_b, torch.tensor(indices, dtype=torch.long)


def _adapter_used(got_row, x_row, loras_a, loras_b):
    """The adapter whose A and B give ``got_row`` for the input ``x_row``, or None."""
    for k in range(len(loras_a)):
        want = x_row @ loras_a[k] @ loras_b[k]
        if want.shape == got_row.shape and torch.allclose(got_row, want, atol=1e-4, rtol=1e-4):
            return k
    return None


def _diagnose(got, x, loras_a, loras_b, indices, expected, i) -> str | None:
    """What went wrong, when row ``i`` is the first wrong row of the learner's output."""
    n, wanted = len(loras_a), [int(k) for k in indices]
    k = wanted[i]

    def close(a, b):
        return a.shape == b.shape and torch.allclose(a, b, atol=1e-4, rtol=1e-4)

    used = [_adapter_used(got[r], x[r], loras_a, loras_b) for r in range(len(x))]
    if None not in used:
        if used == list(range(len(x))):
            return (f"row {i} used adapter {i}, its row number, instead of adapter "
                    f"lora_indices[{i}] = {k}: pick each row's A and B by lora_indices")
        if used == sorted(wanted):
            return (f"the rows got the adapters in sorted order {used}, not in the rows' order "
                    f"{wanted}: sort() or unique() reorders the adapters but not the rows; "
                    f"gather with lora_indices as it is")
        if used == [(w - 1) % n for w in wanted] or used == [(w + 1) % n for w in wanted]:
            return (f"row {i} used adapter {used[i]} instead of adapter {k} = lora_indices[{i}]: "
                    f"an index off by one (adapter k is loras_a[k], counting from 0)")
        return (f"row {i} used adapter {used[i]} instead of adapter {k} = lora_indices[{i}]: "
                f"each row takes the adapter its own entry of lora_indices names")
    row = got[i]
    if not row.abs().any():
        return (f"row {i} is all zeros: every row gets x[{i}] @ A[k] @ B[k] with "
                f"k = lora_indices[{i}] = {k}")
    if close(row, expected.sum(0)):
        return (f"row {i} holds the sum of all rows' results: keep one result per row (a batched "
                f"product, or torch.stack of the rows), do not add the rows together")
    for other in range(n):
        if (close(row, x[i] @ loras_a[k] @ loras_b[other])
                or close(row, x[i] @ loras_a[other] @ loras_b[k])):
            return (f"row {i} mixes adapter {k}'s A with another adapter's B: take A and B of the "
                    f"same adapter, both by lora_indices[{i}]")
    for j in range(len(x)):
        if j != i and close(row, expected[j]):
            shared = " (rows that share an adapter each need their own result)" \
                if wanted[j] == k else ""
            return f"row {i} holds row {j}'s result{shared}"
    return None


def _expect_output(got, x, loras_a, loras_b, indices, expected, device, learner=None) -> None:
    """Compare the learner's output with the course's; the hint names the first wrong row."""
    batch, seq = x.shape[0], x.shape[1]
    if not isinstance(got, torch.Tensor):
        raise Hint(f"should return a tensor of shape {shape_of(expected)} "
                   f"(batch, seq, out), got {type(got).__name__}")
    expect_device("the result", got, device)
    if got.shape == expected.shape and got.dtype != expected.dtype:
        raise Hint(dtype_hint("the result", got.dtype, expected.dtype))
    got = got.detach().cpu().float()
    if got.shape != expected.shape:
        shape, want = tuple(got.shape), tuple(expected.shape)
        if got.dim() == 4 and got.shape[:2] == (batch, batch):
            why = ("each row was multiplied as the whole batch: row i's product uses x[i] only, "
                   "not x")
        elif seq == 1 and got.shape == (batch, expected.shape[2]) and _squeezes(learner, x, loras_a,
                                                                               loras_b, indices):
            why = ("the seq dimension of size 1 is gone (squeeze() drops every dimension of size "
                   "1): keep it, torch.stack of the rows' (seq, out) results as they are")
        elif got.dim() == 2 and got.shape[0] == batch * seq:
            why = "torch.cat joined the rows end to end: torch.stack makes them a new first dimension"
        elif got.shape == expected.shape[1:] or (got.dim() == 3 and got.shape[0] == 1 < batch):
            why = "the rows were added together (summed over the batch): keep one result per row"
        elif got.dim() == 3 and got.shape[0] == len(indices.unique()) < batch:
            why = (f"one result per distinct adapter ({got.shape[0]}), not per row ({batch}): rows "
                   f"that share an adapter each need their own result")
        elif got.dim() == 2 and got.shape == (batch, expected.shape[2]):
            why = "the seq dimension is gone: keep every position of every row"
        elif got.shape[-1] == RANK or got.shape[-1] == loras_a.shape[2]:
            why = "the last size is the rank r: multiply by B (r × out) after A"
        else:
            why = "x (batch, seq, in) @ A (in, r) @ B (r, out) gives (batch, seq, out)"
        raise Hint(f"the result has shape {shape}, expected {want}: {why}")
    bad = ~torch.isclose(got, expected, atol=1e-4, rtol=1e-4)
    if not bad.any():
        return
    i = int(bad.nonzero()[0][0])
    story = _diagnose(got, x, loras_a, loras_b, indices, expected, i)
    if story:
        raise Hint(story)
    place = tuple(int(v) for v in bad.nonzero()[0])
    raise Hint(f"row {place[0]}, position {place[1]}, output {place[2]}: got "
               f"{got[place].item():.4g}, expected {expected[place].item():.4g}")


def _squeezes(learner, x, loras_a, loras_b, indices) -> bool:
    """True when the learner's function keeps the seq dimension for two positions per row but
    not for one: it squeezes the result (torch.cat would lose it for two positions as well)."""
    if learner is None:
        return False
    x2 = torch.cat([x, x], dim=1)
    try:
        with torch.no_grad():
            out = learner(x2, loras_a, loras_b, indices)
    except Exception:
        return False
    return isinstance(out, torch.Tensor) and tuple(out.shape) == (x.shape[0], 2, loras_b.shape[2])


def _run(learner, case, device, reference) -> int:
    """Run the learner's function on ``case`` (moved to ``device``), compare with the course's
    (on the CPU), check that the inputs came back unchanged, and return how many matrix
    products the learner's function ran."""
    x, loras_a, loras_b, indices = case
    on = [t.to(device) for t in case]
    before = [t.clone() for t in on]
    with torch.no_grad():
        got, cost = flops(learner, *on)
    for name, t, b in zip(("x", "loras_a", "loras_b", "lora_indices"), on, before):
        expect_unchanged(name, b, t)
    with torch.no_grad():
        expected, expected_cost = flops(reference, *on)
    _expect_output(got, x, loras_a, loras_b, indices, expected.cpu(), device,
                   lambda *args: learner(*(t.to(device) for t in args)))
    if expected.device != got.device:
        raise Hint(device_hint("the result", got.device, expected.device))
    _expect_cost(cost, expected_cost, x, loras_a, loras_b)


def _expect_cost(got: int, expected: int, x, loras_a, loras_b) -> None:
    """(x·A)·B: each token shrinks to r numbers, then grows back. Forming A·B first builds an
    in × out matrix for every row (or adapter): counted as floating-point operations."""
    if got <= expected:
        return
    batch, seq, d_in = x.shape
    rank, d_out = loras_a.shape[2], loras_b.shape[2]
    if got >= 2 * d_in * rank * d_out + 2 * seq * d_in * d_out:
        raise Hint(f"right numbers, but A·B was formed first: an in x out = {d_in} x {d_out} "
                   f"matrix per row ({got:,} floating-point operations here where "
                   f"(x @ A) @ B needs {expected:,}); multiply x by A first, then by B, so that "
                   f"every token shrinks to r = {rank} numbers before it grows back")
    raise Hint(f"right numbers, but {got:,} floating-point operations in the matrix products "
               f"where (x @ A) @ B needs {expected:,}: compute only those products")


CASES = [
    ("4 rows, 4 different adapters", dict(indices=[3, 1, 5, 2])),
    ("8 rows, several sharing an adapter", dict(indices=[3, 1, 3, 0, 5, 1, 1, 4], seed=1)),
    ("prompts: 5 positions per row", dict(indices=[4, 2, 4], seq=5, seed=2)),
    ("one row, the last adapter", dict(indices=[5], seed=3)),
    ("every row the same adapter", dict(indices=[2, 2, 2, 2, 2], seq=2, seed=4)),
    ("the lesson's sizes: 1024 -> 1024, rank 2, 64 adapters",
     dict(indices=[3, 17, 3, 0, 63, 17, 17, 42, 8, 9, 10, 11, 12, 13, 14, 15], seed=5,
          in_features=1024, out_features=1024, rank=2, n=64)),
]

CAUSES = {
    "cannot be multiplied": "a product whose inner sizes differ: x (…, in) @ A (in, r) gives "
                            "(…, r), then @ B (r, out); check that A comes first and that "
                            "neither is transposed",
    "Expected size for first two dimensions of batch2": "the stacks gathered for the rows do not "
                            "line up with x: gather along dimension 0 (one adapter per row, "
                            "index_select(0, lora_indices)), then x @ A (in, r) before @ B (r, out)",
    "must match the size of tensor": "the gathered stack must have one adapter per row of x: "
                            "gather along dimension 0 with lora_indices itself",
    "out of DATA bounds": "an index beyond the end of a dimension: lora_indices picks adapters, "
                          "which sit along dimension 0 of loras_a and loras_b",
    "index out of range in self": "an index beyond the end of a dimension: lora_indices picks "
                                  "adapters, which sit along dimension 0 of loras_a and loras_b",
    "only integer tensors of a single element": "a tensor of indices cannot index a list: "
                            "loop over lora_indices.tolist() for plain ints",
}


def _calls(learner, rows: int, device) -> tuple[int, int]:
    """(torch operations, matrix products) the learner's function calls for ``rows`` rows, each
    with an adapter of its own, one position each."""
    case = [t.to(device) for t in _case(indices=list(range(rows)), seed=7, n=rows)]
    with torch.no_grad(), CountCalls() as count:
        learner(*case)
    return count.calls, count.products


def _cases(reference, count_calls: bool, device):
    def checker(learner, cases):
        for label, spec in CASES:
            with cases(label):
                case = _case(**spec)
                sharing = len(set(spec["indices"])) < len(spec["indices"])
                try:
                    _run(learner, case, device, reference)
                except (Hint, NotImplementedError):
                    raise
                except Exception as error:
                    if sharing and cases.passed >= 1:   # right when every row had its own adapter
                        message = str(error).strip().splitlines()[0][:100] if str(error).strip() else ""
                        raise Hint(f"{type(error).__name__} ({message}) only when rows share an "
                                   f"adapter: every row needs its own copy of its adapter's A and "
                                   f"B; gather with lora_indices itself, not its distinct "
                                   f"values") from None
                    raise
        if count_calls:
            with cases("4 rows and 8 rows, each its own adapter: the same torch operations"):
                (few, few_products), (many, many_products) = (_calls(learner, 4, device),
                                                              _calls(learner, 8, device))
                if many > few:
                    what = (f"{few_products} and {many_products} matrix products"
                            if many_products > few_products else f"{few} and {many} torch operations")
                    raise Hint(f"right numbers, but {what} for 4 and 8 rows: that is a loop over "
                               f"rows (or adapters). Gather every row's A and B with "
                               f"index_select, then two batched products (torch.bmm) do all rows "
                               f"at once, with the same operations for any batch")
    return checker


def check_linear_lora_loop(learner_linear_lora_loop, device="cpu"):
    """Lesson 06: check the learner's ``linear_lora_loop(x, loras_a, loras_b, lora_indices)``
    (one row at a time) against the course's on rows with different and shared adapters,
    prompts of several positions, one row, and the lesson's sizes; print one line and return the
    function the rest of the lesson should use."""
    return run_check("linear_lora_loop", learner_linear_lora_loop,
                     _cases(linear_lora_loop, count_calls=False, device=torch.device(device)),
                     fallback=linear_lora_loop, causes=CAUSES, gpu=True)


def check_linear_lora_gathered(learner_linear_lora_gathered, device="cpu"):
    """Lesson 06: check the learner's ``linear_lora_gathered(x, loras_a, loras_b,
    lora_indices)`` (every row's A and B gathered, then batched products) against the course's
    on the same cases as the loop, and that it calls the same torch operations for 4 rows as
    for 8 (no loop over the rows or the adapters); print one line and return the function the
    rest of the lesson should use."""
    return run_check("linear_lora_gathered", learner_linear_lora_gathered,
                     _cases(linear_lora_gathered, count_calls=True, device=torch.device(device)),
                     fallback=linear_lora_gathered, causes=CAUSES, gpu=True)
