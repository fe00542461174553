"""The machinery of the learners' checks (every lesson's "Your turn" exercises).

A check runs the learner's code and the course's on a few cases, edge cases included, and
prints one line: a pass, or the first difference it found, said so that the learner can act on
it (which row, which position, expected against got, and the usual cause when there is one).
Never a traceback: an exception in the learner's code becomes that one line too, and a stub
that still raises ``NotImplementedError`` is "not written yet".

Whatever happens, a check returns what the rest of the lesson should use: the learner's code
when it passed, the course's version otherwise (and it says so), so that a workbook keeps
running to its end with an exercise missing or wrong.

A lesson's check is a function ``check_<name>(learner_code, ...)``; its cases live in a
*checker*, a function that raises :class:`Hint` at the first difference::

    def _merge_cases(merge_batches, cases):
        with cases("two rows of different lengths"):
            ...
            if got != expected:
                raise Hint("row 1 ...")

    def check_merge_batches(merge_batches):
        return run_check("merge_batches", merge_batches, _merge_cases, fallback=reference)
"""

from __future__ import annotations

import numbers
import weakref
from contextlib import contextmanager
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

PASSED, FAILED, NOT_YET = "✓", "✗", "…"
NOT_WRITTEN = "not written yet"
USING_OURS = "the rest of the lesson uses the course's version"
MAX_LINE = 400
DEVICES_MET = ("a tensor made on the CPU met one on the GPU: make every new tensor on the "
               "inputs' device (device=x.device, x.new_zeros(...), .to(model.device))")


MADE_ON_THE_CPU = ("made on the CPU (torch.tensor, torch.zeros, torch.arange ... without device=, "
                   "or .cpu())")


class Hint(Exception):
    """The first difference a check found, in words a learner can act on."""


class Cases:
    """Counts the cases a checker runs and remembers which one is running, so that a hint or
    an exception can name it: ``with cases("a row that finishes at once"): ...``."""

    def __init__(self):
        self.passed = 0
        self.current: str | None = None

    @contextmanager
    def __call__(self, description: str):
        self.current = description
        yield
        self.passed += 1
        self.current = None


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_LINE else text[:MAX_LINE - 1] + "…"


def run_check(name: str, candidate: Any, checker: Callable[[Any, Cases], None], fallback: Any,
              kind: str = "function", causes: dict[str, str] | None = None,
              gpu: Any = None) -> Any:
    """Run ``checker(candidate, cases)``, print one line, and return ``candidate`` when it
    passed or ``fallback`` (the course's version) when it did not.

    ``causes`` maps a piece of an exception's message to its usual cause in this exercise
    (``{"Sizes of tensors must match": "pad the shorter history first"}``), or is a function
    of the exception that returns that cause (or None): when the learner's code raises such an
    exception, the line ends with that cause.

    ``gpu`` says that the cases' tensors stand for tensors on a GPU (the lesson's
    ``model.device`` on Colab): the learner's function then runs inside :class:`OnTheGpu`
    (``gpu`` is the model it feeds, or True), which catches on any device the tensors a GPU
    would refuse."""
    if candidate is None or (kind == "function" and not callable(candidate)):
        print(f"{FAILED} {name}: expected a {kind}, got {type(candidate).__name__}; "
              f"{USING_OURS}.")
        return fallback
    cases = Cases()
    try:
        checker(candidate if gpu is None else on_the_gpu(candidate, gpu), cases)
    except NotImplementedError:
        print(f"{NOT_YET} {name}: {NOT_WRITTEN}; {USING_OURS}.")
        return fallback
    except Hint as hint:
        where = f" (case: {cases.current})" if cases.current else ""
        print(_one_line(f"{FAILED} {name}{where}: {hint}") + f" ({USING_OURS})")
        return fallback
    except Exception as error:     # the learner's code failed: one line, never a traceback
        where = f" on the case: {cases.current}" if cases.current else ""
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if callable(causes):
            cause = causes(error)
        else:
            cause = next((c for text, c in (causes or {}).items() if text in str(error)), None)
        if cause is None and "same device" in str(error):     # torch's words for two devices
            cause = DEVICES_MET
        message = (message if len(message) <= 100 else message[:99] + "…")
        message += f"; likely cause: {cause}" if cause else ""
        print(_one_line(f"{FAILED} {name} raised {type(error).__name__}{where}: {message}")
              + f" ({USING_OURS})")
        return fallback
    print(f"{PASSED} {name}: right on all {cases.passed} cases.")
    return candidate


