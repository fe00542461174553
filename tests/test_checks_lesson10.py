"""Lesson 10's checks pass the course's code, say "not written yet" for a stub, and catch the
mistakes learners make in capture sizes, padding, a counting backend and the break-even point
of a compile, each with a hint at its symptom."""

import math
import time

import pytest
import torch

from helpers.checks import (check_break_even, check_capture_size, check_counting_backend,
                            check_replay,
                            check_pad_batch)
from helpers.compilation import (CountingBackend, break_even_tokens, capture_size, pad_batch,
                                 replay_step)
from tests.answers import Exercise
from tests.checking import assert_caught, assert_not_written, assert_passes, run

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- capture_size: the lesson's solution and typical mistakes --------------------------------

def lesson_capture_size(batch, sizes=(1, 2, 4, 8, 16, 32, 64)):      # as in the lesson
    fitting = [size for size in sizes if size >= batch]
    return min(fitting) if fitting else None


def rounding_down(batch, sizes=(1, 2, 4, 8, 16, 32, 64)):
    fitting = [size for size in sizes if size <= batch]
    return max(fitting) if fitting else None


def strictly_larger(batch, sizes=(1, 2, 4, 8, 16, 32, 64)):
    fitting = [size for size in sizes if size > batch]
    return min(fitting) if fitting else None


def first_that_fits(batch, sizes=(1, 2, 4, 8, 16, 32, 64)):          # assumes sorted sizes
    return next((size for size in sizes if size >= batch), None)


def largest_when_too_big(batch, sizes=(1, 2, 4, 8, 16, 32, 64)):
    fitting = [size for size in sizes if size >= batch]
    return min(fitting) if fitting else max(sizes)


def raising_when_too_big(batch, sizes=(1, 2, 4, 8, 16, 32, 64)):
    fitting = [size for size in sizes if size >= batch]
    if not fitting:
        raise ValueError("batch too large")
    return min(fitting)


def next_power_of_two(batch, sizes=(1, 2, 4, 8, 16, 32, 64)):
    return 1 << (batch - 1).bit_length() if batch <= max(sizes) else None


def bisecting(batch, sizes=(1, 2, 4, 8, 16, 32, 64)):              # needs sorted sizes
    import bisect
    i = bisect.bisect_left(list(sizes), batch)
    return sizes[i] if i < len(sizes) else None


def sorting_the_sizes_in_place(batch, sizes=(1, 2, 4, 8, 16, 32, 64)):
    sizes.sort()                                      # a tuple has no sort(); a list changes
    return next((size for size in sizes if size >= batch), None)


def without_the_default_sizes(batch, sizes):
    return lesson_capture_size(batch, sizes)


def size_as_a_float(batch, sizes=(1, 2, 4, 8, 16, 32, 64)):
    found = lesson_capture_size(batch, sizes)
    return None if found is None else float(found)


def from_sorted_sizes(batch, sizes=(1, 2, 4, 8, 16, 32, 64)):
    """Right, written another way: the sizes sorted (a copy), then the first that fits."""
    return next((size for size in sorted(sizes) if size >= batch), None)


CAPTURE_MISTAKES = {
    rounding_down: "cannot hold the batch",
    strictly_larger: "compare with >=, not >",
    first_that_fits: "may come in any order",
    largest_when_too_big: "return None",
    raising_when_too_big: "raised ValueError: no size holds 65 rows",
    next_power_of_two: "not the next power of two",
    bisecting: "nor a bisect, which needs them sorted",
    sorting_the_sizes_in_place: "are not yours to change: sorted(sizes) makes a sorted copy",
    without_the_default_sizes: "keep the default, def capture_size(batch, sizes=CAPTURE_SIZES)",
    size_as_a_float: "gave 1.0, a float: return one of the sizes as it is (an int)",
}


def test_capture_size_check_passes_right_answers_written_otherwise():
    assert_passes(check_capture_size, from_sorted_sizes)


def test_capture_size_check_passes_the_course_functions():
    assert_passes(check_capture_size, lesson_capture_size)
    assert_passes(check_capture_size, capture_size)


def test_capture_size_check_says_not_written_for_a_stub():
    assert_not_written(check_capture_size, fallback=capture_size)


@pytest.mark.parametrize("mistake", CAPTURE_MISTAKES, ids=lambda f: f.__name__)
def test_capture_size_check_catches(mistake):
    assert_caught(check_capture_size, mistake, symptom=CAPTURE_MISTAKES[mistake],
                  fallback=capture_size)


# ---- pad_batch: the lesson's solution and typical mistakes -----------------------------------

