"""Every tensor a lesson feeds to the model is on the model's device.

`helpers.load_model` puts the model on CUDA when there is a GPU. A cell that builds its input
on the CPU and hands it to that model works here (no GPU: everything is on the CPU) and fails
on Colab or any CUDA machine. Running the lessons cannot catch this on a CPU, so this test
reads every code cell of every lesson with `ast` and applies two rules.

Definitions
- A *tensor-making call* is one of the torch functions that make a new tensor on the default
  device (``torch.tensor``, ``as_tensor``, ``from_numpy``, ``zeros``, ``ones``, ``full``,
  ``empty``, ``arange``, ``linspace``, ``rand``, ``randn``, ``randint``, ``eye``,
  ``LongTensor``, ``FloatTensor``), or any call with ``return_tensors="pt"`` (a tokenizer).
  ``torch.cat``, ``torch.stack``, ``*_like`` and tensor methods are not: their result is on
  the device of their inputs, which are checked where they are made.
- Such a call is *placed* when it passes ``device=D``, or when ``.to(D)`` is applied to its
  result, directly or after attributes, indexing and other method calls
  (``tokenizer(p, return_tensors="pt").input_ids.to(model.device)``), where ``D`` is an
  expression that ends in the word ``device``: ``model.device``, ``ids.device``, ``device``,
  ``DEVICE``. ``.to(torch.float16)`` changes the dtype only, and a literal ``"cpu"`` or
  ``"cuda"`` is wrong on one of the two machines, so neither counts. A new tensor written
  into part of another one (``ids[i, :n] = torch.tensor(row)``) is placed too: its values
  are copied onto the device of ``ids``, which is checked where ``ids`` is made.
- A *model* is a name bound to the first value of ``load_model(...)`` (``model, tok =
  load_model()`` or ``load_model()[0]``), or to ``get_peft_model(m, ...)``,
  ``PeftModel.from_pretrained(m, ...)`` (any ``...Model....from_pretrained``),
  ``copy.deepcopy(m)``, ``m.merge_and_unload()``, ``m.to(...)``, ``m.eval()`` of a model
  ``m``. The name ``model`` itself always counts, also as a function's parameter.
- A *model call* is ``m(...)``, ``m.forward(...)`` or ``m.generate(...)`` for a model ``m``,
  any ``.generate(...)`` call at all, and any call that passes a model as an argument
  (a function such as ``answer(peft_model, sentence)`` is assumed to run it), except the
  calls above that make a model from one (``get_peft_model(model, config)``).

Rules
1. In a cell that contains a model call (inside a function defined there too), every
   tensor-making call is placed.
2. A name bound at the top level of a cell to an unplaced tensor (``x = torch.randn(...)``,
   ``enc = tokenizer(..., return_tensors="pt")``, ``ids = tokenizer(...).input_ids * 2``)
   is not passed to a model call in a later cell (until it is bound to something else).

What it cannot see
- tensors made inside functions that live outside the lesson (``helpers``, transformers):
  placing those is the helpers' job;
- a tensor made in one cell by a function or a loop, or kept in a list, dict or attribute,
  and fed to a model in another cell (rule 2 follows plain names bound directly only);
- models it cannot name: kept in a container or an attribute, returned by a function of the
  lesson, or called through a parameter not named ``model`` other than by ``.generate``;
- whether the device given is the model's: ``.to(x.device)`` passes even if ``x`` is on
  the CPU;
- code that is not a code cell (exercise solutions written in markdown) or that runs from a
  string, such as the statement after ``%time`` or ``%%timeit`` (IPython passes it as text);
- the toy models of lessons 05 and 06 (``ToyModel``, ``ToyMultiLoraModel``): they are not
  models for these rules, since a lesson may keep one on the CPU, where its inputs belong too.

    python tests/test_lesson_devices.py lessons/05_lora.ipynb    # print what the check flags
"""