# ---- comparisons that raise a Hint at the first difference --------------------------------

def shape_of(x) -> tuple:
    return tuple(x.shape) if hasattr(x, "shape") else ()


def dtype_name(dtype) -> str:
    """``torch.int64`` -> ``'int64 (torch.long)'``: the name a learner finds in the docs."""
    name = str(dtype).replace("torch.", "")
    aliases = {"int64": "torch.long", "float32": "torch.float", "float64": "torch.double",
               "int32": "torch.int", "float16": "torch.half"}
    return f"{name} ({aliases[name]})" if name in aliases else name


def _is_integer_dtype(dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex) and dtype != torch.bool


def dtype_hint(what: str, got, expected) -> str:
    """The sentence that names a dtype difference and its usual cause."""
    said = f"{what} holds {dtype_name(got)}, expected {dtype_name(expected)}"
    if _is_integer_dtype(expected) and (got.is_floating_point or got == torch.bool):
        return (f"{said}: ids, masks, positions and codes are integers; torch.zeros and "
                f"torch.ones make floats unless given dtype={expected}")
    if expected.is_floating_point and not got.is_floating_point:
        return f"{said}: the values are real numbers; compute in floats (.float())"
    return (f"{said}: keep the dtype of the inputs (a new tensor takes dtype=... of the tensor "
            f"it joins, e.g. x.new_zeros(...), torch.zeros_like(x))")


def device_hint(what: str, got, expected) -> str:
    """The sentence that names a device difference and its usual cause."""
    return (f"{what} is on {got}, expected {expected}, where the inputs are: make every new "
            f"tensor on the inputs' device (device=x.device, x.new_zeros(...), "
            f"torch.zeros_like(x)) or move it with .to(x.device); on a GPU, tensors on two "
            f"devices cannot meet in one operation")


def expect_shape(what: str, got, shape: tuple, why: str = "") -> None:
    """Raise a Hint unless ``got`` is a tensor of ``shape``; ``why`` ends the hint
    (": one position per token")."""
    if not isinstance(got, torch.Tensor):
        raise Hint(f"{what} should be a tensor of shape {tuple(shape)}, got {type(got).__name__}")
    if tuple(got.shape) != tuple(shape):
        raise Hint(f"{what} has shape {tuple(got.shape)}, expected {tuple(shape)}{why}")


def expect_like(what: str, got, expected: torch.Tensor, why: str = "") -> None:
    """Raise a Hint unless ``got`` is a tensor of ``expected``'s shape, dtype and device: what
    the lesson's later cells feed it to (the model's embedding wants integer ids, a tensor on
    the CPU cannot meet one on the GPU)."""
    expect_shape(what, got, tuple(expected.shape), why)
    expect_kind(what, got, expected)


def expect_kind(what: str, got: torch.Tensor, like: torch.Tensor) -> None:
    """Raise a Hint unless the tensor ``got`` has ``like``'s dtype and device (its shape may
    differ: a rank's shard of a weight, say)."""
    if got.dtype != like.dtype:
        raise Hint(dtype_hint(what, got.dtype, like.dtype))
    if got.device != like.device:
        raise Hint(device_hint(what, got.device, like.device))