def lesson_pad_batch(input_ids, size, pad_token_id):                   # as in the lesson
    padding = input_ids.new_full((size - input_ids.shape[0], input_ids.shape[1]), pad_token_id)
    return torch.cat([input_ids, padding])


def padding_on_top(input_ids, size, pad_token_id):
    padding = input_ids.new_full((size - input_ids.shape[0], input_ids.shape[1]), pad_token_id)
    return torch.cat([padding, input_ids])


def padding_positions(input_ids, size, pad_token_id):
    padding = input_ids.new_full((input_ids.shape[0], size - input_ids.shape[1]), pad_token_id)
    return torch.cat([input_ids, padding], dim=1)


def only_the_padding(input_ids, size, pad_token_id):
    return input_ids.new_full((size - input_ids.shape[0], input_ids.shape[1]), pad_token_id)


def padding_with_zeros(input_ids, size, pad_token_id):
    return lesson_pad_batch(input_ids, size, 0)


def float_padding(input_ids, size, pad_token_id):
    padding = torch.full((size - input_ids.shape[0], input_ids.shape[1]), float(pad_token_id),
                         device=input_ids.device)
    return torch.cat([input_ids.float(), padding])


def a_list(input_ids, size, pad_token_id):
    return lesson_pad_batch(input_ids, size, pad_token_id).tolist()


def padding_made_with_torch_full(input_ids, size, pad_token_id):
    padding = torch.full((size - input_ids.shape[0], input_ids.shape[1]), pad_token_id,
                         device=input_ids.device)
    return torch.cat([input_ids, padding])           # int64 whatever the input's dtype


def padding_into_the_input(input_ids, size, pad_token_id):
    out = input_ids.new_full((size, input_ids.shape[1]), pad_token_id)
    out[:input_ids.shape[0]] = input_ids
    input_ids.fill_(pad_token_id)                      # the caller's batch is gone
    return out


def padding_with_new_full_and_a_slice(input_ids, size, pad_token_id):
    """Right, written another way: a full batch of padding, the real rows copied in."""
    out = input_ids.new_full((size, input_ids.shape[1]), pad_token_id)
    out[:input_ids.shape[0]] = input_ids
    return out


PAD_MISTAKES = {
    padding_on_top: "put them first and the padding below",
    padding_positions: "pad rows (dimension 0, the batch), not positions",
    only_the_padding: "return the whole batch",
    padding_with_zeros: "should hold pad_token_id (99)",
    float_padding: "token ids stay integers",
    a_list: "should return a tensor, got list",
    padding_made_with_torch_full: "the result is torch.int64, the input torch.int32",
    padding_into_the_input: "changed its input input_ids in place",
}


def test_pad_batch_check_passes_the_course_functions():
    assert_passes(check_pad_batch, lesson_pad_batch)
    assert_passes(check_pad_batch, pad_batch)
    assert_passes(check_pad_batch, padding_with_new_full_and_a_slice)


def test_pad_batch_check_says_not_written_for_a_stub():
    assert_not_written(check_pad_batch, fallback=pad_batch)


@pytest.mark.parametrize("mistake", PAD_MISTAKES, ids=lambda f: f.__name__)
def test_pad_batch_check_catches(mistake):
    assert_caught(check_pad_batch, mistake, symptom=PAD_MISTAKES[mistake], fallback=pad_batch)


# ---- CountingBackend: the lesson's solution and typical mistakes -----------------------------

class LessonBackend:                                                     # as in the lesson
    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


class ReturningTheGraph(LessonBackend):                                  # also right
    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm


class ReturningNothing(LessonBackend):
    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)


class KeepingTheInputs(LessonBackend):
    def __call__(self, gm, example_inputs):
        self.graphs.append(example_inputs)
        return gm.forward


class CountingCalls(LessonBackend):
    def __call__(self, gm, example_inputs):
        def run(*args):
            self.graphs.append(gm)
            return gm.forward(*args)
        return run


class SharedList:
    graphs = []                                        # one list for every backend

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


class NotAppending(LessonBackend):
    def __call__(self, gm, example_inputs):
        return gm.forward


class OneArgument(LessonBackend):
    def __call__(self, gm):
        self.graphs.append(gm)
        return gm.forward


class Stub(LessonBackend):
    def __call__(self, gm, example_inputs):
        raise NotImplementedError()


class KeepingTheFirstResult(LessonBackend):
    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        first = gm.forward(*example_inputs)            # a constant, whatever the inputs
        return lambda *args: first


