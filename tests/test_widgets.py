"""The live plot runs headless, redraws in place and leaves a PNG in the saved notebook."""

import base64

import nbformat
import pytest
from nbclient import NotebookClient

from helpers import LivePlot, rerun_controls

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_live_plot_outside_a_notebook_draws_png():
    plot = LivePlot("t", xlabel="token", ylabel="ms", ylabel2="tok/s", show=False, interval=0)
    for i in range(5):
        plot.add("no cache", i, i * 2.0)
        plot.add("throughput", i, 10 - i, axis=2)
    plot.finish()
    assert plot.png().startswith(PNG_MAGIC)
    assert plot.redraws == 11
    with pytest.raises(ValueError, match="axis"):
        plot.add("x", 0, 0, axis=3)
    with pytest.raises(ValueError, match="2 x values but 1 y values"):
        plot.set("x", [1, 2], [1])


def test_throttling_limits_redraws():
    plot = LivePlot(show=False, interval=60)
    for i in range(50):
        plot.add("a", i, i)
    plot.finish()
    assert plot.redraws == 2  # the first point, then the forced final picture


def test_live_plot_in_a_headless_kernel_leaves_one_image(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "from helpers import LivePlot\n"
        "plot = LivePlot('latency', xlabel='token', ylabel='ms', interval=0)\n"
        "for i in range(6):\n"
        "    plot.add('with cache', i, 1.0 + i)\n"
        "plot.finish()\n"
        "print('redraws', plot.redraws)")]
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = nb.cells[0].outputs
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1, "updates must replace the image, not add new ones"
    assert base64.b64decode(images[0]["data"]["image/png"]).startswith(PNG_MAGIC)
    assert any("redraws 7" in o.get("text", "") for o in outputs)


def test_rerun_controls_call_the_function_with_the_values():
    calls = []
    box = rerun_controls(lambda batch, axis: calls.append((batch, axis)),
                         batch=(1, 64, 1, 8), axis=["per-tensor", "per-channel"])
    box.run()
    assert calls == [(8, "per-tensor")]
    with pytest.raises(ValueError, match="control 'bad'"):
        rerun_controls(lambda bad: None, bad=())


def test_show_diagram_reads_the_repository_and_says_when_it_is_not_there(monkeypatch, tmp_path):
    import helpers.widgets as widgets

    shown = []
    monkeypatch.setattr(widgets, "_display", shown.append)
    widgets.show_diagram("kv_cache")  # from the repository's img/
    assert shown and shown[0].data.startswith(PNG_MAGIC)
    with pytest.raises(ValueError, match=r"no diagram named 'kv-cache'.*known: \[.*'kv_cache'"):
        widgets.show_diagram("kv-cache")
    monkeypatch.setattr(widgets, "DIAGRAMS_DIR", tmp_path / "img")  # installed without the repo
    with pytest.raises(FileNotFoundError, match="img/ folder.*clone of the repository"):
        widgets.show_diagram("kv_cache")


def test_every_diagram_a_lesson_shows_exists():
    import json
    import re

    from helpers.widgets import DIAGRAMS_DIR

    root = DIAGRAMS_DIR.parent
    named = set()
    for lesson in sorted((root / "lessons").glob("*.ipynb")):
        for cell in json.loads(lesson.read_text())["cells"]:
            if cell["cell_type"] == "code":
                named |= set(re.findall(r"show_diagram\(\"(\w+)\"\)", "".join(cell["source"])))
    assert len(named) >= 7
    assert not [n for n in sorted(named) if not (DIAGRAMS_DIR / f"{n}.png").is_file()]