def expect_tensor(what: str, got, expected: torch.Tensor, atol: float = 0.0,
                  rows: str = "row", cols: str = "column") -> None:
    """Raise a Hint naming the first place where ``got`` differs from ``expected``: a missing
    tensor, another shape, another dtype or device, the first (row, column) whose value
    differs, or, the values right, a tensor made on the CPU in a case that stands for a GPU
    (:class:`OnTheGpu`)."""
    expect_like(what, got, expected)
    got_c, exp_c = got.detach().cpu(), expected.detach().cpu()
    if got_c.is_floating_point() or exp_c.is_floating_point():
        bad = ~torch.isclose(got_c.double(), exp_c.double(), atol=atol, rtol=1e-4 if atol else 0)
    else:
        bad = got_c != exp_c
    if not bad.any():
        if made_on_host(got) and not made_on_host(expected):   # right values, wrong place
            raise Hint(host_hint(what))
        return
    index = tuple(int(i) for i in bad.nonzero()[0])
    names = [rows, cols] + [f"dim {d}" for d in range(2, len(index))]
    place = ", ".join(f"{n} {i}" for n, i in zip(names, index)) or "the value"
    g, e = got_c[index].item(), exp_c[index].item()
    fmt = (lambda v: f"{v:.4g}") if isinstance(e, float) else str
    raise Hint(f"{what} differs at {place}: got {fmt(g)}, expected {fmt(e)}")


def expect_unchanged(what: str, before, after) -> None:
    """Raise a Hint when the learner's code changed an input it was given: ``before`` is a
    copy taken before the call (``snapshot``), ``after`` the input itself, a tensor, a list, a
    dict, a batch or a KV cache, compared all the way down. The lesson goes on using its
    inputs afterwards."""
    change = first_change(before, after, what)
    if change:
        raise Hint(f"your code changed its input {what} in place ({change}); the lesson uses "
                   f"it again afterwards: compute into new tensors, lists and dicts (no +=, "
                   f"*_() methods, .append/.pop or slice assignment on the input)")


def expect_equal(what: str, got, expected) -> None:
    """Raise a Hint when two plain values (numbers, lists) differ, with both shown."""
    if got != expected:
        raise Hint(f"{what}: got {_short(got)}, expected {_short(expected)}")


def expect_number(what: str, got) -> float:
    """``got`` as a float, or a Hint unless it is a plain number (an int or a float, not a
    string, a tensor or a bool): the lesson's later cells format and add it."""
    if isinstance(got, bool) or not isinstance(got, numbers.Real):
        extra = ": use .item()" if isinstance(got, torch.Tensor) and got.numel() == 1 else ""
        raise Hint(f"{what} should be a number (an int or a float), got "
                   f"{type(got).__name__}{extra}")
    return float(got)


def expect_int_list(what: str, got) -> list[int]:
    """``got`` itself when it is a list of Python ints; else a Hint that names what it holds
    (a tensor, a tuple, a list of tensors or floats): the lesson compares it with lists of
    ints and decodes it."""
    if isinstance(got, torch.Tensor):
        raise Hint(f"{what} should be a list of ints, got a tensor: return .tolist() of it, or "
                   f"append int(token) at every step")
    if not isinstance(got, list):
        raise Hint(f"{what} should be a list of ints, got {type(got).__name__}")
    for item in got:
        if isinstance(item, bool) or not isinstance(item, int):
            how = (": append int(token), not the tensor" if isinstance(item, torch.Tensor)
                   else "")
            raise Hint(f"{what} should be a list of ints, but it holds "
                       f"{type(item).__name__} values{how}")
    return got


def expect_close(what: str, got, expected: float, rel: float = 1e-6) -> None:
    """Raise a Hint when a number is not within ``rel`` of the expected one (or is no number)."""
    value = expect_number(what, got)
    if not abs(value - expected) <= rel * max(abs(expected), 1e-12):
        raise Hint(f"{what}: got {value:.6g}, expected {expected:.6g}")


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


# ---- cases that stand for a GPU, on any device --------------------------------------------

