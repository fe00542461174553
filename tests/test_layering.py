"""The helpers package's imports point one way: down the layers listed in helpers/__init__.py.

A lower layer (models, generation, batching, ...) never imports a higher one (plots, widgets,
the server, the corpus the lessons read), so a reader who opens a module is never sent up to
something built on top of it. Every import counts: absolute and relative, at the top of a
module or inside a function.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "helpers"


def declared_layers(docstring: str) -> dict[str, int]:
    """Module name -> layer number, from the numbered list in helpers/__init__.py's docstring
    (``    4. batching, quantization, lora   what lessons 02-06 teach``)."""
    layers = {}
    for number, names in re.findall(r"^ {4}(\d+)\. ([\w, ]+?)(?: {2,}|$)", docstring, re.M):
        for name in names.split(","):
            name = name.strip()
            layers["helpers" if name == "helpers" else f"helpers.{name}"] = int(number)
    return layers


def module_name(path: Path, root: Path) -> str:
    """``helpers/server/app.py`` -> ``helpers.server.app``; a package's __init__ is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool, modules) -> list[tuple[int, str]]:
    """(line, module) for every import of the ``helpers`` package in ``source``, relative ones
    resolved. ``from X import name`` imports the module ``X.name`` when there is one (``from .
    import plots``, ``from helpers import plots``), else the module ``X``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[:len(parts) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                child = f"{target}.{alias.name}"
                found.append((node.lineno, child if child in modules else target))
    return sorted({(line, name) for line, name in found if name.split(".")[0] == "helpers"})


def unit(name: str) -> str:
    """What the layer list names: a module of the package, or the sub-package a module is in
    (``helpers.server.app`` -> ``helpers.server``); the package itself is ``helpers``."""
    return ".".join(name.split(".")[:2])


def violations(sources: dict[str, tuple[str, bool]], layers: dict[str, int]) -> list[str]:
    """What breaks the layering in ``sources`` (module name -> (source, is_package))."""
    problems = []
    modules = set(sources) | set(layers)
    for module, (source, is_package) in sorted(sources.items()):
        own = layers.get(unit(module))
        if own is None:
            missing = f"{unit(module)} is in no layer: add it to the list in helpers/__init__.py"
            problems += [missing] if missing not in problems else []
            continue
        for line, target in imported_modules(source, module, is_package, modules):
            theirs = layers.get(unit(target))
            if unit(target) != unit(module) and theirs is not None and theirs >= own:
                problems.append(f"{module} (layer {own}) line {line} imports {target} "
                                f"(layer {theirs})")
    return problems


def _package_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(path, ROOT): (path.read_text(), path.name == "__init__.py")
            for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_of_the_package_is_in_a_layer():
    layers = declared_layers(ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text())))
    assert layers["helpers.quiet"] == 1 and layers["helpers"] == max(layers.values())
    units = {unit(module) for module in _package_sources()}
    assert units == set(layers), "the layer list and the package's modules differ"


def test_imports_point_down_the_layers():
    layers = declared_layers(ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text())))
    assert violations(_package_sources(), layers) == []


LAYERS = {"helpers.models": 1, "helpers.lora": 2, "helpers.batching": 2, "helpers.plots": 3,
          "helpers.server": 4, "helpers": 5}


@pytest.mark.parametrize("source", [
    "from .plots import PALETTE\n",                          # relative, at the top
    "def f():\n    from .plots import PALETTE\n",            # inside a function
    "import helpers.plots\n",                                # absolute
    "from helpers import plots\n",                           # a module by name
    "from . import plots\n",
    "from helpers.plots import PALETTE\n",
    "from helpers import load_model\n",                      # the package itself is on top
])
def test_the_check_catches_an_import_from_a_higher_layer(source):
    sources = {"helpers.lora": (source, False), "helpers.plots": ("", False),
               "helpers": ("", True)}
    (problem,) = violations(sources, LAYERS)
    assert re.fullmatch(r"helpers\.lora \(layer 2\) line \d imports helpers(\.plots)? "
                        r"\(layer [35]\)", problem)


def test_the_check_allows_lower_layers_and_a_sub_package_inside():
    sources = {
        "helpers.lora": ("from .models import load_model\nimport torch\n", False),
        "helpers.plots": ("def f():\n    from .lora import TOY_COLOURS\n", False),
        "helpers.server.app": ("from .engine import Engine\nfrom .. import server\n", False),
        "helpers.server.engine": ("from ..batching import Batch\n", False),
        "helpers.server": ("from .background import serve_in_background\n", True),
        "helpers": ("from .server import serve_in_background\n", True),
    }
    assert violations(sources, LAYERS) == []
    # peers of one layer do not import each other, and the server's modules do not reach up
    sources["helpers.batching"] = ("from .lora import MultiLora\n", False)
    sources["helpers.server.engine"] = ("from helpers import seed_everything\n", False)
    assert violations(sources, LAYERS) == [
        "helpers.batching (layer 2) line 1 imports helpers.lora (layer 2)",
        "helpers.server.engine (layer 4) line 1 imports helpers (layer 5)",
    ]


def test_a_module_missing_from_the_list_is_reported():
    assert violations({"helpers.extra": ("", False)}, LAYERS) == [
        "helpers.extra is in no layer: add it to the list in helpers/__init__.py"]
    sub_package = {"helpers.kv": ("", True), "helpers.kv.blocks": ("", False)}
    assert violations(sub_package, LAYERS) == [
        "helpers.kv is in no layer: add it to the list in helpers/__init__.py"]


def test_the_layer_list_is_read_from_the_docstring():
    text = "Layers:\n\n    1. quiet      noise\n    2. a, b        two\n    3. helpers\n"
    assert declared_layers(text) == {"helpers.quiet": 1, "helpers.a": 2, "helpers.b": 2,
                                     "helpers": 3}
