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
    box(ax, 0.3, 3.3, 4.9, 0.6, "lm_head → logits: (batch, sequence, vocabulary)", ORANGE, size=9)
    arrow(ax, 5.2, 3.6, 6.0, 3.6)
    box(ax, 6.0, 3.2, 3.7, 0.8, "last position only:\nargmax → ' mainly'", ORANGE, size=10, weight="bold")
    arrow(ax, 7.85, 3.2, 7.85, 1.2, PINK)
    box(ax, 6.0, 0.3, 3.7, 0.9, "append the new token and\nrun again: one token per step", PINK, size=10)
    arrow(ax, 6.0, 0.6, 5.25, 0.6, PINK)
    return fig


@diagram
def kv_cache():
    """Lesson 01: prefill then decode steps, without and with the KV cache."""
    fig, ax = canvas(10, 5.9)
    prompt = ["The", "rain", "in", "Spain", "falls"]
    answer = ["mainly", "on", "the", "plain"]
    cw, ch, x0 = 0.66, 0.32, 1.45                        # cell width and height, first column

    def row(y, label, n_cached, n_computed, note=""):
        """One forward pass: n_cached cells read from the cache, then n_computed computed."""
        ax.text(0.15, y + ch / 2, label, fontsize=9, va="center")
        words = prompt + answer
        for j in range(n_cached + n_computed):
            cached = j < n_cached
            box(ax, x0 + j * cw, y, cw - 0.07, ch, words[j], BLUE if cached else ORANGE,
                fill=0.12 if cached else 0.45, size=7)
        end = x0 + (n_cached + n_computed) * cw
        out = answer[n_cached + n_computed - len(prompt)]
        arrow(ax, end - 0.02, y + ch / 2, end + 0.35, y + ch / 2)
        ax.text(end + 0.4, y + ch / 2, f"'{out}'", fontsize=8, va="center", weight="bold")
        if note:
            ax.text(8.25, y + ch / 2, note, fontsize=8, va="center", color="#333333")

    ax.text(0.15, 5.55, "Without a cache: every step feeds the whole sequence", fontsize=11,
            weight="bold")
    for step in range(4):
        row(4.95 - step * 0.42, f"step {step + 1}", 0, len(prompt) + step,
            "reads the prompt" if step == 0 else "")
    ax.text(8.25, 3.9, "every step recomputes\nK and V of all tokens:\nwork grows with\nthe sequence",
            fontsize=8, color=ORANGE)

    ax.text(0.15, 3.05, "With the KV cache: one prefill, then one token per decode step",
            fontsize=11, weight="bold")
    row(2.45, "prefill", 0, len(prompt), "whole prompt, one pass:\nfills the cache (TTFT)")
    for step in range(1, 4):
        row(2.45 - step * 0.42, f"decode {step}", len(prompt) + step - 1, 1,
            "1 new token (TPOT)" if step == 1 else "")
    ax.text(0.15, 0.45, "orange: keys and values computed in this pass", fontsize=8.5,
            color=ORANGE, va="center")
    ax.text(4.6, 0.45, "blue: keys and values read from the cache", fontsize=8.5, color=BLUE,
            va="center")
    ax.text(0.15, 0.15, "cache size = 2 × bytes × layers × hidden × sequence × batch",
            fontsize=8.5, va="center", color="#333333")
    return fig


@diagram
def padding():
    """Lesson 02: left padding, the attention mask and the position ids of one batch."""
    fig, ax = canvas(10, 6.4)
    rows = [["The", " quick", " brown", " fox", " jumped", " over", " the"],
            ["The", " rain", " in", " Spain", " falls"],
            ["What", " comes", " up", " must"],
            ["Jack", " and", " Jill"],
            ["Humpty", " Dumpty", " sat"]]
    width = max(len(r) for r in rows)
    h = 0.36                                              # height of a row of cells

    # 1. the padded tokens: PAD (= the EOS token) on the left, every prompt ends in the last column
    ax.text(0.2, 6.15, "input_ids: pad on the LEFT (PAD = <|endoftext|>, the EOS token)",
            fontsize=11, weight="bold")
    x0, w, top = 1.0, 0.95, 5.65
    for i, r in enumerate(rows):
        y = top - i * (h + 0.08)
        pads = width - len(r)
        for j in range(width):
            if j < pads:
                box(ax, x0 + j * w, y, w - 0.08, h, "PAD", GREY, fill=0.12, size=8)
            else:
                box(ax, x0 + j * w, y, w - 0.08, h, r[j - pads].strip(), BLUE, size=8)
        ax.text(x0 - 0.15, y + h / 2, f"row {i}", ha="right", va="center", fontsize=8)
    last = x0 + (width - 1) * w
    bottom = top - (len(rows) - 1) * (h + 0.08)
    ax.add_patch(FancyBboxPatch((last - 0.06, bottom - 0.06), w + 0.04, top + h - bottom + 0.12,
                                boxstyle="round,pad=0.02", fc="none", ec=ORANGE, lw=2))
    ax.text(last + w + 0.1, top - 0.6, "every row's\nnewest token:\nlogits[:, -1]\npicks the next\n"
            "token of all\nrows at once", fontsize=8.5, color=ORANGE, va="top")

    # 2. the attention mask and 3. the position ids, side by side below
    def grid(x, title, values, real_color, note):
        ax.text(x, 3.15, title, fontsize=10.5, weight="bold")
        cw = 0.5
        for i, r in enumerate(values):
            y = 2.65 - i * (h + 0.08)
            for j, (v, real) in enumerate(r):
                box(ax, x + j * cw, y, cw - 0.07, h, str(v), real_color if real else GREY,
                    fill=0.3 if real else 0.08, size=8, weight="bold" if real else "normal")
        ax.text(x, 2.65 - len(values) * (h + 0.08) + 0.2, note, fontsize=8.5, va="top")

    mask = [[(int(j >= width - len(r)), j >= width - len(r)) for j in range(width)] for r in rows]
    grid(0.2, "attention_mask", mask, GREEN,
         "1 = a real token, 0 = padding:\nattention never looks at a 0 column")
    positions = []
    for r in rows:
        pads = width - len(r)
        positions.append([(1, False) if j < pads else (j - pads, True) for j in range(width)])
    grid(5.4, "position_ids = cumsum(mask) − 1", positions, PINK,
         "each prompt starts at position 0, as if alone;\npadding gets 1 (any value would do: "
         "it is masked)")
    return fig


