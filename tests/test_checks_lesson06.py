"""Lesson 06's checks pass the course's functions, say "not written yet" for a stub, and catch
the mistakes learners make in linear_lora_loop and linear_lora_gathered, each with a hint at
its symptom."""

import time

import pytest
import torch

from helpers.checks import check_linear_lora_gathered, check_linear_lora_loop
from helpers.lora import linear_lora_gathered, linear_lora_loop
from tests.answers import Exercise
from tests.checking import assert_caught, assert_not_written, assert_passes, run

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- linear_lora_loop: typical mistakes ------------------------------------------------------

def loop_by_row_number(x, loras_a, loras_b, lora_indices):
    return torch.stack([x[i] @ loras_a[i] @ loras_b[i] for i in range(len(x))])


def loop_b_before_a(x, loras_a, loras_b, lora_indices):
    return torch.stack([x[i] @ loras_b[k] @ loras_a[k] for i, k in enumerate(lora_indices.tolist())])


def loop_whole_batch_each_row(x, loras_a, loras_b, lora_indices):
    return torch.stack([x @ loras_a[k] @ loras_b[k] for k in lora_indices.tolist()])


def loop_cat_instead_of_stack(x, loras_a, loras_b, lora_indices):
    return torch.cat([x[i] @ loras_a[k] @ loras_b[k] for i, k in enumerate(lora_indices.tolist())])


def loop_summing_the_rows(x, loras_a, loras_b, lora_indices):
    out = 0
    for i, k in enumerate(lora_indices.tolist()):
        out = out + x[i] @ loras_a[k] @ loras_b[k]
    return out.unsqueeze(0)


def loop_one_result_per_adapter(x, loras_a, loras_b, lora_indices):
    results = {}
    for i, k in enumerate(lora_indices.tolist()):
        results[k] = x[i] @ loras_a[k] @ loras_b[k]
    return torch.stack(list(results.values()))


def loop_index_off_by_one(x, loras_a, loras_b, lora_indices):
    return torch.stack([x[i] @ loras_a[k - 1] @ loras_b[k - 1]
                        for i, k in enumerate(lora_indices.tolist())])


def loop_a_and_b_of_different_adapters(x, loras_a, loras_b, lora_indices):
    return torch.stack([x[i] @ loras_a[k] @ loras_b[lora_indices[0]]
                        for i, k in enumerate(lora_indices.tolist())])


def loop_as_in_the_lesson(x, loras_a, loras_b, lora_indices):
    rows = []
    for i, k in enumerate(lora_indices.tolist()):
        rows.append(x[i] @ loras_a[k] @ loras_b[k])
    return torch.stack(rows)


def loop_with_cat_of_unsqueezed_rows(x, loras_a, loras_b, lora_indices):
    """Right, written another way: each row made (1, seq, out), then joined end to end."""
    return torch.cat([(x[i] @ loras_a[k] @ loras_b[k]).unsqueeze(0)
                      for i, k in enumerate(lora_indices)])


def loop_forming_a_times_b_first(x, loras_a, loras_b, lora_indices):
    return torch.stack([x[i] @ (loras_a[k] @ loras_b[k]) for i, k in enumerate(lora_indices.tolist())])


def loop_stacked_then_squeezed(x, loras_a, loras_b, lora_indices):
    return torch.stack([x[i] @ loras_a[k] @ loras_b[k]
                        for i, k in enumerate(lora_indices.tolist())]).squeeze()


def loop_in_double_precision(x, loras_a, loras_b, lora_indices):
    return loop_as_in_the_lesson(x.double(), loras_a.double(), loras_b.double(), lora_indices)


LOOP_MISTAKES = {
    loop_by_row_number: "row 0 used adapter 0, its row number, instead of adapter lora_indices[0] = 3",
    loop_b_before_a: "check that A comes first",
    loop_whole_batch_each_row: "row i's product uses x[i] only",
    loop_cat_instead_of_stack: "torch.stack makes them a new first dimension",
    loop_summing_the_rows: "the rows were added together",
    loop_one_result_per_adapter: "rows that share an adapter each need their own result",
    loop_index_off_by_one: "an index off by one",
    loop_a_and_b_of_different_adapters: "mixes adapter 1's A with another adapter's B",
    loop_forming_a_times_b_first: "right numbers, but A·B was formed first",
    loop_stacked_then_squeezed: "squeeze() drops every dimension of size 1",
    loop_in_double_precision: "the result holds float64 (torch.double), expected float32",
}


# ---- linear_lora_gathered: typical mistakes --------------------------------------------------