from __future__ import annotations

import ast
import json
import pathlib
import sys
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))

TORCH_MAKERS = {"tensor", "as_tensor", "from_numpy", "zeros", "ones", "full", "empty", "arange",
                "linspace", "rand", "randn", "randint", "eye", "LongTensor", "FloatTensor"}
# Methods that hand back the same model (or a model built from it).
MODEL_METHODS = {"merge_and_unload", "to", "eval", "half", "float", "bfloat16"}


@dataclass(frozen=True)
class Finding:
    cell: int       # index among the notebook's cells (markdown included), as Jupyter counts
    line: int       # line within the cell, from 1
    message: str

    def __str__(self):
        return f"cell {self.cell}, line {self.line}: {self.message}"


# --- what the source says ------------------------------------------------------------------

def _dotted(node) -> str:
    """'torch.zeros' for torch.zeros, 'tokenizer' for tokenizer; '' for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def _is_maker(call: ast.Call) -> bool:
    if any(k.arg == "return_tensors" and isinstance(k.value, ast.Constant) and k.value.value == "pt"
           for k in call.keywords):
        return True
    name = _dotted(call.func)
    return name.startswith("torch.") and name.split(".")[-1] in TORCH_MAKERS and name.count(".") == 1


def _is_device(node) -> bool:
    """An expression ending in the word device: model.device, device, DEVICE, x.device."""
    if isinstance(node, ast.Attribute):
        return node.attr == "device"
    if isinstance(node, ast.Name):
        return node.id.lower().endswith("device")
    return False


def _moves_to_device(call: ast.Call) -> bool:
    """call is x.to(D, ...) or x.to(device=D) with D a device expression."""
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "to"):
        return False
    given = call.args[:1] + [k.value for k in call.keywords if k.arg == "device"]
    return any(_is_device(d) for d in given)


def _parents(tree) -> dict:
    parent = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parent[child] = node
    return parent


def _copied_into_a_tensor(call: ast.Call, parent: dict) -> bool:
    """`x[i] = torch.tensor(...)` (also as one of a tuple): the values are copied into x,
    on x's device, whatever the device of the new tensor."""
    up = parent.get(call)
    if isinstance(up, ast.Assign) and up.value is call:
        return all(isinstance(t, ast.Subscript) for t in up.targets)
    if isinstance(up, ast.Tuple) and isinstance(parent.get(up), ast.Assign) and parent[up].value is up:
        position = up.elts.index(call)
        return all(isinstance(t, ast.Tuple) and len(t.elts) == len(up.elts)
                   and isinstance(t.elts[position], ast.Subscript) for t in parent[up].targets)
    return False


def _placed(call: ast.Call, parent: dict) -> bool:
    if any(k.arg == "device" and _is_device(k.value) for k in call.keywords):
        return True
    if _copied_into_a_tensor(call, parent):
        return True
    # Walk up the chain call(...).attr[...].method(...).to(device)
    node = call
    while True:
        up = parent.get(node)
        if isinstance(up, (ast.Attribute, ast.Subscript)) and up.value is node:
            node = up
        elif isinstance(up, ast.Call) and up.func is node:
            if _moves_to_device(up):
                return True
            node = up
        else:
            return False


def _chain_root(node):
    """The expression a chain of attributes, indexing, method calls and arithmetic starts from:
    the maker call in `tokenizer(...).input_ids[:, -1:] * 2`, the name in `batch.input_ids`."""
    while True:
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not _is_maker(node):
            if _moves_to_device(node):
                return None
            node = node.func.value
        elif isinstance(node, ast.BinOp):
            left = _chain_root(node.left)
            return left if left is not None else _chain_root(node.right)
        elif isinstance(node, ast.UnaryOp):
            node = node.operand
        else:
            return node


