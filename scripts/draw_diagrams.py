"""Draw the diagrams the lessons show (PNG files in img/).

    python scripts/draw_diagrams.py            # all of them
    python scripts/draw_diagrams.py kv_cache   # one by name

Each diagram is one function below; the file name is the function name.
"""

import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

IMG = pathlib.Path(__file__).resolve().parents[1] / "img"
BLUE, ORANGE, GREEN, GREY, PINK = "#0072B2", "#D55E00", "#009E73", "#999999", "#CC79A7"
DIAGRAMS = {}


def diagram(fn):
    DIAGRAMS[fn.__name__] = fn
    return fn


def box(ax, x, y, w, h, text, color=BLUE, fill=0.15, size=10, weight="normal"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                fc=matplotlib.colors.to_rgba(color, fill), ec=color, lw=1.5))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight)


def arrow(ax, x0, y0, x1, y1, color="black", style="-|>", lw=1.3):
    ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle=style, mutation_scale=12,
                                 color=color, lw=lw))


def canvas(w, h):
    fig, ax = plt.subplots(figsize=(w, h), dpi=110)
    ax.set_xlim(0, w)
    ax.set_ylim(0, h)
    ax.axis("off")
    return fig, ax


@diagram
def decoder_flow():
    """Lesson 01: a decoder-only model turns a prompt into one next token."""
    fig, ax = canvas(10, 4.2)
    words = ["The", " rain", " in", " Spain", " falls"]
    for i, w in enumerate(words):
        box(ax, 0.3 + i * 1.0, 0.3, 0.9, 0.55, repr(w)[1:-1], GREY, size=9)
        arrow(ax, 0.75 + i * 1.0, 0.85, 0.75 + i * 1.0, 1.25)
    box(ax, 0.3, 1.25, 4.9, 0.55, "tokenizer → token ids → embeddings (+ positions)", GREEN, size=9)
    arrow(ax, 2.75, 1.8, 2.75, 2.1)
    box(ax, 0.3, 2.1, 4.9, 0.9, "N decoder blocks\n(causal self-attention + MLP)", BLUE, size=10)
    arrow(ax, 2.75, 3.0, 2.75, 3.3)
    box(ax, 0.3, 3.3, 4.9, 0.6, "logits: (batch, sequence, vocabulary)", ORANGE, size=9)
    arrow(ax, 5.2, 3.6, 6.0, 3.6)
    box(ax, 6.0, 3.2, 3.7, 0.8, "last position only:\nargmax → ' mainly'", ORANGE, size=10, weight="bold")
    arrow(ax, 7.85, 3.2, 7.85, 1.2, PINK)
    box(ax, 6.0, 0.3, 3.7, 0.9, "append the new token and\nrun again: one token per step", PINK, size=10)
    arrow(ax, 6.0, 0.6, 5.25, 0.6, PINK)
    return fig


@diagram
def kv_cache():
    """Lesson 01: without the cache every step recomputes all keys and values."""
    fig, ax = canvas(10, 4.6)
    ax.text(0.2, 4.3, "Without a cache: step t feeds all t tokens", fontsize=11, weight="bold")
    ax.text(0.2, 2.0, "With the KV cache: step t feeds 1 token, reuses the stored K and V",
            fontsize=11, weight="bold")
    for step in range(4):
        y = 3.65 - step * 0.42
        ax.text(0.2, y + 0.12, f"step {step + 1}", fontsize=9)
        for j in range(step + 4):
            box(ax, 1.2 + j * 0.55, y, 0.48, 0.32, "", ORANGE, fill=0.45 if j >= 0 else 0.1)
    ax.text(5.4, 3.0, "work per step grows with\nthe sequence: O(t) tokens\nthrough every layer",
            fontsize=9, color=ORANGE)
    for step in range(4):
        y = 1.35 - step * 0.42
        ax.text(0.2, y + 0.12, f"step {step + 1}", fontsize=9)
        for j in range(step + 3):
            box(ax, 1.2 + j * 0.55, y, 0.48, 0.32, "", BLUE, fill=0.12)
        box(ax, 1.2 + (step + 3) * 0.55, y, 0.48, 0.32, "", ORANGE, fill=0.45)
    ax.text(5.4, 0.55, "blue: keys/values read from the cache\norange: computed this step\n"
            "cache size = 2 × bytes × layers × hidden\n                  × sequence × batch",
            fontsize=9, color=BLUE)
    return fig


def main(names):
    IMG.mkdir(exist_ok=True)
    for name in names or DIAGRAMS:
        if name not in DIAGRAMS:
            raise SystemExit(f"unknown diagram {name!r}; known: {', '.join(DIAGRAMS)}")
        fig = DIAGRAMS[name]()
        fig.savefig(IMG / f"{name}.png", bbox_inches="tight")
        plt.close(fig)
        print(f"img/{name}.png")


if __name__ == "__main__":
    main(sys.argv[1:])
