"""Lesson 10's checks pass the course's code, say "not written yet" for a stub, and catch the
mistakes learners make in capture sizes, padding, a counting backend and the break-even point
of a compile, each with a hint at its symptom."""

import math
import time

import pytest
import torch

from helpers.checks import (check_break_even, check_capture_size, check_counting_backend,
                            check_pad_batch)
from helpers.compilation import CountingBackend, break_even_tokens, capture_size, pad_batch
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


CAPTURE_MISTAKES = {
    rounding_down: "cannot hold the batch",
    strictly_larger: "compare with >=, not >",
    first_that_fits: "may come in any order",
    largest_when_too_big: "return None",
    raising_when_too_big: "raised ValueError: no size holds 65 rows",
    next_power_of_two: "not the next power of two",
}


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
    padding = torch.full((size - input_ids.shape[0], input_ids.shape[1]), float(pad_token_id))
    return torch.cat([input_ids.float(), padding])


def a_list(input_ids, size, pad_token_id):
    return lesson_pad_batch(input_ids, size, pad_token_id).tolist()


PAD_MISTAKES = {
    padding_on_top: "put them first and the padding below",
    padding_positions: "pad rows (dimension 0, the batch), not positions",
    only_the_padding: "return the whole batch",
    padding_with_zeros: "should hold pad_token_id (99)",
    float_padding: "token ids stay integers",
    a_list: "should return a tensor, got list",
}


def test_pad_batch_check_passes_the_course_functions():
    assert_passes(check_pad_batch, lesson_pad_batch)
    assert_passes(check_pad_batch, pad_batch)


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


COUNTING_MISTAKES = {
    ReturningNothing: "must return a callable",
    KeepingTheInputs: "keep the graph itself, gm",
    CountingCalls: "count in __call__, not inside the function you return",
    SharedList: "a list of its own",
    NotAppending: "append gm in __call__",
    OneArgument: "called with two arguments, gm and example_inputs",
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


def rounded_after(compile_seconds, eager_step, compiled_step, batch=1):   # also accepted
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


BREAK_EVEN_MISTAKES = {
    steps_only: "multiply by the batch",
    not_rounded: "round them up (math.ceil)",
    no_infinity: "divides by zero",
    negative_when_slower: "expected math.inf",
    saving_inverted: "the saving per step is eager_step − compiled_step",
    none_when_never: "return math.inf when the compiled step saves nothing",
    ratio_of_steps: "divided by the saving per step",
    rounded_down: "rounded up to whole steps",
    rounded_to_nearest: "rounded up to whole steps",
}


def test_break_even_check_passes_the_course_functions():
    assert_passes(check_break_even, lesson_break_even)
    assert_passes(check_break_even, break_even_tokens)
    assert_passes(check_break_even, rounded_after)


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


def assigns_new_buffers(graphs, token, position, pad_token_id):
    graph = graphs[capture_size(token.shape[0], list(graphs))]
    graph.token = pad_batch(token, graph.size, pad_token_id)
    graph.position = position
    return graph.replay()[:token.shape[0]]


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


REPLAY_MISTAKES = {
    assigns_new_buffers: "copy into them",
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
