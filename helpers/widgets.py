"""Live plots and small controls for the notebooks.

Introduced in lesson 01 (per-token latency drawn while tokens are generated); used in every
lesson that times something.

``LivePlot`` draws with matplotlib into a PNG and shows it through IPython's display system:
the first ``display(..., display_id=True)`` creates an output and every redraw replaces it in
place (``handle.update``). No widget library is involved, so it works the same in JupyterLab 4
(ipywidgets 8), Colab (ipywidgets 7.7.1), VS Code and headless execution, and the saved
notebook keeps the final picture as an ordinary image that GitHub shows.

``rerun_controls`` builds a few core ipywidgets (sliders, a button) that re-run a measurement
and redraw its plot; the default top-to-bottom run never needs them.
"""

from __future__ import annotations

import io
import time
from collections import OrderedDict
from pathlib import Path

from matplotlib.figure import Figure  # no pyplot: no global figure state, no double drawing
from matplotlib.ticker import FuncFormatter

from .plots import PALETTE  # colours of the series, in order: the course's one palette


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _display(obj, **kwargs):
    from IPython.display import display

    return display(obj, **kwargs)


class LivePlot:
    """A line chart that redraws while data arrives. (Lesson 01.)

    >>> plot = LivePlot("Per-token latency", xlabel="token", ylabel="ms")
    >>> for i, ms in enumerate(timings):
    ...     plot.add("with cache", i, ms)     # redraws at most every `interval` seconds
    >>> plot.finish()                         # final redraw; the picture stays in the notebook

    Several named series share the axes; a series added with ``axis=2`` goes on a second
    y-axis on the right (label ``ylabel2``). ``logx``/``logy`` use log scales (base 2 for x).

    A redraw renders the whole chart on the caller's thread and takes tens of milliseconds.
    Time each step on its own stopwatch (as lesson 01 does), or, when the points are arrival
    times of something that keeps running meanwhile (a stream of tokens), take every timestamp
    first and draw after: a redraw in between would show up as a delay of the stream (lesson 07).
    """

    def __init__(self, title: str = "", xlabel: str = "", ylabel: str = "", ylabel2: str = "",
                 logx: bool = False, logy: bool = False, interval: float = 0.5,
                 figsize=(7.5, 3.6), dpi: int = 90, show: bool = True):
        if interval < 0:
            raise ValueError(f"interval must be >= 0 seconds, got {interval!r}")
        self.title, self.xlabel, self.ylabel, self.ylabel2 = title, xlabel, ylabel, ylabel2
        self.logx, self.logy, self.interval = logx, logy, interval
        self.figsize, self.dpi = figsize, dpi
        self.series: OrderedDict[str, dict] = OrderedDict()
        self.redraws = 0
        self._last = 0.0
        self._handle = _display(self._image(), display_id=True) if show else None

    # -- data ---------------------------------------------------------------------------
    def add(self, name: str, x: float, y: float, axis: int = 1, style: str = "-") -> None:
        """Append the point (x, y) to series ``name`` and redraw if ``interval`` has passed."""
        if axis not in (1, 2):
            raise ValueError(f"axis must be 1 (left) or 2 (right), got {axis!r}")
        s = self.series.setdefault(name, {"x": [], "y": [], "axis": axis, "style": style})
        s["x"].append(x)
        s["y"].append(y)
        self.update()

    def set(self, name: str, xs, ys, axis: int = 1, style: str = "-") -> None:
        """Replace series ``name`` with the points (xs, ys) and redraw."""
        xs, ys = list(xs), list(ys)
        if len(xs) != len(ys):
            raise ValueError(f"series {name!r}: {len(xs)} x values but {len(ys)} y values")
        self.series[name] = {"x": xs, "y": ys, "axis": axis, "style": style}
        self.update()

    def clear(self) -> None:
        """Forget every series (the next redraw shows empty axes)."""
        self.series.clear()
        self.update(force=True)

    # -- drawing ------------------------------------------------------------------------
    def update(self, force: bool = False) -> None:
        """Redraw now if forced or if ``interval`` seconds passed since the last redraw ended.
        (Counted from its end, so that on a slow machine, where a redraw takes as long as the
        interval, the measured work still gets at least half of the time.)"""
        if not force and time.perf_counter() - self._last < self.interval:
            return
        if self._handle is not None:
            self._handle.update(self._image())
        self._last = time.perf_counter()
        self.redraws += 1

    def finish(self) -> None:
        """Draw the final picture (call once the data is complete)."""
        self.update(force=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finish()
        return False

    def figure(self) -> Figure:
        """The current chart as a matplotlib Figure (for saving or further styling)."""
        fig = Figure(figsize=self.figsize, dpi=self.dpi, layout="constrained")
        ax = fig.add_subplot()
        ax2 = ax.twinx() if any(s["axis"] == 2 for s in self.series.values()) else None
        for i, (name, s) in enumerate(self.series.items()):
            target = ax2 if s["axis"] == 2 else ax
            target.plot(s["x"], s["y"], s["style"], color=PALETTE[i % len(PALETTE)],
                        label=name, marker="o" if len(s["x"]) < 16 else None, markersize=4)
        ax.set_title(self.title)
        ax.set_xlabel(self.xlabel)
        ax.set_ylabel(self.ylabel)
        ax.grid(alpha=0.3)
        if self.logx:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 1, 2, 4 … not 2⁰ …
        if self.logy:
            ax.set_yscale("log")
        if ax2 is not None:
            ax2.set_ylabel(self.ylabel2)
        handles, labels = ax.get_legend_handles_labels()
        if ax2 is not None:
            h2, l2 = ax2.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        if handles:
            ax.legend(handles, labels, loc="upper left", fontsize=8)
        return fig

    def png(self) -> bytes:
        """The current chart as PNG bytes."""
        return _png(self.figure())

    def _image(self):
        from IPython.display import Image

        return Image(data=self.png(), format="png")


def show_figure(fig: Figure) -> None:
    """Display a matplotlib Figure as a PNG image (same path as LivePlot's final picture)."""
    from IPython.display import Image

    _display(Image(data=_png(fig), format="png"))


def rerun_controls(run, button: str = "Run again", **sliders):
    """Sliders and a button that call ``run(**values)`` when clicked. (Lesson 02 onwards.)

    ``sliders`` maps an argument name to ``(min, max, step, value)`` for an integer slider or
    to a list of options for a dropdown. Only core ipywidgets are used (Button, IntSlider,
    Dropdown, Output, HBox, VBox), which behave alike in ipywidgets 7.7 and 8. Returns the
    container; the output of each run appears beneath the controls.
    """
    import ipywidgets as W

    controls = {}
    for name, spec in sliders.items():
        if isinstance(spec, (list, tuple)) and len(spec) == 4 and all(isinstance(v, int) for v in spec):
            lo, hi, step, value = spec
            controls[name] = W.IntSlider(value=value, min=lo, max=hi, step=step, description=name)
        elif isinstance(spec, (list, tuple)) and spec:
            controls[name] = W.Dropdown(options=list(spec), value=spec[0], description=name)
        else:
            raise ValueError(f"control {name!r}: give (min, max, step, value) integers or a "
                             f"non-empty list of options, got {spec!r}")
    go = W.Button(description=button)
    out = W.Output()

    def clicked(_):
        out.clear_output(wait=True)
        with out:
            run(**{k: c.value for k, c in controls.items()})

    go.on_click(clicked)
    box = W.VBox([W.HBox(list(controls.values()) + [go]), out])
    box.run = lambda: clicked(None)  # lets tests and scripts press the button
    return box


#: The diagrams the lessons show (drawn by scripts/draw_diagrams.py). They live in the course
#: repository's img/ folder, beside this package, and are not installed with it.
DIAGRAMS_DIR = Path(__file__).resolve().parents[1] / "img"


def show_diagram(name: str) -> None:
    """Show ``img/<name>.png`` from the course repository (drawn by scripts/draw_diagrams.py).

    A code cell, not a markdown image, so that it also renders on Colab. The lessons run from
    a clone of the repository (Colab's setup cell makes one); a copy of ``helpers`` installed
    without the repository has no diagrams and says so (FileNotFoundError).
    """
    from IPython.display import Image

    if not DIAGRAMS_DIR.is_dir():
        raise FileNotFoundError(
            f"the lessons' diagrams are read from the course repository's img/ folder, and "
            f"there is none at {DIAGRAMS_DIR}: this copy of helpers was installed without the "
            f"repository. Run the lessons from a clone of the repository.")
    path = DIAGRAMS_DIR / f"{name}.png"
    if not path.is_file():
        known = sorted(p.stem for p in DIAGRAMS_DIR.glob("*.png"))
        raise ValueError(f"no diagram named {name!r} in {DIAGRAMS_DIR}; known: {known}")
    _display(Image(filename=str(path)))