def gathered_along_the_wrong_dimension(x, loras_a, loras_b, lora_indices):
    a = loras_a.index_select(1, lora_indices)
    b = loras_b.index_select(1, lora_indices)
    return torch.bmm(torch.bmm(x, a), b)


def gathered_a_and_b_swapped(x, loras_a, loras_b, lora_indices):
    a = loras_a.index_select(0, lora_indices)
    b = loras_b.index_select(0, lora_indices)
    return torch.bmm(torch.bmm(x, b), a)


def gathered_distinct_adapters_only(x, loras_a, loras_b, lora_indices):
    distinct = lora_indices.unique()
    return torch.bmm(torch.bmm(x, loras_a[distinct]), loras_b[distinct])


def gathered_each_adapter_once(x, loras_a, loras_b, lora_indices):
    distinct = torch.tensor(list(dict.fromkeys(lora_indices.tolist())))   # first-seen order
    return torch.bmm(torch.bmm(x, loras_a[distinct]), loras_b[distinct])


def gathered_first_rows_of_the_stack(x, loras_a, loras_b, lora_indices):
    return torch.bmm(torch.bmm(x, loras_a[:len(x)]), loras_b[:len(x)])


def gathered_summed_with_einsum(x, loras_a, loras_b, lora_indices):
    a, b = loras_a[lora_indices], loras_b[lora_indices]
    return torch.einsum("bsi,bir,bro->so", x, a, b)


def gathered_but_looping(x, loras_a, loras_b, lora_indices):
    return torch.stack([x[i] @ loras_a[k] @ loras_b[k] for i, k in enumerate(lora_indices.tolist())])


def gathered_into_a_new_cpu_tensor(x, loras_a, loras_b, lora_indices):
    out = torch.zeros(x.shape[0], x.shape[1], loras_b.shape[2])
    out += torch.bmm(torch.bmm(x, loras_a[lora_indices]), loras_b[lora_indices]).cpu()
    return out


def gathered_rows_sorted_by_adapter(x, loras_a, loras_b, lora_indices):
    ordered = lora_indices.sort().values       # grouped by adapter, but the rows were not moved
    return torch.bmm(torch.bmm(x, loras_a[ordered]), loras_b[ordered])


def gathered_as_in_the_lesson(x, loras_a, loras_b, lora_indices):
    a = loras_a.index_select(0, lora_indices)
    b = loras_b.index_select(0, lora_indices)
    return torch.bmm(torch.bmm(x, a), b)


def gathered_by_broadcasting(x, loras_a, loras_b, lora_indices):
    """Right, written another way: indexing and @ instead of index_select and bmm."""
    return x @ loras_a[lora_indices] @ loras_b[lora_indices]


def gathered_with_einsum(x, loras_a, loras_b, lora_indices):
    """Right, written another way: two einsums."""
    xa = torch.einsum("bsi,bir->bsr", x, loras_a[lora_indices])
    return torch.einsum("bsr,bro->bso", xa, loras_b[lora_indices])


def gathered_forming_a_times_b_first(x, loras_a, loras_b, lora_indices):
    a = loras_a.index_select(0, lora_indices)
    b = loras_b.index_select(0, lora_indices)
    return torch.bmm(x, torch.bmm(a, b))


def gathered_by_a_loop_then_bmm(x, loras_a, loras_b, lora_indices):
    a = torch.stack([loras_a[k] for k in lora_indices.tolist()])     # one copy per row, in Python
    b = torch.stack([loras_b[k] for k in lora_indices.tolist()])
    return torch.bmm(torch.bmm(x, a), b)


def gathered_by_a_loop_over_the_adapters(x, loras_a, loras_b, lora_indices):
    out = x.new_zeros(x.shape[0], x.shape[1], loras_b.shape[2])
    for k in lora_indices.unique().tolist():
        rows = lora_indices == k
        out[rows] = x[rows] @ loras_a[k] @ loras_b[k]
    return out


GATHERED_MISTAKES = {
    gathered_along_the_wrong_dimension: "along dimension 0 of loras_a and loras_b",
    gathered_a_and_b_swapped: "then x @ A (in, r) before @ B (r, out)",
    gathered_distinct_adapters_only: "the adapters in sorted order",
    gathered_each_adapter_once: "only when rows share an adapter",
    gathered_first_rows_of_the_stack: "its row number, instead of adapter lora_indices[0] = 3",
    gathered_summed_with_einsum: "the rows were added together",
    gathered_but_looping: "that is a loop over rows",
    gathered_rows_sorted_by_adapter: "sort() or unique() reorders the adapters but not the rows",
    gathered_forming_a_times_b_first: "right numbers, but A·B was formed first",
    gathered_by_a_loop_then_bmm: "torch operations for 4 and 8 rows: that is a loop over rows",
    gathered_by_a_loop_over_the_adapters: "matrix products for 4 and 8 rows: that is a loop over rows (or adapters)",
}


