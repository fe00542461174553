"""helpers/widgets.py under what Colab ships: ipywidgets 7.7.1, IPython 7.34, ipykernel 6.

Run by `make test-colab` in .venv-colab, the environment pinned to Colab's GPU runtime
(constraints-colab.txt), after the lessons have run there. The package is stood up as an empty
module whose path is this repository's helpers/ (not the copy the Colab cell installed):
`import helpers.widgets` then runs widgets.py and the one module it imports (plots.py).
"""

import base64
import pathlib

import ipywidgets
import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
HELPERS = ROOT / "helpers"
LOAD = (
    "import sys, types\n"
    "package = types.ModuleType('helpers'); package.__path__ = [" + repr(str(HELPERS)) + "]\n"
    "sys.modules['helpers'] = package   # without running helpers/__init__.py (torch)\n"
    "import helpers.widgets as w\n"
)


def test_this_is_the_colab_widget_stack():
    assert ipywidgets.__version__ == "7.7.1"


def test_live_plot_and_controls_render_headless(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(LOAD + "import ipywidgets; print(ipywidgets.__version__)"),
        nbformat.v4.new_code_cell(
            "plot = w.LivePlot('latency', xlabel='token', ylabel='ms', logx=True, interval=0)\n"
            "for i in range(1, 9):\n"
            "    plot.add('a', 2 ** i, i)\n"
            "    plot.add('b', 2 ** i, 10 - i, axis=2)\n"
            "plot.finish()\n"
            "print('redraws', plot.redraws)"),
        nbformat.v4.new_code_cell(
            "calls = []\n"
            "box = w.rerun_controls(lambda n, axis: calls.append((n, axis)),\n"
            "                       n=(1, 64, 1, 8), axis=['per-tensor', 'per-channel'])\n"
            "box.run(); print(calls)\n"
            "box"),
    ]
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    first, plot, controls = (c.outputs for c in nb.cells)
    assert first[0]["text"].strip() == "7.7.1"
    images = [o for o in plot if "image/png" in o.get("data", {})]
    assert len(images) == 1, "redraws must replace the picture in place"
    assert base64.b64decode(images[0]["data"]["image/png"]).startswith(b"\x89PNG")
    assert any("redraws 17" in o.get("text", "") for o in plot)
    assert any("[(8, 'per-tensor')]" in o.get("text", "") for o in controls)
    views = [o for o in controls if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert views, "the controls did not produce a widget view"