class IgnoringItsInputs(LessonBackend):
    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return lambda *args: gm.forward(*example_inputs)


COUNTING_MISTAKES = {
    ReturningNothing: "must return a callable",
    KeepingTheInputs: "keep the graph itself, gm",
    CountingCalls: "count in __call__, not inside the function you return",
    SharedList: "a list of its own",
    NotAppending: "append gm in __call__",
    OneArgument: "called with two arguments, gm and example_inputs",
    KeepingTheFirstResult: "a second call with new values gives what the first call gave",
    IgnoringItsInputs: "a second call with new values gives what the first call gave",
}


def test_counting_backend_check_passes_the_course_classes_quickly():
    start = time.perf_counter()
    assert_passes(check_counting_backend, LessonBackend)
    assert time.perf_counter() - start < 10             # < 1 s on a quiet 2-core machine
    assert_passes(check_counting_backend, CountingBackend)
    assert_passes(check_counting_backend, ReturningTheGraph)
    assert_passes(check_counting_backend, LessonBackend)     # twice: nothing cached interferes


def test_counting_backend_check_says_not_written_for_a_stub():
    line, returned = run(check_counting_backend, Stub)
    assert "not written yet" in line and returned is CountingBackend


def test_counting_backend_check_wants_a_class():
    line, returned = run(check_counting_backend, None)
    assert line.startswith("✗") and "expected a class" in line and returned is CountingBackend


@pytest.mark.parametrize("mistake", COUNTING_MISTAKES, ids=lambda c: c.__name__)
def test_counting_backend_check_catches(mistake):
    SharedList.graphs = []
    assert_caught(check_counting_backend, mistake, symptom=COUNTING_MISTAKES[mistake],
                  fallback=CountingBackend)


# ---- break_even_tokens: the lesson's solution and typical mistakes ---------------------------

def lesson_break_even(compile_seconds, eager_step, compiled_step, batch=1):   # as in the lesson
    saving = eager_step - compiled_step
    if saving <= 0:
        return math.inf
    return math.ceil(compile_seconds / saving) * batch


def steps_only(compile_seconds, eager_step, compiled_step, batch=1):
    saving = eager_step - compiled_step
    return math.ceil(compile_seconds / saving) if saving > 0 else math.inf


def not_rounded(compile_seconds, eager_step, compiled_step, batch=1):
    saving = eager_step - compiled_step
    return compile_seconds / saving * batch if saving > 0 else math.inf


def rounded_after(compile_seconds, eager_step, compiled_step, batch=1):
    saving = eager_step - compiled_step
    return math.ceil(compile_seconds / saving * batch) if saving > 0 else math.inf


def no_infinity(compile_seconds, eager_step, compiled_step, batch=1):
    return math.ceil(compile_seconds / (eager_step - compiled_step)) * batch


def negative_when_slower(compile_seconds, eager_step, compiled_step, batch=1):
    saving = eager_step - compiled_step
    return math.ceil(compile_seconds / saving) * batch if saving else math.inf


def saving_inverted(compile_seconds, eager_step, compiled_step, batch=1):
    saving = compiled_step - eager_step
    return math.ceil(compile_seconds / saving) * batch if saving > 0 else math.inf


def none_when_never(compile_seconds, eager_step, compiled_step, batch=1):
    saving = eager_step - compiled_step
    return math.ceil(compile_seconds / saving) * batch if saving > 0 else None


def rounded_down(compile_seconds, eager_step, compiled_step, batch=1):
    saving = eager_step - compiled_step
    return math.floor(compile_seconds / saving) * batch if saving > 0 else math.inf


def rounded_to_nearest(compile_seconds, eager_step, compiled_step, batch=1):
    saving = eager_step - compiled_step
    return round(compile_seconds / saving) * batch if saving > 0 else math.inf


def ratio_of_steps(compile_seconds, eager_step, compiled_step, batch=1):
    return math.ceil(compile_seconds / (eager_step / compiled_step)) * batch


def one_step_more(compile_seconds, eager_step, compiled_step, batch=1):
    saving = eager_step - compiled_step
    return (int(compile_seconds / saving) + 1) * batch if saving > 0 else math.inf


def tokens_as_a_float(compile_seconds, eager_step, compiled_step, batch=1):
    saving = eager_step - compiled_step
    return float(math.ceil(compile_seconds / saving) * batch) if saving > 0 else math.inf