_ON_HOST: dict[int, weakref.ref] = {}          # id -> the tensor, for those made on the CPU
#: Operations a GPU runs with a CPU tensor among their operands (an index, a value to copy).
_MIXED_ALLOWED = {"__getitem__", "__setitem__", "copy_", "to", "index_put_", "equal",
                  "__get__", "__set__"}


def made_on_host(tensor) -> bool:
    """True when ``tensor`` was made on the CPU by code that ran inside :class:`OnTheGpu` (a
    constructor without ``device=``, ``.cpu()``, or computed from such tensors alone)."""
    ref = _ON_HOST.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
    return ref is not None and ref() is tensor


def _mark(value, host: bool) -> None:
    for t in tree_flatten(value)[0]:
        if not isinstance(t, torch.Tensor):
            continue
        if host:
            _ON_HOST[id(t)] = weakref.ref(t)
        else:
            _ON_HOST.pop(id(t), None)


def _target(args, kwargs):
    """Where ``.to(...)`` sends a tensor: 'host', 'device', the tensor it follows, or None
    (a dtype only)."""
    for value in [kwargs.get("device"), *args[1:]]:
        if isinstance(value, str):
            return "host" if value.startswith("cpu") else "device"
        if isinstance(value, torch.device):
            return "device"        # the lesson's device (model.device, x.device)
        if isinstance(value, torch.Tensor):
            return value
    return None