# ---- the tests -------------------------------------------------------------------------------

@pytest.mark.parametrize("check, solution", [(check_linear_lora_loop, linear_lora_loop),
                                             (check_linear_lora_gathered, linear_lora_gathered)])
def test_check_passes_the_course_function_quickly(check, solution):
    start = time.perf_counter()
    line = assert_passes(check, solution)
    assert "right on all" in line
    assert time.perf_counter() - start < 4   # ≤ 2 s on a quiet 2-core machine


def test_right_answers_written_otherwise_pass():
    for exercise in EXERCISES:
        for right in exercise.right:
            assert_passes(exercise.check, right)
    assert_passes(check_linear_lora_loop, gathered_as_in_the_lesson)   # the loop's check asks for numbers only


@pytest.mark.parametrize("check, solution", [(check_linear_lora_loop, linear_lora_loop),
                                             (check_linear_lora_gathered, linear_lora_gathered)])
def test_check_says_not_written_for_a_stub(check, solution):
    assert_not_written(check, fallback=solution)


@pytest.mark.parametrize("mistake", LOOP_MISTAKES, ids=lambda f: f.__name__)
def test_loop_check_catches(mistake):
    assert_caught(check_linear_lora_loop, mistake, symptom=LOOP_MISTAKES[mistake],
                  fallback=linear_lora_loop)


@pytest.mark.parametrize("mistake", GATHERED_MISTAKES, ids=lambda f: f.__name__)
def test_gathered_check_catches(mistake):
    assert_caught(check_linear_lora_gathered, mistake, symptom=GATHERED_MISTAKES[mistake],
                  fallback=linear_lora_gathered)


def test_a_function_that_changes_its_input_is_caught():
    def scaling_x_in_place(x, loras_a, loras_b, lora_indices):
        x.mul_(1.0001)
        return linear_lora_gathered(x, loras_a, loras_b, lora_indices)

    assert_caught(check_linear_lora_gathered, scaling_x_in_place,
                  symptom="changed its input x in place", fallback=linear_lora_gathered)


def test_a_result_left_on_another_device_is_caught():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU: on a CPU every tensor is on the same device")
    assert_caught(check_linear_lora_gathered, gathered_into_a_new_cpu_tensor, "cuda",
                  symptom="the result is on cpu, expected cuda", fallback=linear_lora_gathered)


def test_the_check_runs_on_the_device_it_is_given():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seen = set()

    def spying(x, loras_a, loras_b, lora_indices):
        seen.add(x.device.type)
        return linear_lora_gathered(x, loras_a, loras_b, lora_indices)

    line, _ = run(check_linear_lora_gathered, spying, device)
    assert line.startswith("✓") and seen == {device}, line


def loop_stacking_on_the_cpu(x, loras_a, loras_b, lora_indices):
    return loop_as_in_the_lesson(x, loras_a, loras_b, lora_indices).cpu()


def loop_into_zeros_made_on_the_cpu(x, loras_a, loras_b, lora_indices):
    out = torch.zeros(x.shape[0], x.shape[1], loras_b.shape[2], dtype=x.dtype)   # no device=
    for i, k in enumerate(lora_indices.tolist()):
        out[i] = x[i] @ loras_a[k] @ loras_b[k]
    return out


ON_A_GPU = {loop_into_zeros_made_on_the_cpu: "make every new tensor on the inputs' device"}


EXERCISES = [
    Exercise("linear_lora_loop", check_linear_lora_loop, ("device",), linear_lora_loop,
             right=[loop_as_in_the_lesson, loop_with_cat_of_unsqueezed_rows],
             wrong={**LOOP_MISTAKES, **ON_A_GPU,
                    loop_stacking_on_the_cpu: "make every new tensor on the inputs' device"}),
    Exercise("linear_lora_gathered", check_linear_lora_gathered, ("device",), linear_lora_gathered,
             right=[gathered_as_in_the_lesson, gathered_by_broadcasting, gathered_with_einsum],
             wrong={**GATHERED_MISTAKES,
                    gathered_into_a_new_cpu_tensor: "make every new tensor on the inputs' device"}),
]
