"""Lesson 10's checks: capture sizes and padding, a backend that counts its compilations, and
the break-even point of a compile.

``capture_size`` and ``pad_batch`` are compared with ``helpers.compilation``'s on hand-made
batches and size lists (unsorted lists in an order that neither a first fit nor a bisect gets
right, batches too large for any size, the lesson's default sizes; int32 ids, on the lesson's
device). ``CountingBackend`` is first called by hand with a small traced graph, then used as
the backend of ``torch.compile`` on a small function made afresh for each check (a new code
object, so nothing TorchDynamo cached earlier interferes): one graph for the first call, none
for a call with the same shapes, one more for a new shape, the function's values at every call
(not only the first), and a list of its own for each backend. ``break_even_tokens`` is compared
with the formula on seven cases: two exact divisions, two where the compiled step saves nothing.
"""

from __future__ import annotations

import math

import torch

from ..compilation import CAPTURE_SIZES, CountingBackend, break_even_tokens, capture_size, pad_batch
from .core import Hint, device_hint, expect_equal, expect_unchanged, run_check

__all__ = ["check_break_even", "check_capture_size", "check_counting_backend", "check_replay",
           "check_pad_batch"]


# ---- capture_size -----------------------------------------------------------------------------

def _capture_cases(learner, cases):
    powers = (1, 2, 4, 8, 16, 32, 64)
    shuffled = (64, 8, 32, 1, 16, 4, 2)          # neither a first fit nor a bisect finds 4 for 3
    scenarios = [
        ("a batch of 1", 1, powers),
        ("a batch between two sizes", 3, powers),
        ("a batch that is a capture size", 8, powers),
        ("the largest size", 64, powers),
        ("a batch between 32 and 64", 33, powers),
        ("a list that is not powers of two", 17, (1, 2, 4, 8, 16, 24, 32)),
        ("sizes in no particular order", 3, [8, 1, 4, 2]),
        ("sizes in no particular order", 3, list(shuffled)),
        ("sizes in no particular order", 17, list(shuffled)),
        ("sizes in no particular order, a batch that is one of them", 16, list(shuffled)),
        ("a batch larger than every size", 65, powers),
        ("a batch larger than every size, unsorted", 65, list(shuffled)),
    ]
    for label, batch, sizes in scenarios:
        with cases(f"{label}: capture_size({batch}, {sizes})"):
            expected = capture_size(batch, sizes)
            given = list(sizes) if isinstance(sizes, list) else sizes
            try:
                got = learner(batch, given)
            except Exception as error:
                if expected is not None:
                    raise
                raise Hint(f"capture_size({batch}, {sizes}) raised {type(error).__name__}: no "
                           f"size holds {batch} rows, so the batch runs without a compiled "
                           f"graph: return None") from None
            if isinstance(sizes, list):
                expect_unchanged("sizes", sizes, given)
            if got is not None and (isinstance(got, bool) or not isinstance(got, int)):
                raise Hint(f"capture_size({batch}, {sizes}) gave {got!r}, a "
                           f"{type(got).__name__}: return one of the sizes as it is (an int), or "
                           f"None; pad_batch makes that many rows")
            if got == expected and (got is None) == (expected is None):
                continue
            where = f"capture_size({batch}, {sizes}) gave {got!r}, expected {expected!r}"
            if expected is None:
                raise Hint(f"{where}: no size holds {batch} rows, so the batch runs without a "
                           f"compiled graph: return None")
            if isinstance(got, (int, float)) and not isinstance(got, bool) and got < batch:
                raise Hint(f"{where}: {got} rows cannot hold the batch; take the smallest size "
                           f"that is at least the batch (size >= batch)")
            if batch in sizes and got != batch:
                raise Hint(f"{where}: a batch that is already a capture size needs no padding: "
                           f"compare with >=, not >")
            if label.startswith("sizes"):
                raise Hint(f"{where}: the sizes may come in any order; take the smallest of those "
                           f"that fit (min), not the first one (nor a bisect, which needs them "
                           f"sorted)")
            if got == 1 << (batch - 1).bit_length():
                raise Hint(f"{where}: use the sizes given, not the next power of two")
            expect_equal(f"capture_size({batch}, {sizes})", got, expected)
    with cases(f"the lesson's call with the default sizes: capture_size(5) (sizes={CAPTURE_SIZES})"):
        got = learner(5)
        if got != capture_size(5):
            raise Hint(f"capture_size(5) gave {got!r}, expected {capture_size(5)}: keep the "
                       f"default sizes=CAPTURE_SIZES, which the lesson's later cells use")