@diagram
def zero_point():
    """Lesson 04: zero-point (affine) quantization, the library convention: a float scale and
    an integer zero point z, the code that stands for 0.0 (q = round(x / scale) + z)."""
    fig, ax = canvas(10, 5.4)
    lo, hi, x = -0.42, 0.61, 0.33                       # an example range (it contains 0.0)
    scale = (hi - lo) / 255
    z = round(-lo / scale)                              # the integer code of 0.0
    q = round(x / scale) + z
    x0, x1, yf, yq = 1.3, 9.3, 4.5, 2.95

    def at(value):                                      # where a float sits on both lines
        return x0 + (value - lo) / (hi - lo) * (x1 - x0)

    def code_at(code):                                  # where a code sits: (code - z) * scale
        return at((code - z) * scale)

    # the float line, with a few weights drawn as dots above it
    ax.plot([x0, x1], [yf, yf], color=BLUE, lw=2)
    ax.text(0.1, yf, "float\nweights", fontsize=10, color=BLUE, va="center", weight="bold")
    dots = [-0.41, -0.2, -0.12, -0.07, -0.05, -0.02, 0.0, 0.01, 0.03, 0.04, 0.06, 0.09, 0.13,
            0.18, 0.25, 0.33, 0.61]
    ax.scatter([at(v) for v in dots], [yf + 0.13] * len(dots), s=14, color=BLUE, zorder=3)
    # the code line: 256 integer codes, a tick every 17
    ax.plot([x0, x1], [yq, yq], color=ORANGE, lw=2)
    ax.text(0.1, yq, "uint8\ncodes", fontsize=10, color=ORANGE, va="center", weight="bold")
    for code in range(0, 256, 17):
        ax.plot([code_at(code)] * 2, [yq - 0.07, yq + 0.07], color=ORANGE, lw=1)

    marks = [  # float value, label above, code, label below, colour
        (lo, "min", 0, "0", BLUE),
        (0.0, "0.0", z, f"z = {z}\n(zero point)", GREEN),
        (x, "x", q, f"q = {q}", PINK),
        (hi, "max", 255, "255", BLUE),
    ]
    for value, top, code, bottom, color in marks:
        ax.text(at(value), yf + 0.3, top, ha="center", va="bottom", fontsize=9, color=color)
        arrow(ax, at(value), yf - 0.05, code_at(code), yq + 0.1, color=color)
        ax.text(code_at(code), yq - 0.15, bottom, ha="center", va="top", fontsize=9,
                color=color, weight="bold")
    ax.text(at(0.0) - 0.1, (yf + yq) / 2,
            "0.0 → code z,\nand back: (z − z) × scale\n= 0.0 exactly",
            fontsize=8, color=GREEN, va="center", ha="right")

    # a zoom on three neighbouring codes: one step is one scale
    zx0, zy = 5.6, 0.75
    ax.add_patch(FancyBboxPatch((code_at(q) - 0.18, yq - 0.12), 0.36, 0.24,
                                boxstyle="round,pad=0.01", fc="none", ec=GREY, lw=1))
    ax.plot([code_at(q), zx0 + 1.9], [yq - 0.55, zy + 0.55], color=GREY, lw=0.8, ls=":")
    ax.plot([zx0 - 0.1, zx0 + 3.9], [zy, zy], color=ORANGE, lw=2)
    for i, label in enumerate([f"{q - 1}", f"{q}", f"{q + 1}"]):
        px = zx0 + 0.4 + i * 1.5
        ax.plot([px, px], [zy - 0.1, zy + 0.1], color=ORANGE, lw=1.5)
        ax.text(px, zy - 0.15, label, ha="center", va="top", fontsize=9, color=ORANGE)
    ax.add_patch(FancyBboxPatch((zx0 + 1.15, zy - 0.06), 1.5, 0.12, boxstyle="square,pad=0",
                                fc=matplotlib.colors.to_rgba(PINK, 0.35), ec="none"))
    arrow(ax, zx0 + 0.4, zy + 0.3, zx0 + 1.9, zy + 0.3, style="<|-|>", color="black")
    ax.text(zx0 + 1.15, zy + 0.36, "scale", ha="center", va="bottom", fontsize=9)
    ax.text(zx0 + 3.1, zy + 0.3, "every x in the pink band\nrounds to q: error ≤ scale / 2",
            fontsize=8, color=PINK, va="center")

    ax.text(0.1, 1.05,
            "scale = (max − min) / 255   float; min ≤ 0 ≤ max\n"
            "z  = round(−min / scale)    integer: the code of 0.0\n"
            "q  = clamp(round(x / scale) + z, 0, 255)\n"
            "x' = (q − z) × scale        dequantize\n"
            "one (scale, z) per tensor, or per row/column",
            fontsize=8.5, va="center", linespacing=1.6, family="monospace")
    return fig


