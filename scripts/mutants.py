r"""Small variants of a piece of Python (mutants), for testing the learners' checks.

    from mutants import mutants
    for mutant in mutants(source, lines=range(5, 12)):
        print(mutant.key, mutant.line)         # what changed, and the changed line
        exec(mutant.source, namespace)         # the whole source with that one change

Each mutant changes one thing in the lines given (an exercise's solution, between its markers)
the way a slip would: a comparison's operator, an arithmetic operator, a number off by one, the
operands of a product or the items of a list swapped, a product regrouped ((x @ A) @ B as
x @ (A @ B): the same numbers at another cost), a dimension or a dtype changed (an integer one
made float), a keyword argument (``device=`` too) or a method call dropped, a copy dropped
(``list(x)``, ``.clone()``: the input itself changed afterwards), a tensor made without the
input's device (``x.new_zeros(s)`` as ``torch.zeros(s)``), a function swapped for its opposite
(min/max, any/all, cat/stack, floor/ceil, ...), a statement dropped, two statements swapped, a
model pass, graph replay or all-reduce repeated (a loop where one call was). ``key`` names the
change in words and code (``compare: \`n < len(guesses)\` -> \`n <= len(guesses)\```) and does
not depend on line numbers, so that a list of mutants known to be harmless survives edits
elsewhere in the lesson. Mutants that come out the same as the source are left out.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass
from typing import Iterator

COMPARE_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
                 ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
                 ast.In: ast.NotIn, ast.NotIn: ast.In}
BINOP_SWAPS = {ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.Div], ast.Div: [ast.Mult, ast.FloorDiv],
               ast.FloorDiv: [ast.Div], ast.Mod: [ast.FloorDiv], ast.Pow: [ast.Mult]}
#: Names and attributes swapped for their opposite or their neighbour.
OPPOSITES = {"min": "max", "max": "min", "amin": "amax", "amax": "amin", "any": "all",
             "all": "any", "ceil": "floor", "floor": "ceil", "argmax": "argmin",
             "argmin": "argmax", "cat": "stack", "stack": "cat",
             "long": "float", "float": "double", "int": "long", "double": "float",
             "round": "trunc", "sum": "mean", "cumsum": "cumprod",
             "ones_like": "zeros_like", "zeros_like": "ones_like", "ones": "zeros",
             "zeros": "ones", "keys": "values", "values": "keys", "new_full": "new_zeros",
             "gather": "wait", "move_to_end": "pop"}
#: dtypes swapped for a neighbour.
DTYPES = {"long": "int32", "int64": "int32", "int32": "int64", "int": "int64", "uint8": "int8",
          "float": "float64", "float32": "float64", "float64": "float32", "bool": "uint8"}
#: Integer and boolean dtypes, made floats (a mask or ids built with torch.zeros/ones' default).
TO_FLOAT = {"long", "int64", "int32", "int", "uint8", "bool"}
#: Tensors made on the input's device, made without it: ``x.new_zeros(s)`` -> ``torch.zeros(s)``.
NEW_ON_DEVICE = {"new_zeros": "zeros", "new_ones": "ones", "new_full": "full",
                 "new_empty": "empty", "new_tensor": "tensor"}
LIKE = {"zeros_like": "zeros", "ones_like": "ones", "full_like": "full", "empty_like": "empty"}
#: Calls that make a copy, so that the caller's object is left as it was.
COPIES = {"list", "dict", "copy", "deepcopy", "clone"}
#: Calls whose count a lesson promises (a model pass, a graph replay, an all-reduce).
COUNTED = {"model", "replay", "all_reduce"}
#: Method calls that return their receiver changed; dropping one keeps the receiver as it was.
PASS_THROUGH = {"float", "long", "int", "double", "to", "clamp", "round", "detach", "clone",
                "contiguous", "tolist", "item", "squeeze", "unsqueeze", "flatten", "view",
                "reshape", "view_as", "expand", "expand_as", "masked_fill", "cpu", "cuda",
                "abs", "bool", "nonzero", "copy", "unique", "sort", "mean", "new_tensor"}


@dataclass
class Mutant:
    key: str            # what changed, in words and code; stable when other lines move
    line: str           # the line it changes, as the source has it
    lineno: int         # where (1-based, in the source)
    source: str         # the whole source with the change


def _code(node) -> str:
    try:
        return ast.unparse(node)
    except Exception:           # noqa: BLE001 (a node unparse cannot print alone)
        return type(node).__name__


def _short(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


class _Site:
    """One place to change: the node's path from the tree's root, and how to change it."""

    def __init__(self, path, kind, make, lineno):
        self.path, self.kind, self.make, self.lineno = path, kind, make, lineno


def _walk(node, path=()):
    yield node, path
    for field, value in ast.iter_fields(node):
        if isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, ast.AST):
                    yield from _walk(item, path + ((field, i),))
        elif isinstance(value, ast.AST):
            yield from _walk(value, path + ((field, None),))


def _get(tree, path):
    node = tree
    for field, index in path:
        node = getattr(node, field)
        if index is not None:
            node = node[index]
    return node


def _set(tree, path, new):
    parent = _get(tree, path[:-1])
    field, index = path[-1]
    if index is None:
        setattr(parent, field, new)
    else:
        getattr(parent, field)[index] = new


def _sites(tree, lines: set[int]) -> Iterator[tuple[tuple, str, object]]:
    """(path, key, replacement-maker) for every change inside ``lines``."""
    for node, path in _walk(tree):
        lineno = getattr(node, "lineno", None)
        if lineno is None or lineno not in lines or not path:
            continue
        # comparisons
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in COMPARE_SWAPS:
                    def make(n=node, i=i, op=op):
                        new = copy.deepcopy(n)
                        new.ops[i] = COMPARE_SWAPS[type(op)]()
                        return new
                    yield path, "compare", make
        # arithmetic
        if isinstance(node, ast.BinOp):
            for swap in BINOP_SWAPS.get(type(node.op), []):
                def make(n=node, swap=swap):
                    new = copy.deepcopy(n)
                    new.op = swap()
                    return new
                yield path, "arithmetic", make
            if not isinstance(node.op, (ast.Add, ast.Mult)):      # order matters: swap operands
                def make(n=node):
                    new = copy.deepcopy(n)
                    new.left, new.right = new.right, new.left
                    return new
                yield path, "operands swapped", make
            if isinstance(node.left, ast.BinOp) and type(node.left.op) is type(node.op) \
                    and isinstance(node.op, (ast.MatMult, ast.Sub, ast.Div)):
                def make(n=node):                                   # (a op b) op c -> a op (b op c)
                    new = copy.deepcopy(n)
                    inner = new.left
                    return ast.BinOp(inner.left, inner.op, ast.BinOp(inner.right, new.op, new.right))
                yield path, "regrouped", make
        if isinstance(node, ast.AugAssign) and type(node.op) in BINOP_SWAPS:
            for swap in BINOP_SWAPS[type(node.op)]:
                def make(n=node, swap=swap):
                    new = copy.deepcopy(n)
                    new.op = swap()
                    return new
                yield path, "arithmetic", make
        if isinstance(node, ast.BoolOp):
            def make(n=node):
                new = copy.deepcopy(n)
                new.op = ast.Or() if isinstance(n.op, ast.And) else ast.And()
                return new
            yield path, "and/or", make
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
            yield path, "sign or not dropped", (lambda n=node: copy.deepcopy(n.operand))
        # numbers: off by one (and True/False)
        if isinstance(node, ast.Constant) and not isinstance(node.value, str):
            if isinstance(node.value, bool):
                yield path, "boolean", (lambda n=node: ast.Constant(not n.value))
            elif isinstance(node.value, int):
                for delta in (1, -1):
                    yield path, "off by one", (lambda n=node, d=delta: ast.Constant(n.value + d))
            elif isinstance(node.value, float):
                yield path, "number", (lambda n=node: ast.Constant(n.value * 2 if n.value else 1.0))
        # swapped items: a list, a tuple or a call's positional arguments
        if isinstance(node, (ast.List, ast.Tuple)) and len(node.elts) >= 2 \
                and not isinstance(getattr(node, "ctx", None), ast.Store):
            def make(n=node):
                new = copy.deepcopy(n)
                new.elts[0], new.elts[1] = new.elts[1], new.elts[0]
                return new
            yield path, "items swapped", make
        if isinstance(node, ast.Call):
            if len(node.args) >= 2 and not any(isinstance(a, ast.Starred) for a in node.args[:2]):
                def make(n=node):
                    new = copy.deepcopy(n)
                    new.args[0], new.args[1] = new.args[1], new.args[0]
                    return new
                yield path, "arguments swapped", make
            for i, kw in enumerate(node.keywords):
                if kw.arg is not None:
                    def make(n=node, i=i):
                        new = copy.deepcopy(n)
                        del new.keywords[i]
                        return new
                    yield path, "keyword dropped", make
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in PASS_THROUGH:
                yield path, "call dropped", (lambda n=node: copy.deepcopy(n.func.value))
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in OPPOSITES:
                def make(n=node, name=name):
                    new = copy.deepcopy(n)
                    if isinstance(new.func, ast.Attribute):
                        new.func.attr = OPPOSITES[name]
                    else:
                        new.func.id = OPPOSITES[name]
                    return new
                yield path, "function swapped", make
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if isinstance(func, ast.Attribute) and name in NEW_ON_DEVICE:
                def make(n=node, name=name):           # x.new_zeros(s) -> torch.zeros(s)
                    new = copy.deepcopy(n)
                    new.func = ast.Attribute(ast.Name("torch", ast.Load()), NEW_ON_DEVICE[name],
                                             ast.Load())
                    return new
                yield path, "made without the input's device", make
            if name in LIKE and len(node.args) >= 1:
                def make(n=node, name=name):           # torch.zeros_like(x) -> torch.zeros(x.shape)
                    new = copy.deepcopy(n)
                    new.func = ast.Attribute(ast.Name("torch", ast.Load()), LIKE[name], ast.Load())
                    new.args[0] = ast.Attribute(new.args[0], "shape", ast.Load())
                    return new
                yield path, "made without the input's device", make
            if name in COPIES and len(node.args) == 1 and not node.keywords \
                    and not isinstance(node.args[0], ast.Starred):
                yield path, "copy dropped", (lambda n=node: copy.deepcopy(n.args[0]))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "torch" and node.attr in DTYPES:
            yield path, "dtype", (lambda n=node: ast.Attribute(n.value, DTYPES[n.attr], ast.Load()))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "torch" and node.attr in TO_FLOAT:
            yield path, "dtype made float", (lambda n=node: ast.Attribute(n.value, "float32",
                                                                          ast.Load()))
        if isinstance(node, ast.Attribute) and node.attr == "T":
            yield path, "transpose dropped", (lambda n=node: copy.deepcopy(n.value))
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice):
            for bound in ("lower", "upper"):
                if getattr(node.slice, bound) is not None:
                    def make(n=node, bound=bound):
                        new = copy.deepcopy(n)
                        setattr(new.slice, bound, None)
                        return new
                    yield path, "slice bound dropped", make
    # statements: dropped, or swapped with the next one
    for node, path in _walk(tree):
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for i, stmt in enumerate(block):
                if getattr(stmt, "lineno", None) not in lines or isinstance(stmt, ast.Pass):
                    continue
                if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
                    continue
                yield path + ((field, i),), "statement dropped", (lambda: ast.Pass())
                if _counted_call(stmt):                 # a loop where one call was
                    yield (path + ((field, i),), "call repeated", (lambda s=stmt: _twice(s)))
                if i + 1 < len(block) and getattr(block[i + 1], "lineno", None) in lines:
                    yield (path + ((field, i),), "statements swapped",
                           ("swap", path + ((field, i),), path + ((field, i + 1),)))


def _twice(stmt):
    """``for _ in range(2): stmt``."""
    loop = ast.parse("for _ in range(2):\n    pass").body[0]
    loop.body = [copy.deepcopy(stmt)]
    return loop


def _counted_call(stmt) -> bool:
    """Whether a statement (an assignment or a bare call) calls one of COUNTED."""
    if not isinstance(stmt, (ast.Assign, ast.Expr, ast.AugAssign)):
        return False
    for node in ast.walk(stmt.value):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in COUNTED:
                return True
    return False


def mutants(source: str, lines) -> list[Mutant]:
    """Every mutant of ``source`` that changes something on one of ``lines`` (1-based)."""
    tree = ast.parse(source)
    original = ast.unparse(tree)
    source_lines = source.splitlines()
    lines = set(lines)
    seen, found = set(), []
    for path, kind, make in list(_sites(tree, lines)):
        new_tree = copy.deepcopy(tree)
        if isinstance(make, tuple):                       # two statements swapped
            _, first, second = make
            a, b = _get(new_tree, first), _get(new_tree, second)
            _set(new_tree, first, b)
            _set(new_tree, second, a)
            first_line = lambda node: _code(node).splitlines()[0]      # noqa: E731
            before = first_line(_get(tree, first)) + " / " + first_line(_get(tree, second))
            after = first_line(b) + " / " + first_line(a)
            lineno = _get(tree, first).lineno
        else:
            old = _get(tree, path)
            new = make()
            _set(new_tree, path, new)
            before, after, lineno = _code(old), _code(new), old.lineno
            if kind == "statement dropped":
                before = before.splitlines()[0] + (" ..." if "\n" in before else "")
                after = "pass"
            else:
                before, after = before.splitlines()[0], after.splitlines()[0]
        ast.fix_missing_locations(new_tree)
        try:
            text = ast.unparse(new_tree)
            compile(text, "<mutant>", "exec")
        except (SyntaxError, ValueError):
            continue
        if text == original or text in seen:
            continue
        seen.add(text)
        key = f"{kind}: `{_short(before)}` -> `{_short(after)}`"
        found.append(Mutant(key=key, line=source_lines[lineno - 1].strip(), lineno=lineno,
                            source=text))
    # the same change at two places reads the same: number them
    counts: dict[str, int] = {}
    for m in found:
        counts[m.key] = counts.get(m.key, 0) + 1
    numbering: dict[str, int] = {}
    for m in found:
        if counts[m.key] > 1:
            numbering[m.key] = numbering.get(m.key, 0) + 1
            m.key = f"{m.key} (#{numbering[m.key]})"
    return found