def check_capture_size(learner_capture_size):
    """Lesson 10: check the learner's ``capture_size(batch, sizes=CAPTURE_SIZES)`` (the smallest
    size that holds the batch, None when none does) against ``helpers.compilation.capture_size``
    on sorted and unsorted sizes, batches too large for any size and the default sizes; print
    one line and return the function the rest of the lesson should use."""
    return run_check("capture_size", learner_capture_size, _capture_cases, fallback=capture_size,
                     causes={"missing 1 required positional argument": "keep the default, "
                             "def capture_size(batch, sizes=CAPTURE_SIZES): the lesson calls "
                             "capture_size(batch)",
                             "object has no attribute 'sort'": "the sizes may be a tuple "
                             "(CAPTURE_SIZES is one) and are not yours to change: sorted(sizes) "
                             "makes a sorted copy, or take min() of those that fit"})


# ---- pad_batch --------------------------------------------------------------------------------

def _pad_cases(learner, cases, device):
    rows = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]], device=device)
    scenarios = [("3 rows padded to 4", rows, 4, 0),
                 ("3 rows padded to 8, pad id 99", rows, 8, 99),
                 ("1 row padded to 2", rows[:1], 2, 0),
                 ("a batch that already has the size", rows, 3, 0),
                 ("ids of another integer type (int32)", rows.int(), 4, 7)]
    for label, ids, size, pad in scenarios:
        where = f"a {tuple(ids.shape)} {str(ids.dtype).replace('torch.', '')} tensor on {device}"
        with cases(f"{label}: pad_batch({where}, {size}, {pad})"):
            expected = pad_batch(ids, size, pad)
            before = ids.clone()
            given = ids.clone()
            got = learner(given, size, pad)
            expect_unchanged("input_ids", before, given)
            batch = ids.shape[0]
            if not isinstance(got, torch.Tensor):
                raise Hint(f"pad_batch should return a tensor, got {type(got).__name__}")
            if tuple(got.shape) == (batch, size) and size != batch:
                raise Hint(f"got shape {tuple(got.shape)}, expected {tuple(expected.shape)}: pad "
                           f"rows (dimension 0, the batch), not positions")
            if tuple(got.shape) == (size - batch, ids.shape[1]) and size != batch:
                raise Hint(f"got shape {tuple(got.shape)}, expected {tuple(expected.shape)}: "
                           f"return the whole batch, the real rows followed by the padding")
            if tuple(got.shape) != tuple(expected.shape):
                raise Hint(f"got shape {tuple(got.shape)}, expected {tuple(expected.shape)}: "
                           f"(size, sequence)")
            if got.dtype != ids.dtype:
                raise Hint(f"the result is {got.dtype}, the input {ids.dtype}: token ids stay "
                           f"integers (input_ids.new_full(...) keeps the dtype and device)")
            if got.device != ids.device:
                raise Hint(device_hint("the padded batch", got.device, ids.device))
            if torch.equal(got, expected):
                continue
            if size > batch and torch.equal(got[size - batch:], ids):
                raise Hint("the real rows are at the bottom: put them first and the padding "
                           "below, so that row i of the output is row i of the input and the "
                           "step's output for them is out[:batch]")
            if torch.equal(got[:batch], ids) and not (got[batch:] == pad).all():
                raise Hint(f"the new rows should hold pad_token_id ({pad}), got "
                           f"{got[batch:].flatten().tolist()[:6]}")
            if not torch.equal(got[:batch], before):
                raise Hint("the real rows changed: copy them as they are")
            expect_equal("the padded batch", got.tolist(), expected.tolist())


