"""How every benchmark draws its figures: matplotlib without a window, one way to save a
figure, an axis of concurrent clients, and a figure's median with its spread as bars."""


def pyplot():
    """matplotlib's pyplot on the Agg backend: figures go to files, no window opens."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path, dpi: int = 110) -> None:
    """Lay ``fig`` out, write it as a PNG to ``path`` and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def clients_axis(ax, clients) -> None:
    """An x axis of concurrent clients (1, 4, 16, 64, ...): log 2, one tick a level, a grid."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(clients, [str(c) for c in clients])
    ax.minorticks_off()
    ax.set_xlabel("concurrent streaming clients")
    ax.grid(alpha=0.3)


def spread_bars(ax, x, figures, scale: float = 1.0, **style) -> list[float]:
    """Each figure's median (``timing.spread``) at its x, with a bar from its min to its max;
    returns the medians (times ``scale``)."""
    middle = [f["median"] * scale for f in figures]
    bars = [[m - f["min"] * scale for m, f in zip(middle, figures)],
            [f["max"] * scale - m for m, f in zip(middle, figures)]]
    ax.errorbar(x, middle, yerr=bars, marker="o", capsize=4, **style)
    return middle