@diagram
def continuous_batching():
    """Lesson 03: static batching leaves finished rows idle; continuous batching refills them."""
    fig, ax = canvas(11, 5.9)
    steps = [8, 2, 3, 2, 3, 2, 4, 3]          # decode steps each request of the queue needs
    colors = [BLUE, ORANGE, GREEN, PINK, "#E69F00", "#56B4E9", "#8C564B", "#7F3C8D"]
    slots, u, x0, h = 4, 0.45, 0.9, 0.34        # slots per batch, width of a step, left edge, row

    def request(y, slot, start, length, rid):
        box(ax, x0 + start * u + 0.03, y - slot * 0.42, length * u - 0.06, h, f"R{rid}",
            colors[rid], fill=0.45, size=8)

    def idle(y, slot, start, length):
        ax.add_patch(FancyBboxPatch((x0 + start * u + 0.03, y - slot * 0.42), length * u - 0.06, h,
                                    boxstyle="square,pad=0", fc="white", ec=GREY, lw=0.8,
                                    hatch="///", linestyle="--"))

    def axes(y, end, label):
        for s in range(slots):
            ax.text(x0 - 0.12, y - s * 0.42 + h / 2, f"slot {s}", ha="right", va="center", fontsize=8)
        base = y - (slots - 1) * 0.42 - 0.1
        arrow(ax, x0, base, x0 + 12.8 * u, base, GREY, lw=1)
        ax.text(x0, base - 0.08, "time, in decode steps →", va="top", fontsize=8,
                color=GREY)
        ax.plot([x0 + end * u] * 2, [base, y + h + 0.12], color="black", lw=1.2, ls=":")
        ax.text(x0 + end * u, y + h + 0.15, label, ha="center", fontsize=9, va="bottom",
                weight="bold")

    # Static batching: requests 0-3, then 4-7; each batch lasts as long as its longest request.
    top = 4.75
    ax.text(0.1, top + 0.75, "Static: a batch runs until its longest request is done",
            fontsize=11, weight="bold")
    start = 0
    for first in (0, 4):
        longest = max(steps[first:first + slots])
        for slot in range(slots):
            rid = first + slot
            request(top, slot, start, steps[rid], rid)
            if steps[rid] < longest:
                idle(top, slot, start + steps[rid], longest - steps[rid])
        start += longest
    axes(top, start, f"{start} steps")
    ax.text(x0 + 5.0 * u, top - 0.42 + h / 2, "idle: finished, still computed", fontsize=8,
            color="#555555", ha="center", va="center",
            bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none"))

    # Continuous batching: a freed slot takes the next request of the queue at once.
    top = 1.85
    ax.text(0.1, top + 0.75, "Continuous: a freed slot is refilled from the queue at once",
            fontsize=11, weight="bold")
    free_at = [0] * slots
    for rid, length in enumerate(steps):
        slot = min(range(slots), key=lambda s: (free_at[s], s))
        request(top, slot, free_at[slot], length, rid)
        free_at[slot] += length
    axes(top, max(free_at), f"{max(free_at)} steps, no slot idle while requests wait")

    # The loop of the four helpers, on the right.
    left, width, height = 7.0, 2.75, 0.9
    ax.text(left + width / 2, 5.45, "one round of the loop", ha="center", fontsize=10,
            weight="bold")
    loop = [
        ("init_batch + generate_next_token\nnewcomers read their prompts\n(the prefill)", GREEN),
        ("merge_batches\npad the shorter history on the left,\nstack the rows", BLUE),
        ("generate_next_token\none decode step:\na token for every row", ORANGE),
        ("filter_batch\ndrop finished rows,\ntrim padding they all share", PINK),
    ]
    tops = [4.35 - i * 1.25 for i in range(len(loop))]
    for i, ((text, color), y) in enumerate(zip(loop, tops)):
        box(ax, left, y, width, height, text, color, size=8)
        if i < len(loop) - 1:
            arrow(ax, left + width / 2, y, left + width / 2, y - 0.35)
    right, bottom_mid, top_mid = left + width, tops[-1] + height / 2, tops[0] + height / 2
    ax.plot([right + 0.02, right + 0.3, right + 0.3], [bottom_mid, bottom_mid, top_mid],
            color=PINK, lw=1.3)
    arrow(ax, right + 0.3, top_mid, right + 0.04, top_mid, PINK)
    ax.text(right + 0.4, (top_mid + bottom_mid) / 2, "free slots?\ntake requests\nfrom the queue",
            fontsize=8, color=PINK, va="center")
    return fig


@diagram
def lora():
    """Lesson 05: LoRA adds a trainable low-rank detour x·A·B beside the frozen weight W."""
    fig, ax = canvas(10, 5.4)
    # the input x and the output h, drawn as flat vectors
    box(ax, 3.0, 0.25, 4.0, 0.4, "x   (1 × d)", GREY, size=10)
    box(ax, 3.0, 4.75, 4.0, 0.4, "h = x·W + (x·A·B) × α / r   (1 × d)", GREEN, size=10,
        weight="bold")
    # the frozen weight: a big d × d square
    box(ax, 0.9, 1.3, 2.9, 2.9, "W\nd × d\nfrozen\n\n1024 × 1024\n= 1,048,576", BLUE, fill=0.25,
        size=10)
    ax.text(2.35, 1.12, "pretrained, never changed", ha="center", va="top", fontsize=8,
            color=BLUE)
    # the adapter: a tall thin A (d × r) and a wide flat B (r × d)
    box(ax, 5.6, 1.3, 0.45, 2.9, "A\n\nd\n×\nr", ORANGE, fill=0.35, size=9)
    box(ax, 6.45, 3.25, 2.9, 0.45, "B   r × d", ORANGE, fill=0.35, size=9)
    ax.text(7.9, 2.75, "trainable adapter\n(B starts at zero)\n\nr = 4:\n"
            "2 × 1024 × 4 = 8,192\n= 0.78 % of W", ha="center", va="top", fontsize=8,
            color=ORANGE)
    arrow(ax, 6.05, 2.2, 6.45, 3.3, ORANGE)
    ax.text(6.3, 2.35, "x·A\n(1 × r)", fontsize=7, color=ORANGE, va="top")
    # the data flow: x goes through both paths, the results are added
    arrow(ax, 4.0, 0.65, 2.35, 1.3)
    arrow(ax, 6.0, 0.65, 5.82, 1.3, ORANGE)
    arrow(ax, 2.35, 4.2, 4.0, 4.75)
    arrow(ax, 7.9, 3.7, 6.0, 4.75, ORANGE)
    ax.text(5.0, 4.45, "+", ha="center", va="center", fontsize=16, weight="bold")
    ax.text(5.0, 1.0, "same x,\ntwo paths", fontsize=8, color=GREY, ha="center", va="center")
    return fig


@diagram
def multi_lora():
    """Lesson 06: a batch where every row has its own adapter: gather A and B per row, then
    one batched matrix product for all rows."""
    fig, ax = canvas(11, 5.2)
    colors = {"A0": BLUE, "A1": ORANGE, "A2": GREEN, "A3": PINK}
    rows = [1, 3, 1, 0]                           # the adapter index of each row
    ax.text(0.1, 4.85, "batch: one adapter index per row", fontsize=10, weight="bold")
    for i, k in enumerate(rows):
        y = 4.05 - i * 0.7
        box(ax, 0.2, y, 1.9, 0.5, f"row {i}: x{i}", GREY, fill=0.1, size=9)
        box(ax, 2.3, y, 0.7, 0.5, f"{k}", list(colors.values())[k], fill=0.45, size=9,
            weight="bold")
    # The stack of adapters.
    ax.text(4.0, 4.85, "stack of n adapters", fontsize=10, weight="bold")
    for k, color in enumerate(colors.values()):
        y = 4.05 - k * 0.7
        box(ax, 4.0, y, 1.0, 0.5, f"A{k}\n(in×r)", color, fill=0.3, size=8)
        box(ax, 5.1, y, 1.0, 0.5, f"B{k}\n(r×out)", color, fill=0.3, size=8)
    ax.text(5.05, 1.05, "loras_a (n, in, r)\nloras_b (n, r, out)", ha="center", fontsize=8,
            color="#555555")
    # Gathered copies, one per row.
    ax.text(7.0, 4.85, "gathered per row (index_select)", fontsize=10, weight="bold")
    for i, k in enumerate(rows):
        y = 4.05 - i * 0.7
        color = list(colors.values())[k]
        box(ax, 7.0, y, 0.9, 0.5, f"A{k}", color, fill=0.45, size=9)
        box(ax, 8.0, y, 0.9, 0.5, f"B{k}", color, fill=0.45, size=9)
        arrow(ax, 6.15, 4.3 - k * 0.7, 6.95, y + 0.25, color, lw=1)
    ax.text(7.95, 1.05, "(batch, in, r) and (batch, r, out)", ha="center", fontsize=8,
            color="#555555")
    # The result.
    box(ax, 9.25, 2.2, 1.65, 1.9, "batched\nproducts:\nevery row\nthrough its\nown adapter", BLUE,
        fill=0.15, size=9, weight="bold")
    arrow(ax, 8.95, 3.15, 9.22, 3.15)
    ax.text(0.2, 0.35, "output = base layer(x) + each row's detour through its own adapter, "
            "for the whole batch at once instead of a loop over rows",
            fontsize=9.5, color="#333333")
    return fig


@diagram
def server():
    """Lesson 07: a multi-adapter server: requests name their adapter, wait in one queue, and a
    scheduler runs continuous batching with a different adapter on every row, streaming tokens
    back to each client."""
    fig, ax = canvas(12, 5.4)
    requests = [("client 1", "adapter: entities", ORANGE), ("client 2", "adapter: none", GREY),
                ("client 3", "adapter: rhymes", GREEN), ("client 4", "adapter: title", PINK)]
    ax.text(0.15, 5.0, "HTTP clients", fontsize=10, weight="bold")
    for i, (who, adapter, color) in enumerate(requests):
        y = 4.05 - i * 1.0
        box(ax, 0.15, y, 1.9, 0.7, f"{who}\n{adapter}", color, fill=0.3, size=8.5)
        arrow(ax, 2.1, y + 0.5, 3.0, 2.6 + (1.5 - i) * 0.25, color, lw=1)
        arrow(ax, 2.5, y + 0.2, 2.1, y + 0.2, BLUE, lw=1)          # its tokens come back
    ax.plot([11.1, 11.1, 2.5, 2.5], [1.65, 0.45, 0.45, 4.25], color=BLUE, lw=1.3)
    ax.text(6.8, 0.12, "tokens stream back to each client as they are generated "
            "(POST / with stream, /generate_stream, /v1/completions)", ha="center", fontsize=8,
            color="#555555")
    # Queue.
    ax.text(3.0, 5.0, "queue", fontsize=10, weight="bold")
    box(ax, 3.0, 1.7, 1.3, 2.4, "", GREY, fill=0.08)
    for j, (_, _, color) in enumerate(requests[:3]):
        box(ax, 3.15, 3.35 - j * 0.7, 1.0, 0.5, "request", color, fill=0.35, size=8)
    ax.text(3.65, 1.4, "full → 429", ha="center", fontsize=8, color="#555555")
    arrow(ax, 4.35, 2.9, 5.0, 2.9)
    # Scheduler.
    ax.text(5.0, 5.0, "scheduler (one loop owns the model)", fontsize=10, weight="bold")
    box(ax, 5.0, 0.9, 5.2, 3.9, "", BLUE, fill=0.06)
    ax.text(7.6, 4.45, "continuous batching: between steps,\nnew requests join (prefill + merge)"
            " and finished ones leave (filter)", ha="center", va="center", fontsize=8.5)
    rows = [("row 0", "entities", ORANGE), ("row 1", "no adapter", GREY),
            ("row 2", "rhymes", GREEN), ("row 3", "title", PINK)]
    for i, (row, adapter, color) in enumerate(rows):
        y = 3.35 - i * 0.58
        box(ax, 5.2, y, 1.2, 0.45, row, GREY, fill=0.1, size=8)
        box(ax, 6.55, y, 1.5, 0.45, f"W + A·B ({adapter})", color, fill=0.35, size=7.5)
        box(ax, 8.2, y, 1.8, 0.45, "JSON guide (optional)" if i == 0 else "next token", BLUE,
            fill=0.12, size=7.5)
    ax.text(7.6, 1.0, "one decode step = one forward pass for all rows,\n"
            "each row with its own LoRA (lesson 6)", ha="center", fontsize=8, color="#333333")
    # Streams back.
    box(ax, 10.35, 1.7, 1.5, 2.4, "token\nstreams\n(SSE)\nback to\neach\nclient", BLUE, fill=0.15,
        size=8.5)
    arrow(ax, 10.2, 2.9, 10.33, 2.9)
    return fig


@diagram
def paged_blocks():
    """Lesson 08: a pool of fixed-size KV blocks, one block table per request, and a prefix
    block shared by two requests (reference count 2)."""
    fig, ax = canvas(11, 4.8)
    ax.text(5.5, 4.5, "KV pool: 8 blocks of 4 token positions (every layer)", ha="center",
            fontsize=11, weight="bold")
    # What each block holds: (owner colour, tokens written, reference count, label).
    a, b, both = ORANGE, GREEN, PINK
    pool = [(both, 4, 2, "system prompt\n(hash h0)"), (a, 4, 1, "A's tokens"),
            (b, 4, 1, "B's tokens"), (a, 2, 1, "A (2 of 4)"), (GREY, 0, 0, "free"),
            (b, 3, 1, "B (3 of 4)"), (GREY, 0, 0, "free"), (GREY, 0, 0, "free")]
    for i, (color, filled, refs, label) in enumerate(pool):
        x = 0.4 + i * 1.3
        box(ax, x, 2.55, 1.15, 1.2, "", color, fill=0.08)
        for slot in range(4):   # one small square per token position
            ax.add_patch(FancyBboxPatch((x + 0.08 + slot * 0.26, 3.2), 0.2, 0.35,
                                        boxstyle="square,pad=0",
                                        fc=matplotlib.colors.to_rgba(color, 0.6 if slot < filled else 0.05),
                                        ec=color, lw=0.8))
        ax.text(x + 0.575, 2.85, label, ha="center", va="center", fontsize=7.5)
        ax.text(x + 0.575, 4.0, f"block {i}\nref {refs}", ha="center", va="center", fontsize=8)
    # Block tables: one list of block ids per request, in token order.
    for y, name, table, color in ((1.45, "request A", [0, 1, 3], a),
                                  (0.45, "request B", [0, 2, 5], b)):
        box(ax, 0.3, y, 1.6, 0.6, name, color, fill=0.3, size=9)
        ax.text(2.05, y + 0.3, "block table:", va="center", fontsize=9)
        for j, block in enumerate(table):
            bx = 3.2 + j * 0.7
            box(ax, bx, y + 0.05, 0.55, 0.5, str(block), color, fill=0.15, size=9)
            arrow(ax, bx + 0.27, y + 0.57, 0.4 + block * 1.3 + 0.575, 2.53, color=color, lw=0.9)
    ax.text(6.1, 1.25, "token i of a request lives in block table[i // 4], at offset i % 4.\n"
            "Blocks are taken one at a time as a request grows: no padding.\n"
            "Admission reserves enough free blocks for the longest answer:\n"
            "it counts them, it does not take them. Block 0 holds the same\n"
            "4 prompt tokens for A and B: found by its hash, computed once,\n"
            "counted twice (ref 2).",
            fontsize=8.5, va="center", color="#333333")
    return fig


@diagram
def speculative():
    """Lesson 09: a proposer guesses k tokens, one verify pass of the model checks them all,
    the longest agreeing prefix is kept and the model's own token comes for free."""
    fig, ax = canvas(11, 5.6)
    ax.text(0.2, 5.25, "1 · propose: k = 4 cheap guesses (a draft model, or prompt lookup)",
            fontsize=11, weight="bold")
    prompt, guesses = ["Jack", " and", " Jill"], [" went", " up", " a", " hill"]
    choices = [" went", " up", " the", " hill", " to"]
    cw = 1.05
    for i, word in enumerate(prompt):
        box(ax, 0.3 + i * cw, 4.35, cw - 0.1, 0.5, word, GREY, size=9)
    for i, word in enumerate(guesses):
        box(ax, 0.3 + (3 + i) * cw, 4.35, cw - 0.1, 0.5, word, PINK, fill=0.35, size=9)
    ax.text(7.75, 4.6, "4 small steps of the draft\n(or one n-gram look-up)", fontsize=8.5,
            va="center", color="#333333")
    ax.text(0.2, 3.75, "2 · verify: the model reads the last token and the 4 guesses in ONE pass",
            fontsize=11, weight="bold")
    fed = [" Jill"] + guesses
    for i, word in enumerate(fed):
        x = 0.3 + (2 + i) * cw
        box(ax, x, 2.85, cw - 0.1, 0.5, word, BLUE, fill=0.15, size=9)
        arrow(ax, x + cw / 2 - 0.05, 2.85, x + cw / 2 - 0.05, 2.35)
        box(ax, x, 1.8, cw - 0.1, 0.5, choices[i], ORANGE, fill=0.15, size=9)
    ax.text(0.3, 2.05, "model's own\nnext token:", fontsize=8.5, va="center")
    ax.text(0.3, 3.1, "fed together:", fontsize=8.5, va="center")
    ax.text(7.75, 2.6, "output i is the model's choice\nafter guess i; the earlier tokens\n"
            "come from the KV cache", fontsize=8.5, va="center", color="#333333")
    ax.text(0.2, 1.25, "3 · keep the guesses that match, take the model's token at the first "
            "mismatch, crop the cache", fontsize=11, weight="bold")
    verdicts = [("went ✓", GREEN), ("up ✓", GREEN), ("a ✗ → the", ORANGE), ("hill ✗", GREY)]
    for i, (text, color) in enumerate(verdicts):
        box(ax, 0.3 + (3 + i) * cw, 0.35, cw - 0.1, 0.5, text, color, fill=0.3, size=8.5)
    ax.text(7.75, 0.6, "3 tokens from one pass of the model,\nexactly what greedy decoding "
            "writes;\nthe keys and values of ' a', ' hill' are cropped", fontsize=8.5,
            va="center", color="#333333")
    return fig


@diagram
def compilation():
    """Lesson 10: eager PyTorch dispatches every small operation from Python; a compiled step
    runs a few fused kernels between the matrix products; a batch is padded up to the next
    captured size, so that a handful of shapes serve every batch."""
    fig, ax = canvas(11, 6.6)
    ax.text(0.2, 6.3,
            "eager: every operation goes Python → dispatcher → kernel, one after another",
            fontsize=11, weight="bold")
    ops = ["layer\nnorm", "matmul", "split", "view", "index\ncopy", "attention", "matmul",
           "add", "layer\nnorm", "matmul", "tanh", "mul", "add", "matmul", "add"]
    for i, op in enumerate(ops):
        x = 0.3 + i * 0.7
        box(ax, x, 5.3, 0.58, 0.5, "Python", GREY, fill=0.15, size=6.5)
        arrow(ax, x + 0.29, 5.3, x + 0.29, 5.05, lw=0.8)
        matmul = op in ("matmul", "attention")
        box(ax, x, 4.45, 0.58, 0.55, op, ORANGE if matmul else BLUE, fill=0.3 if matmul else 0.12,
            size=6.5)
    ax.text(0.3, 4.1, "× 4 layers: about two hundred operations per decode step. Most are small "
            "(views, adds, norms):\non a small model their bookkeeping costs more than their "
            "arithmetic.", fontsize=8.5, va="top", color="#333333")
    ax.text(0.2, 3.25, "compiled: traced once into a graph; the steps between matrix products "
            "fused into one loop each", fontsize=11, weight="bold")
    fused = [("fused:\nadd + norm", False), ("matmul", True),
             ("fused:\nsplit + cache\nwrite + mask", False), ("attention", True),
             ("matmul", True), ("fused:\nadd + norm", False), ("matmul", True),
             ("fused: gelu\n(tanh, mul, add)", False), ("matmul", True)]
    x = 0.3
    for name, matmul in fused:
        w = 0.85 if matmul else 1.3
        box(ax, x, 2.05, w, 0.75, name, ORANGE if matmul else GREEN, fill=0.3 if matmul else 0.2,
            size=7)
        x += w + 0.12
    ax.text(0.3, 1.85, "× 4 layers, all in one call from Python per step; the matrix products "
            "and attention stay library calls",
            fontsize=8.5, va="top", color="#333333")
    # padding up to a capture size
    ax.text(0.2, 1.2, "a batch of 5 padded to the next captured size, 8", fontsize=11,
            weight="bold")
    for i in range(8):
        real = i < 5
        box(ax, 0.3 + i * 0.55, 0.3, 0.45, 0.55, f"row {i}" if real else "pad",
            BLUE if real else GREY, fill=0.3 if real else 0.08, size=7)
    ax.text(4.9, 0.575, "captured sizes: 1, 2, 4, 8, 16, 32, 64\none graph each (or one graph "
            "with a symbolic batch);\nthe padding rows' outputs are thrown away",
            fontsize=8.5, va="center", color="#333333")
    return fig


@diagram
def tensor_parallel():
    """Lesson 11: one GPT-2 block on two ranks. c_attn and c_fc are split by columns (c_attn
    per part, queries, keys and values each by heads), c_proj by rows; one all-reduce ends each
    pair, and the bias of a row split is added once, after it."""
    fig, ax = canvas(11.5, 6.4)
    ax.text(0.2, 6.1, "Conv1D computes x @ W with W stored (in, out): a column split cuts "
            "dimension 1, a row split dimension 0", fontsize=10.5, weight="bold")
    # c_attn's columns: [queries | keys | values], each part cut by heads
    ax.text(0.3, 5.55, "c_attn (256, 768) = [ queries | keys | values ], 4 heads each:",
            fontsize=9.5)
    for part, name in enumerate(("Q", "K", "V")):
        for head in range(4):
            rank = 0 if head < 2 else 1
            x = 0.3 + part * 2.45 + head * 0.58
            box(ax, x, 4.8, 0.52, 0.5, f"{name}{head}", (BLUE, ORANGE)[rank], fill=0.3, size=8)
    ax.text(7.75, 5.05, "rank 0 keeps Q0 Q1, K0 K1, V0 V1;\nrank 1 keeps Q2 Q3, K2 K3, V2 V3\n"
            "(cutting the 768 columns in two halves\nwould give rank 0 all of Q and half of K)",
            fontsize=8.5, va="center", color="#333333")
    # the two ranks' paths through a block
    for rank, (y, colour) in enumerate(((3.3, BLUE), (1.5, ORANGE))):
        ax.text(0.2, y + 0.95, f"rank {rank}", fontsize=10, weight="bold", color=colour)
        steps = [("x (whole)", GREY, 1.05), ("c_attn: its\nheads' Q K V", colour, 1.25),
                 ("attention\n(its 2 heads)", colour, 1.2), ("c_proj:\nits rows", colour, 1.0),
                 ("", None, 1.2),
                 ("c_fc: its\ncolumns", colour, 1.0), ("GELU", colour, 0.7),
                 ("c_proj:\nits rows", colour, 1.0)]
        x = 0.3
        for text, c, w in steps:
            if c is not None:
                box(ax, x, y, w, 0.75, text, c, fill=0.2 if c != GREY else 0.1, size=8)
                arrow(ax, x + w, y + 0.375, x + w + 0.12, y + 0.375, lw=0.9)
            x += w + 0.15
    # the all-reduces, each after the two ranks' row splits; the first one's sum goes on to
    # both ranks' MLPs, the second one's to the next block
    for x in (5.45, 9.95):
        box(ax, x, 2.3, 0.95, 1.25, "all-reduce\n+ bias once", GREEN, fill=0.3, size=8)
        arrow(ax, x - 0.05, 3.675, x + 0.1, 3.55, color=GREEN)
        arrow(ax, x - 0.05, 1.875, x + 0.1, 2.3, color=GREEN)
    arrow(ax, 6.4, 3.2, 6.75, 3.55, color=GREEN)
    arrow(ax, 6.4, 2.5, 6.75, 2.2, color=GREEN)
    ax.text(10.42, 2.1, "to the\nnext block", ha="center", va="top", fontsize=8,
            color="#333333")
    ax.text(0.3, 0.95, "Everything between a column split and its row split stays on its rank: "
            "no communication inside attention or inside the MLP.", fontsize=8.5,
            color="#333333")
    ax.text(0.3, 0.6, "Two all-reduces a block, each of one hidden vector per token; the sum "
            "of the partial products is the whole product, the same on every rank.",
            fontsize=8.5, color="#333333")
    ax.text(0.3, 0.25, "Embeddings, layer norms and the output layer stay whole on every rank, "
            "so every rank picks the same next token.", fontsize=8.5, color="#333333")
    return fig

@diagram
def course_map():
    """README: which lesson builds on which, and the three paths through the course."""
    fig, ax = canvas(13, 5.6)
    w, h = 2.3, 0.8
    spots = {  # lesson -> (x, y, title, colour)
        "01": (4.3, 4.5, "01 Text generation\n(KV cache)", BLUE),
        "02": (1.2, 3.1, "02 Batching", BLUE),
        "04": (4.3, 3.1, "04 Quantization", GREY),
        "05": (7.4, 3.1, "05 LoRA", GREEN),
        "03": (1.2, 1.7, "03 Continuous\nbatching", BLUE),
        "09": (4.3, 1.7, "09 Speculative\ndecoding", PINK),
        "06": (7.4, 1.7, "06 Multi-LoRA", GREEN),
        "08": (0.2, 0.3, "08 Paged KV cache", PINK),
        "07": (4.3, 0.3, "07 Serving", BLUE),
        "10": (10.5, 3.1, "10 Compilation", PINK),
        "11": (10.5, 4.5, "11 Sharding", PINK),
    }
    for x, y, title, colour in spots.values():
        box(ax, x, y, w, h, title, colour, fill=0.25, size=9.5, weight="bold")
    needs = [("01", "02"), ("01", "04"), ("01", "05"), ("02", "03"), ("02", "09"),
             ("05", "06"), ("02", "06"), ("03", "07"), ("06", "07"), ("03", "08"), ("01", "10"),
             ("01", "11")]
    for before, after in needs:
        (x0, y0, _, _), (x1, y1, _, _) = spots[before], spots[after]
        if y0 == y1:                          # side by side: from the right edge to the left
            arrow(ax, x0 + w, y0 + h / 2, x1, y1 + h / 2, "#555555", lw=1)
        else:
            arrow(ax, x0 + w / 2, y0, x1 + w / 2, y1 + h, "#555555", lw=1)
    notes = [(BLUE, "half-day core: 01 → 02 → 03 → 07"),
             (GREEN, "the original course: 01 to 07 (adds 04, 05, 06)"),
             (PINK, "the full course: all eleven (08 to 11 go past the original)"),
             (GREY, "04 stands alone: nothing later needs it")]
    for i, (colour, text) in enumerate(notes):
        box(ax, 7.2, 0.95 - i * 0.32, 0.25, 0.22, "", colour, fill=0.5)
        ax.text(7.55, 1.06 - i * 0.32, text, fontsize=8.5, va="center")
    ax.text(6.5, 5.45, "an arrow: the lesson it points to uses what the other one teaches",
            ha="center", fontsize=8.5, color="#555555")
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