def with_integer_division(compile_seconds, eager_step, compiled_step, batch=1):
    """Right, written another way: ceil as minus floor of minus."""
    saving = eager_step - compiled_step
    if saving <= 0:
        return math.inf
    return int(-(-compile_seconds // saving)) * batch


BREAK_EVEN_MISTAKES = {
    steps_only: "multiply by the batch",
    not_rounded: "round them up (math.ceil)",
    no_infinity: "divides by zero",
    negative_when_slower: "expected math.inf",
    saving_inverted: "the saving per step is eager_step − compiled_step",
    none_when_never: "return math.inf when the compiled step saves nothing",
    ratio_of_steps: "divided by the saving per step",
    rounded_down: "the steps were rounded down",
    rounded_to_nearest: "the steps were rounded down (3906.25 to 3906, by int(), floor or round())",
    rounded_after: "rounding the tokens up counts part of a step",
    one_step_more: "math.ceil, not int(...) + 1",
    tokens_as_a_float: "a float: return an int",
}


def test_break_even_check_passes_the_course_functions():
    assert_passes(check_break_even, lesson_break_even)
    assert_passes(check_break_even, break_even_tokens)
    assert_passes(check_break_even, with_integer_division)


def test_break_even_check_says_not_written_for_a_stub():
    assert_not_written(check_break_even, fallback=break_even_tokens)


@pytest.mark.parametrize("mistake", BREAK_EVEN_MISTAKES, ids=lambda f: f.__name__)
def test_break_even_check_catches(mistake):
    assert_caught(check_break_even, mistake, symptom=BREAK_EVEN_MISTAKES[mistake],
                  fallback=break_even_tokens)


# ---- replay: the lesson's solution and typical mistakes ---------------------------------------

def lesson_replay(graphs, token, position, pad_token_id):             # as in the lesson
    graph = graphs[capture_size(token.shape[0], list(graphs))]
    graph.token.copy_(pad_batch(token, graph.size, pad_token_id))
    graph.position.copy_(position)
    return graph.replay()[:token.shape[0]]


def copies_the_rows_then_the_padding(graphs, token, position, pad_token_id):   # also right
    rows = token.shape[0]
    graph = graphs[min(size for size in graphs if size >= rows)]
    graph.token[:rows] = token
    graph.token[rows:] = pad_token_id
    graph.position[:] = position
    return graph.replay()[:rows]


def assigns_new_buffers(graphs, token, position, pad_token_id):
    graph = graphs[capture_size(token.shape[0], list(graphs))]
    graph.token = pad_batch(token, graph.size, pad_token_id)
    graph.position = position
    return graph.replay()[:token.shape[0]]


def gives_the_buffers_new_memory(graphs, token, position, pad_token_id):
    graph = graphs[capture_size(token.shape[0], list(graphs))]
    graph.token.data = pad_batch(token, graph.size, pad_token_id)    # same tensor, new memory
    graph.position.data = position.clone()
    return graph.replay()[:token.shape[0]]


def sets_the_buffers(graphs, token, position, pad_token_id):
    graph = graphs[capture_size(token.shape[0], list(graphs))]
    graph.token.set_(pad_batch(token, graph.size, pad_token_id))
    graph.position.set_(position.clone())
    return graph.replay()[:token.shape[0]]


def looks_up_the_default_sizes(graphs, token, position, pad_token_id):
    graph = graphs[capture_size(token.shape[0])]                      # not the graphs' sizes
    graph.token.copy_(pad_batch(token, graph.size, pad_token_id))
    graph.position.copy_(position)
    return graph.replay()[:token.shape[0]]


def replays_the_cuda_graph_itself(graphs, token, position, pad_token_id):
    graph = graphs[capture_size(token.shape[0], list(graphs))]
    graph.token.copy_(pad_batch(token, graph.size, pad_token_id))
    graph.position.copy_(position)
    graph.graph.replay()                                               # StepGraph's inside
    return graph.output[:token.shape[0]]


def forgets_the_position(graphs, token, position, pad_token_id):
    graph = graphs[capture_size(token.shape[0], list(graphs))]
    graph.token.copy_(pad_batch(token, graph.size, pad_token_id))
    return graph.replay()[:token.shape[0]]


def forgets_the_tokens(graphs, token, position, pad_token_id):
    graph = graphs[capture_size(token.shape[0], list(graphs))]
    graph.position.copy_(position)
    return graph.replay()[:token.shape[0]]


def always_the_largest_graph(graphs, token, position, pad_token_id):
    graph = graphs[max(graphs)]
    graph.token.copy_(pad_batch(token, graph.size, pad_token_id))
    graph.position.copy_(position)
    return graph.replay()[:token.shape[0]]


def returns_the_padding_too(graphs, token, position, pad_token_id):
    graph = graphs[capture_size(token.shape[0], list(graphs))]
    graph.token.copy_(pad_batch(token, graph.size, pad_token_id))
    graph.position.copy_(position)
    return graph.replay()


def never_replays(graphs, token, position, pad_token_id):
    graph = graphs[capture_size(token.shape[0], list(graphs))]
    graph.token.copy_(pad_batch(token, graph.size, pad_token_id))
    graph.position.copy_(position)
    return graph.output[:token.shape[0]]


def replays_twice(graphs, token, position, pad_token_id):
    graph = graphs[capture_size(token.shape[0], list(graphs))]
    graph.token.copy_(pad_batch(token, graph.size, pad_token_id))
    graph.position.copy_(position)
    graph.replay()
    return graph.replay()[:token.shape[0]]


def returns_a_list(graphs, token, position, pad_token_id):
    return lesson_replay(graphs, token, position, pad_token_id).tolist()


def leaves_the_padding_rows(graphs, token, position, pad_token_id):
    graph = graphs[capture_size(token.shape[0], list(graphs))]
    graph.token[:token.shape[0]].copy_(token)        # the rows below keep an earlier step's
    graph.position.copy_(position)
    return graph.replay()[:token.shape[0]]


def pads_with_zeros(graphs, token, position, pad_token_id):
    graph = graphs[capture_size(token.shape[0], list(graphs))]
    graph.token.zero_()
    graph.token[:token.shape[0]].copy_(token)
    graph.position.copy_(position)
    return graph.replay()[:token.shape[0]]


REPLAY_MISTAKES = {
    leaves_the_padding_rows: "fill every row below the batch with pad_token_id",
    pads_with_zeros: "fill every row below the batch with pad_token_id",
    assigns_new_buffers: "copy into its buffers",
    gives_the_buffers_new_memory: "new memory for it",
    sets_the_buffers: "new memory for it",
    looks_up_the_default_sizes: "capture_size(batch, list(graphs))",
    replays_the_cuda_graph_itself: "stand-in graphs have what a StepGraph offers",
    forgets_the_position: "copy the new one into graph.position",
    forgets_the_tokens: "does not hold the batch's tokens",
    always_the_largest_graph: "smallest size that holds it",
    returns_the_padding_too: "the batch's rows only",
    never_replays: "call graph.replay()",
    replays_twice: "2 time(s)",
    returns_a_list: "should return a tensor",
}


def test_replay_check_passes_the_course_functions():
    from helpers.checks import check_replay
    from helpers.compilation import replay_step

    assert_passes(check_replay, lesson_replay)
    assert_passes(check_replay, copies_the_rows_then_the_padding)
    assert_passes(check_replay, replay_step)


def test_replay_check_says_not_written_for_a_stub():
    from helpers.checks import check_replay
    from helpers.compilation import replay_step

    assert_not_written(check_replay, fallback=replay_step)


@pytest.mark.parametrize("mistake", list(REPLAY_MISTAKES), ids=lambda f: f.__name__)
def test_replay_check_catches(mistake):
    from helpers.checks import check_replay
    from helpers.compilation import replay_step

    assert_caught(check_replay, mistake, symptom=REPLAY_MISTAKES[mistake], fallback=replay_step)

def padding_of_the_dtype_on_the_cpu(input_ids, size, pad_token_id):
    padding = torch.full((size - input_ids.shape[0], input_ids.shape[1]), pad_token_id,
                         dtype=input_ids.dtype)                    # on the CPU
    return torch.cat([input_ids, padding])


EXERCISES = [
    Exercise("CountingBackend", check_counting_backend, (), CountingBackend,
             right=[LessonBackend, ReturningTheGraph], wrong=COUNTING_MISTAKES),
    Exercise("capture_size", check_capture_size, (), capture_size,
             right=[lesson_capture_size, from_sorted_sizes], wrong=CAPTURE_MISTAKES),
    Exercise("pad_batch", check_pad_batch, ("device",), pad_batch,
             right=[lesson_pad_batch, padding_with_new_full_and_a_slice],
             wrong={**PAD_MISTAKES,
                    padding_of_the_dtype_on_the_cpu: "a tensor made on the CPU met one on the GPU"}),
    Exercise("break_even_tokens", check_break_even, (), break_even_tokens,
             right=[lesson_break_even, with_integer_division], wrong=BREAK_EVEN_MISTAKES),
    Exercise("replay", check_replay, (), replay_step,
             right=[lesson_replay, copies_the_rows_then_the_padding], wrong=REPLAY_MISTAKES),
]