class _Notebook:
    """The rules, applied cell after cell; models and unplaced names carry over between cells."""

    def __init__(self):
        self.models = {"model"}
        self.unplaced = {}          # name -> cell where it was bound to an unplaced tensor
        self.findings = []

    # a model expression: a model name, load_model(...)[0], or a maker of a model
    def _is_model(self, node) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.models
        if isinstance(node, ast.Subscript):
            return (isinstance(node.value, ast.Call) and _dotted(node.value.func).endswith("load_model")
                    and isinstance(node.slice, ast.Constant) and node.slice.value == 0)
        if isinstance(node, ast.Call):
            func = _dotted(node.func)
            last = func.split(".")[-1]
            if last in ("get_peft_model", "deepcopy") and node.args:
                return self._is_model(node.args[0])
            if last == "from_pretrained":
                receiver = func.rsplit(".", 1)[0] if "." in func else ""
                return "Model" in receiver
            if isinstance(node.func, ast.Attribute) and node.func.attr in MODEL_METHODS:
                return self._is_model(node.func.value)
        return False

    def _learn_models(self, tree):
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign):
                continue
            value = node.value
            for target in node.targets:
                if (isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[0], ast.Name)
                        and isinstance(value, ast.Call) and _dotted(value.func).endswith("load_model")):
                    self.models.add(target.elts[0].id)
                elif isinstance(target, ast.Name) and self._is_model(value):
                    self.models.add(target.id)

    def _model_calls(self, tree) -> list[ast.Call]:
        calls = []
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if self._is_model(func):
                calls.append(node)
            elif isinstance(func, ast.Attribute) and func.attr == "generate":
                calls.append(node)
            elif isinstance(func, ast.Attribute) and func.attr == "forward" and self._is_model(func.value):
                calls.append(node)
            elif any(self._is_model(a) for a in node.args + [k.value for k in node.keywords]):
                if not self._is_model(node):         # get_peft_model(model, ...) makes one
                    calls.append(node)
        return calls

    def cell(self, index: int, source: str):
        tree = ast.parse(source)
        parent = _parents(tree)
        self._learn_models(tree)
        calls = self._model_calls(tree)
        if calls:
            first = min(calls, key=lambda c: (c.lineno, c.col_offset))
            shown = ast.unparse(first.func)
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and _is_maker(node) and not _placed(node, parent):
                    self.findings.append(Finding(index, node.lineno, (
                        f"{ast.unparse(node.func)}(...) makes a tensor on the CPU in a cell that "
                        f"calls the model ({shown}, line {first.lineno}); give it "
                        f"device=model.device or .to(model.device)")))
        # rule 2: names from earlier cells
        for call in calls:
            args = call.args + [k.value for k in call.keywords]
            for arg in args:
                root = _chain_root(arg)
                if isinstance(root, ast.Name) and self.unplaced.get(root.id, index) != index:
                    self.findings.append(Finding(index, call.lineno, (
                        f"{root.id}, made on the CPU in cell {self.unplaced[root.id]}, is passed to "
                        f"{ast.unparse(call.func)}; move it with .to(model.device)")))
        self._learn_names(index, tree, parent)

    def _learn_names(self, index, tree, parent):
        """Top-level bindings (not inside a def or class) of this cell, in order."""
        for statement in _top_level(tree):
            tracked = set()
            if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
                target, root = statement.targets[0], _chain_root(statement.value)
                if (isinstance(target, ast.Name) and isinstance(root, ast.Call) and _is_maker(root)
                        and not _placed(root, parent)):
                    self.unplaced[target.id] = index
                    tracked.add(target.id)
            for node in _walk_outside_defs(statement):
                if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                    if node.id not in tracked:
                        self.unplaced.pop(node.id, None)
            if isinstance(statement, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                self.unplaced.pop(statement.name, None)


def _top_level(tree):
    """Statements at the top level of a cell, entering with/for/if/try blocks but not defs."""
    out = []
    todo = list(tree.body)
    while todo:
        statement = todo.pop(0)
        out.append(statement)
        if not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody"):
                todo[:0] = [s for s in getattr(statement, field, []) if isinstance(s, ast.stmt)]
            for handler in getattr(statement, "handlers", []):
                todo[:0] = list(handler.body)
    return out


def _walk_outside_defs(statement):
    """Nodes of one statement without descending into nested statements or defs' bodies."""
    todo = [statement]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                continue                    # nested statements are visited as their own
            todo.append(child)


def _python(source: str) -> str:
    """Cell source as Python: IPython's %magics and !commands become ordinary calls."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


def check_cells(cells: list[tuple[int, str]]) -> list[Finding]:
    """Findings for code cells given as (index in the notebook, source), in order."""
    notebook = _Notebook()
    for index, source in cells:
        notebook.cell(index, _python(source))
    return notebook.findings


def check_notebook(path) -> list[Finding]:
    nb = json.loads(pathlib.Path(path).read_text())
    return check_cells([(i, "".join(c["source"])) for i, c in enumerate(nb["cells"])
                        if c["cell_type"] == "code"])


def check(*sources: str) -> list[Finding]:
    """The findings for a few cells of source (numbered 0, 1, ...): the unit tests' entry."""
    return check_cells(list(enumerate(sources)))


# --- the checker on small pieces of source -------------------------------------------------

SETUP = "from helpers import load_model\nmodel, tokenizer = load_model()\n"

# Lesson 05's answer() cell as it was before the lessons were made to run on a GPU: the
# tokenizer's tensors stay on the CPU while the model may be on CUDA.
LESSON_05_ANSWER = '''\
def answer(m, sentence, max_new_tokens=24):
    inputs = tokenizer(task_prompt(sentence), return_tensors="pt")
    with torch.no_grad():
        out = m.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True).strip()

for sentence, expected in task_examples("title", seed=7, n=3):
    print(sentence)
    print("   adapter:", answer(peft_model, sentence), "   expected:", expected)
'''


def test_lesson_05_answer_cell_as_it_was_is_flagged():
    findings = check(SETUP, LESSON_05_ANSWER)
    assert [(f.cell, f.line) for f in findings] == [(1, 2)]
    assert "tokenizer(...) makes a tensor on the CPU" in findings[0].message


def test_lesson_05_answer_cell_with_its_input_moved_passes():
    fixed = LESSON_05_ANSWER.replace('return_tensors="pt")', 'return_tensors="pt").to(m.device)')
    assert check(SETUP, fixed) == []


@pytest.mark.parametrize("source", [
    'ids = tokenizer("a b", return_tensors="pt").input_ids.to(model.device)\nmodel(ids)',
    'enc = tokenizer(["a"], return_tensors="pt", padding=True).to(model.device)\nmodel(**enc)',
    'x = torch.zeros(2, 3, dtype=torch.long, device=model.device)\nmodel(x)',
    'x = torch.tensor([[1, 2]]).unsqueeze(0).to(device=model.device)\nmodel(input_ids=x)',
    'device = model.device\nx = torch.arange(5, device=device)\nmodel(x)',
    'mask = torch.cat([mask, torch.ones_like(ids)], dim=1)\nmodel(ids, attention_mask=mask)',
    # no model in the cell: a CPU toy is fine
    'x = torch.randn(8, 1, 1024)\ny = linear_lora_loop(x, a, b, torch.tensor([1, 2]))',
    'toy = ToyModel()\nids = toy.encode("red")\ntoy(ids)',
])
def test_accepted(source):
    assert check(SETUP, source) == [], source


@pytest.mark.parametrize("source, line", [
    ('batch = tokenizer(["a"] * 4, return_tensors="pt")\ncache = model(**batch).past_key_values', 1),
    ('ids = torch.tensor([[1, 2, 3]])\nmodel(ids)', 1),
    ('ids = torch.tensor(tokenizer.encode("a b"))[None]\nmodel.generate(ids)', 1),
    ('x = torch.full((2, 3), 0).to(torch.float16)\nmodel(x)', 1),          # a dtype, not a device
    ('x = torch.ones(2, 3).to("cpu")\nmodel(x)', 1),                        # a literal
    ('x = torch.randint(0, 9, (1, 4), device="cuda")\nmodel(x)', 1),
    # inside a function of the cell, as lesson 05's encode()/loss_of() pair
    ('def encode(rows):\n    return torch.full((len(rows), 4), 0)\n'
     'def loss_of(ids):\n    return peft(input_ids=ids).logits', 2),
    # any .generate call, whatever its receiver is called
    ('def gen(m, p):\n    return m.generate(**tokenizer(p, return_tensors="pt"))', 2),
    # a function that is handed the model is assumed to run it
    ('ids = torch.arange(4)[None]\ntimed(model, ids)', 1),
])
def test_flagged(source, line):
    cells = [SETUP, "from peft import get_peft_model\npeft = get_peft_model(model, config)", source]
    findings = check(*cells)
    assert [(f.cell, f.line) for f in findings] == [(2, line)], findings


def test_models_are_followed_through_copies_and_adapters():
    findings = check(
        "base, tok = load_model()",
        "reloaded = PeftModel.from_pretrained(base, folder)\nmerged = reloaded.merge_and_unload()",
        "other = copy.deepcopy(load_model()[0]).eval()",
        'merged(torch.tensor([[1]]))\nother(torch.tensor([[1]]))',
    )
    assert [(f.cell, f.line) for f in findings] == [(3, 1), (3, 2)]


def test_a_name_made_on_the_cpu_in_one_cell_and_fed_in_another_is_flagged():
    findings = check(SETUP, 'check = tokenizer(["a", "b"], return_tensors="pt", padding=True)',
                     "logits = model(**check).logits")
    assert [(f.cell, f.line) for f in findings] == [(2, 1)]
    assert "check, made on the CPU in cell 1" in findings[0].message


def test_a_rebound_or_moved_name_is_no_longer_flagged():
    made = 'ids = tokenizer("a", return_tensors="pt").input_ids'
    assert check(SETUP, made, "ids = ids.to(model.device)", "model(ids)") == []
    assert check(SETUP, made, "for ids in rows:\n    pass", "model(ids)") == []
    assert check(SETUP, made, "model(ids.to(model.device))") == []
    assert len(check(SETUP, made, "model(ids[:, -1:])")) == 1


def test_magics_do_not_stop_the_check():
    findings = check(SETUP, '%load_ext autoreload\n!ls\nout = model(torch.zeros(1, 2, dtype=torch.long))')
    assert [(f.cell, f.line) for f in findings] == [(1, 3)]


def test_a_new_tensor_copied_into_part_of_a_placed_one_is_accepted():
    source = ("ids = torch.full((2, 4), 0, device=model.device)\n"
              "mask = torch.zeros((2, 4), dtype=torch.long, device=model.device)\n"
              "ids[0, :2], mask[0, :2] = torch.tensor([5, 6]), 1\n"
              "ids[1, :1] = torch.tensor([7])\n"
              "model(input_ids=ids, attention_mask=mask)")
    assert check(SETUP, source) == []
    assert len(check(SETUP, source.replace("ids[1, :1] =", "row ="))) == 1


# --- the lessons ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lessons_feed_the_model_only_tensors_on_its_device(path):
    findings = check_notebook(path)
    assert not findings, f"{path.name}:\n" + "\n".join(map(str, findings))


def main(argv: list[str]) -> int:
    flagged = 0
    for path in argv or LESSONS:
        findings = check_notebook(path)
        flagged += len(findings)
        print(f"{pathlib.Path(path).name}: {len(findings) or 'nothing'} flagged")
        for finding in findings:
            print("   ", finding)
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