def check_pad_batch(learner_pad_batch, device="cpu"):
    """Lesson 10: check the learner's ``pad_batch(input_ids, size, pad_token_id)`` against
    ``helpers.compilation.pad_batch`` on five batches on ``device`` (the lesson's:
    ``model.device``), one of int32 ids: same values, dtype and device; print one line and
    return the function the rest of the lesson should use."""
    device = torch.device(device)
    return run_check("pad_batch", learner_pad_batch,
                     lambda learner, cases: _pad_cases(learner, cases, device), fallback=pad_batch,
                     gpu=True)


# ---- CountingBackend --------------------------------------------------------------------------

def _fresh_function():
    """A small function with a code object of its own, so that TorchDynamo has nothing cached
    for it whatever ran before."""
    namespace = {"torch": torch}
    exec("def scaled_sine(x):\n    return torch.sin(x) * 2 + 1\n", namespace)  # noqa: S102
    return namespace["scaled_sine"]


def _call(compiled, x):
    """Call a compiled function; a failure inside the backend surfaces as the learner's own
    exception (TorchDynamo wraps it in BackendCompilerFailed)."""
    from torch._dynamo.exc import BackendCompilerFailed

    try:
        return compiled(x)
    except BackendCompilerFailed as error:
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if isinstance(inner, NotImplementedError):
            raise NotImplementedError() from None
        if inner is not None and "did not return callable" not in str(error):
            raise inner from None
        raise Hint("the backend must return a callable that runs the graph: return gm.forward "
                   "(or gm itself)") from None


def _counting_cases(learner_class, cases):
    fn = _fresh_function()
    x = torch.arange(6.0).view(2, 3)
    with cases("a backend called by hand with a traced graph"):
        backend = learner_class()
        if not isinstance(getattr(backend, "graphs", None), list):
            raise Hint("a new backend should have an empty list in self.graphs (made in __init__)")
        gm = torch.fx.symbolic_trace(fn)
        runner = backend(gm, [x])
        if not callable(runner):
            raise Hint(f"the backend returned {type(runner).__name__}; it must return a callable "
                       f"that runs the graph: gm.forward")
        if not torch.allclose(runner(x), fn(x)):
            raise Hint("what the backend returned computes other values: return gm.forward, "
                       "which runs the graph as it was traced")
        if len(backend.graphs) != 1:
            raise Hint(f"after one call, backend.graphs holds {len(backend.graphs)} items, "
                       f"expected 1: append gm in __call__")
        if backend.graphs[0] is not gm:
            raise Hint(f"backend.graphs holds a {type(backend.graphs[0]).__name__}; keep the "
                       f"graph itself, gm (example_inputs are only sample tensors)")
    with cases("a second backend starts empty"):
        backend = learner_class()
        if backend.graphs:
            raise Hint("a new backend already holds graphs: every backend needs a list of its "
                       "own, made in __init__ (self.graphs = []), not one shared by the class")
    compiled = torch.compile(fn, backend=backend, dynamic=False)
    with cases("torch.compile with the backend, a first call"):
        out = _call(compiled, x)
        if not torch.allclose(out, fn(x)):
            raise Hint("the compiled function gives other values than the function itself: "
                       "return gm.forward")
        if len(backend.graphs) != 1:
            raise Hint(f"one call compiled {len(backend.graphs)} graphs by your count, expected 1")
    with cases("a second call with tensors of the same shape"):
        out = _call(compiled, x + 1)
        if not torch.allclose(out, fn(x + 1)):
            raise Hint("a second call with new values gives what the first call gave (or other "
                       "values than the function): the callable you return must run the graph "
                       "on the inputs it is given, gm.forward, not a result kept from before")
        if len(backend.graphs) != 1:
            raise Hint(f"backend.graphs holds {len(backend.graphs)} graphs after two calls of the "
                       f"same shape, expected 1: the backend is called once per compilation; "
                       f"count in __call__, not inside the function you return")
    with cases("a call with a new shape (dynamic=False: a recompilation)"):
        y = torch.linspace(-2, 2, 12).view(4, 3)
        out = _call(compiled, y)
        if not torch.allclose(out, fn(y)):
            raise Hint("the compiled function gives other values than the function for a new "
                       "shape: return gm.forward, which runs the graph it was given")
        if len(backend.graphs) != 2:
            raise Hint(f"backend.graphs holds {len(backend.graphs)} graphs after a new shape, "
                       f"expected 2")