class OnTheGpu(TorchFunctionMode):
    """Runs code as if the tensors it is given were on a GPU, whatever device they are on:
    every tensor the code makes on the CPU (a constructor such as ``torch.zeros`` or
    ``torch.tensor`` without ``device=``, ``.cpu()``, ``.to("cpu")``) is marked, and so is
    what is computed from marked tensors alone; an operation that mixes a marked tensor with
    another one, which a GPU refuses ("Expected all tensors to be on the same device"), is a
    :class:`Hint`, and so is a marked tensor fed to ``model`` (when given). Inside the model's
    own forward nothing is marked: its code is the library's. ``made_on_host`` tells a result
    apart afterwards."""

    def __init__(self, model=None):
        super().__init__()
        from torch.utils._device import _device_constructors

        self.constructors = _device_constructors()
        self.model = model if isinstance(model, torch.nn.Module) else None
        self.inside_model = 0
        self.handles = []
        for dead in [k for k, ref in _ON_HOST.items() if ref() is None]:
            del _ON_HOST[dead]

    def __enter__(self):
        if self.model is not None:
            self.handles = [
                self.model.register_forward_pre_hook(self._fed, with_kwargs=True, prepend=True),
                self.model.register_forward_hook(self._done, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return super().__exit__(*exc)

    def _fed(self, module, args, kwargs):
        for name, value in [("input_ids", a) for a in args] + list(kwargs.items()):
            if isinstance(value, torch.Tensor) and value.dim() and made_on_host(value):
                raise Hint(f"the model was fed {name} {MADE_ON_THE_CPU}: on a GPU a tensor made "
                           f"on the CPU met one on the GPU there; make it on model.device or "
                           f"move it with .to(model.device)")
        self.inside_model += 1

    def _done(self, module, args, output):
        self.inside_model = max(0, self.inside_model - 1)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside_model:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        host = [t for t in tensors if made_on_host(t)]
        if func in self.constructors and kwargs.get("device") is None and not (
                args and isinstance(args[0], torch.Tensor)):
            result = func(*args, **kwargs)
            _mark(result, True)
            return result
        if host and name not in _MIXED_ALLOWED:
            big_host = [t for t in host if t.dim()]
            big_device = [t for t in tensors if t.dim() and not made_on_host(t)]
            if big_host and big_device:
                raise Hint(f"on a GPU, {name}() would fail: {DEVICES_MET}")
        result = func(*args, **kwargs)
        if name in ("cpu", "cuda") or (name == "to" and _target(args, kwargs) is not None):
            target = "host" if name == "cpu" else "device" if name == "cuda" else _target(
                args, kwargs)
            host = target == "host" or (isinstance(target, torch.Tensor) and made_on_host(target))
            if result is args[0] and host != made_on_host(result):
                result = result.view_as(result)     # a copy on a GPU: leave the original be
            _mark(result, host)
        elif name == "__getitem__":
            _mark(result, bool(args) and made_on_host(args[0]))
        elif host and len(host) == len(tensors):
            _mark(result, True)
        return result


def on_the_gpu(function, gpu=True):
    """``function``, run inside :class:`OnTheGpu` at every call (``gpu``: the model it feeds,
    or True)."""
    def as_on_a_gpu(*args, **kwargs):
        with OnTheGpu(gpu):
            return function(*args, **kwargs)
    as_on_a_gpu.__wrapped__ = function
    return as_on_a_gpu


def host_hint(what: str) -> str:
    """The sentence for a result made on the CPU in a case that stands for a GPU."""
    return (f"{what}: a tensor {MADE_ON_THE_CPU}, where the inputs stand for tensors on the "
            f"GPU: make every new tensor on the inputs' device (device=x.device, x.new_zeros(...), "
            f"torch.zeros_like(x)) or move it with .to(x.device)")


def expect_device(what: str, got: torch.Tensor, device) -> None:
    """Raise a Hint unless the tensor ``got`` is on ``device`` and was not made on the CPU by
    code that stood for a GPU's (:class:`OnTheGpu`)."""
    device = torch.device(device)
    if got.device.type != device.type:
        raise Hint(device_hint(what, got.device, device))
    if made_on_host(got):
        raise Hint(host_hint(what))


# ---- inputs left as they were ---------------------------------------------------------------

def snapshot(value):
    """A deep copy of an input, to compare with it after the learner's code ran."""
    import copy

    return copy.deepcopy(value)


def first_change(before, after, where: str = "", depth: int = 0) -> str | None:
    """Where ``after`` differs from ``before`` (its ``snapshot``), in words, or None: tensors,
    lists, tuples, dicts and the attributes of objects (a batch, a KV cache), all the way
    down."""
    if depth > 8:
        return None
    if isinstance(before, torch.Tensor):
        if not isinstance(after, torch.Tensor) or before.shape != after.shape:
            return f"{where} changed its shape"
        if before.dtype != after.dtype or not torch.equal(before.cpu(), after.detach().cpu()):
            return f"{where} holds other values"
        return None
    if type(before) is not type(after):
        return f"{where} was replaced"
    if isinstance(before, (list, tuple)):
        if len(before) != len(after):
            return f"{where or 'it'} went from {len(before)} to {len(after)} items"
        for i, (b, a) in enumerate(zip(before, after)):
            found = first_change(b, a, f"{where}[{i}]", depth + 1)
            if found:
                return found
        return None
    if isinstance(before, dict):
        if before.keys() != after.keys():
            gone = [k for k in before if k not in after]
            return (f"{where} lost the key {gone[0]!r}" if gone
                    else f"{where} got the key {next(k for k in after if k not in before)!r}")
        for key in before:
            found = first_change(before[key], after[key], f"{where}[{key!r}]", depth + 1)
            if found:
                return found
        return None
    if hasattr(before, "__dict__") and not callable(before):
        if vars(before).keys() != vars(after).keys():
            gone = [k for k in vars(before) if k not in vars(after)]
            new = [k for k in vars(after) if k not in vars(before)]
            return (f"{where}.{gone[0]} was deleted" if gone
                    else f"{where} got a new attribute, {new[0]}")
        for key, value in vars(before).items():
            found = first_change(value, vars(after).get(key), f"{where}.{key}", depth + 1)
            if found:
                return found
        return None
    try:
        return None if before == after else f"{where} went from {_short(before)} to {_short(after)}"
    except Exception:                # noqa: BLE001 (a value that cannot be compared)
        return None