COUNTING_CAUSES = {
    "did not return callable": "the backend must return a callable: gm.forward",
    "takes 2 positional arguments but 3 were given": "a backend is called with two arguments, "
                                                     "gm and example_inputs",
}


def check_counting_backend(learner_counting_backend):
    """Lesson 10: check the learner's ``CountingBackend`` class (a ``torch.compile`` backend
    that keeps each graph in ``self.graphs`` and runs it as it is) by hand and under
    ``torch.compile``; print one line and return the class the rest of the lesson should
    use."""
    return run_check("CountingBackend", learner_counting_backend, _counting_cases,
                     fallback=CountingBackend, kind="class", causes=COUNTING_CAUSES)


# ---- break_even_tokens ------------------------------------------------------------------------

def _break_even_cases(learner, cases):
    scenarios = [
        ("batch 1", 30.0, 0.0060, 0.0031, 1),
        ("batch 64", 25.0, 0.0300, 0.0249, 64),
        ("batch 8", 12.5, 0.0093, 0.0061, 8),
        ("an exact division: 3 s / 0.25 s = 12 steps", 3.0, 0.5, 0.25, 1),
        ("an exact division at batch 4: 1.5 s / 0.125 s = 12 steps", 1.5, 0.25, 0.125, 4),
        ("a compiled step no faster", 20.0, 0.004, 0.004, 1),
        ("a compiled step slower", 20.0, 0.004, 0.005, 4),
    ]
    for label, compile_s, eager, compiled, batch in scenarios:
        call = f"break_even_tokens({compile_s}, {eager}, {compiled}, batch={batch})"
        with cases(f"{label}: {call}"):
            expected = break_even_tokens(compile_s, eager, compiled, batch)
            try:
                got = learner(compile_s, eager, compiled, batch)
            except ZeroDivisionError:
                raise Hint(f"{call} divides by zero: when the compiled step saves nothing, "
                           f"compiling never pays; return math.inf") from None
            if isinstance(got, bool) or not isinstance(got, (int, float)):
                if expected == math.inf:
                    raise Hint(f"{call} gave {got!r}: return math.inf when the compiled step "
                               f"saves nothing (or is slower)")
                raise Hint(f"{call} should be a number of tokens (an int), got "
                           f"{type(got).__name__}")
            value = float(got)
            if expected == math.inf:
                if value != math.inf:
                    raise Hint(f"{call} gave {got!r}, expected math.inf: a compiled step that is "
                               f"not faster never pays back its compile time")
                continue
            saving = eager - compiled
            steps = compile_s / saving
            if value == math.inf or value < 0:
                raise Hint(f"{call} gave {got!r}: the saving per step is eager_step − "
                           f"compiled_step ({saving:.4g} s here), positive when compiling helps")
            if abs(value - math.ceil(steps)) < 1e-6 and batch > 1:
                raise Hint(f"{call} gave {got!r}, expected {expected}: that is the number of "
                           f"steps; each step writes batch tokens, so multiply by the batch")
            if abs(value - steps * batch) < 1e-6 and not value.is_integer():
                raise Hint(f"{call} gave {got!r}, expected {expected}: the steps are whole "
                           f"steps, so round them up (math.ceil) before multiplying by the "
                           f"batch")
            if steps.is_integer() and value == (steps + 1) * batch:
                raise Hint(f"{call} gave {got!r}, expected {expected}: {compile_s} / {saving} "
                           f"is exactly {steps:.0f} steps, and rounding up leaves a whole number "
                           f"as it is: math.ceil, not int(...) + 1")
            if value == expected and not isinstance(got, int):
                raise Hint(f"{call} gave {got!r}, a float: return an int (math.ceil gives one), "
                           f"as the lesson prints it as a count of tokens")
            if value != expected:
                if value == math.floor(steps) * batch:
                    raise Hint(f"{call} gave {got!r}, expected {expected}: the steps were rounded "
                               f"down ({steps:.7g} to {math.floor(steps)}, by int(), floor or "
                               f"round()); the last part of a step still needs a whole step, so "
                               f"round up: math.ceil")
                if value == math.ceil(steps * batch):
                    raise Hint(f"{call} gave {got!r}, expected {expected}: round the steps up "
                               f"(math.ceil(compile_seconds / saving)), then multiply by the "
                               f"batch; rounding the tokens up counts part of a step")
                raise Hint(f"{call} gave {got!r}, expected {expected}: compile_seconds divided "
                           f"by the saving per step, rounded up to whole steps, times the batch")


def check_break_even(learner_break_even_tokens):
    """Lesson 10: check the learner's ``break_even_tokens(compile_seconds, eager_step,
    compiled_step, batch)`` against ``helpers.compilation.break_even_tokens`` on seven cases
    (two exact divisions, two where the compiled step saves nothing); print one line and return
    the function the rest of the lesson should use."""
    return run_check("break_even_tokens", learner_break_even_tokens, _break_even_cases,
                     fallback=break_even_tokens)


# ---- replay (CUDA graphs: the copy-in and the choice of graph) -----------------------------------

#: The token every row of a stand-in graph's buffer holds before the first replay: what an
#: earlier step (another batch) left there.
STALE = 42


class _RecordedStep:
    """A stand-in for one ``StepGraph`` of ``size`` rows, for the check: its buffers, and a
    "replay" that computes each row's next token from the buffers' contents alone (row by row,
    as a decode step does), counting the replays. Any change of a buffer's address is seen."""

    def __init__(self, size: int):
        self.size = size
        self.token = torch.full((size, 1), STALE, dtype=torch.long)   # an earlier step's
        self.position = torch.zeros(1, dtype=torch.long)
        self.output = torch.zeros(size, 1, dtype=torch.long)
        self.replays = 0
        self._recorded = (self.token, self.position, self.output)
        self._addresses = tuple(t.data_ptr() for t in self._recorded)

    def moved(self) -> bool:
        """Whether a buffer is no longer the one recorded: another tensor in its place, or the
        same tensor given other memory (``.data = ...``, ``.set_(...)``)."""
        now = (self.token, self.position, self.output)
        return (any(a is not b for a, b in zip(now, self._recorded))
                or tuple(t.data_ptr() for t in self._recorded) != self._addresses)

    def replay(self):
        self.replays += 1
        token, position, output = self._recorded      # what a graph reads: the recorded ones
        output.copy_((token * 7 + position * 3 + 1) % 101)
        return output


def _recorded_graphs(sizes=(1, 8, 64)) -> dict:
    return {size: _RecordedStep(size) for size in sizes}


def _replay_cases(learner, cases):
    from ..compilation import replay_step

    pad = 100                     # not 0: zeros are no padding here
    for label, batch, position in [("a batch that is a capture size (8 rows)", 8, 5),
                                   ("a batch padded up to a capture size (3 rows into 8)", 3, 9),
                                   ("a batch of one row", 1, 12),
                                   ("a batch padded up to the largest size (33 rows)", 33, 4)]:
        with cases(label):
            generator = torch.Generator().manual_seed(batch)
            token = torch.randint(1, 100, (batch, 1), generator=generator)
            before = token.clone()
            graphs, reference = _recorded_graphs(), _recorded_graphs()
            expected = replay_step(reference, token, torch.tensor([position]), pad)
            given_position = torch.tensor([position])
            got = learner(graphs, token, given_position, pad)
            size = capture_size(batch, list(graphs))
            if any(g.moved() for g in graphs.values()):
                raise Hint("a graph reads the memory it recorded: copy into its buffers "
                           "(graph.token.copy_(...), graph.position.copy_(...)); a new tensor "
                           "in graph.token, or new memory for it (.data =, .set_), leaves the "
                           "graph reading the old one")
            replayed = {s: g.replays for s, g in graphs.items() if g.replays}
            if not replayed:
                raise Hint("no graph was replayed: after copying the inputs in, call "
                           "graph.replay() and read its output")
            if replayed != {size: 1}:
                raise Hint(f"the batch of {batch} rows replayed the graph(s) of "
                           f"{sorted(replayed)} rows {sum(replayed.values())} time(s); replay "
                           f"once the graph of the smallest size that holds it, {size} rows "
                           f"(capture_size)")
            if not torch.equal(token, before):
                raise Hint("replay changed the token tensor it was given: copy it into the "
                           "graph's buffer, do not write into it")
            expect_unchanged("position", torch.tensor([position]), given_position)
            if not isinstance(got, torch.Tensor):
                raise Hint(f"replay should return a tensor (the graph's output rows), got "
                           f"{type(got).__name__}")
            if got.shape == (size, 1) and size != batch:
                raise Hint(f"replay returned all {size} rows of the graph's output; return the "
                           f"batch's rows only, output[:{batch}] (the rest are padding)")
            if got.dtype != expected.dtype or got.device != expected.device:
                raise Hint(f"replay returned {got.dtype} on {got.device}; the graph's output "
                           f"is {expected.dtype} on {expected.device}: return it as it is")
            if tuple(got.shape) != (batch, 1):
                raise Hint(f"replay returned shape {tuple(got.shape)}, expected ({batch}, 1): "
                           f"the first {batch} rows of the graph's output")
            graph = graphs[size]
            if not torch.equal(graph.position, torch.tensor([position])):
                raise Hint("the graph still holds the previous position: copy the new one into "
                           "graph.position before the replay")
            if not torch.equal(graph.token[:batch], token):
                raise Hint("the graph's token buffer does not hold the batch's tokens: copy "
                           "them into its first rows (pad_batch(token, graph.size, pad_token_id)"
                           " makes the rows below them) before the replay")
            stale = (graph.token[batch:] != pad).nonzero()
            if len(stale):
                row = batch + int(stale[0, 0])
                value = int(graph.token[row, 0])
                raise Hint(f"row {row} of the graph's token buffer, below the batch's {batch} "
                           f"rows, holds {value}"
                           + (", what an earlier step left there" if value == STALE else "")
                           + f": fill every row below the batch with pad_token_id ({pad} here), "
                             f"so that the padding rows the graph computes read a known token")
            if not torch.equal(got, expected):
                raise Hint("the rows returned are not the replay's output for this batch")
    with cases("two steps in a row: the second replay reads the second step's inputs"):
        graphs = _recorded_graphs()
        first = learner(graphs, torch.tensor([[5], [6]]), torch.tensor([3]), pad).clone()
        second = learner(graphs, torch.tensor([[7], [8]]), torch.tensor([4]), pad)
        want = replay_step(_recorded_graphs(), torch.tensor([[7], [8]]), torch.tensor([4]), pad)
        if torch.equal(second, first) or not torch.equal(second, want):
            raise Hint("the second step gave the first step's tokens: copy each step's token "
                       "and position into the graph's buffers before every replay")


def check_replay(learner_replay):
    """Lesson 10: check the learner's ``replay(graphs, token, position, pad_token_id)`` (the
    copy-in with its padding rows, the choice of graph, the replay, the batch's rows) on
    stand-in graphs that notice a buffer replaced instead of filled; print one line and return the function the rest of
    the lesson should use."""
    from ..compilation import replay_step

    return run_check("replay", learner_replay, _replay_cases, fallback=replay_step,
                     causes=_replay_cause)


def _replay_cause(error: Exception) -> str | None:
    if isinstance(error, KeyError):
        return ("look the graph up by one of the graphs' own sizes: "
                "capture_size(batch, list(graphs))")
    if isinstance(error, AttributeError) and "_RecordedStep" in str(error):
        return ("the check's stand-in graphs have what a StepGraph offers a replay: size, "
                "token, position and replay(), which returns the output")
    return None
